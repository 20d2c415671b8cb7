"""The Pallas kernel paths ("pallas_gpu": the GPU decode kernel; "pallas_tpu": splash attention for
prefill) against the dense reference, run in Pallas' interpret mode on CPU (no GPU or TPU here; the
device check runs them compiled), and generate's greedy tokens through them against the chunked path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from retrace_jax.attention import (
    cached_attention,
    fresh_attention,
    kernels,
    pallas_interpret,
    reference_attention,
)


@pytest.fixture
def interpret():
    with pallas_interpret():
        yield


def _case(rng, t, slots, d, extra, dtype=jnp.float32):
    """Two layers of a random cache with 3 rows, GQA (4 query heads over 2 KV heads) and ragged limits:
    a row that sees one slot, a full row, and causal limits (each query one slot further)."""
    b, h, kv = 3, 4, 2
    k = jnp.asarray(rng.standard_normal((2, b, kv, slots, d)), dtype)  # [L, B, K, S, D]
    v = jnp.asarray(rng.standard_normal((2, b, kv, slots, d)), dtype)
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
    limit = jnp.asarray(np.stack([np.full(t, 1), np.full(t, slots), np.minimum(np.arange(t) + 37, slots)]), jnp.int32)
    ek = ev = None
    if extra:
        ek = jnp.asarray(rng.standard_normal((b, 4, kv, d)), dtype)
        ev = jnp.asarray(rng.standard_normal((b, 4, kv, d)), dtype)
    return q, k, v, limit, ek, ev


def _pallas_gpu(q, k, v, limit, ek, ev, kv_chunk=32):
    fn = jax.jit(lambda *a: cached_attention(*a, implementation="pallas_gpu", kv_chunk=kv_chunk))
    args = (q, k, v, jnp.int32(1), limit, ek, ev)
    return fn(*args), "pallas_call" in str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize("t,slots,extra", [(1, 128, False), (16, 128, True),
                                            pytest.param(1, 256, True, marks=pytest.mark.slow),
                                            pytest.param(16, 96, False, marks=pytest.mark.slow)])
def test_pallas_gpu_decode_kernel_matches_reference(interpret, t, slots, extra):
    """Decode (T=1), draft (extra keys) and verify-like (per-query limits) calls through the kernel,
    with the slots only some queries see and the extra keys merged in from the kernel's residuals."""
    q, k, v, limit, ek, ev = _case(np.random.default_rng(t + slots), t, slots, 16, extra)
    want = cached_attention(q, k, v, 1, limit, ek, ev, implementation="dense")
    got, used_kernel = _pallas_gpu(q, k, v, limit, ek, ev)
    assert used_kernel
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-5)


@pytest.mark.slow
def test_pallas_gpu_bfloat16_close_to_reference(interpret):
    q, k, v, limit, ek, ev = _case(np.random.default_rng(7), 4, 128, 32, True, jnp.bfloat16)
    want = cached_attention(*(x.astype(jnp.float32) for x in (q, k, v)), 1, limit, ek.astype(jnp.float32),
                            ev.astype(jnp.float32), implementation="dense")
    got, used_kernel = _pallas_gpu(q, k, v, limit, ek, ev)
    assert used_kernel and got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=3e-2)


@pytest.mark.parametrize("t,slots,d", [(1, 100, 16), pytest.param(65, 128, 16, marks=pytest.mark.slow),
                                        pytest.param(1, 128, 24, marks=pytest.mark.slow)])
def test_pallas_gpu_falls_back_to_chunked_where_the_kernel_does_not_fit(interpret, t, slots, d):
    """Slot counts that do not split into blocks of 16, more than PALLAS_GPU_MAX_T queries (prefill) and
    head dims that are not a power of two run the chunked walk, with the same result."""
    q, k, v, limit, _, _ = _case(np.random.default_rng(3), t, slots, d, False)
    want = cached_attention(q, k, v, 1, limit, implementation="dense")
    got, used_kernel = _pallas_gpu(q, k, v, limit, None, None, kv_chunk=slots)
    assert not used_kernel
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("t", [37, 130])
def test_pallas_tpu_splash_prefill_is_causal_attention(interpret, t):
    """Splash attention over the prompt's own keys (padded to its 128-token blocks) against the reference
    with a causal mask, grouped-query shapes."""
    rng = np.random.default_rng(t)
    q = jnp.asarray(rng.standard_normal((2, t, 8, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, t, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, t, 2, 16)), jnp.float32)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (2, t, t))
    got = jax.jit(lambda q, k, v: fresh_attention(q, k, v, "pallas_tpu"))(q, k, v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(reference_attention(q, k, v, causal)), atol=2e-6,
                               rtol=2e-5)


def test_pallas_kernels_need_their_device():
    q, k, v, limit, _, _ = _case(np.random.default_rng(0), 1, 128, 16, False)
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="'pallas_gpu' needs a GPU.*pallas_interpret"):
            cached_attention(q, k, v, 0, limit, implementation="pallas_gpu")
    if jax.default_backend() != "tpu":
        with pytest.raises(ValueError, match="'pallas_tpu' needs a TPU"):
            fresh_attention(q, k[0], v[0], "pallas_tpu")
        with pytest.raises(ValueError, match="'pallas_tpu' needs a TPU"):  # also for calls that stay chunked
            cached_attention(q, k, v, 0, limit, implementation="pallas_tpu")


@pytest.mark.slow
@pytest.mark.parametrize("implementation,kernel", [("pallas_gpu", "decode_kernel_cached"),
                                                   ("pallas_tpu", "splash_fresh")])
def test_generate_through_pallas_kernels_gives_the_same_tokens(monkeypatch, implementation, kernel):
    """generate(attention=...) with the kernel in interpret mode gives the chunked path's greedy tokens,
    plain and speculative (the block-16 oracle drafter of tests/oracle.py: verify and draft calls of 16
    queries, rounds that accept many of them), and the kernel is part of the programs."""
    import retrace_jax as rj
    from retrace_jax.models.tiny import tiny_target
    from tests.oracle import Oracle

    target = tiny_target()
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    drafter = Oracle.build(target, prompts, 12, 16).drafter  # rounds of every acceptance length
    want = [rj.generate(target, prompts, 12, attention="chunked", **kw).tokens for kw in ({}, {"drafter": drafter})]
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="needs a"):
            rj.generate(target, prompts, 12, attention=implementation)
    calls = []
    original = getattr(kernels, kernel)

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(kernels, kernel, counted)
    for kw, tokens in zip(({}, {"drafter": drafter}), want, strict=True):
        calls.clear()
        with pallas_interpret():
            assert rj.generate(target, prompts, 12, attention=implementation, **kw).tokens == tokens
        assert calls  # traced into the program (decode/verify/draft for the GPU kernel, prefill for splash)
