"""The flash-decoding kernel behind ``implementation="split_gpu"``: Pallas on GPUs (Triton), reading one layer
of the stacked KV cache ``[L, B, K, S, D]`` in place.

One program per (row ``b``, KV head ``k``, block of ``M`` queries, split ``j``) takes the ``T * G`` queries
of its KV head (``M`` rows: query ``t`` and head ``g`` at row ``t * G + g``, padded to the block) and walks
its share of the row's filled slots in blocks of ``block_k``: the slots up to the largest limit of its
queries are cut into :attr:`SplitPlan.splits` equal runs of whole blocks, so the work follows the text, not
``S``, and a short text still spreads over as many programs as it has blocks (up to the splits). Each query
masks the slots ``s >= limit[b, t]`` (a verify pass's causal block needs no second walk). Keys and values
are loaded at a dynamic offset of the whole cache (layer, row, head, slot): no copy of the layer is made,
whether ``layer`` is static (unrolled layers) or traced (a scan). Each program writes its float32 softmax
partials (max, sum, weighted values); :func:`split_cached` merges the splits and folds in the extra keys
with the chunked walk's online softmax (:func:`~retrace_jax.attention.chunked.extra_update`).

This module imports Pallas, so :mod:`retrace_jax.attention` imports it at the first call that asks for it
(a JAX without Pallas fails there, with a clear error). Shape letters: :mod:`retrace_jax.attention` (``M``:
the ``T * G`` query rows of one KV head; ``X``: the splits).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from retrace_jax.attention.chunked import NEG, extra_update, finish, softmax_step
from retrace_jax.attention.kernels import interpreting

SPLIT_PROGRAMS = 256  # programs a call aims at (rows x KV heads x query blocks x splits): about 2 per SM
MAX_SPLITS = 64  # ... with at most this many splits of a row's filled slots
MAX_BLOCK_M = 64  # query rows per program, at most (the float32 accumulator is block_m x D)
BLOCK_KS = (64, 32, 16)  # slots per block, the largest that divides S (Triton's products need 16 or more)


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """The static shape of one kernel call: ``block_m`` query rows and ``block_k`` slots per block (powers of
    two from 16), ``splits`` runs of the filled slots per (row, KV head, query block)."""

    block_m: int
    block_k: int
    splits: int


def split_plan(b: int, kv: int, m: int, s: int, d: int) -> SplitPlan | None:
    """The plan for ``B`` rows, ``K`` KV heads, ``M = T * G`` query rows per KV head over ``S`` slots of head
    dim ``D``, or None where the call stays chunked: a head dim that is not a power of two from 16, or slots
    that no block of 16 or more divides."""
    if d < 16 or d & (d - 1):
        return None
    block_k = next((k for k in BLOCK_KS if s % k == 0), None)
    if block_k is None:
        return None
    block_m = min(MAX_BLOCK_M, max(16, 1 << (m - 1).bit_length()))
    programs = b * kv * -(-m // block_m)
    splits = max(1, min(MAX_SPLITS, s // block_k, -(-SPLIT_PROGRAMS // programs)))
    return SplitPlan(block_m, block_k, splits)


def product_precision(dtype):
    """The precision of the kernel's products: full float32 products (``HIGHEST``) for float32 queries
    under ``jax.default_matmul_precision("highest")`` or ``("float32")``, as XLA computes the other paths
    there; else the device's default (Triton computes float32 products in TF32 on NVIDIA GPUs)."""
    full = jax.config.jax_default_matmul_precision in ("highest", "float32")
    return jax.lax.Precision.HIGHEST if full and jnp.dtype(dtype) == jnp.float32 else None


