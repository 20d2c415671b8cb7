"""Dense products under jax.default_matmul_precision("bfloat16"): bfloat16 operands, float32 accumulation,
done explicitly (XLA:CPU ignores the setting); bfloat16_kernels rounds the weights once."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import retrace_jax as rj
from retrace_jax.models.layers import bfloat16_kernels, linear
from retrace_jax.training.dflash_loss import target_features
from retrace_jax.training.feature_store import store_key


def test_bfloat16_precision_rounds_operands_and_accumulates_in_float32():
    layer = linear(64, 32, True, jnp.float32, nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (5, 64), jnp.float32)
    w, b = layer.kernel.get_value(), layer.bias.get_value()
    exact = np.asarray(x) @ np.asarray(w) + np.asarray(b)
    rounded = (np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
               @ np.asarray(w.astype(jnp.bfloat16).astype(jnp.float32), np.float64) + np.asarray(b))
    fn = jax.jit(lambda v: layer(v))
    plain = np.asarray(fn(x))
    with jax.default_matmul_precision("bfloat16"):
        fast = np.asarray(fn(x))  # the setting is part of the jitted function's cache key: traced again
    assert plain.dtype == fast.dtype == np.float32
    np.testing.assert_allclose(plain, exact, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fast, rounded, rtol=1e-5, atol=1e-5)  # float32 accumulation of rounded operands
    assert np.abs(fast - exact).max() > 1e-4  # and not the float32 product
    np.testing.assert_array_equal(np.asarray(fn(x)), plain)  # the float32 program again


def test_bfloat16_kernels_change_only_dense_kernels_and_give_the_same_bfloat16_products():
    target = rj.tiny.tiny_target()
    fast = bfloat16_kernels(target)
    dtypes = {"/".join(map(str, p)): v.get_value().dtype for p, v in nnx.to_flat_state(nnx.state(fast))}
    assert all((d == jnp.bfloat16) == k.endswith("kernel") for k, d in dtypes.items()), dtypes
    assert any(k.endswith("kernel") for k in dtypes) and fast.dtype == jnp.float32  # activations stay float32
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 500, (2, 12)), jnp.int32)
    layers = (1, 2)
    with jax.default_matmul_precision("bfloat16"):
        a = np.asarray(target_features(target, tokens, layers))
        b = np.asarray(target_features(fast, tokens, layers))
        out = rj.generate(fast, [[1, 2, 3], [4, 5]], 8)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert a.dtype == np.float32
    f32 = np.asarray(target_features(target, tokens, layers))
    # (0.047 of the largest feature with the random weights of separate q/k/v and gate/up projections,
    # 0.055 with those of the joined ones: other random draws; the same weights give the same difference)
    assert 0 < np.abs(a - f32).max() < 0.1 * np.abs(f32).max()
    assert len(out.tokens[0]) == 8


def test_the_feature_store_key_names_bfloat16_products_only():
    old = store_key("/t", [1, 2], 64, np.float32, 10)
    assert store_key("/t", [1, 2], 64, np.float32, 10, "float32") == old  # stores made before keep their key
    assert store_key("/t", [1, 2], 64, np.float32, 10, "bfloat16") == {**old, "precision": "bfloat16"}


def test_bfloat16_products_are_for_a_float32_target():
    import pytest

    from retrace_jax.errors import ConfigError
    from retrace_jax.training.config import load_config

    assert load_config(None, ["target_precision=bfloat16"]).target_precision == "bfloat16"
    with pytest.raises(ConfigError, match="target_precision: bfloat16 products are for a float32 target"):
        load_config(None, ["target_dtype=bfloat16", "target_precision=bfloat16"])


def _grads(x, w):
    from retrace_jax.models.layers import products

    dims = (((x.ndim - 1,), (0,)), ((), ()))
    return jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.sin(products(a, b, dims))), argnums=(0, 1)))(x, w)


def test_bfloat16_products_differentiate_through_bfloat16_operands():
    """The input gradient is ct @ w.T and the weight gradient x.T @ ct, each of bfloat16 operands (the
    cotangent rounded once) accumulated in float32: equal to those products computed in float64 from the
    rounded values, close to the float32 gradients, and the backward pass's products are bfloat16 ones."""
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 7, 48), jnp.float32)
    w = jax.random.normal(jax.random.PRNGKey(1), (48, 24), jnp.float32) / 7
    exact = _grads(x, w)
    with jax.default_matmul_precision("bfloat16"):
        fast = _grads(x, w)
        hlo = jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.sin(
            rj_products(a, b))), argnums=(0, 1))).lower(x, w).as_text()
    r = lambda a: np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32), np.float64)  # noqa: E731
    xr, wr = r(x), r(w)
    ct = r(np.cos(np.asarray(xr @ wr, np.float32)))  # d sum(sin(y)) / dy at the forward's output, rounded
    for got, want in ((fast[0], ct @ wr.T), (fast[1], xr.reshape(-1, 48).T @ ct.reshape(-1, 24))):
        assert got.dtype == np.float32
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-3, atol=2e-3)
    for got, f32 in zip(fast, exact):
        assert 0 < np.abs(np.asarray(got) - np.asarray(f32)).max() < 0.02 * np.abs(np.asarray(f32)).max()
    dots = [line.split(":")[-1] for line in hlo.splitlines() if "dot_general" in line]  # (operand types) -> result
    assert len(dots) == 3 and all(d.count("xbf16>") == 2 and d.endswith("xf32>") for d in dots), dots


def rj_products(a, b):
    from retrace_jax.models.layers import products

    return products(a, b, (((a.ndim - 1,), (0,)), ((), ())))
