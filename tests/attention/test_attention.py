"""The chunked attention (online softmax over cache chunks, query chunks for prefill) against the dense
reference, and the in-place cache writes."""

import jax.numpy as jnp
import numpy as np
import pytest

from retrace_jax.attention import cache_slots, cached_attention, reference_attention, walk_chunk
from retrace_jax.models.kv_cache import KVCache, write_rows


def _random_cache(rng, layers, batch, slots, kv_heads, head_dim, dtype):
    """Random keys and values in the cache's layout ``[L, B, K, S, D]``."""
    k = rng.standard_normal((layers, batch, kv_heads, slots, head_dim)).astype(np.float32)
    v = rng.standard_normal((layers, batch, kv_heads, slots, head_dim)).astype(np.float32)
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype)


def slot_major(layer_bksd):
    """One layer of the cache as the reference takes keys: ``[B, S, K, D]``."""
    return layer_bksd.swapaxes(1, 2)


@pytest.mark.parametrize("t,slots,kv_chunk,q_chunk", [(1, 64, 16, 16), (5, 64, 16, 16), (40, 64, 16, 8),
                                                      (3, 48, 48, 16), (33, 96, 32, 32)])
@pytest.mark.parametrize("extra", [False, True])
def test_chunked_matches_reference(t, slots, kv_chunk, q_chunk, extra, walk):
    rng = np.random.default_rng(t * 100 + slots)
    b, h, kv, d, layer = 3, 4, 2, 8, 1
    k, v = _random_cache(rng, 2, b, slots, kv, d, jnp.float32)
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    # ragged limits: a row with one visible slot, a row up to the end, and causal-style limits
    limit = np.stack([np.full(t, 1), np.full(t, slots), np.minimum(np.arange(t) + 7, slots)]).astype(np.int32)
    ek = ev = None
    mask = np.arange(slots)[None, None, :] < limit[:, :, None]
    keys, values = slot_major(k[layer]), slot_major(v[layer])
    if extra:
        ek = jnp.asarray(rng.standard_normal((b, 4, kv, d)), jnp.float32)
        ev = jnp.asarray(rng.standard_normal((b, 4, kv, d)), jnp.float32)
        keys, values = jnp.concatenate([keys, ek], 1), jnp.concatenate([values, ev], 1)
        mask = np.concatenate([mask, np.ones((b, t, 4), bool)], -1)
    want = reference_attention(q, keys, values, jnp.asarray(mask))
    got = cached_attention(q, k, v, jnp.int32(layer), jnp.asarray(limit), ek, ev, implementation="chunked",
                           kv_chunk=kv_chunk, q_chunk=q_chunk)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-5)
    dense = cached_attention(q, k, v, layer, jnp.asarray(limit), ek, ev, implementation="dense")
    np.testing.assert_allclose(np.asarray(dense), np.asarray(want), atol=2e-6, rtol=2e-5)


def test_chunked_bfloat16_close_to_reference():
    rng = np.random.default_rng(0)
    k, v = _random_cache(rng, 1, 2, 128, 2, 16, jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((2, 4, 4, 16)), jnp.bfloat16)
    limit = jnp.asarray([[50] * 4, [128] * 4], jnp.int32)
    mask = jnp.arange(128)[None, None, :] < limit[:, :, None]
    want = reference_attention(q.astype(jnp.float32), slot_major(k[0]).astype(jnp.float32),
                               slot_major(v[0]).astype(jnp.float32), mask)
    got = cached_attention(q, k, v, 0, limit, kv_chunk=32)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=3e-2)


def test_walk_stops_at_the_longest_row(walk):
    """Slots past every query's limit are never read: poisoning them changes nothing."""
    rng = np.random.default_rng(1)
    k, v = _random_cache(rng, 1, 2, 256, 2, 8, jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, 1, 2, 8)), jnp.float32)
    limit = jnp.asarray([[40], [70]], jnp.int32)
    clean = cached_attention(q, k, v, 0, limit, kv_chunk=32)
    poisoned = cached_attention(q, k.at[:, :, :, 96:].set(jnp.nan), v.at[:, :, :, 96:].set(jnp.nan), 0, limit, kv_chunk=32)
    np.testing.assert_array_equal(np.asarray(clean), np.asarray(poisoned))


