"""KV caches kept between ``generate`` calls, so that a call does not allocate and first-touch caches of
its whole capacity.

A decode program takes its caches as a donated argument (``spare``) and returns them: XLA writes the
prefill and every step into the buffers it was given, and the call hands them back for the next call of
the same sizes. What they hold from the earlier call is stale and never counts: every cache read is
masked to the slots below the reading row's length, so those slots get exactly zero weight (see
``retrace_jax/attention/``), and the prefill overwrites the prompt's slots first. A zero weight times a
stale value is zero only while the value is finite, so caches of a call whose logits were not finite are
dropped, not kept.

On a CPU a fresh 16K-slot cache cost more than the decoding of a hundred tokens in it
(``benchmarks/long_context.py --sections buffer``; docs/performance.md). The pool holds the caches of
the last :data:`KEEP` distinct cache sets (a plain call keeps one cache, a speculative call two);
:func:`clear_decode_buffers` frees them.
"""

from __future__ import annotations

import collections
import functools
import threading

import jax

from retrace_jax.models.kv_cache import KVCache

KEEP = 4  # distinct cache sets kept: plain and speculative decoding at two sizes, say


class SparePool:
    """Spare caches by key (everything that fixes their shapes, dtypes and placement), the most recently
    returned :attr:`limit` kept. ``take`` removes what it returns: a buffer is never in use twice."""

    def __init__(self, limit: int = KEEP):
        self.limit = limit
        self._items: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def take(self, key):
        with self._lock:
            return self._items.pop(key, None)

    def put(self, key, caches) -> None:
        with self._lock:
            self._items[key] = caches
            self._items.move_to_end(key)
            while len(self._items) > self.limit:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


POOL = SparePool()


def clear_decode_buffers() -> None:
    """Frees the KV caches that ``generate`` keeps for its next call of the same sizes (at most
    :data:`KEEP` sets). Nothing else changes: the next call allocates fresh ones."""
    POOL.clear()


def cache_key(cfg, batch: int, max_len: int, dtype, mesh) -> tuple:
    """What fixes a cache's buffers: the arguments of ``KVCache.zeros`` (layers, batch, max_len, KV heads,
    head dim), the dtype's name and the mesh it is placed on."""
    return (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim), jax.numpy.dtype(dtype).name, mesh


@functools.cache
def _empty(sizes: tuple, dtype: str, mesh):
    """A compiled program that returns an empty cache placed as the decode programs place it (one per
    :func:`cache_key`: no recompiles)."""
    return jax.jit(lambda: KVCache.zeros(*sizes, dtype).constrain(mesh))


def empty_cache(cfg, batch: int, max_len: int, dtype, mesh=None) -> KVCache:
    """An empty cache for a stack of decoder blocks of shape ``cfg``, as ``KVCache.for_decoder`` makes it."""
    return _empty(*cache_key(cfg, batch, max_len, dtype, mesh))()


def take_spare(specs) -> tuple[tuple, tuple[KVCache, ...]]:
    """The caches for ``specs`` (``(cfg, batch, max_len, dtype, mesh)`` per cache): the pooled ones if a
    call of these sizes returned them, else new empty ones. Returns the pool key and the caches."""
    key = tuple(cache_key(*spec) for spec in specs)
    caches = POOL.take(key)
    if caches is None:
        caches = tuple(empty_cache(*spec) for spec in specs)
    return key, caches


def spare_or_new(model, batch: int, max_len: int, dtype, spare: KVCache | None, what: str) -> KVCache:
    """Inside a decode program: ``model.init_cache(batch, max_len, dtype)``, or ``spare`` with its lengths
    zeroed after checking (at trace time) that it has that cache's shapes and dtypes; raises
    ``ValueError`` naming ``what`` otherwise."""
    if spare is None:
        return model.init_cache(batch, max_len, dtype)
    expected = jax.eval_shape(lambda: model.init_cache(batch, max_len, dtype))
    got = [(x.shape, x.dtype) for x in (spare.k, spare.v)]
    want = [(x.shape, x.dtype) for x in (expected.k, expected.v)]
    if got != want:
        raise ValueError(f"{what}: the spare cache has shapes/dtypes {got}, this call needs {want}")
    return spare.replace(lengths=jax.numpy.zeros_like(expected.lengths))
