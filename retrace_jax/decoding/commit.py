"""Committing tokens to the per-row output buffer: stop tokens, ``max_new_tokens`` and finished rows.

Plain decoding commits one token per step; speculative decoding commits ``a + 1`` per round. Both go
through :func:`commit`, so the two loops cannot disagree on where a generation ends.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class OutputBuffer:
    tokens: jax.Array  # [B, O] new tokens (O: the output capacity); entries >= num[b] are padding
    num: jax.Array  # [B] int32: tokens committed so far
    done: jax.Array  # [B] bool: stop token committed, max_new_tokens reached or non-finite logits met
    non_finite: jax.Array | None = None  # [B] bool: the target's logits held a NaN or an infinity

    @classmethod
    def empty(cls, batch: int, capacity: int, done_b=None):
        done = jnp.zeros((batch,), bool) if done_b is None else done_b
        return cls(jnp.zeros((batch, capacity), jnp.int32), jnp.zeros((batch,), jnp.int32), done,
                   jnp.zeros((batch,), bool))


def commit(buf: OutputBuffer, new_bt, count_b, max_new, stop_ids) -> OutputBuffer:
    """Appends ``new[b, :count[b]]`` to each unfinished row.

    A row keeps tokens up to and including its first stop token and never more than ``max_new`` in
    all; it is then done and later commits leave it unchanged. ``stop_ids`` is padded with -1.
    """
    batch, t = new_bt.shape
    slot = jnp.arange(t, dtype=jnp.int32)[None, :]  # [1, T]
    offered = slot < count_b[:, None]
    is_stop = offered & jnp.any(new_bt[:, :, None] == stop_ids[None, None, :], axis=-1)
    first_stop = jnp.where(jnp.any(is_stop, -1), jnp.argmax(is_stop, -1), t)  # [B]
    take = jnp.minimum(jnp.minimum(count_b, first_stop + 1), max_new - buf.num)
    take = jnp.where(buf.done, 0, jnp.maximum(take, 0))
    keep = slot < take[:, None]
    capacity = buf.tokens.shape[1]
    pos = jnp.where(keep, buf.num[:, None] + slot, capacity)  # out-of-range index: dropped
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, t))
    tokens = buf.tokens.at[rows, pos].set(new_bt.astype(jnp.int32), mode="drop")
    num = buf.num + take
    hit_stop = jnp.any(is_stop & keep, axis=-1)
    return buf.replace(tokens=tokens, num=num, done=buf.done | hit_stop | (num >= max_new))


def stop_non_finite(buf: OutputBuffer, logits_b_v) -> OutputBuffer:
    """Finishes and flags each unfinished row whose target logits (``[B, ..., V]``) hold a NaN or an
    infinity: a broken model (weights, or a config value such as a negative ``rms_norm_eps``) whose
    greedy choice would otherwise be an arbitrary token. ``generate`` raises for flagged rows."""
    total = jnp.sum(logits_b_v.astype(jnp.float32), axis=tuple(range(1, logits_b_v.ndim)))  # NaN or inf spread
    bad = ~jnp.isfinite(total) & ~buf.done
    flagged = bad if buf.non_finite is None else buf.non_finite | bad
    return buf.replace(done=buf.done | bad, non_finite=flagged)
