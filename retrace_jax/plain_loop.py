"""Plain autoregressive decoding as one program: prefill, then a ``lax.while_loop`` of one-token steps."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from retrace_jax.commit import OutputBuffer, commit
from retrace_jax.kv_cache import KVCache
from retrace_jax.target import prefill


@struct.dataclass
class PlainCarry:
    cache: KVCache
    buf: OutputBuffer
    last_b: jax.Array  # [B] the token fed to the next step


@functools.partial(jax.jit, static_argnames=("graphdef", "capacity"))
def plain_generate(graphdef, state, tokens_bp, prompt_lens_b, live_b, max_new, stop_ids, *, capacity):
    """Greedy decoding of a right-padded batch; rows with ``live_b`` False are padding.

    Returns the output buffer (``capacity`` >= ``max_new`` slots per row).
    """
    model = nnx.merge(graphdef, state)
    batch, prompt_len = tokens_bp.shape
    cache = model.init_cache(batch, prompt_len + capacity)
    logits_bv, cache, _ = prefill(model, tokens_bp, prompt_lens_b, cache)
    first_b = jnp.argmax(logits_bv, -1).astype(jnp.int32)
    ones_b = jnp.ones((batch,), jnp.int32)
    buf = commit(OutputBuffer.empty(batch, capacity, ~live_b), first_b[:, None], ones_b, max_new, stop_ids)

    def step(c: PlainCarry) -> PlainCarry:
        out = model(c.last_b[:, None], c.cache)
        next_b = jnp.argmax(model.logits(out.hidden[:, 0]), -1).astype(jnp.int32)
        lengths = jnp.where(c.buf.done, c.cache.lengths, out.cache.lengths)
        buf = commit(c.buf, next_b[:, None], ones_b, max_new, stop_ids)
        return PlainCarry(out.cache.replace(lengths=lengths), buf, next_b)

    final = jax.lax.while_loop(lambda c: ~jnp.all(c.buf.done), step, PlainCarry(cache, buf, first_b))
    return final.buf
