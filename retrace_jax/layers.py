"""Building blocks shared by the target model and the DFlash drafter."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    """RMSNorm with Hugging Face semantics: statistics in float32, scale applied in the input dtype.

    Written out rather than ``nnx.RMSNorm`` so that bfloat16 rounding matches transformers exactly.
    """

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * x32.astype(x.dtype)


def linear(din: int, dout: int, bias: bool, dtype, rngs: nnx.Rngs) -> nnx.Linear:
    """A dense layer whose parameters and computation use ``dtype`` (kernel stored ``[in, out]``)."""
    return nnx.Linear(
        din,
        dout,
        use_bias=bias,
        dtype=dtype,
        param_dtype=dtype,
        kernel_init=nnx.initializers.normal(0.02),
        rngs=rngs,
    )


class MLP(nnx.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, dim: int, hidden: int, bias: bool, dtype, rngs: nnx.Rngs):
        self.gate_proj = linear(dim, hidden, bias, dtype, rngs)
        self.up_proj = linear(dim, hidden, bias, dtype, rngs)
        self.down_proj = linear(hidden, dim, bias, dtype, rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def rope(x_bthd, positions_bt, theta: float):
    """Rotary embedding (the "rotate half" layout of transformers) at absolute positions."""
    head_dim = x_bthd.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions_bt.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    cos, sin = jnp.cos(angles).astype(x_bthd.dtype), jnp.sin(angles).astype(x_bthd.dtype)
    x1, x2 = jnp.split(x_bthd, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x_bthd * cos + rotated * sin


def attention(q_bthd, k_bskd, v_bskd, mask_bts):
    """Grouped-query attention of ``T`` queries over ``S`` keys; ``mask[b, t, s]`` marks visible keys.

    Scores and softmax run in float32; the output has the query dtype.
    """
    b, t, h, d = q_bthd.shape
    kv_heads = k_bskd.shape[2]
    q = q_bthd.reshape(b, t, kv_heads, h // kv_heads, d)
    scores = jnp.einsum(
        "btkgd,bskd->bkgts", q, k_bskd, preferred_element_type=jnp.float32
    ) * (d**-0.5)
    scores = jnp.where(mask_bts[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bskd.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_bskd)
    return out.reshape(b, t, h, d)


def attention_beside_context(q_bthd, k_btkd, v_btkd, ctx_k_bskd, ctx_v_bskd, mask_bt_st):
    """Attention over a fixed context followed by the new tokens' own keys: ``mask[:, :, :S]`` covers
    the context, ``mask[:, :, S:]`` the new tokens. Used by DFlash's KV injection and by training's
    verification of drafted blocks."""
    keys = jnp.concatenate([ctx_k_bskd, k_btkd.astype(ctx_k_bskd.dtype)], axis=1)
    values = jnp.concatenate([ctx_v_bskd, v_btkd.astype(ctx_v_bskd.dtype)], axis=1)
    return attention(q_bthd, keys, values, mask_bt_st)
