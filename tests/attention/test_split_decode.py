"""The flash-decoding kernel behind "split_gpu" (retrace_jax/attention/split_decode.py) against the dense
reference, in Pallas' interpret mode on CPU (no GPU here; the device check times it compiled), its lowering
for CUDA (the Triton call reads the stacked cache itself: no copy of a layer), and generate's greedy tokens
through it against the chunked path."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from retrace_jax.attention import cached_attention, kernels, pallas_interpret, split_decode


@pytest.fixture
def interpret():
    with pallas_interpret():
        yield


def _case(rng, t, slots, extra, dtype, h=8, kv=2, d=16):
    """Three layers of a random cache with 4 rows, GQA (``h`` query heads over ``kv`` KV heads) and ragged
    limits: a row that sees no slot, one that sees one, a full row, and causal limits (each query one slot
    further, as in a verify pass)."""
    b = 4
    k = jnp.asarray(rng.standard_normal((3, b, kv, slots, d)), dtype)  # [L, B, K, S, D]
    v = jnp.asarray(rng.standard_normal((3, b, kv, slots, d)), dtype)
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
    limit = np.stack([np.zeros(t), np.ones(t), np.full(t, slots), np.minimum(np.arange(t) + 37, slots)])
    ek = ev = None
    if extra:
        ek = jnp.asarray(rng.standard_normal((b, 5, kv, d)), dtype)
        ev = jnp.asarray(rng.standard_normal((b, 5, kv, d)), dtype)
    return q, k, v, jnp.asarray(limit, jnp.int32), ek, ev


def _split_gpu(q, k, v, layer, limit, ek=None, ev=None, valid=None):
    fn = jax.jit(lambda *a: cached_attention(*a[:7], extra_valid_be=a[7], implementation="split_gpu"))
    args = (q, k, v, jnp.int32(layer), limit, ek, ev, valid)  # the layer traced, as in a scan over layers
    return fn(*args), "pallas_call" in str(jax.make_jaxpr(fn)(*args))


def _want(q, k, v, layer, limit, ek, ev, valid=None):
    """The dense reference in float32; a query that sees no key at all gets zeros (as the chunked walk
    gives it: the reference's softmax over nothing but masked scores averages every slot instead)."""
    f32 = (lambda x: None if x is None else x.astype(jnp.float32))
    want = cached_attention(f32(q), f32(k), f32(v), layer, limit, f32(ek), f32(ev), extra_valid_be=valid,
                            implementation="dense")
    sees = limit > 0
    if ek is not None:
        sees |= True if valid is None else jnp.any(valid, axis=1)[:, None]
    return jnp.where(sees[:, :, None, None], want, 0)


@pytest.mark.parametrize("t,slots,extra,dtype", [
    (1, 128, False, jnp.float32),  # decode
    (16, 128, True, jnp.float32),  # verify (causal limits) and draft (extra keys) shapes
    (40, 96, True, jnp.float32),  # 160 query rows per KV head: several query blocks, padding rows
    (1, 256, True, jnp.bfloat16),
    (16, 64, False, jnp.bfloat16),
])
def test_split_gpu_matches_reference(interpret, t, slots, extra, dtype):
    """Decode, verify and draft calls through the kernel over layer 2 of 3 (a traced index), with batch
    rows of different limits (0, 1, all slots, ragged per query) and extra keys merged in after it."""
    q, k, v, limit, ek, ev = _case(np.random.default_rng(t + slots), t, slots, extra, dtype)
    got, used_kernel = _split_gpu(q, k, v, 2, limit, ek, ev)
    assert used_kernel and got.dtype == dtype
    atol, rtol = (2e-6, 2e-5) if dtype == jnp.float32 else (3e-2, 0)
    want = _want(q, k, v, 2, limit, ek, ev)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=atol, rtol=rtol)


def test_split_gpu_extra_keys_where_valid_and_other_layers(interpret):
    """Extra keys masked per row (``extra_valid``), and each layer of the cache read where it lies: layer 0
    and layer 1 give the dense path's results for those layers, different from each other."""
    rng = np.random.default_rng(5)
    q, k, v, limit, ek, ev = _case(rng, 4, 128, True, jnp.float32, h=4, kv=4, d=32)
    valid = jnp.asarray(rng.random((4, 5)) < 0.5).at[0].set(False)  # row 0 then sees nothing at all
    outs = []
    for layer in (0, 1):
        got, _ = _split_gpu(q, k, v, layer, limit, ek, ev, valid)
        np.testing.assert_allclose(np.asarray(got), np.asarray(_want(q, k, v, layer, limit, ek, ev, valid)),
                                   atol=2e-6, rtol=2e-5)
        outs.append(got)
    assert not np.allclose(np.asarray(outs[0][1:]), np.asarray(outs[1][1:]))


def test_split_work_follows_the_filled_length(interpret):
    """The filled blocks are shared out over the splits: a short text in a long cache keeps its work in the
    first splits (the rest return an empty softmax: max NEG, sum 0), and a longer one spreads over more."""
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((1, 1, 16, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 1, 1, 1024, 16)), jnp.float32)
    plan = split_decode.split_plan(1, 1, 16, 1024, 16)
    assert plan == split_decode.SplitPlan(block_m=16, block_k=64, splits=16)
    busy = []
    for filled in (100, 700):
        _, l, _ = split_decode.split_partials(q, jnp.full((1, 16), filled, jnp.int32), k, k, 1, plan)
        busy.append(int(jnp.sum(jnp.any(l > 0, axis=-1))))  # splits that saw a slot
    assert busy == [2, 11]  # ceil(100 / 64) and ceil(700 / 64) blocks, one per split


