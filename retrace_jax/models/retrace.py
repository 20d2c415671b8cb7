"""ReTrace: the rejected-suffix buffer and its gated-residual fusion into the next block.

After a round at anchor ``s`` accepts ``a`` proposals, the next round starts at ``s' = s + a + 1``. Its
slot ``j`` (``1 <= j <= B-2-a``) sits at position ``s + a + 1 + j``, which this round drafted at slot
``a + 1 + j``; the drafter's state there and the target state that scored it (verify slot ``a + j``) are
kept for that slot. Before the first drafter layer each valid slot's mask embedding receives

    r_j  = mem_d[j] + beta * W_c [mem_d[j] ; mem_t[j]]
    e'_j = e_j + valid_j * (W_v r_j) * sigmoid(W_g [e_j ; r_j])

``W_v`` starts at zero, so a new ReTrace module leaves DFlash unchanged. With ``hints="tokens"`` each valid
slot also receives the target's verdict there as tokens: ``t_j``, the target's own (argmax) token at the
verify slot that scored it, and ``r_j``, the drafter's rejected proposal, through the target's (frozen)
input embedding ``E``:

    h_j  = [E[t_j] ; E[r_j]]
    e'_j += valid_j * (W_h h_j) * sigmoid(W_hg h_j)

``W_h`` starts at zero too. With ``zero_start="scale"`` the first residual is multiplied by a learned
scalar that starts at zero, and ``W_v`` starts small and random instead. See ``docs/retrace.md``.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx, struct
from pydantic import BaseModel

from retrace_jax.models.layers import linear
from retrace_jax.validation import STRICT, Bool, PositiveInt, config_dataclass, validated

SIGNALS = ("drafter", "target", "both")
Signals = Literal[SIGNALS]
SLOTS = ("all", "agreed")
Slots = Literal[SLOTS]
# Where the memory enters the next block: "embedding" (the paper's gated residual into the block's input
# embeddings) or "keys" (an ablation, as DFlow and Carryover Drafting do: the target's features at the
# kept slots become extra keys and values of the block, through the drafter's own context projections;
# no parameters of its own, and signals, rank and gate do not apply).
FUSIONS = ("embedding", "keys")
Fusion = Literal[FUSIONS]
# What else the memory carries into the next block's embeddings: "none" (the paper's design) or "tokens"
# (the target's own token and the drafter's rejected proposal at each kept slot, embedded; see above).
HINTS = ("none", "tokens")
Hints = Literal[HINTS]
# Which parameter starts at zero, so that a new module drafts exactly as DFlash: "value" (W_v, the
# paper's: W_c's gradient is then zero until W_v grows) or "scale" (a learned scalar on the fused residual;
# W_v starts small and random, so W_c and W_v learn as soon as the scale moves).
ZERO_STARTS = ("value", "scale")
ZeroStart = Literal[ZERO_STARTS]


@config_dataclass
class ReTraceConfig:
    """The options of a drafter's ReTrace module (``docs/retrace.md``), checked whenever it is built."""

    signals: Signals = "both"  # which rejected states enter the correction
    rank: PositiveInt | None = None  # low-rank factorisation of W_c, W_v, W_g
    gate: Bool = True  # sigmoid gate on the residual
    # which rejected slots the memory keeps: "all" (the paper's design) or "agreed", only those where the
    # drafter's rejected token equals the target's own (argmax) token there in the same verify pass
    slots: Slots = "all"
    fusion: Fusion = "embedding"
    hints: Hints = "none"
    zero_start: ZeroStart = "value"

    def __post_init__(self):
        module = (self.signals, self.rank, self.gate, self.hints, self.zero_start)
        if self.fusion == "keys" and module != ("both", None, True, "none", "value"):
            from retrace_jax.errors import ConfigError

            raise ConfigError(f"retrace fusion 'keys' feeds the target's features to the drafter's attention and "
                              f"has no correction, gate, rank, hints or zero start: leave signals, rank, gate, hints "
                              f"and zero_start at their defaults (got signals={self.signals!r}, rank={self.rank!r}, "
                              f"gate={self.gate!r}, hints={self.hints!r}, zero_start={self.zero_start!r})")

    @classmethod
    def from_hf(cls, hf: dict[str, Any] | None) -> "ReTraceConfig | None":
        """The ``retrace_config`` object of a drafter ``config.json`` (None when absent, empty or
        disabled)."""
        if hf is None or hf == {}:
            return None
        keys = validated(ReTraceKeys, hf, parent="retrace_config")
        if not keys.enabled:
            return None
        return cls(keys.signals, keys.rank, keys.gate, keys.slots, keys.fusion, keys.hints, keys.zero_start)

    def to_hf(self) -> dict[str, Any]:
        hf = {"enabled": True, "signals": self.signals, "rank": self.rank, "gate": self.gate, "slots": self.slots,
              "fusion": self.fusion}
        # written only when used: a drafter of the paper's design keeps its old config
        if self.hints != "none":
            hf["hints"] = self.hints
        if self.zero_start != "value":
            hf["zero_start"] = self.zero_start
        return hf