def test_cache_slots_tile_into_chunks():
    assert cache_slots(10, 512) == 10 and cache_slots(512, 512) == 512 and cache_slots(513, 512) == 1024
    # Caches of up to one chunk are walked in small chunks (one chunk walked whole makes XLA copy it).
    assert cache_slots(128) == 128 and cache_slots(129) == 256 and cache_slots(200) == 256
    assert walk_chunk(256) == 128 and walk_chunk(512) == 128 and walk_chunk(80) == 80 and walk_chunk(1024) == 512
    assert walk_chunk(200) == 200 and walk_chunk(1000, 4096) == 1000  # caches made otherwise: walked whole
    with pytest.raises(ValueError, match="does not tile"):
        k = jnp.zeros((1, 1, 1, 48, 4))
        cached_attention(jnp.zeros((1, 1, 1, 4)), k, k, 0, jnp.ones((1, 1), jnp.int32), kv_chunk=32)


def test_write_rows_at_each_rows_offset():
    buf = jnp.zeros((2, 3, 2, 10, 2))  # [L, B, K, S, D]
    new = jnp.arange(3 * 4 * 2 * 2, dtype=jnp.float32).reshape(3, 4, 2, 2) + 1  # [B, T, K, D]
    out = np.asarray(write_rows(buf, 1, new, jnp.asarray([0, 3, 6])))
    assert not out[0].any()
    np.testing.assert_array_equal(out[1, 0, :, 0:4], new[0].swapaxes(0, 1))
    np.testing.assert_array_equal(out[1, 1, :, 3:7], new[1].swapaxes(0, 1))
    np.testing.assert_array_equal(out[1, 2, :, 6:10], new[2].swapaxes(0, 1))
    assert not out[1, 0, :, 4:].any() and not out[1, 1, :, :3].any() and not out[1, 1, :, 7:].any()


def test_cache_allocation_rounds_to_chunks():
    cache = KVCache.zeros(2, 1, 600, 2, 4, jnp.float32)
    assert cache.max_len == cache_slots(600)


def test_fresh_attention_is_causal_attention_over_the_new_tokens():
    """The prefill path for kernels (jax.nn.dot_product_attention; its XLA implementation runs here, cuDNN's
    on GPUs in the device check) against the reference with a causal mask, grouped-query shapes."""
    from retrace_jax.attention import fresh_attention

    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((2, 37, 8, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 37, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 37, 2, 16)), jnp.float32)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((37, 37), bool)), (2, 37, 37))
    np.testing.assert_allclose(fresh_attention(q, k, v, "xla"), reference_attention(q, k, v, causal), atol=2e-5)
    with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
        fresh_attention(q, k, v, "cudnn")


def test_cudnn_prefill_path_gives_the_same_tokens(monkeypatch):
    """generate(attention="cudnn") sends empty-cache prefills through fresh_attention and everything else
    through the chunked walk; with the kernel swapped for the XLA implementation (no GPU here) the
    tokens equal the chunked path's, plain and speculative."""
    import retrace_jax as rj
    import retrace_jax.models.target as target_module
    from retrace_jax.attention import fresh_attention
    from retrace_jax.models.tiny import tiny_target
    from tests.oracle import Oracle

    calls = []

    def kernel(q, k, v, implementation):
        calls.append(q.shape)
        return fresh_attention(q, k, v, "xla")

    target = tiny_target()
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    drafter = Oracle.build(target, prompts, 12, 4).drafter  # rounds of every acceptance length
    want = [rj.generate(target, prompts, 12, attention="chunked", **kw).tokens for kw in ({}, {"drafter": drafter})]
    with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
        rj.generate(target, prompts, 12, attention="cudnn")
    monkeypatch.setattr(target_module, "fresh_attention", kernel)
    got = [rj.generate(target, prompts, 12, attention="cudnn", **kw).tokens for kw in ({}, {"drafter": drafter})]
    assert got == want
    assert calls and all(shape[1] == 16 for shape in calls)  # the prompt bucket, never a decode step


def test_a_long_cache_walks_its_filled_tail_in_small_chunks(walk):
    """A cache of several large chunks is walked in large chunks up to the last large boundary below the
    longest row and in small chunks after it: it matches the reference at every filled length, and a
    short filled length reads no slot past the small chunks it needs (poisoned slots change nothing;
    a walk in chunks of 512 would read them, and NaN values give NaN outputs)."""
    from retrace_jax.attention import KV_CHUNK, SMALL_CHUNK

    rng = np.random.default_rng(2)
    slots = 3 * KV_CHUNK
    k, v = _random_cache(rng, 1, 2, slots, 2, 8, jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 8)), jnp.float32)
    for lengths in ([1, 150], [KV_CHUNK, KV_CHUNK + 1], [700, 1300], [slots, 2 * KV_CHUNK - 5]):
        limit = np.minimum(np.asarray(lengths)[:, None] + np.arange(3)[None, :], slots).astype(np.int32)
        mask = np.arange(slots)[None, None, :] < limit[:, :, None]
        want = reference_attention(q, slot_major(k[0]), slot_major(v[0]), jnp.asarray(mask))
        got = cached_attention(q, k, v, 0, jnp.asarray(limit))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-5)
    limit = jnp.asarray([[150, 151, 152], [60, 61, 62]], jnp.int32)
    tail_end = 2 * SMALL_CHUNK  # the small chunks that hold slots below 152
    clean = cached_attention(q, k, v, 0, limit)
    poisoned = cached_attention(q, k.at[:, :, :, tail_end:].set(jnp.nan),
                                v.at[:, :, :, tail_end:].set(jnp.nan), 0, limit)
    np.testing.assert_array_equal(np.asarray(clean), np.asarray(poisoned))


