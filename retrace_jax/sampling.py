"""The target's sampling distribution: temperature, then top-k, then top-p, on float32 logits.

Plain sampling and speculative verification both call :func:`filtered_logprobs`, so "the target's
distribution" is one definition. Filters keep every token tied with the last kept one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplingMode:
    """The static part of the sampling settings (what changes the compiled program)."""

    sample: bool = False  # False: greedy
    top_k: bool = False  # a top-k filter is applied
    top_p: bool = False  # a top-p filter is applied
    draft_rule: str = "argmax"  # "argmax": one-hot rejection; "target_sample": official; "sample": from q


def filtered_logprobs(logits_nv, temperature, top_k, top_p, mode: SamplingMode):
    """Log-probabilities of the filtered, renormalised distribution (``-inf`` outside it)."""
    x = logits_nv.astype(jnp.float32) / temperature
    if mode.top_k or mode.top_p:
        sorted_desc = -jnp.sort(-x, axis=-1)
    if mode.top_k:
        k = jnp.clip(top_k, 1, x.shape[-1])
        kth = jnp.take_along_axis(sorted_desc, jnp.broadcast_to(k - 1, x.shape[:-1] + (1,)), axis=-1)
        x = jnp.where(x >= kth, x, NEG_INF)
        sorted_desc = jnp.where(sorted_desc >= kth, sorted_desc, NEG_INF)
    if mode.top_p:
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = mass_before < top_p  # the smallest prefix whose mass reaches top_p (at least one token)
        threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x >= threshold, x, NEG_INF)
    return jax.nn.log_softmax(x, axis=-1)


def choose(key, logits_nv, temperature, top_k, top_p, mode: SamplingMode):
    """Greedy or sampled tokens ``[N]`` (``key`` is one key per row, ``[N, 2]``, when sampling)."""
    if not mode.sample:
        return jnp.argmax(logits_nv, -1).astype(jnp.int32)
    logp = filtered_logprobs(logits_nv, temperature, top_k, top_p, mode)
    return jax.vmap(jax.random.categorical)(key, logp).astype(jnp.int32)


def row_keys(seed, batch: int):
    """An independent random stream per row: ``fold_in(PRNGKey(seed), row)``."""
    base = jax.random.PRNGKey(seed)
    return jax.vmap(lambda b: jax.random.fold_in(base, b))(jnp.arange(batch))


def step_keys(keys_b, step_b):
    """The key of each row for its own step counter (prefill is step 0)."""
    return jax.vmap(jax.random.fold_in)(keys_b, step_b)


@struct.dataclass
class SamplingParams:
    """The traced part of the sampling settings (changing them does not recompile)."""

    temperature: jax.Array  # float32 scalar (> 0 when sampling)
    top_k: jax.Array  # int32 scalar
    top_p: jax.Array  # float32 scalar
    seed: jax.Array  # uint32 scalar

    @classmethod
    def make(cls, temperature=0.0, top_k=0, top_p=1.0, seed=0):
        return cls(jnp.float32(temperature if temperature > 0 else 1.0), jnp.int32(top_k), jnp.float32(top_p),
                   jnp.uint32(seed))

    def logprobs(self, logits_nv, mode: SamplingMode):
        return filtered_logprobs(logits_nv, self.temperature, self.top_k, self.top_p, mode)

    def choose(self, keys_n, logits_nv, mode: SamplingMode):
        return choose(keys_n, logits_nv, self.temperature, self.top_k, self.top_p, mode)
