"""Fixed-shape KV caches as explicit pytrees, written in place at each row's own offset."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from retrace_jax.attention import cache_slots
from retrace_jax.parallel.sharding import CACHE_AXES, constrain


@struct.dataclass
class KVCache:
    """Keys and values ``[L, B, K, S, D]`` (head-major: a chunk of one head's slots is contiguous, as the
    attention products read it) and a valid length per row.

    Positions ``< lengths[b]`` of row ``b`` hold committed tokens; anything past them is stale and is
    never read (attention looks only below each query's limit, and the next write overwrites it).
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array  # [B] int32
    # A row view (see row_view): the call's rows are the buffers' rows first_row, first_row + 1, ...; None
    # for the whole batch.
    first_row: jax.Array | None = None

    @classmethod
    def zeros(cls, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int, dtype):
        """A cache with room for at least ``max_len`` positions per row (rounded up to whole attention
        chunks: see :func:`~retrace_jax.attention.cache_slots`)."""
        shape = (num_layers, batch, kv_heads, cache_slots(max_len), head_dim)
        # Two different constants (0.0 and -0.0; both read as zero): identical broadcasts would be merged
        # by XLA into one buffer, which then needs a full copy per cache before the in-place writes.
        return cls(jnp.zeros(shape, dtype), jnp.full(shape, -0.0, dtype), jnp.zeros((batch,), jnp.int32))

    @classmethod
    def for_decoder(cls, cfg, batch: int, max_len: int, dtype) -> "KVCache":
        """An empty cache for a stack of decoder blocks of shape ``cfg``
        (a :class:`~retrace_jax.models.config.DecoderShape`: the target's or a drafter's config)."""
        return cls.zeros(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim, dtype)

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def constrain(self, mesh) -> "KVCache":
        """Pins the cache's sharding on ``mesh``: batch over data, KV heads over tensor."""
        return KVCache(constrain(self.k, CACHE_AXES, mesh), constrain(self.v, CACHE_AXES, mesh),
                       constrain(self.lengths, ("batch",), mesh))

    def write(self, layer, k_btkd, v_btkd, offsets_b) -> "KVCache":
        """Writes ``k[b], v[b]`` into layer ``layer`` (may be traced) at slots ``offsets[b] + 0..T-1``."""
        return self.replace(k=write_rows(self.k, layer, k_btkd, offsets_b, self.first_row),
                            v=write_rows(self.v, layer, v_btkd, offsets_b, self.first_row))

    def row_view(self, first_row, lengths_b) -> "KVCache":
        """The rows ``first_row .. first_row + len(lengths) - 1`` (``first_row`` may be traced) as a cache of
        their own with ``lengths``, sharing the buffers: a forward pass over it reads and writes those rows
        of the whole batch's buffers in place, so that one row can be prefilled while the others hold their
        text (a slot refilled inside the decode loop) without copying a row out and back.
        :meth:`whole` gives the batch back."""
        return KVCache(self.k, self.v, jnp.asarray(lengths_b, jnp.int32), jnp.asarray(first_row, jnp.int32))

    def whole(self, lengths_b) -> "KVCache":
        """The whole batch again after a :meth:`row_view`, with ``lengths`` for every row."""
        return KVCache(self.k, self.v, lengths_b)


def write_rows(buf_lbksd, layer, new_btkd, offsets_b, first_row=None):
    """Writes ``new[b]`` into ``buf[layer, first_row + b]`` (``first_row`` 0 unless given) starting at slot
    ``offsets[b]``.

    One scatter of ``B * T`` slots of ``[K, D]`` into the stacked buffer, which XLA updates in place (no
    cache-sized copy or transpose). Callers keep ``offsets + T <= S``: the write is promised in bounds,
    because a bounds check ("drop" mode) makes XLA select over the whole buffer after each write."""
    b, t = new_btkd.shape[:2]
    rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
    if first_row is not None:
        rows = rows + first_row
    slots = offsets_b[:, None].astype(jnp.int32) + jnp.arange(t, dtype=jnp.int32)[None, :]
    layer_idx = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (b, t))
    # Advanced indices around a slice: the update's dims are the indices' [B, T], then K and D.
    return buf_lbksd.at[layer_idx, rows, :, slots].set(new_btkd.astype(buf_lbksd.dtype),
                                                         mode="promise_in_bounds")
