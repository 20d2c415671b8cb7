"""Speculative generation as one program: prefill, then a ``lax.while_loop`` of draft -> verify -> commit.

Per row ``b`` the carry keeps ``start[b]`` (= the target cache length): the positions ``< start`` are in
both the target cache and the drafter's context cache, and ``anchor[b]`` is the committed token at
``start``. A round drafts a block ``[anchor, MASK, ...]`` at positions ``start .. start+B-1``, the target
verifies it in one forward pass, ``a`` proposals are accepted, and ``a + 1`` tokens are committed (the
accepted ones and the target's own next token, which becomes the new anchor). Rejected positions stay in
the caches only as stale entries past the new length, which nothing reads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from retrace_jax.commit import OutputBuffer, commit
from retrace_jax.kv_cache import KVCache
from retrace_jax.retrace import Memory, shift_memory
from retrace_jax.sampling import SamplingMode, SamplingParams, row_keys, step_keys
from retrace_jax.target import prefill
from retrace_jax.verify import accepted_count, committed_tokens, rejection_sample, target_sample_match


@struct.dataclass
class SpecCarry:
    target_cache: KVCache  # lengths = start
    draft_cache: KVCache  # the drafter's context keys/values; lengths = start
    buf: OutputBuffer
    anchor_b: jax.Array  # [B] the committed token at position start
    accept_br: jax.Array  # [B, R] a + 1 of each round
    rounds_b: jax.Array  # [B] rounds run by each row
    memory: Memory | None  # ReTrace's rejected-suffix buffer (None for DFlash)


def draft_block(target, drafter, anchor_b, draft_cache: KVCache, block_size: int, memory: Memory | None = None):
    """The drafter's final-norm states of the block ``[anchor, MASK, ...]``, ``[B, block_size, d]``."""
    batch = anchor_b.shape[0]
    mask_tokens = jnp.full((batch, block_size - 1), drafter.cfg.mask_token_id, jnp.int32)
    block = jnp.concatenate([anchor_b[:, None], mask_tokens], axis=1)
    return drafter.draft(target.embed(block), draft_cache, memory)


def make_proposals(keys_b, draft_logits_bkv, sampling: SamplingParams, mode: SamplingMode):
    """The drafter's tokens ``[B, K]``: argmax (``draft_rule`` "argmax", "target_sample" and greedy), or
    draws from its filtered distribution q (``draft_rule="sample"``)."""
    if mode.sample and mode.draft_rule == "sample":
        keys = jax.vmap(lambda k: jax.random.fold_in(k, 1))(keys_b)
        return jax.vmap(jax.random.categorical)(keys, sampling.logprobs(draft_logits_bkv, mode)).astype(jnp.int32)
    return jnp.argmax(draft_logits_bkv, -1).astype(jnp.int32)


def verify_round(keys_b, proposals_bk, draft_logits_bkv, target_logits_bjv, sampling: SamplingParams,
                 mode: SamplingMode):
    """Accepted count ``a`` and the round's tokens ``[B, K + 1]``, of which the first ``a + 1`` are
    committed. Greedy: exact match with the target's argmax; ``draft_rule="target_sample"``: match with
    the target's own samples (the official DFlash rule); else rejection sampling."""
    if not mode.sample:
        choice = jnp.argmax(target_logits_bjv, -1).astype(jnp.int32)
        a = accepted_count(proposals_bk, choice)
        return a, committed_tokens(proposals_bk, choice, a)
    keys = jax.vmap(lambda k: jax.random.fold_in(k, 2))(keys_b)
    if mode.draft_rule == "target_sample":
        return target_sample_match(keys, proposals_bk, sampling.logprobs(target_logits_bjv, mode))
    draft_logp = sampling.logprobs(draft_logits_bkv, mode) if mode.draft_rule == "sample" else None
    a, next_b = rejection_sample(keys, proposals_bk, sampling.logprobs(target_logits_bjv, mode), draft_logp)
    return a, committed_tokens(proposals_bk, jnp.broadcast_to(next_b[:, None], target_logits_bjv.shape[:2]), a)


