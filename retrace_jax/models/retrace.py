"""ReTrace: the rejected-suffix buffer and its gated-residual fusion into the next block.

After a round at anchor ``s`` accepts ``a`` proposals, the next round starts at ``s' = s + a + 1``. Its
slot ``j`` (``1 <= j <= B-2-a``) sits at position ``s + a + 1 + j``, which this round drafted at slot
``a + 1 + j``; the drafter's state there and the target state that scored it (verify slot ``a + j``) are
kept for that slot. Before the first drafter layer each valid slot's mask embedding receives

    r_j  = mem_d[j] + beta * W_c [mem_d[j] ; mem_t[j]]
    e'_j = e_j + valid_j * (W_v r_j) * sigmoid(W_g [e_j ; r_j])

``W_v`` starts at zero, so a new ReTrace module leaves DFlash unchanged. With ``hints="tokens"`` each valid
slot also receives the target's verdict there as tokens: ``t_j``, the target's own (argmax) token at the
verify slot that scored it, and ``x_j``, the drafter's rejected proposal, through the target's (frozen)
input embedding ``E``:

    h_j  = [E[t_j] ; E[x_j]]
    e'_j += valid_j * (W_h h_j) * sigmoid(W_hg h_j)

``W_h`` starts at zero too. With ``mixture="target"`` the drafter's distribution at each valid slot is
mixed with the target's stale distribution there (its top ``MIXTURE_TOP_K`` tokens at the verify slot that
scored the position, renormalised): ``q_j = (1 - g_j) p_j + g_j p^t_j`` with the gate
``g_j = clip(alpha, 0, 1) * sigmoid(w . hd_j + b)`` on the drafter's final state ``hd_j``; ``alpha`` starts at
zero, so the gate starts closed. With ``zero_start="scale"`` the first residual is multiplied by a learned
scalar that starts at zero, and ``W_v`` starts small and random instead. See ``docs/retrace.md``.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx, struct
from pydantic import BaseModel

from retrace_jax.decoding.sampling import largest_k
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
# Whether the proposals mix in the target's stale distribution: "none" (the paper's design) or "target"
# (an output-level mixture under a learned gate that starts closed; see above). The memory keeps the
# target's MIXTURE_TOP_K most likely tokens of each slot.
MIXTURES = ("none", "target")
Mixture = Literal[MIXTURES]
MIXTURE_TOP_K = 8
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
    mixture: Mixture = "none"

    def __post_init__(self):
        module = (self.signals, self.rank, self.gate, self.hints, self.zero_start, self.mixture)
        if self.fusion == "keys" and module != ("both", None, True, "none", "value", "none"):
            from retrace_jax.errors import ConfigError

            raise ConfigError(f"retrace fusion 'keys' feeds the target's features to the drafter's attention and "
                              f"has no correction, gate, rank, hints, zero start or mixture: leave them at their "
                              f"defaults (got signals={self.signals!r}, rank={self.rank!r}, gate={self.gate!r}, "
                              f"hints={self.hints!r}, zero_start={self.zero_start!r}, mixture={self.mixture!r})")

    @classmethod
    def from_hf(cls, hf: dict[str, Any] | None) -> "ReTraceConfig | None":
        """The ``retrace_config`` object of a drafter ``config.json`` (None when absent, empty or
        disabled)."""
        if hf is None or hf == {}:
            return None
        keys = validated(ReTraceKeys, hf, parent="retrace_config")
        if not keys.enabled:
            return None
        return cls(keys.signals, keys.rank, keys.gate, keys.slots, keys.fusion, keys.hints, keys.zero_start,
                   keys.mixture)

    def to_hf(self) -> dict[str, Any]:
        hf = {"enabled": True, "signals": self.signals, "rank": self.rank, "gate": self.gate, "slots": self.slots,
              "fusion": self.fusion}
        # written only when used: a drafter of the paper's design keeps its old config
        if self.hints != "none":
            hf["hints"] = self.hints
        if self.zero_start != "value":
            hf["zero_start"] = self.zero_start
        if self.mixture != "none":
            hf["mixture"] = self.mixture
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
    mixture: Mixture = "none"  # likewise


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
    """The correction ``W_c``, value ``W_v`` and gate ``W_g`` of ReTrace, and the parameters of its
    options: the scale of ``zero_start="scale"``, the hint projection and gate of ``hints="tokens"``, the
    mixture gate and scale of ``mixture="target"``."""

    def __init__(self, cfg: ReTraceConfig, d_draft: int, d_target: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        d_in = {"drafter": d_draft, "target": d_target, "both": d_draft + d_target}[cfg.signals]
        self.correct = Projection(d_in, d_draft, cfg.rank, dtype, rngs)
        self.value = Projection(d_draft, d_draft, cfg.rank, dtype, rngs, zero=cfg.zero_start == "value")
        if cfg.zero_start == "scale":
            self.scale = nnx.Param(jnp.zeros((1,), dtype))
        if cfg.gate:
            self.gate = Projection(2 * d_draft, d_draft, cfg.rank, dtype, rngs)
        if cfg.hints == "tokens":  # W_h (zero at the start) and its gate W_hg, both reading [E[t]; E[x]]
            self.hint = Projection(2 * d_draft, d_draft, cfg.rank, dtype, rngs, zero=True)
            self.hint_gate = Projection(2 * d_draft, d_draft, cfg.rank, dtype, rngs)
        if cfg.mixture == "target":  # g = clip(alpha, 0, 1) * sigmoid(w . h + b), alpha zero at the start
            self.mix_gate = linear(d_draft, 1, True, dtype, rngs)
            self.mix_scale = nnx.Param(jnp.zeros((1,), dtype))

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

    def mix(self, logits_bjv, hidden_bjd, memory: "Memory", closed_is_dflash: bool = False):
        """``mixture="target"``: the log-probabilities of ``q = (1 - g) p + g p^t`` at the valid slots of
        the block's drafted slots ``1..W-1`` (``logits_bjv`` and ``hidden_bjd`` are theirs, over the
        draft vocabulary), the logits themselves where a slot is not valid. ``closed_is_dflash``
        (decoding): where the gate is exactly 0 (a new module) the logits are kept too, so that drafts are
        exactly DFlash's; training leaves it off, so the zero-started scale has its gradient.

        Computed so that it stays finite, with its gradient, at ``g = 0`` and for tokens whose ``p_v`` is
        far below the stale probability (see below)."""
        valid = memory.valid[:, 1:]
        ids, probs = memory.mix_ids[:, 1:], memory.mix_p[:, 1:].astype(jnp.float32)
        alpha = jnp.clip(self.mix_scale[...].astype(jnp.float32), 0.0, 1.0)  # g stays in [0, 1)
        g = alpha * jax.nn.sigmoid(self.mix_gate(hidden_bjd).astype(jnp.float32))
        logp = jax.nn.log_softmax(logits_bjv.astype(jnp.float32), -1)
        rows = jnp.arange(ids.shape[0])[:, None, None]
        cols = jnp.arange(ids.shape[1])[None, :, None]
        stale = jnp.zeros_like(logp).at[rows, cols, jnp.maximum(ids, 0)].add(jnp.where(ids >= 0, probs, 0.0))
        # log q = log p + log1p(g (s/p - 1)) where s/p is at most e^80; where p is far smaller than the stale
        # probability s, log q = log s + log(g + (1 - g) p/s), p/s kept at least e^-85. Both branches stay
        # finite everywhere, so neither leaks a NaN into the other's gradient.
        has = stale > 0
        log_s = jnp.log(jnp.where(has, stale, 1.0))
        gap = logp - log_s
        far = has & (gap < -80.0)
        ratio = jnp.where(has & ~far, jnp.exp(jnp.clip(-gap, -80.0, 80.0)), 0.0)
        near_q = logp + jnp.log1p(g * (ratio - 1.0))
        far_q = log_s + jnp.log(g + (1.0 - g) * jnp.exp(jnp.clip(gap, -85.0, 85.0)))
        mixed = jnp.where(far, far_q, near_q)
        use = valid[..., None] & ((g > 0) if closed_is_dflash else True)
        return jnp.where(use, mixed, logits_bjv.astype(jnp.float32)).astype(logits_bjv.dtype)


@struct.dataclass
class Memory:
    """The rejected-suffix buffer, one entry per next-block slot."""

    mem_d: jax.Array  # [B, W, d_draft] the drafter's rejected final-norm states
    mem_t: jax.Array  # [B, W, d_target] the target's final-norm states that scored them; with fusion "keys"
    #                   [B, W, F], the target's features there (its layers that the drafter reads)
    valid: jax.Array  # [B, W] bool
    hint: jax.Array | None = None  # [B, W, 2 d_draft] hints="tokens": [E[t]; E[x]] of each slot; else None
    mix_ids: jax.Array | None = None  # [B, W, K] mixture="target": the target's top-K (draft indices, -1 outside)
    mix_p: jax.Array | None = None  # [B, W, K] their probabilities, renormalised over those inside

    @classmethod
    def empty(cls, batch: int, block_size: int, d_draft: int, d_target: int, dtype, hints: bool = False,
              mixture: bool = False):
        hint = jnp.zeros((batch, block_size, 2 * d_draft), dtype) if hints else None
        mix_ids = jnp.full((batch, block_size, MIXTURE_TOP_K), -1, jnp.int32) if mixture else None
        mix_p = jnp.zeros((batch, block_size, MIXTURE_TOP_K), jnp.float32) if mixture else None
        return cls(jnp.zeros((batch, block_size, d_draft), dtype), jnp.zeros((batch, block_size, d_target), dtype),
                   jnp.zeros((batch, block_size), bool), hint, mix_ids, mix_p)


def stale_top_k(target_logits_bwv, to_index):
    """The target's ``MIXTURE_TOP_K`` most likely tokens of each slot as draft-vocabulary indices
    (``to_index``: target ids -> draft indices, -1 outside) and their probabilities, renormalised over the
    ones inside the draft vocabulary (all zero when none is). Renormalised, they are a softmax of those
    logits alone, so the vocabulary's normaliser is never computed: a round takes the top entries of the
    verify pass's logits and nothing else over the vocabulary."""
    top_logits, top_ids = largest_k(target_logits_bwv.astype(jnp.float32), MIXTURE_TOP_K)
    ids = to_index(top_ids)
    inside = ids >= 0
    peak = jnp.max(jnp.where(inside, top_logits, -jnp.inf), -1, keepdims=True)
    p = jnp.exp(jnp.where(inside, top_logits - peak, -jnp.inf))
    return ids, p / jnp.maximum(jnp.sum(p, -1, keepdims=True), 1e-30)


