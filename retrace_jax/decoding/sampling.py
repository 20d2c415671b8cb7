"""The target's sampling distribution: temperature, then top-k, then top-p, on float32 logits.

Plain sampling and speculative verification both call :func:`filtered_logprobs`, so "the target's
distribution" is one definition. Filters keep every token tied with the last kept one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplingMode:
    """The static part of the sampling settings (what changes the compiled program)."""

    sample: bool = False  # False: greedy
    top_k: bool = False  # a top-k filter is applied
    top_p: bool = False  # a top-p filter is applied
    draft_rule: str = "argmax"  # "argmax": one-hot rejection; "target_sample": official; "sample": from q


TOP_CAP = 256  # candidates taken with lax.top_k before falling back to sorting the whole vocabulary


def filtered_logprobs(logits_nv, temperature, top_k, top_p, mode: SamplingMode):
    """Log-probabilities of the filtered, renormalised distribution (``-inf`` outside it).

    Both filters reduce to a threshold on the logits. It is found among the ``TOP_CAP`` largest logits
    (``lax.top_k``, no sort of the vocabulary) whenever they decide it: ``top_k <= TOP_CAP`` and, for
    top-p, those candidates holding at least ``top_p`` of the mass. Otherwise the whole vocabulary is
    sorted (``lax.cond``), which gives the same threshold."""
    x = logits_nv.astype(jnp.float32) / temperature
    if not (mode.top_k or mode.top_p):
        return jax.nn.log_softmax(x, axis=-1)
    vocab = x.shape[-1]
    k = jnp.clip(top_k, 1, vocab)
    cap = min(TOP_CAP, vocab)
    top_desc = jax.lax.top_k(x, cap)[0]
    if mode.top_k:  # top-k's threshold is the k-th largest logit
        kth = jax.lax.cond(k <= cap, lambda: _kth(top_desc, k), lambda: _kth(_sort_desc(x), k))
        x = jnp.where(x >= kth, x, NEG_INF)
    if mode.top_p:
        z = jax.nn.logsumexp(x, axis=-1, keepdims=True)  # the normaliser over the whole (top-k) vocabulary
        if mode.top_k:
            top_desc = jnp.where(top_desc >= kth, top_desc, NEG_INF)
        decided = jnp.all(jnp.sum(jnp.exp(top_desc - z), axis=-1) >= top_p)
        threshold = jax.lax.cond(decided, lambda: _top_p_threshold(top_desc, z, top_p),
                                 lambda: _top_p_threshold(_sort_desc(x), z, top_p))
        x = jnp.where(x >= threshold, x, NEG_INF)
    return jax.nn.log_softmax(x, axis=-1)


def _sort_desc(x_nv):
    return -jnp.sort(-x_nv, axis=-1)


def _kth(desc_nc, k):
    return jnp.take_along_axis(desc_nc, jnp.broadcast_to(k - 1, desc_nc.shape[:-1] + (1,)), axis=-1)


def _top_p_threshold(desc_nc, z_n1, top_p):
    """The smallest logit of the shortest prefix of ``desc`` whose mass reaches ``top_p`` (at least one).

    The first entry is kept whatever ``top_p`` is: a ``top_p`` below float32's smallest normal number
    (1e-40) is flushed to 0, where no mass is below it, and no kept token would leave every
    log-probability NaN."""
    probs = jnp.exp(desc_nc - z_n1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p) | (jnp.arange(desc_nc.shape[-1]) == 0)
    return jnp.min(jnp.where(keep, desc_nc, jnp.inf), axis=-1, keepdims=True)


ARGMAX_BLOCK = 128  # vocabulary entries per block of the CPU's two-level argmax and top-k


def _vocab_blocks(logits_nv):
    """``[..., V / ARGMAX_BLOCK, ARGMAX_BLOCK]``, padded with -inf after the vocabulary (a pad entry never
    comes before an entry it ties with)."""
    pad = -logits_nv.shape[-1] % ARGMAX_BLOCK
    x = jnp.pad(logits_nv, [(0, 0)] * (logits_nv.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
    return x.reshape(*x.shape[:-1], -1, ARGMAX_BLOCK)


def _two_levels(logits_nv) -> bool:
    return jax.default_backend() == "cpu" and logits_nv.shape[-1] >= 2 * ARGMAX_BLOCK


def argmax(logits_nv):
    """``jnp.argmax(logits, -1)`` as int32: the first index of the largest value over the vocabulary.
    Rows with a NaN get some index (the decode programs report non-finite logits: see
    :func:`~retrace_jax.decoding.commit.stop_non_finite`).

    On CPU it is taken in two levels, the largest value of each block of ``ARGMAX_BLOCK`` entries, the
    first block that holds the largest of them, then the first index of it inside that block, because
    XLA's CPU backend reduces a (value, index) pair element by element: on ``[16, 4096]`` logits the
    plain argmax took several times longer than the whole two-level one (``benchmarks/lm_head.py``).
    Elsewhere it is one reduction."""
    if not _two_levels(logits_nv):
        return jnp.argmax(logits_nv, -1).astype(jnp.int32)
    blocks = _vocab_blocks(logits_nv)
    best = jnp.argmax(jnp.max(blocks, -1), -1)
    inside = jnp.take_along_axis(blocks, best[..., None, None], axis=-2)[..., 0, :]
    return (best * ARGMAX_BLOCK + jnp.argmax(inside, -1)).astype(jnp.int32)


def largest_k(logits_nv, k: int):
    """``jax.lax.top_k(logits, k)`` over the last axis, exactly (the same values and indices, ties to the
    lower index), with int32 indices.

    On CPU it is taken in two levels, as :func:`argmax` is: the ``k`` blocks of ``ARGMAX_BLOCK`` entries
    with the largest maxima (ties to the lower block), then the top ``k`` of their entries in vocabulary
    order. Exact because an entry of the top ``k`` has at most ``k - 1`` entries before it in the order
    (value descending, index ascending), and each block ranked before its own holds one such entry (its
    first largest). XLA's CPU top-8 over ``[16, 151936]`` logits took 2.5 ms, the two levels 0.28 ms
    (``benchmarks/lm_head.py``). Elsewhere it is ``lax.top_k``."""
    blocks_n = -(-logits_nv.shape[-1] // ARGMAX_BLOCK)
    if not _two_levels(logits_nv) or k > blocks_n:
        values, ids = jax.lax.top_k(logits_nv, k)
        return values, ids.astype(jnp.int32)
    blocks = _vocab_blocks(logits_nv)
    chosen = jnp.sort(jax.lax.top_k(jnp.max(blocks, -1), k)[1], -1)  # [..., k] block numbers, ascending
    candidates = jnp.take_along_axis(blocks, chosen[..., None], axis=-2).reshape(*logits_nv.shape[:-1], -1)
    values, pos = jax.lax.top_k(candidates, k)
    ids = jnp.take_along_axis(chosen, pos // ARGMAX_BLOCK, -1) * ARGMAX_BLOCK + pos % ARGMAX_BLOCK
    return values, ids.astype(jnp.int32)


def choose(key, logits_nv, temperature, top_k, top_p, mode: SamplingMode):
    """Greedy or sampled tokens ``[N]`` (``key`` is one key per row, ``[N, 2]``, when sampling)."""
    if not mode.sample:
        return argmax(logits_nv)
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
        # NumPy scalars: a jitted program takes them as it takes JAX scalars of the same dtype (same
        # compiled program), without four small transfers to the device at every generate call.
        return cls(np.float32(temperature if temperature > 0 else 1.0), np.int32(top_k), np.float32(top_p),
                   np.uint32(seed))

    def logprobs(self, logits_nv, mode: SamplingMode):
        return filtered_logprobs(logits_nv, self.temperature, self.top_k, self.top_p, mode)

    def choose(self, keys_n, logits_nv, mode: SamplingMode):
        return choose(keys_n, logits_nv, self.temperature, self.top_k, self.top_p, mode)