def test_split_plan_and_fallbacks(interpret):
    """Powers of two from 16 for the query rows and slot blocks, the splits filling about SPLIT_PROGRAMS
    programs; head dims that are not a power of two from 16, slot counts no block of 16 divides and more
    than PALLAS_GPU_MAX_T queries run the chunked walk, with the same result."""
    plan = split_decode.split_plan
    assert plan(1, 8, 4, 4096, 128) == split_decode.SplitPlan(16, 64, 32)  # Qwen3-4B decode, batch 1
    assert plan(8, 8, 4, 4096, 128) == split_decode.SplitPlan(16, 64, 4)
    assert plan(1, 8, 64, 96, 128) == split_decode.SplitPlan(64, 32, 3)  # a verify block; splits <= blocks
    assert plan(1, 8, 4, 100, 128) is None and plan(1, 8, 4, 128, 24) is None and plan(1, 8, 4, 128, 8) is None
    rng = np.random.default_rng(3)
    for t, slots, d in ((1, 100, 16), (65, 128, 16), (1, 128, 24)):
        q, k, v, limit, _, _ = _case(rng, t, slots, False, jnp.float32, d=d)
        got, used_kernel = _split_gpu(q, k, v, 1, limit)
        assert not used_kernel
        np.testing.assert_allclose(np.asarray(got), np.asarray(_want(q, k, v, 1, limit, None, None)),
                                   atol=2e-6, rtol=2e-5)


def test_split_gpu_needs_a_gpu():
    q, k, v, limit, _, _ = _case(np.random.default_rng(0), 1, 128, False, jnp.float32)
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="'split_gpu' needs a GPU.*pallas_interpret"):
            cached_attention(q, k, v, 0, limit, implementation="split_gpu")


@pytest.mark.parametrize("t,dtype,precision", [(16, jnp.bfloat16, None), (1, jnp.float32, "highest"),
                                               (64, jnp.bfloat16, None)])
def test_split_gpu_lowers_for_cuda_reading_the_cache_in_place(monkeypatch, t, dtype, precision):
    """Lowered for CUDA (no GPU needed to lower), the call is one Triton kernel whose operands are the
    stacked cache's keys and values themselves (the jitted function's arguments 1 and 2), of a 36-layer,
    Qwen3-4B-shaped cache: no slice or copy of a layer comes before it, whether the layer is traced or
    static. Decode, verify and 64-query (4 query blocks) calls; float32 with full products."""
    monkeypatch.setattr(kernels, "check_pallas_backend", lambda implementation: None)
    q = jax.ShapeDtypeStruct((2, t, 32, 128), dtype)
    cache = jax.ShapeDtypeStruct((36, 2, 8, 1024, 128), dtype)
    limit = jax.ShapeDtypeStruct((2, t), jnp.int32)
    for layer in (jax.ShapeDtypeStruct((), jnp.int32), 7):
        fn = jax.jit(lambda q, k, v, lim, layer: cached_attention(q, k, v, layer, lim, implementation="split_gpu"),
                     static_argnums=() if isinstance(layer, jax.ShapeDtypeStruct) else 4)
        with jax.default_matmul_precision(precision):
            text = fn.trace(q, cache, cache, limit, layer).lower(lowering_platforms=("cuda",)).as_text()
        calls = re.findall(r"stablehlo\.custom_call @__gpu\$xla\.gpu\.triton\(([^)]*)\)", text)
        assert len(calls) == 1 and calls[0].split(", ")[3:] == ["%arg1", "%arg2"], calls
        assert f"36x2x8x1024x128x{jnp.dtype(dtype).name.replace('float', 'f')}" in text
        assert "dynamic_slice" not in text
    assert split_decode.product_precision(jnp.float32) is None  # outside the precision context
    with jax.default_matmul_precision("highest"):
        assert split_decode.product_precision(jnp.float32) == jax.lax.Precision.HIGHEST
        assert split_decode.product_precision(jnp.bfloat16) is None


@pytest.mark.parametrize("path", ["plain", "scan", "speculative"])
def test_generate_through_split_gpu_gives_the_same_tokens(monkeypatch, path):
    """generate(attention="split_gpu") with the kernel in interpret mode gives the chunked path's greedy
    tokens, plain (unrolled layers, as a CPU runs them, and a scan over layers) and speculative (the
    block-16 oracle drafter of tests/oracle.py: verify and draft calls of 16 queries, rounds that accept
    many of them), and the kernel is part of the programs."""
    import retrace_jax as rj
    from retrace_jax.models.tiny import tiny_target
    from tests.oracle import Oracle

    target = tiny_target()
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    if path == "speculative":
        kw = {"drafter": Oracle.build(target, prompts, 12, 16).drafter}  # rounds of every acceptance length
    else:
        kw = {"layer_loop": "scan"} if path == "scan" else {}
    calls = []
    original = split_decode.split_cached

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(split_decode, "split_cached", counted)
    want = rj.generate(target, prompts, 12, attention="chunked", **kw).tokens
    with pallas_interpret():
        assert rj.generate(target, prompts, 12, attention="split_gpu", **kw).tokens == want
    assert calls  # traced into the program: decode steps, or verify and draft calls
