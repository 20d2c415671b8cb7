"""A tiny random target built on the spot, for demos and smoke runs without any checkpoint."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from retrace_jax.models.config import ModelConfig
from retrace_jax.models.target import TargetModel

TINY_QWEN3 = ModelConfig(
    model_type="qwen3",
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    qkv_bias=False,
    o_bias=False,
    mlp_bias=False,
    qk_norm=True,
)


def tiny_target(seed: int = 0, cfg: ModelConfig = TINY_QWEN3, weight_std: float = 0.08,
                dtype=jnp.float32) -> TargetModel:
    """A randomly initialised Qwen3-shaped target (float32 unless ``dtype``; its text is meaningless).

    Matrices are drawn with ``weight_std`` (0.08: greedy outputs vary instead of repeating one token).
    """
    graphdef, state = nnx.split(TargetModel(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(seed)))
    state = jax.tree.map(lambda x: x * (weight_std / 0.02) if x.ndim == 2 else x, state)
    return nnx.merge(graphdef, state)