@functools.partial(
    jax.jit, static_argnames=("target_def", "drafter_def", "capacity", "block_size", "use_retrace", "mode", "mesh")
)
def speculative_generate(target_def, target_state, drafter_def, drafter_state, tokens_bp, prompt_lens_b,
                         live_b, max_new, stop_ids, sampling: SamplingParams, *, capacity, block_size,
                         use_retrace=True, mode: SamplingMode = SamplingMode(), mesh=None):
    """Speculative decoding of a right-padded batch (rows with ``live_b`` False are padding), greedy or
    by rejection sampling; row ``b`` uses key ``fold_in(PRNGKey(seed), b)`` folded with its step
    (0 for prefill, round + 1 after).

    A ReTrace drafter carries its rejected-suffix memory from round to round unless ``use_retrace`` is
    False. With a ``mesh`` both caches are sharded (batch over data, KV heads over tensor). Returns the
    output buffer, the acceptance lengths ``[B, capacity]`` and the rounds per row.
    """
    target = nnx.merge(target_def, target_state)
    drafter = nnx.merge(drafter_def, drafter_state)
    layer_ids = drafter.cfg.target_layer_ids
    batch, prompt_len = tokens_bp.shape
    max_len = prompt_len + capacity + block_size  # a verify block may reach past the last kept token

    logits_bv, target_cache, features = prefill(
        target, tokens_bp, prompt_lens_b, target.init_cache(batch, max_len).constrain(mesh), feature_layers=layer_ids
    )
    draft_cache = drafter.extend_cache(features, drafter.init_cache(batch, max_len).constrain(mesh))
    draft_cache = draft_cache.replace(lengths=prompt_lens_b)
    keys_b = row_keys(sampling.seed, batch)
    first_b = sampling.choose(step_keys(keys_b, jnp.zeros((batch,), jnp.int32)), logits_bv, mode)
    buf = OutputBuffer.empty(batch, capacity, ~live_b)
    buf = commit(buf, first_b[:, None], jnp.ones((batch,), jnp.int32), max_new, stop_ids)
    memory = None
    if use_retrace and drafter.cfg.retrace is not None:
        d = drafter.cfg.hidden_size
        memory = Memory.empty(batch, block_size, d, target.cfg.hidden_size, drafter.dtype)

    def round_(c: SpecCarry) -> SpecCarry:
        active = ~c.buf.done
        start = c.target_cache.lengths
        draft_hidden = draft_block(target, drafter, c.anchor_b, c.draft_cache, block_size, c.memory)
        draft_logits = target.logits(draft_hidden[:, 1:])
        keys = step_keys(keys_b, c.rounds_b + 1)
        proposals = make_proposals(keys, draft_logits, sampling, mode)
        block = jnp.concatenate([c.anchor_b[:, None], proposals], axis=1)
        out = target(block, c.target_cache, feature_layers=layer_ids)
        a, tokens = verify_round(keys, proposals, draft_logits, target.logits(out.hidden), sampling, mode)
        buf = commit(c.buf, tokens, a + 1, max_new, stop_ids)
        # A row that finishes keeps its old start: its later (ignored) rounds then stay inside the caches.
        new_start = jnp.where(active & ~buf.done, start + a + 1, start)
        draft_cache = drafter.extend_cache(out.features, c.draft_cache)
        next_anchor = jnp.take_along_axis(tokens, a[:, None], axis=1)[:, 0]
        rows = jnp.arange(batch)
        accept = c.accept_br.at[rows, jnp.where(active, c.rounds_b, capacity)].set(a + 1, mode="drop")
        return SpecCarry(
            target_cache=out.cache.replace(lengths=new_start).constrain(mesh),
            draft_cache=draft_cache.replace(lengths=new_start).constrain(mesh),
            buf=buf,
            anchor_b=jnp.where(active, next_anchor, c.anchor_b),
            accept_br=accept,
            rounds_b=c.rounds_b + active.astype(jnp.int32),
            memory=None if c.memory is None else shift_memory(draft_hidden, out.hidden.astype(drafter.dtype), a),
        )

    init = SpecCarry(
        target_cache=target_cache,
        draft_cache=draft_cache,
        buf=buf,
        anchor_b=first_b,
        accept_br=jnp.zeros((batch, capacity), jnp.int32),
        rounds_b=jnp.zeros((batch,), jnp.int32),
        memory=memory,
    )
    final = jax.lax.while_loop(lambda c: ~jnp.all(c.buf.done), round_, init)
    return final.buf, final.accept_br, final.rounds_b
