"""Building blocks shared by the target model and the DFlash drafter: one attention layer and one
decoder block serve both (shape letters: see ``retrace_jax/attention.py``)."""

from __future__ import annotations

import dataclasses
from typing import Callable

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


def fuse_linears(*linears: nnx.Linear) -> nnx.Linear:
    """One dense layer computing the outputs of ``linears`` (same input, same flags) side by side, in
    their order: their kernels (and biases) concatenated along the output axis. Works on stacked layers
    too (a leading layer axis)."""
    fused = nnx.clone(linears[0])
    fused.kernel.set_value(jnp.concatenate([lin.kernel[...] for lin in linears], axis=-1))
    if fused.bias is not None:
        fused.bias.set_value(jnp.concatenate([lin.bias[...] for lin in linears], axis=-1))
    fused.out_features = sum(lin.out_features for lin in linears)
    return fused


class MLP(nnx.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``; ``gate`` and ``up`` may be fused into one
    ``gate_up_proj`` (see :meth:`DecoderBlock.fuse_projections`)."""

    def __init__(self, dim: int, hidden: int, bias: bool, dtype, rngs: nnx.Rngs):
        self.gate_proj = linear(dim, hidden, bias, dtype, rngs)
        self.up_proj = linear(dim, hidden, bias, dtype, rngs)
        self.down_proj = linear(hidden, dim, bias, dtype, rngs)

    def fuse_projections(self):
        """Replaces ``gate_proj`` and ``up_proj`` by one ``gate_up_proj`` with the same outputs (in place)."""
        self.gate_up_proj = fuse_linears(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

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
    """Grouped-query attention: projections, optional q/k RMSNorm, RoPE at absolute positions."""

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

    def fuse_projections(self):
        """Replaces ``q_proj``, ``k_proj`` and ``v_proj`` by one ``qkv_proj`` with the same outputs (in
        place): one matrix product per call instead of three."""
        self.qkv_proj = fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def projections(self, x_btd, names: str = "qkv") -> list:
        """The query, key and value projections named in ``names``, ``[B, T, heads, D]`` each, before
        norms and RoPE; one product when the projections are fused."""
        spec = self.spec
        b, t, _ = x_btd.shape
        heads = {"q": spec.num_heads, "k": spec.num_kv_heads, "v": spec.num_kv_heads}
        if hasattr(self, "qkv_proj"):
            q_end, k_end = spec.num_heads * spec.head_dim, (spec.num_heads + spec.num_kv_heads) * spec.head_dim
            outs = dict(zip("qkv", jnp.split(self.qkv_proj(x_btd), [q_end, k_end], axis=-1)))
        else:
            outs = {n: getattr(self, f"{n}_proj")(x_btd) for n in names}
        return [outs[n].reshape(b, t, heads[n], spec.head_dim) for n in names]

    def _keys(self, k_btkd, positions_bt):
        if self.spec.qk_norm:
            k_btkd = self.k_norm(k_btkd)
        return rope(k_btkd, positions_bt, self.spec.rope_theta)

    def _queries(self, q_bthd, positions_bt):
        if self.spec.qk_norm:
            q_bthd = self.q_norm(q_bthd)
        return rope(q_bthd, positions_bt, self.spec.rope_theta)

    def keys_values(self, x_btd, positions_bt):
        """Keys (normed when the model has q/k norms, rotated) and values ``[B, T, K, D]`` of ``x``."""
        k, v = self.projections(x_btd, "kv")
        return self._keys(k, positions_bt), v

    def queries(self, x_btd, positions_bt):
        (q,) = self.projections(x_btd, "q")
        return self._queries(q, positions_bt)

    def __call__(self, x_btd, positions_bt, attend: Attend):
        b, t, _ = x_btd.shape
        q, k, v = self.projections(x_btd)
        out, aux = attend(self._queries(q, positions_bt), self._keys(k, positions_bt), v)
        return self.o_proj(out.reshape(b, t, -1)), aux


class DecoderBlock(nnx.Module):
    """Pre-norm decoder block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, spec: BlockSpec, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(spec, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias, dtype, rngs)

    def fuse_projections(self) -> DecoderBlock:
        """Fuses q/k/v into one projection and gate/up into another, in place (same outputs, fewer and
        larger matrix products), and returns the block. The checkpoint layout keeps them separate; the
        target's per-layer copies for CPU programs are fused (``TargetModel.layer_slices``)."""
        self.self_attn.fuse_projections()
        self.mlp.fuse_projections()
        return self

    def __call__(self, x_btd, positions_bt, attend: Attend):
        attn, aux = self.self_attn(self.input_layernorm(x_btd), positions_bt, attend)
        x_btd = x_btd + attn
        return x_btd + self.mlp(self.post_attention_layernorm(x_btd)), aux