class ReTraceKeys(BaseModel):
    """``retrace_config`` in a drafter's ``config.json``: this project's own object, so an unknown key
    is refused (a misspelt option would otherwise be dropped)."""

    model_config = STRICT
    enabled: Bool = True
    signals: Signals = "both"
    rank: PositiveInt | None = None
    gate: Bool = True
    slots: Slots = "all"  # absent in checkpoints written before it existed: their design, "all"
    fusion: Fusion = "embedding"  # likewise
    hints: Hints = "none"  # likewise
    zero_start: ZeroStart = "value"  # likewise


class Projection(nnx.Module):
    """``W x`` as one matrix, or as a ``down`` / ``up`` pair of rank ``rank``."""

    def __init__(self, din: int, dout: int, rank: int | None, dtype, rngs: nnx.Rngs, zero: bool = False):
        if rank is None:
            self.full = linear(din, dout, False, dtype, rngs)
            if zero:
                self.full.kernel[...] = jnp.zeros_like(self.full.kernel[...])
        else:
            self.down = linear(din, rank, False, dtype, rngs)
            self.up = linear(rank, dout, False, dtype, rngs)
            if zero:
                self.up.kernel[...] = jnp.zeros_like(self.up.kernel[...])
        self.rank = rank

    def __call__(self, x):
        return self.full(x) if self.rank is None else self.up(self.down(x))


