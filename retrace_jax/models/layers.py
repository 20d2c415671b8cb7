"""Building blocks shared by the target model and the DFlash drafter: one attention layer and one
decoder block serve both (shape letters: see ``retrace_jax/attention/``)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, NamedTuple

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


def products(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    """``lax.dot_general`` of the dense layers. Under ``jax.default_matmul_precision("bfloat16")`` (read
    when tracing, and part of every jitted function's cache key) float32 operands are rounded to bfloat16
    and the products accumulated in float32: what that setting asks of a GPU or TPU, done here explicitly
    because XLA:CPU ignores it, where it runs batched products 2-3x faster on processors with AVX-512
    BF16 (docs/performance.md). A layer's product ``[..., in] x [in, out]`` differentiates the same way
    (:func:`_bfloat16_matmul`: the gradients' products take bfloat16 operands too, with float32 results),
    so that a training step's products are all bfloat16 ones. Otherwise, and for other dtypes, the plain product."""
    if (jax.config.jax_default_matmul_precision == "bfloat16" and lhs.dtype == jnp.float32
            and rhs.dtype == jnp.float32 and preferred_element_type in (None, jnp.float32)):
        if rhs.ndim == 2 and tuple(map(tuple, dimension_numbers[0])) == ((lhs.ndim - 1,), (0,)) \
                and not any(dimension_numbers[1]) and precision is None and not kwargs:
            return _bfloat16_matmul(lhs, rhs)
        return jax.lax.dot_general(lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16), dimension_numbers,
                                   precision=precision, preferred_element_type=jnp.float32, **kwargs)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, **kwargs)


def _matmul(x, w):
    """``x [..., din] @ w [din, dout] -> [..., dout]``, accumulated in float32."""
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


@jax.custom_vjp
def _bfloat16_matmul(x, w):
    """``x @ w`` of float32 arrays through bfloat16 operands and float32 accumulation, forward and
    backward: the input gradient is ``ct @ w.T`` and the weight gradient ``x.T @ ct`` of bfloat16
    operands (the cotangent rounded once), where autodiff of the rounded product would leave both in
    float32 (a mixed product is promoted)."""
    return _matmul(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))


def _bfloat16_matmul_fwd(x, w):
    x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    return _matmul(x, w), (x, w)


