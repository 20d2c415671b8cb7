"""Speculative generation as one program: prefill, then a ``lax.while_loop`` of draft -> verify -> commit.

Per row ``b`` the carry keeps ``start[b]`` (= the target cache length): the positions ``< start`` are in
both the target cache and the drafter's context cache, and ``anchor[b]`` is the committed token at
``start``. A round drafts a block ``[anchor, MASK, ...]`` at positions ``start .. start+B-1``, the target
verifies it in one forward pass, ``a`` proposals are accepted, and ``a + 1`` tokens are committed (the
accepted ones and the target's own next token, which becomes the new anchor). Rejected positions stay in
the caches only as stale entries past the new length, which nothing reads.

The round is a pure function :func:`speculative_round` ``(models, constants, carry) -> (carry, info)``.
The compiled loop (:func:`speculative_generate`) calls it, and so does :class:`SpeculativeStepper`, a
Python driver that runs one jitted round at a time (debugging, per-round statistics, benchmarks).
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx, struct

from retrace_jax.decoding.buffers import spare_or_new
from retrace_jax.decoding.commit import OutputBuffer, commit, stop_non_finite
from retrace_jax.decoding.layer_loop import decode_weights, merge_target
from retrace_jax.decoding.plain import StepConstants
from retrace_jax.decoding.programs import DecodeProgram, cpu_products_options
from retrace_jax.decoding.sampling import SamplingMode, SamplingParams, argmax, row_keys, step_keys
from retrace_jax.decoding.verify import (
    accepted_count,
    committed_tokens,
    rejection_sample,
    target_sample_match,
)
from retrace_jax.models.draft_vocab import (
    DraftHead,
    draft_head,
    head_logits,
    to_draft_index,
    to_full_vocab,
    to_target_ids,
)
from retrace_jax.models.kv_cache import KVCache
from retrace_jax.models.retrace import Memory, shift_memory, stale_top_k, token_hints
from retrace_jax.models.target import prefill


@struct.dataclass
class SpecCarry:
    target_cache: KVCache  # lengths = start
    draft_cache: KVCache  # the drafter's context keys/values; lengths = start
    buf: OutputBuffer
    anchor_b: jax.Array  # [B] the committed token at position start
    accept_br: jax.Array  # [B, R] a + 1 of each round
    rounds_b: jax.Array  # [B] rounds run by each row
    memory: Memory | None  # ReTrace's rejected-suffix buffer (None for DFlash)


@struct.dataclass
class RoundConstants(StepConstants):
    """What every round reads and none changes (plain decoding's constants plus the block size); the
    static fields shape the compiled program."""

    block_size: int = struct.field(pytree_node=False, default=16)
    draft_head: DraftHead | None = None  # the drafter's LM head over its draft vocabulary, if it has one


class RoundInfo(NamedTuple):
    """What one round saw, for drivers that want it (the compiled loop drops it)."""

    active_b: jax.Array  # [B] the row was still generating
    start_b: jax.Array  # [B] the block's first position
    accepted_b: jax.Array  # [B] a
    proposals_bj: jax.Array  # [B, J] the drafter's tokens for block slots 1..J
    tokens_bw: jax.Array  # [B, W] the round's tokens; the first a + 1 are committed
    draft_logits_bjv: jax.Array  # [B, J, V] (-inf outside a draft vocabulary)
    # [B, W, V] the verify pass's logits: slot k scores position start + k + 1, on a context that holds the
    # block's proposals up to slot k, rejected ones included (what ReTrace's mem_t states score)
    target_logits_bwv: jax.Array | None = None

    # The field names before 0.2.0, when K stood for both KV heads and drafted slots.
    proposals_bk = property(lambda self: _renamed(self, "proposals_bk", "proposals_bj"))
    tokens_bk = property(lambda self: _renamed(self, "tokens_bk", "tokens_bw"))
    draft_logits_bkv = property(lambda self: _renamed(self, "draft_logits_bkv", "draft_logits_bjv"))


def _renamed(info: RoundInfo, old: str, new: str):
    warnings.warn(f"RoundInfo.{old} is now RoundInfo.{new}; the old name will be removed", DeprecationWarning,
                  stacklevel=3)
    return getattr(info, new)


def draft_block(target, drafter, anchor_b, draft_cache: KVCache, block_size: int, memory: Memory | None = None,
                attention: str = "auto"):
    """The drafter's final-norm states of the block ``[anchor, MASK, ...]``, ``[B, block_size, d]``."""
    batch = anchor_b.shape[0]
    mask_tokens = jnp.full((batch, block_size - 1), drafter.cfg.mask_token_id, jnp.int32)
    block = jnp.concatenate([anchor_b[:, None], mask_tokens], axis=1)
    return drafter.draft(target.embed(block), draft_cache, memory, attention=attention)


def make_proposals(keys_b, draft_logits_bjv, sampling: SamplingParams, mode: SamplingMode,
                   head: DraftHead | None = None):
    """The drafter's tokens ``[B, J]``: argmax (``draft_rule`` "argmax", "target_sample" and greedy), or
    draws from its filtered distribution q (``draft_rule="sample"``). With a draft vocabulary ``head``
    the logits are ``[B, J, U]`` over it, and the tokens come back as target ids."""
    if mode.sample and mode.draft_rule == "sample":
        keys = jax.vmap(lambda k: jax.random.fold_in(k, 1))(keys_b)
        index = jax.vmap(jax.random.categorical)(keys, sampling.logprobs(draft_logits_bjv, mode))
    else:
        index = argmax(draft_logits_bjv)
    return to_target_ids(head, index.astype(jnp.int32))


def verify_round(keys_b, proposals_bj, draft_logits_bjv, target_logits_bwv, sampling: SamplingParams,
                 mode: SamplingMode, head: DraftHead | None = None):
    """Accepted count ``a`` and the round's tokens ``[B, W]``, of which the first ``a + 1`` are
    committed. Greedy: exact match with the target's argmax; ``draft_rule="target_sample"``: match with
    the target's own samples (the official DFlash rule); else rejection sampling."""
    if not mode.sample:
        choice = argmax(target_logits_bwv)
        a = accepted_count(proposals_bj, choice)
        return a, committed_tokens(proposals_bj, choice, a)
    keys = jax.vmap(lambda k: jax.random.fold_in(k, 2))(keys_b)
    if mode.draft_rule == "target_sample":
        return target_sample_match(keys, proposals_bj, sampling.logprobs(target_logits_bwv, mode))
    draft_logp = None
    if mode.draft_rule == "sample":  # q over the whole vocabulary (zero outside a draft vocabulary)
        vocab = target_logits_bwv.shape[-1]
        draft_logp = to_full_vocab(head, sampling.logprobs(draft_logits_bjv, mode), vocab)
    a, next_b = rejection_sample(keys, proposals_bj, sampling.logprobs(target_logits_bwv, mode), draft_logp)
    return a, committed_tokens(proposals_bj, jnp.broadcast_to(next_b[:, None], target_logits_bwv.shape[:2]), a)


def speculative_init(models, tokens_bp, prompt_lens_b, live_b, max_new, stop_ids, sampling: SamplingParams, *,
                     capacity: int, block_size: int, use_retrace: bool = True, mode: SamplingMode = SamplingMode(),
                     mesh=None, cache_dtype=None, attention="auto", spare=None) -> tuple[RoundConstants, SpecCarry]:
    """Prefill of a right-padded batch (rows with ``live_b`` False are padding): the first token of
    each row from the prompt's logits (key step 0), both caches filled, the empty ReTrace memory.
    ``spare``: the target's and the drafter's caches to fill (stale contents: see
    ``retrace_jax/decoding/buffers.py``), or None for new empty ones."""
    target, drafter = models
    layer_ids = drafter.cfg.target_layer_ids
    batch, prompt_len = tokens_bp.shape
    max_len = prompt_len + capacity + block_size  # a verify block may reach past the last kept token
    caches = [spare_or_new(m, batch, max_len, cache_dtype, s, what) for m, s, what in
              zip(models, spare or (None, None), ("the target's cache", "the drafter's cache"))]
    logits_bv, target_cache, features = prefill(
        target, tokens_bp, prompt_lens_b, caches[0].constrain(mesh), feature_layers=layer_ids, attention=attention,
    )
    draft_cache = drafter.extend_cache(features, caches[1].constrain(mesh))
    draft_cache = draft_cache.replace(lengths=prompt_lens_b)
    consts = RoundConstants(row_keys(sampling.seed, batch), jnp.asarray(max_new, jnp.int32), stop_ids, sampling,
                            block_size=block_size, mode=mode, mesh=mesh, attention=attention,
                            draft_head=draft_head(target, drafter))
    first_b = sampling.choose(step_keys(consts.keys_b, jnp.zeros((batch,), jnp.int32)), logits_bv, mode)
    buf = stop_non_finite(OutputBuffer.empty(batch, capacity, ~live_b), logits_bv)
    buf = commit(buf, first_b[:, None], jnp.ones((batch,), jnp.int32), consts.max_new, stop_ids)
    memory = empty_memory(models, batch, block_size) if use_retrace else None
    carry = SpecCarry(
        target_cache=target_cache,
        draft_cache=draft_cache,
        buf=buf,
        anchor_b=first_b,
        accept_br=jnp.zeros((batch, capacity), jnp.int32),
        rounds_b=jnp.zeros((batch,), jnp.int32),
        memory=memory,
    )
    return consts, carry


def empty_memory(models, batch: int, block_size: int) -> Memory | None:
    """The ReTrace memory before a prompt's first round (nothing valid), or None for a drafter without a
    ReTrace module."""
    target, drafter = models
    if drafter.cfg.retrace is None:
        return None
    target_width = (drafter.cfg.num_features * target.cfg.hidden_size if drafter.cfg.retrace.fusion == "keys"
                    else target.cfg.hidden_size)  # the target's features, or its final-norm states
    return Memory.empty(batch, block_size, drafter.cfg.hidden_size, target_width, drafter.dtype,
                        hints=drafter.cfg.retrace.hints == "tokens", mixture=drafter.cfg.retrace.mixture == "target")


def speculative_round(models, consts: RoundConstants, c: SpecCarry) -> tuple[SpecCarry, RoundInfo]:
    """One round for every row: draft, verify, commit, advance both caches and the ReTrace memory.
    Rows that are done change nothing but stale cache entries past their length."""
    target, drafter = models
    mode, mesh, block_size = consts.mode, consts.mesh, consts.block_size
    batch, capacity = c.accept_br.shape
    active = ~c.buf.done
    start = c.target_cache.lengths
    draft_hidden = draft_block(target, drafter, c.anchor_b, c.draft_cache, block_size, c.memory, consts.attention)
    head = consts.draft_head
    # The head multiplies every block row, the anchor's included, and drops the anchor's logits after: XLA's
    # CPU backend multiplies 7 rows by the head more slowly than 8, and 15 about as fast as 16
    # (benchmarks/lm_head.py --rows 7,8,15,16); on accelerators the extra row costs next to nothing.
    draft_logits = head_logits(target, head, draft_hidden)[:, 1:]  # [B, J, U] ([B, J, V] without a draft vocab)
    if c.memory is not None and drafter.cfg.retrace.mixture == "target":  # q mixes in the stale target
        draft_logits = drafter.retrace.mix(draft_logits, draft_hidden[:, 1:], c.memory, closed_is_dflash=True)
    keys = step_keys(consts.keys_b, c.rounds_b + 1)
    proposals = make_proposals(keys, draft_logits, consts.sampling, mode, head)
    block = jnp.concatenate([c.anchor_b[:, None], proposals], axis=1)
    out = target(block, c.target_cache, feature_layers=drafter.cfg.target_layer_ids, attention=consts.attention)
    target_logits = target.logits(out.hidden)
    a, tokens = verify_round(keys, proposals, draft_logits, target_logits, consts.sampling, mode, head)
    buf = commit(stop_non_finite(c.buf, target_logits), tokens, a + 1, consts.max_new, consts.stop_ids)
    # A row that finishes keeps its old start: its later (ignored) rounds then stay inside the caches.
    new_start = jnp.where(active & ~buf.done, start + a + 1, start)
    draft_cache = drafter.extend_cache(out.features, c.draft_cache)
    next_anchor = jnp.take_along_axis(tokens, a[:, None], axis=1)[:, 0]
    memory = None
    if c.memory is not None:
        rc = drafter.cfg.retrace
        agreed = hint = None
        if rc.slots == "agreed" or rc.hints == "tokens":  # the target's own tokens, whatever the sampling
            own = argmax(target_logits)[:, :-1]
            agreed = proposals == own if rc.slots == "agreed" else None
            hint = token_hints(target.embed, own, proposals, drafter.dtype) if rc.hints == "tokens" else None
        scored = out.features if rc.fusion == "keys" else out.hidden  # [B, W, F] or [B, W, d]
        mix = None
        if rc.mixture == "target":
            mix = stale_top_k(target_logits, lambda ids: to_draft_index(head, ids, target.cfg.vocab_size))
        memory = shift_memory(draft_hidden, scored.astype(drafter.dtype), a, agreed, hint, mix)
    rows = jnp.arange(batch)
    accept = c.accept_br.at[rows, jnp.where(active, c.rounds_b, capacity)].set(a + 1, mode="drop")
    carry = SpecCarry(
        target_cache=out.cache.replace(lengths=new_start).constrain(mesh),
        draft_cache=draft_cache.replace(lengths=new_start).constrain(mesh),
        buf=buf,
        anchor_b=jnp.where(active, next_anchor, c.anchor_b),
        accept_br=accept,
        rounds_b=c.rounds_b + active.astype(jnp.int32),
        memory=memory,
    )
    full_logits = to_full_vocab(head, draft_logits, target.cfg.vocab_size)  # for drivers; unused in the loop
    return carry, RoundInfo(active, start, a, proposals, tokens, full_logits, target_logits)


@functools.partial(
    DecodeProgram,
    static_argnames=("target_def", "drafter_def", "capacity", "block_size", "use_retrace", "mode", "mesh",
                     "cache_dtype", "attention", "layer_loop"), donate_argnames=("spare",),
)
def speculative_generate(target_def, target_state, drafter_def, drafter_state, tokens_bp, prompt_lens_b,
                         live_b, max_new, stop_ids, sampling: SamplingParams, *, capacity, block_size,
                         use_retrace=True, mode: SamplingMode = SamplingMode(), mesh=None, cache_dtype=None,
                         attention="auto", layer_loop="auto", kept=None, spare=None):
    """Speculative decoding of a right-padded batch, greedy or by rejection sampling; row ``b`` uses key
    ``fold_in(PRNGKey(seed), b)`` folded with its step (0 for prefill, round + 1 after).

    A ReTrace drafter carries its rejected-suffix memory from round to round unless ``use_retrace`` is
    False. With a ``mesh`` both caches are sharded (batch over data, KV heads over tensor). Returns the
    output buffer, the acceptance lengths ``[B, capacity]`` and the rounds per row. ``layer_loop``:
    "scan" or "unrolled" (see ``TargetModel.unroll_layers``); an unrolled loop takes the target's per-layer
    weights and LM head from ``kept`` (see :func:`~retrace_jax.decoding.layer_loop.decode_weights`), or slices
    the layers itself. Given ``spare`` caches (the target's and the drafter's, donated: see
    ``retrace_jax/decoding/buffers.py``), decodes in them and returns them as a fourth output.
    """
    models = (merge_target(target_def, target_state, layer_loop, kept), nnx.merge(drafter_def, drafter_state))
    consts, init = speculative_init(models, tokens_bp, prompt_lens_b, live_b, max_new, stop_ids, sampling,
                                    capacity=capacity, block_size=block_size, use_retrace=use_retrace, mode=mode,
                                    mesh=mesh, cache_dtype=cache_dtype, attention=attention, spare=spare)
    final = jax.lax.while_loop(lambda c: ~jnp.all(c.buf.done), lambda c: speculative_round(models, consts, c)[0],
                               init)
    if spare is None:
        return final.buf, final.accept_br, final.rounds_b
    return final.buf, final.accept_br, final.rounds_b, (final.target_cache, final.draft_cache)


class SpeculativeStepper:
    """The same program, one jitted round per Python call: ``init`` runs the prefill, ``step`` one round
    and returns its :class:`RoundInfo`; ``done`` says when every row has finished. The rounds are
    exactly those of :func:`speculative_generate` (same function), so the outputs are identical.

    With the unrolled layer loop (the CPU default) it uses the target's kept per-layer weights, as
    ``generate`` does (:func:`~retrace_jax.decoding.layer_loop.decode_weights`)."""

    def __init__(self, target, drafter, layer_loop: str = "auto", **static):
        self._layer_loop = layer_loop
        (target_def, target_state), (drafter_def, drafter_state) = nnx.split(target), nnx.split(drafter)
        self._defs, self._states = (target_def, drafter_def), (target_state, drafter_state)
        self._kept = decode_weights(target, layer_loop, target_state)
        self.consts = self.carry = None

        def init(states, kept, *args):
            return speculative_init(self._models(states, kept), *args, **static)

        def step(states, kept, consts, carry):
            return speculative_round(self._models(states, kept), consts, carry)

        # the products of several rows compiled as generate's "auto" compiles them for this target
        products = cpu_products_options(target.cfg, target.dtype.itemsize)
        self._init = DecodeProgram(init, cpu_extra_options=products)
        self._step = DecodeProgram(step, donate_argnums=3, cpu_extra_options=products)  # in place

    def _models(self, states, kept):
        return (merge_target(self._defs[0], states[0], self._layer_loop, kept), nnx.merge(self._defs[1], states[1]))

    def init(self, tokens_bp, prompt_lens_b, live_b, max_new, stop_ids, sampling: SamplingParams) -> SpecCarry:
        self.consts, self.carry = self._init(self._states, self._kept, tokens_bp, prompt_lens_b, live_b, max_new,
                                             stop_ids, sampling)
        return self.carry

    def step(self) -> RoundInfo:
        """One round; the previous carry is donated (its buffers are reused), so keep a copy
        (``jax.tree.map(jnp.copy, stepper.carry)``) to run a round again from the same state."""
        self.carry, info = self._step(self._states, self._kept, self.consts, self.carry)
        return info

    @property
    def done(self) -> bool:
        return bool(jnp.all(self.carry.buf.done))