def token_hints(embed, own_bj, proposals_bj, dtype):
    """``[E[t]; E[x]]`` ``[B, W-1, 2d]`` of each proposal slot: the target's own token ``t`` at the verify slot
    that scored proposal ``j`` and the proposal ``x`` itself, through the target's input embedding."""
    return jnp.concatenate([embed(own_bj), embed(proposals_bj)], -1).astype(dtype)


def shift_memory(draft_hidden_bwd, target_hidden_bwd, accepted_b, agreed_bj=None, hint_bje=None,
                 mix_bwk=None) -> Memory:
    """The next round's memory after ``a`` acceptances: slot ``j`` takes drafter slot ``a+1+j`` and
    verify slot ``a+j``, valid for ``1 <= j <= W-2-a`` (gathers on clipped indices; no gradient).
    ``hint_bje`` (``hints="tokens"``): ``[B, W-1, 2d]`` from :func:`token_hints`, indexed like the
    proposals; slot ``j`` takes entry ``a+j``. ``mix_bwk`` (``mixture="target"``): the pair
    :func:`stale_top_k` of the verify pass ``[B, W, K]``, shifted as the target states are.

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
    hint = mix_ids = mix_p = None
    if hint_bje is not None:
        hint = jnp.take_along_axis(hint_bje, jnp.clip(a + j, 0, w - 2)[..., None], axis=1)
    if mix_bwk is not None:
        mix_ids, mix_p = (jnp.take_along_axis(x, idx_t[..., None], axis=1) for x in mix_bwk)
    return jax.lax.stop_gradient(Memory(mem_d, mem_t, valid, hint, mix_ids, mix_p))
