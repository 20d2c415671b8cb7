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