class ReTraceFusion(nnx.Module):
    """The correction ``W_c``, value ``W_v`` and gate ``W_g`` of ReTrace."""

    def __init__(self, cfg: ReTraceConfig, d_draft: int, d_target: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        d_in = {"drafter": d_draft, "target": d_target, "both": d_draft + d_target}[cfg.signals]
        self.correct = Projection(d_in, d_draft, cfg.rank, dtype, rngs)
        self.value = Projection(d_draft, d_draft, cfg.rank, dtype, rngs, zero=cfg.zero_start == "value")
        if cfg.zero_start == "scale":
            self.scale = nnx.Param(jnp.zeros((1,), dtype))
        if cfg.gate:
            self.gate = Projection(2 * d_draft, d_draft, cfg.rank, dtype, rngs)
        if cfg.hints == "tokens":  # W_h (zero at the start) and its gate W_hg, both reading [E[t]; E[r]]
            self.hint = Projection(2 * d_draft, d_draft, cfg.rank, dtype, rngs, zero=True)
            self.hint_gate = Projection(2 * d_draft, d_draft, cfg.rank, dtype, rngs)

    def __call__(self, emb_bwd, memory: "Memory", beta=1.0):
        """Fuses the memory into the block's input embeddings ``[B, W, d]``."""
        mem_d = memory.mem_d.astype(emb_bwd.dtype)
        mem_t = memory.mem_t.astype(emb_bwd.dtype)
        signal = {"drafter": mem_d, "target": mem_t, "both": jnp.concatenate([mem_d, mem_t], -1)}[self.cfg.signals]
        base = mem_d if self.cfg.signals != "target" else jnp.zeros_like(mem_d)
        r = base + beta * self.correct(signal)
        residual = self.value(r)
        if self.cfg.gate:
            residual = residual * jax.nn.sigmoid(self.gate(jnp.concatenate([emb_bwd, r], -1)))
        if self.cfg.zero_start == "scale":
            residual = residual * self.scale[...].astype(residual.dtype)
        if self.cfg.hints == "tokens":
            hint = memory.hint.astype(emb_bwd.dtype)
            residual = residual + self.hint(hint) * jax.nn.sigmoid(self.hint_gate(hint))
        return emb_bwd + jnp.where(memory.valid[..., None], residual, 0).astype(emb_bwd.dtype)


@struct.dataclass
class Memory:
    """The rejected-suffix buffer, one entry per next-block slot."""

    mem_d: jax.Array  # [B, W, d_draft] the drafter's rejected final-norm states
    mem_t: jax.Array  # [B, W, d_target] the target's final-norm states that scored them; with fusion "keys"
    #                   [B, W, F], the target's features there (its layers that the drafter reads)
    valid: jax.Array  # [B, W] bool
    hint: jax.Array | None = None  # [B, W, 2 d_draft] hints="tokens": [E[t]; E[r]] of each slot; else None

    @classmethod
    def empty(cls, batch: int, block_size: int, d_draft: int, d_target: int, dtype, hints: bool = False):
        hint = jnp.zeros((batch, block_size, 2 * d_draft), dtype) if hints else None
        return cls(jnp.zeros((batch, block_size, d_draft), dtype), jnp.zeros((batch, block_size, d_target), dtype),
                   jnp.zeros((batch, block_size), bool), hint)


def token_hints(embed, own_bj, proposals_bj, dtype):
    """``[E[t]; E[r]]`` ``[B, W-1, 2d]`` of each proposal slot: the target's own token ``t`` at the verify slot
    that scored proposal ``j`` and the proposal ``r`` itself, through the target's input embedding."""
    return jnp.concatenate([embed(own_bj), embed(proposals_bj)], -1).astype(dtype)


def shift_memory(draft_hidden_bwd, target_hidden_bwd, accepted_b, agreed_bj=None, hint_bje=None) -> Memory:
    """The next round's memory after ``a`` acceptances: slot ``j`` takes drafter slot ``a+1+j`` and
    verify slot ``a+j``, valid for ``1 <= j <= W-2-a`` (gathers on clipped indices; no gradient).
    ``hint_bje`` (``hints="tokens"``): ``[B, W-1, 2d]`` from :func:`token_hints`, indexed like the
    proposals; slot ``j`` takes entry ``a+j``.

    ``agreed_bj`` (``ReTraceConfig.slots == "agreed"``): ``[B, W-1]``, whether the proposal of block slot
    ``i+1`` equals the target's own (argmax) token from verify slot ``i``, which scored it; slot ``j`` is
    then kept only where ``agreed[a+j]`` holds. Why (``docs/retrace.md``, "Slots"): past the lab drafter's
    training length the paper's memory made its drafts worse, through its own rejected states, and the
    slots where the target disagreed with them carried the harm."""
    w = draft_hidden_bwd.shape[1]
    j = jnp.arange(w)[None, :]
    a = accepted_b[:, None]
    valid = (j >= 1) & (j <= w - 2 - a)
    if agreed_bj is not None:
        valid &= jnp.take_along_axis(agreed_bj, jnp.clip(a + j, 0, w - 2), axis=1)
    idx_d = jnp.clip(a + 1 + j, 0, w - 1)
    idx_t = jnp.clip(a + j, 0, w - 1)
    mem_d = jnp.take_along_axis(draft_hidden_bwd, idx_d[..., None], axis=1)
    mem_t = jnp.take_along_axis(target_hidden_bwd, idx_t[..., None], axis=1)
    hint = None
    if hint_bje is not None:
        hint = jnp.take_along_axis(hint_bje, jnp.clip(a + j, 0, w - 2)[..., None], axis=1)
    return jax.lax.stop_gradient(Memory(mem_d, mem_t, valid, hint))
