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
from retrace_jax.target import prefill
from retrace_jax.verify import accepted_count, committed_tokens


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
    """The drafter's proposals ``[B, block_size - 1]`` for the slots after the anchor, and its
    final-norm states of the whole block ``[B, block_size, d]``."""
    batch = anchor_b.shape[0]
    mask_tokens = jnp.full((batch, block_size - 1), drafter.cfg.mask_token_id, jnp.int32)
    block = jnp.concatenate([anchor_b[:, None], mask_tokens], axis=1)
    hidden = drafter.draft(target.embed(block), draft_cache, memory)
    return jnp.argmax(target.logits(hidden[:, 1:]), -1).astype(jnp.int32), hidden


@functools.partial(jax.jit, static_argnames=("target_def", "drafter_def", "capacity", "block_size", "use_retrace"))
def speculative_generate(target_def, target_state, drafter_def, drafter_state, tokens_bp, prompt_lens_b,
                         live_b, max_new, stop_ids, *, capacity, block_size, use_retrace=True):
    """Greedy speculative decoding of a right-padded batch (rows with ``live_b`` False are padding).

    A ReTrace drafter carries its rejected-suffix memory from round to round unless ``use_retrace`` is
    False. Returns the output buffer, the acceptance lengths ``[B, capacity]`` and the rounds per row.
    """
    target = nnx.merge(target_def, target_state)
    drafter = nnx.merge(drafter_def, drafter_state)
    layer_ids = drafter.cfg.target_layer_ids
    batch, prompt_len = tokens_bp.shape
    max_len = prompt_len + capacity + block_size  # a verify block may reach past the last kept token

    logits_bv, target_cache, features = prefill(
        target, tokens_bp, prompt_lens_b, target.init_cache(batch, max_len), feature_layers=layer_ids
    )
    draft_cache = drafter.extend_cache(features, drafter.init_cache(batch, max_len))
    draft_cache = draft_cache.replace(lengths=prompt_lens_b)
    first_b = jnp.argmax(logits_bv, -1).astype(jnp.int32)
    buf = OutputBuffer.empty(batch, capacity, ~live_b)
    buf = commit(buf, first_b[:, None], jnp.ones((batch,), jnp.int32), max_new, stop_ids)
    memory = None
    if use_retrace and drafter.cfg.retrace is not None:
        d = drafter.cfg.hidden_size
        memory = Memory.empty(batch, block_size, d, target.cfg.hidden_size, drafter.dtype)

    def round_(c: SpecCarry) -> SpecCarry:
        active = ~c.buf.done
        start = c.target_cache.lengths
        proposals, draft_hidden = draft_block(target, drafter, c.anchor_b, c.draft_cache, block_size, c.memory)
        block = jnp.concatenate([c.anchor_b[:, None], proposals], axis=1)
        out = target(block, c.target_cache, feature_layers=layer_ids)
        choice = jnp.argmax(target.logits(out.hidden), -1).astype(jnp.int32)  # [B, block]
        a = accepted_count(proposals, choice)
        buf = commit(c.buf, committed_tokens(proposals, choice, a), a + 1, max_new, stop_ids)
        new_start = jnp.where(active, start + a + 1, start)
        draft_cache = drafter.extend_cache(out.features, c.draft_cache)
        next_anchor = jnp.take_along_axis(choice, a[:, None], axis=1)[:, 0]
        rows = jnp.arange(batch)
        accept = c.accept_br.at[rows, jnp.where(active, c.rounds_b, capacity)].set(a + 1, mode="drop")
        return SpecCarry(
            target_cache=out.cache.replace(lengths=new_start),
            draft_cache=draft_cache.replace(lengths=new_start),
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
