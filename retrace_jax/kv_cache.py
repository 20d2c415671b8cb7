"""Fixed-shape KV caches as explicit pytrees, written at each row's own offset."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from retrace_jax.sharding import CACHE_AXES, constrain


@struct.dataclass
class KVCache:
    """Keys and values ``[layers, batch, max_len, kv_heads, head_dim]`` and a valid length per row.

    Positions ``< lengths[b]`` of row ``b`` hold committed tokens; anything past them is stale and is
    never read (masks hide it, and the next write overwrites it).
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array  # [B] int32

    @classmethod
    def zeros(cls, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int, dtype):
        shape = (num_layers, batch, max_len, kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def constrain(self, mesh) -> "KVCache":
        """Pins the cache's sharding on ``mesh``: batch over data, KV heads over tensor."""
        return KVCache(constrain(self.k, CACHE_AXES, mesh), constrain(self.v, CACHE_AXES, mesh),
                       constrain(self.lengths, ("batch",), mesh))


def write_rows(buf_lbskd, layer: int, new_btkd, offsets_b):
    """Writes ``new[b]`` into ``buf[layer, b]`` starting at position ``offsets[b]``.

    Updates the stacked buffer in place (no per-layer copies); callers keep ``offsets + T`` in bounds.
    """

    def one(buf_lskd, new_tkd, off):
        return jax.lax.dynamic_update_slice(buf_lskd, new_tkd[None].astype(buf_lskd.dtype), (layer, off, 0, 0))

    return jax.vmap(one, in_axes=(1, 0, 0), out_axes=1)(buf_lbskd, new_btkd, offsets_b)