def _kernel(layer_ref, limit_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *, plan: SplitPlan, rows: int,
            precision=None):
    """One program: queries ``q_ref`` ``[block_m, D]`` with their limits ``limit_ref`` ``[block_m]`` (0 for
    padding rows) over its split of the slots of the cache ``k_ref``/``v_ref`` ``[L, B, K, S, D]`` (whole,
    in place); writes the partials of its real rows (``< rows``)."""
    b, h, i, j = (pl.program_id(axis) for axis in range(4))
    block_m, block_k = plan.block_m, plan.block_k
    layer = layer_ref[0]
    limit = limit_ref[...]
    q = q_ref[...]
    d = q.shape[-1]
    blocks = (jnp.max(limit) + block_k - 1) // block_k  # the blocks that hold a slot some query sees
    per_split = (blocks + plan.splits - 1) // plan.splits
    first = j * per_split
    count = jnp.maximum(jnp.minimum(per_split, blocks - first), 0)
    offsets = jnp.arange(block_k, dtype=jnp.int32)

    def body(n, state):
        start = (first + n) * block_k
        k = k_ref[layer, b, h, pl.ds(start, block_k), :].astype(q.dtype)
        v = v_ref[layer, b, h, pl.ds(start, block_k), :]
        scores = plgpu.dot(q, k, trans_b=True, precision=precision) * d**-0.5  # [block_m, block_k], float32
        visible = (start + offsets)[None, :] < limit[:, None]
        return softmax_step(state, scores, visible, lambda p: plgpu.dot(p.astype(v.dtype), v, precision=precision))

    init = (jnp.full((block_m,), NEG, jnp.float32), jnp.zeros((block_m,), jnp.float32),
            jnp.zeros((block_m, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, count, body, init)
    real = i * block_m + jnp.arange(block_m) < rows
    plgpu.store(acc_ref, acc, mask=jnp.broadcast_to(real[:, None], acc.shape))
    plgpu.store(m_ref, m, mask=real)
    plgpu.store(l_ref, l, mask=real)


def split_partials(q_bkmd, limit_bm, k_lbksd, v_lbksd, layer, plan: SplitPlan):
    """The kernel's partials for queries ``[B, K, M, D]`` with limits ``[B, M]`` over layer ``layer`` of the
    cache: ``(m, l, acc)``, ``[B, K, X, M]`` twice and ``[B, K, X, M, D]``, float32 (``X`` splits)."""
    b, kv, rows, d = q_bkmd.shape
    padded = -(-rows // plan.block_m) * plan.block_m
    q = jnp.pad(q_bkmd, ((0, 0), (0, 0), (0, padded - rows), (0, 0)))
    limit = jnp.pad(limit_bm.astype(jnp.int32), ((0, 0), (0, padded - rows)))
    grid = (b, kv, padded // plan.block_m, plan.splits)
    bm, x = plan.block_m, plan.splits
    whole = pl.BlockSpec()  # the whole array, not blocked over the grid
    acc, m, l = pl.pallas_call(
        functools.partial(_kernel, plan=plan, rows=rows, precision=product_precision(q_bkmd.dtype)),
        grid=grid,
        in_specs=[whole,  # the layer index [1]
                  pl.BlockSpec((None, bm), lambda b_, h, i, j: (b_, i)),
                  pl.BlockSpec((None, None, bm, d), lambda b_, h, i, j: (b_, h, i, 0)),
                  whole, whole],  # the whole cache: the kernel loads its blocks in place
        out_specs=[pl.BlockSpec((None, None, None, bm, d), lambda b_, h, i, j: (b_, h, j, i, 0)),
                   pl.BlockSpec((None, None, None, bm), lambda b_, h, i, j: (b_, h, j, i)),
                   pl.BlockSpec((None, None, None, bm), lambda b_, h, i, j: (b_, h, j, i))],
        out_shape=[jax.ShapeDtypeStruct((b, kv, x, padded, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, kv, x, padded), jnp.float32),
                   jax.ShapeDtypeStruct((b, kv, x, padded), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpreting(),
        name="split_decode",
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), limit, q, k_lbksd, v_lbksd)
    return m[..., :rows], l[..., :rows], acc[..., :rows, :]


def merge_splits(m_bkxm, l_bkxm, acc_bkxmd):
    """One online-softmax state ``(m, l, acc)`` (``[B, K, M]``, ``[B, K, M, D]``) from the partials of the
    ``X`` splits (an empty split has max NEG and sum 0, and adds nothing)."""
    m = jnp.max(m_bkxm, axis=2)
    scale = jnp.exp(m_bkxm - m[:, :, None])
    return m, jnp.sum(l_bkxm * scale, axis=2), jnp.sum(acc_bkxmd * scale[..., None], axis=2)


def split_cached(q_btkgd, limit_bt, k_lbksd, v_lbksd, layer, plan: SplitPlan, extra=None, extra_valid=None):
    """:func:`~retrace_jax.attention.cached_attention` through the kernel: query ``(b, t)`` sees the slots
    ``s < limit[b, t]`` of layer ``layer`` and the extra keys (``extra = (k, v)``, ``[B, E, K, D]``, or
    None; those where ``extra_valid`` ``[B, E]`` holds). Returns ``[B, T, H, D]`` in float32."""
    b, t, kv, g, d = q_btkgd.shape
    q_bkmd = q_btkgd.transpose(0, 2, 1, 3, 4).reshape(b, kv, t * g, d)  # row t * G + g
    limit_bm = jnp.repeat(limit_bt, g, axis=1)
    m, l, acc = merge_splits(*split_partials(q_bkmd, limit_bm, k_lbksd, v_lbksd, layer, plan))
    state = (m.reshape(b, kv, t, g).swapaxes(2, 3), l.reshape(b, kv, t, g).swapaxes(2, 3),
             acc.reshape(b, kv, t, g, d).swapaxes(2, 3))  # [B, K, G, T] and [B, K, G, T, D]
    if extra is not None:
        state = extra_update(state, q_btkgd.transpose(0, 2, 3, 1, 4), extra, extra_valid)
    return finish(state)