def _bfloat16_matmul_bwd(residuals, ct):
    x, w = residuals
    ct = ct.astype(jnp.bfloat16)
    grad_x = jax.lax.dot_general(ct, w, (((ct.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    grad_w = jax.lax.dot_general(x.reshape(-1, x.shape[-1]), ct.reshape(-1, ct.shape[-1]), (((0,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
    return grad_x, grad_w


_bfloat16_matmul.defvjp(_bfloat16_matmul_fwd, _bfloat16_matmul_bwd)


def product_precision(precision: str):
    """The context in which a target computes with ``precision`` products (``target_precision``):
    ``jax.default_matmul_precision("bfloat16")`` for ``"bfloat16"``, JAX's own default (no context) for
    ``"float32"``. On a CPU the bfloat16 setting rounds the dense layers' products (:func:`products`);
    on a GPU or TPU it applies to every product (attention included), as XLA applies it there."""
    if precision == "bfloat16":
        return jax.default_matmul_precision("bfloat16")
    if precision != "float32":
        raise ValueError(f"precision must be float32 or bfloat16, got {precision!r}")
    return contextlib.nullcontext()


def bfloat16_kernels(module):
    """A copy of ``module`` whose dense layers' kernels are stored in bfloat16 (embeddings, norms, biases
    and the activations keep their dtype). For :func:`products` under
    ``jax.default_matmul_precision("bfloat16")``: rounding the weights once, outside a compiled loop, keeps
    XLA from converting them again at every step. Outside that setting the kernels are promoted back to
    the module's dtype exactly (products of bfloat16-rounded weights)."""
    graphdef, state = nnx.split(module)

    def rounded(path, value):
        if path[-1] == "kernel" and value.get_value().dtype == jnp.float32:
            return value.replace(value.get_value().astype(jnp.bfloat16))
        return value

    return nnx.merge(graphdef, nnx.from_flat_state([(p, rounded(p, v)) for p, v in nnx.to_flat_state(state)]))


def linear(din: int, dout: int, bias: bool, dtype, rngs: nnx.Rngs) -> nnx.Linear:
    """A dense layer whose parameters and computation use ``dtype`` (kernel stored ``[in, out]``; its
    products: :func:`products`)."""
    return nnx.Linear(
        din,
        dout,
        use_bias=bias,
        dtype=dtype,
        param_dtype=dtype,
        kernel_init=nnx.initializers.normal(0.02),
        dot_general=products,
        rngs=rngs,
    )


class Projection(nnx.Module):
    """A dense layer whose output has several axes: ``x [..., din] -> [..., *out]``, the kernel stored
    ``[din, *out]`` (one product: the kernel is read as ``[din, prod(out)]``). The fused projections of the
    decoder block are such layers (:class:`Attention`'s q/k/v, :class:`MLP`'s gate/up), laid out so that
    splitting their head or neuron axis over devices gives each device matching parts
    (``retrace_jax/io/weights.py`` maps them to the checkpoints' separate tensors)."""

    def __init__(self, din: int, out: tuple[int, ...], bias: bool, dtype, rngs: nnx.Rngs):
        self.kernel = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (din,) + tuple(out), dtype))
        self.bias = nnx.Param(jnp.zeros(tuple(out), dtype)) if bias else None
        self.dtype = dtype

    def __call__(self, x, part: slice | None = None):
        """``x [..., din] -> [..., *out]``; with ``part``, only that slice of the second output axis
        (``kernel[:, :, part]``: the keys and values of ``qkv_proj``)."""
        kernel = self.kernel[...]
        bias = None if self.bias is None else self.bias[...]
        if part is not None:
            kernel, bias = kernel[:, :, part], None if bias is None else bias[:, part]
        # as nnx.Linear: input, kernel and bias in the module's dtype (a bfloat16-stored kernel of a float32
        # module is promoted back exactly: bfloat16_kernels)
        x, kernel = x.astype(self.dtype), kernel.astype(self.dtype)
        y = products(x, kernel.reshape(kernel.shape[0], -1), (((x.ndim - 1,), (0,)), ((), ())))
        y = y.reshape(x.shape[:-1] + kernel.shape[1:])
        return y if bias is None else y + bias.astype(self.dtype)


class MLP(nnx.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``, gate and up one product (``gate_up_proj``,
    kernel ``[d, 2, I]``: index 0 the gate, 1 the up projection)."""

    def __init__(self, dim: int, hidden: int, bias: bool, dtype, rngs: nnx.Rngs):
        self.gate_up_proj = Projection(dim, (2, hidden), bias, dtype, rngs)
        self.down_proj = linear(hidden, dim, bias, dtype, rngs)

    def activations(self, x):
        """``silu(gate(x)) * up(x)`` ``[..., I]``: the input of the down projection."""
        gate_up = self.gate_up_proj(x)
        return jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]

    def __call__(self, x):
        return self.down_proj(self.activations(x))


class Rotary(NamedTuple):
    """RoPE's tables at a call's positions, ``[B, T, 1, D]`` each, float32: made once per forward pass
    (:func:`rotary`) and passed to every layer in place of the positions, so that a step computes its
    cosines and sines once, not once per layer (a scan over layers would compute them in every
    iteration)."""

    cos: jax.Array
    sin: jax.Array


def rotary(positions_bt, head_dim: int, theta: float) -> Rotary:
    """The RoPE tables (:class:`Rotary`) at absolute positions ``[B, T]``."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions_bt.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    return Rotary(jnp.cos(angles), jnp.sin(angles))


def rope(x_bthd, positions_bt, theta: float):
    """Rotary embedding (the "rotate half" layout of transformers) at absolute positions ``[B, T]``, or
    with tables made by :func:`rotary` for them (``positions_bt`` a :class:`Rotary`)."""
    tables = positions_bt if isinstance(positions_bt, Rotary) else rotary(positions_bt, x_bthd.shape[-1], theta)
    cos, sin = tables.cos.astype(x_bthd.dtype), tables.sin.astype(x_bthd.dtype)
    x1, x2 = jnp.split(x_bthd, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x_bthd * cos + rotated * sin


# The separate projections that the joined parameters hold, in their order along the joined axis (the
# layouts: Attention and MLP). Checkpoints keep them separate (retrace_jax/io/weights.py); training
# checkpoints written before the joining hold them too (retrace_jax/training/checkpoints.py).
JOINED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def separate_projections(name: str, joined) -> tuple:
    """The separate parts of a joined kernel (``[..., d, *out]``) or bias (``[..., *out]``) of ``name``
    (a key of :data:`JOINED`), each with its output axes merged as in ``nnx.Linear``:
    ``qkv_proj`` ``[..., K, R + 2, D]`` -> q ``[..., K*R*D]``, k and v ``[..., K*D]``; ``gate_up_proj``
    ``[..., 2, I]`` -> gate and up ``[..., I]``."""
    if name == "gate_up_proj":
        return joined[..., 0, :], joined[..., 1, :]
    lead, (kv, r2, d) = joined.shape[:-3], joined.shape[-3:]
    r = r2 - 2
    return (joined[..., :r, :].reshape(lead + (kv * r * d,)), joined[..., r, :].reshape(lead + (kv * d,)),
            joined[..., r + 1, :].reshape(lead + (kv * d,)))


def join_projections(name: str, parts, shape: tuple):
    """The joined parameter of ``name`` and ``shape`` from its separate parts (:func:`separate_projections`
    inverted)."""
    if name == "gate_up_proj":
        return jnp.stack(parts, axis=-2)
    lead, (kv, r2, d) = tuple(shape[:-3]), tuple(shape[-3:])
    q, k, v = parts
    return jnp.concatenate([q.reshape(lead + (kv, r2 - 2, d)), k.reshape(lead + (kv, 1, d)),
                            v.reshape(lead + (kv, 1, d))], axis=-2)


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
    """Grouped-query attention: projections, optional q/k RMSNorm, RoPE at absolute positions.

    q, k and v are one product (``qkv_proj``, kernel ``[d, K, R + 2, D]`` with ``R = H / K``): for each KV
    head ``g`` its ``R`` query heads ``g*R .. g*R+R-1`` (the heads that attend to it), then its key, then its
    value. Split over the ``K`` axis, every device holds matching query, key and value heads."""

    def __init__(self, spec: BlockSpec, dtype, rngs: nnx.Rngs):
        d, h, kv, hd = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
        if h % kv:
            raise ValueError(f"num_heads {h} is not a multiple of num_kv_heads {kv}")
        self.qkv_proj = Projection(d, (kv, h // kv + 2, hd), spec.qkv_bias, dtype, rngs)
        self.o_proj = linear(h * hd, d, spec.o_bias, dtype, rngs)
        if spec.qk_norm:
            self.q_norm = RMSNorm(hd, spec.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(hd, spec.rms_norm_eps, dtype=dtype)
        self.spec = spec

    def _finish(self, q, k, v, positions_bt):
        """q ``[B, T, H, D]`` and k, v ``[B, T, K, D]`` as projected: normed (q/k norms), rotated."""
        spec = self.spec
        if spec.qk_norm:
            q = None if q is None else self.q_norm(q)
            k = self.k_norm(k)
        q = None if q is None else rope(q, positions_bt, spec.rope_theta)
        return q, rope(k, positions_bt, spec.rope_theta), v

    def keys_values(self, x_btd, positions_bt):
        """Keys (normed when the model has q/k norms, rotated) and values ``[B, T, K, D]`` of ``x``: the
        product with the key and value part of ``qkv_proj`` alone (the drafter's context)."""
        r = self.spec.num_heads // self.spec.num_kv_heads
        kv = self.qkv_proj(x_btd, slice(r, None))  # [B, T, K, 2, D]
        _, k, v = self._finish(None, kv[..., 0, :], kv[..., 1, :], positions_bt)
        return k, v

    def project(self, x_btd, positions_bt):
        """Queries ``[B, T, H, D]``, keys and values ``[B, T, K, D]`` of ``x``: one product, then the q/k
        norms and RoPE."""
        spec = self.spec
        b, t, _ = x_btd.shape
        qkv = self.qkv_proj(x_btd)  # [B, T, K, R + 2, D]
        r = spec.num_heads // spec.num_kv_heads
        q = qkv[..., :r, :].reshape(b, t, spec.num_heads, spec.head_dim)
        return self._finish(q, qkv[..., r, :], qkv[..., r + 1, :], positions_bt)

    def __call__(self, x_btd, positions_bt, attend: Attend):
        b, t, _ = x_btd.shape
        q, k, v = self.project(x_btd, positions_bt)
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
