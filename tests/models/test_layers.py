"""The decoder block shared by the target and the drafter: its joined-projection copy (the decode
programs' layout on CPU) computes the same function."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from retrace_jax.models.layers import BlockSpec, DecoderBlock, join_projections


def _attend(q, k, v):  # any function of all three, so a swapped or misplaced column shows
    g = q.shape[2] // k.shape[2]
    return q * jnp.repeat(k + 2 * v, g, axis=2), None


@pytest.mark.parametrize("bias", [False, True], ids=["qwen3", "qwen2-biases"])
def test_joined_projections_compute_the_same_block(bias):
    spec = BlockSpec(hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16,
                     rope_theta=10000.0, rms_norm_eps=1e-6, qkv_bias=bias, o_bias=False, mlp_bias=bias,
                     qk_norm=not bias)
    block = DecoderBlock(spec, jnp.float32, nnx.Rngs(0))
    if bias:  # non-zero biases, each its own
        for i, m in enumerate((block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj,
                               block.mlp.gate_proj, block.mlp.up_proj)):
            m.bias[...] = jax.random.normal(jax.random.PRNGKey(i), m.bias.shape)
    joined = join_projections(block)
    names = {".".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(joined))}
    assert {"self_attn.qkv_proj.kernel", "mlp.gate_up_proj.kernel"} <= names
    assert not any(n.split(".")[1] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") for n in names)
    assert hasattr(block.self_attn, "q_proj")  # the original is left as it was

    x = jax.random.normal(jax.random.PRNGKey(9), (2, 5, 64))
    positions = jnp.asarray([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    want, _ = block(x, positions, _attend)
    got, _ = joined(x, positions, _attend)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    for a, b in zip(joined.self_attn.keys_values(x, positions), block.self_attn.keys_values(x, positions)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