def test_what_auto_runs_on_each_backend():
    """On a GPU, decode-sized calls run dense (no loop or branch per chunk: a host round trip each there)
    and a bfloat16 or float16 prefill through cuDNN; everything else, and every call elsewhere, chunked."""
    from retrace_jax.attention import DENSE_MAX_SCORES, DENSE_MAX_T, auto_cached, auto_fresh, fresh_kernel

    assert auto_cached(1, 1, 32, 4096, backend="gpu") == "dense"
    assert auto_cached(8, 16, 32, 4096, backend="gpu") == "dense"
    assert auto_cached(1, DENSE_MAX_T + 1, 32, 4096, backend="gpu") == "chunked"  # a prefill
    assert auto_cached(32, 16, 32, DENSE_MAX_SCORES // (32 * 16 * 32) + 1, backend="gpu") == "chunked"
    assert auto_cached(1, 1, 32, 4096, backend="cpu") == auto_cached(1, 1, 32, 4096, backend="tpu") == "chunked"
    assert auto_cached(1, 1, 32, 4096) == "chunked"  # this machine
    assert auto_fresh(jnp.bfloat16, 128, backend="gpu") == auto_fresh(jnp.float16, 64, backend="gpu") == "cudnn"
    assert auto_fresh(jnp.float32, 128, backend="gpu") is None
    assert auto_fresh(jnp.bfloat16, 256, backend="gpu") is None
    assert auto_fresh(jnp.bfloat16, 128, backend="tpu") is None
    # the empty-cache prefill's kernel for each implementation asked for
    assert fresh_kernel("auto", jnp.bfloat16, 128, backend="gpu") == "cudnn"
    assert fresh_kernel("auto", jnp.bfloat16, 128, backend="cpu") is None
    assert fresh_kernel("cudnn", jnp.float32, 256) == "cudnn"
    assert fresh_kernel("pallas_tpu", jnp.float32, 64) == "pallas_tpu"
    assert fresh_kernel("chunked", jnp.bfloat16, 128, backend="gpu") is None
    assert fresh_kernel("dense", jnp.bfloat16, 128, backend="gpu") is None


@pytest.mark.parametrize("t,window", [(1, False), (4, False), (4, True)])
def test_each_row_reads_only_its_own_chunks(t, window):
    """Decode-sized calls over a cache of several chunks walk each row's own filled chunks: a short row
    beside a long one matches the reference (with and without a sliding window's first slot), and never
    reads a chunk past its own limit (its slots there poisoned with NaN change nothing, though the long
    row's walk covers them)."""
    rng = np.random.default_rng(3)
    slots = 512
    k, v = _random_cache(rng, 2, 3, slots, 2, 8, jnp.float32)
    q = jnp.asarray(rng.standard_normal((3, t, 4, 8)), jnp.float32)
    lengths = np.asarray([30, 500, 0])  # a short row, a long one, an empty one
    limit = np.minimum(lengths[:, None] + np.arange(1, t + 1)[None, :], slots).astype(np.int32)
    start = np.maximum(limit - 20, 0) if window else None
    mask = np.arange(slots)[None, None, :] < limit[:, :, None]
    if window:
        mask &= np.arange(slots)[None, None, :] >= start[:, :, None]
    start = None if start is None else jnp.asarray(start)
    want = reference_attention(q, slot_major(k[1]), slot_major(v[1]), jnp.asarray(mask))
    got = cached_attention(q, k, v, 1, jnp.asarray(limit), start_bt=start, kv_chunk=128)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-5)
    poison = (slice(None), 0, slice(None), slice(128, None))  # row 0 past its first chunk of 128
    poisoned = cached_attention(q, k.at[poison].set(jnp.nan), v.at[poison].set(jnp.nan), 1, jnp.asarray(limit),
                                start_bt=start, kv_chunk=128)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(poisoned))
