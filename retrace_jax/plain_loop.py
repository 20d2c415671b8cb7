"""Plain autoregressive decoding as one program: prefill, then a ``lax.while_loop`` of one-token steps."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from retrace_jax.commit import OutputBuffer, commit
from retrace_jax.kv_cache import KVCache
from retrace_jax.sampling import SamplingMode, SamplingParams, row_keys, step_keys
from retrace_jax.target import prefill


@struct.dataclass
class PlainCarry:
    cache: KVCache
    buf: OutputBuffer
    last_b: jax.Array  # [B] the token fed to the next step


@functools.partial(jax.jit, static_argnames=("graphdef", "capacity", "mode", "mesh"))
def plain_generate(graphdef, state, tokens_bp, prompt_lens_b, live_b, max_new, stop_ids,
                   sampling: SamplingParams, *, capacity, mode: SamplingMode = SamplingMode(), mesh=None):
    """Greedy or sampled decoding of a right-padded batch; rows with ``live_b`` False are padding.

    Row ``b`` draws its ``n``-th token with ``fold_in(fold_in(PRNGKey(seed), b), n)``. With a ``mesh``
    the cache is sharded (batch over data, KV heads over tensor) like the parameters.
    Returns the output buffer (``capacity`` >= ``max_new`` slots per row).
    """
    model = nnx.merge(graphdef, state)
    batch, prompt_len = tokens_bp.shape
    cache = model.init_cache(batch, prompt_len + capacity).constrain(mesh)
    logits_bv, cache, _ = prefill(model, tokens_bp, prompt_lens_b, cache)
    keys_b = row_keys(sampling.seed, batch)
    first_b = sampling.choose(step_keys(keys_b, jnp.zeros((batch,), jnp.int32)), logits_bv, mode)
    ones_b = jnp.ones((batch,), jnp.int32)
    buf = commit(OutputBuffer.empty(batch, capacity, ~live_b), first_b[:, None], ones_b, max_new, stop_ids)

    def step(c: PlainCarry) -> PlainCarry:
        out = model(c.last_b[:, None], c.cache)
        next_b = sampling.choose(step_keys(keys_b, c.buf.num), model.logits(out.hidden[:, 0]), mode)
        lengths = jnp.where(c.buf.done, c.cache.lengths, out.cache.lengths)
        buf = commit(c.buf, next_b[:, None], ones_b, max_new, stop_ids)
        return PlainCarry(out.cache.replace(lengths=lengths).constrain(mesh), buf, next_b)

    final = jax.lax.while_loop(lambda c: ~jnp.all(c.buf.done), step, PlainCarry(cache, buf, first_b))
    return final.buf
