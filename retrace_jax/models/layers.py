"""Building blocks shared by the target model and the DFlash drafter: one attention layer and one
decoder block serve both (shape letters: see ``retrace_jax/attention/``)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

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


def joined_linear(parts: Sequence[nnx.Linear]) -> nnx.Linear:
    """One dense layer whose output is the outputs of ``parts`` (same input, dtype and bias flag) side by
    side: their kernels ``[in, out_i]`` and biases concatenated along the output axis."""
    first = parts[0]
    kernel = jnp.concatenate([p.kernel[...] for p in parts], axis=-1)
    bias = jnp.concatenate([p.bias[...] for p in parts], axis=-1) if first.use_bias else None
    return nnx.Linear(first.in_features, kernel.shape[-1], use_bias=first.use_bias, dtype=first.dtype,
                      param_dtype=kernel.dtype, kernel_init=lambda *_: kernel,
                      bias_init=(lambda *_: bias) if first.use_bias else nnx.initializers.zeros,
                      rngs=nnx.Rngs(0))


class MLP(nnx.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``. After :func:`join_projections` the gate and
    up projections are one product (``gate_up_proj``)."""

    def __init__(self, dim: int, hidden: int, bias: bool, dtype, rngs: nnx.Rngs):
        self.gate_proj = linear(dim, hidden, bias, dtype, rngs)
        self.up_proj = linear(dim, hidden, bias, dtype, rngs)
        self.down_proj = linear(hidden, dim, bias, dtype, rngs)

    def __call__(self, x):
        if hasattr(self, "gate_up_proj"):
            gate, up = jnp.split(self.gate_up_proj(x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(jax.nn.silu(gate) * up)


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


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """The shape and flags of one decoder block (the target's and the drafter's differ only here)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool


# attend(q [B, T, H, D], k [B, T, K, D], v [B, T, K, D]) -> (out [B, T, H, D], aux): where the keys go and
# what the queries see (a KV cache, a fixed context) is the caller's business; ``aux`` is passed back.
Attend = Callable[..., tuple]


class Attention(nnx.Module):
    """Grouped-query attention: projections, optional q/k RMSNorm, RoPE at absolute positions. After
    :func:`join_projections` the query, key and value projections are one product (``qkv_proj``,
    outputs ``[q | k | v]``)."""

    def __init__(self, spec: BlockSpec, dtype, rngs: nnx.Rngs):
        d, h, kv, hd = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_proj = linear(d, h * hd, spec.qkv_bias, dtype, rngs)
        self.k_proj = linear(d, kv * hd, spec.qkv_bias, dtype, rngs)
        self.v_proj = linear(d, kv * hd, spec.qkv_bias, dtype, rngs)
        self.o_proj = linear(h * hd, d, spec.o_bias, dtype, rngs)
        if spec.qk_norm:
            self.q_norm = RMSNorm(hd, spec.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(hd, spec.rms_norm_eps, dtype=dtype)
        self.spec = spec

    def keys_values(self, x_btd, positions_bt):
        """Keys (normed when the model has q/k norms, rotated) and values ``[B, T, K, D]`` of ``x``."""
        if hasattr(self, "qkv_proj"):  # the key and value columns of the joined product
            q_width = self.spec.num_heads * self.spec.head_dim
            joined = self.qkv_proj
            kv = x_btd @ joined.kernel[:, q_width:].astype(x_btd.dtype)
            if joined.use_bias:
                kv = kv + joined.bias[q_width:]
            k, v = jnp.split(kv, 2, axis=-1)
        else:
            k, v = self.k_proj(x_btd), self.v_proj(x_btd)
        return self._keys(k, positions_bt), self._heads(v, self.spec.num_kv_heads)

    def queries(self, x_btd, positions_bt):
        return self._queries(self.q_proj(x_btd), positions_bt)

    def _heads(self, x_btn, heads):
        return x_btn.reshape(*x_btn.shape[:2], heads, self.spec.head_dim)

    def _keys(self, k_btn, positions_bt):
        k = self._heads(k_btn, self.spec.num_kv_heads)
        if self.spec.qk_norm:
            k = self.k_norm(k)
        return rope(k, positions_bt, self.spec.rope_theta)

    def _queries(self, q_btn, positions_bt):
        q = self._heads(q_btn, self.spec.num_heads)
        if self.spec.qk_norm:
            q = self.q_norm(q)
        return rope(q, positions_bt, self.spec.rope_theta)

    def __call__(self, x_btd, positions_bt, attend: Attend):
        b, t, _ = x_btd.shape
        if hasattr(self, "qkv_proj"):
            q_width, kv_width = (n * self.spec.head_dim for n in (self.spec.num_heads, self.spec.num_kv_heads))
            q, k, v = jnp.split(self.qkv_proj(x_btd), [q_width, q_width + kv_width], axis=-1)
            q, k, v = self._queries(q, positions_bt), self._keys(k, positions_bt), self._heads(v, self.spec.num_kv_heads)
        else:
            (k, v), q = self.keys_values(x_btd, positions_bt), self.queries(x_btd, positions_bt)
        out, aux = attend(q, k, v)
        return self.o_proj(out.reshape(b, t, -1)), aux


class DecoderBlock(nnx.Module):
    """Pre-norm decoder block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, spec: BlockSpec, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(spec, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias, dtype, rngs)

    def __call__(self, x_btd, positions_bt, attend: Attend):
        attn, aux = self.self_attn(self.input_layernorm(x_btd), positions_bt, attend)
        x_btd = x_btd + attn
        return x_btd + self.mlp(self.post_attention_layernorm(x_btd)), aux


def join_projections(block: DecoderBlock) -> DecoderBlock:
    """A copy of ``block`` (unstacked) that computes the same function with fewer, wider products: the
    query, key and value projections as one (``qkv_proj``) and the gate and up projections as one
    (``gate_up_proj``). The decode programs use it for the copies of the weights that they keep beside
    the model on CPU (``retrace_jax/decoding/layer_loop.py``): a verify pass or a drafted block then
    launches three products fewer per layer. Each output column is the same dot product as before."""
    joined = nnx.clone(block)
    attn, mlp = joined.self_attn, joined.mlp
    attn.qkv_proj = joined_linear([attn.q_proj, attn.k_proj, attn.v_proj])
    mlp.gate_up_proj = joined_linear([mlp.gate_proj, mlp.up_proj])
    del attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj
    return joined
