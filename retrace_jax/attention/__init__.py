"""Attention: one interface for target prefill, verification, plain decoding and drafting.

Shape letters used across the library:

    B  batch rows                      T  query tokens of this call (prompt, block or 1)
    S  KV-cache slots (max_len)        L  layers
    H  query heads                     K  KV heads (H = K * G)
    G  query heads per KV head         D  head dim (``d``: model width)
    C  cache slots per chunk           E  extra keys attended next to the cache (the drafter's block)
    V  vocabulary                      U  draft vocabulary (``retrace_jax/models/draft_vocab.py``)
    W  slots of a drafted block        J  drafted slots of a block (J = W - 1 = block_size - 1)
    A  blocks (anchors) per sequence   R  rounds (the speculative loop's, ReTrace training's)
    P  padded prompt length            F  concatenated target features (number of layers * d)
    N  rows of a flattened batch       O  output capacity (new tokens a row can hold)
    Q  prompts queued for a stream     Y  prompts a stream's call harvests (``decoding/stream.py``)
    M  query rows of one KV head in a decode kernel (M = T * G)
    X  splits of a row's filled slots in the flash-decoding kernel (``split_decode.py``)
    Z  entries of a top-k: the target's top tokens that ``train.distill_topk`` trains on (``dflash_loss.py``)
    I  (row, chunk) pairs that one step of ``walk_rows`` reads, one per lane (I = B; ``chunked.py``)

Capital ``D`` is a head's width and lowercase ``d`` the model's (``x_btd``, ``q_bthd``). Every other
letter has one meaning; a new shape letter joins this table before it is used.

Two implementations share one meaning:

- :func:`reference_attention` (``reference.py``): dense scores over every key with an explicit mask
  ``[B, T, S]``. It is the definition that the tests compare everything against, and training uses it
  (its masks are arbitrary and its sequences short).
- :func:`cached_attention`: queries over a fixed-size KV cache ``[L, B, K, S, D]`` in which query
  ``(b, t)`` sees the slots ``s < limit[b, t]`` (and, optionally, ``E`` extra keys that every query
  sees). The chunked walk (``chunked.py``) visits the cache in chunks of ``C`` slots only up to the
  batch's largest limit, with an online softmax (flash-decoding), so decode, verify and draft cost grows
  with the filled length, not with ``S`` (a long cache's last, partly filled chunk is walked in chunks
  of ``SMALL_CHUNK``, so a short text costs what it costs in a short cache). Calls of up to
  ``ROW_WALK_MAX_T`` queries per row (decode, verify, draft) over a batch and a cache of several chunks
  walk each row's own chunks of ``SMALL_CHUNK`` (``walk_rows``), so that a batch of texts of different
  lengths reads what its texts hold, not every row up to the longest one; long query sequences
  (prefill) are split into chunks of queries as well, each walking only the chunks it can see, so memory
  grows with the chunk sizes, not with the prompt squared.

``implementation`` chooses the backend (the device kernels are in ``kernels.py``):

- ``"chunked"``: the JAX path above; every backend.
- ``"dense"``: the reference over the whole cache; for tests and tiny caches.
- ``"cudnn"``: the prefill of an empty cache through cuDNN's flash attention,
  ``jax.nn.dot_product_attention`` (NVIDIA GPUs, bfloat16 or float16); every other call (decode, verify,
  draft) runs as ``"auto"`` runs it: see :func:`fresh_attention`.
- ``"pallas_gpu"``: decode, verify and draft calls (at most :data:`PALLAS_GPU_MAX_T` queries per row)
  through JAX's Pallas GPU decode kernel (``jax.experimental.pallas.ops.gpu.decode_attention.gqa``,
  flash-decoding with per-row lengths), over the slots that every query of a row sees; the few slots
  that only some of them see (a verify block's own keys) and the extra keys are merged in by the chunked
  walk, through the kernel's softmax residuals. Prefill, caches whose slot count does not split into the
  kernel's blocks and head dims that are not a power of two from 16 stay chunked
  (:func:`~retrace_jax.attention.kernels.decode_kernel_plan`). The kernel reads a contiguous
  ``[B, S, K, D]`` layer, so each call copies its layer of the cache before the kernel walks it.
- ``"split_gpu"``: decode, verify and draft calls (at most :data:`PALLAS_GPU_MAX_T` queries per row)
  through this library's own flash-decoding kernel (``split_decode.py``, Pallas on GPUs), which reads the
  layer's keys and values in place in the stacked cache (no copy of the layer, the layer index static or
  traced). A program per (row, KV head, block of the ``T * G`` queries, split) walks its share of the
  row's filled slots, cut into :attr:`~retrace_jax.attention.split_decode.SplitPlan.splits` runs so that
  the work follows the text, not ``S``, and parallel work stays high at batch 1; each query masks its own
  limit in the kernel (a verify block's own keys need no second walk). A small JAX step merges the splits'
  float32 softmax partials and folds in the extra keys (the chunked walk's online softmax, no loop).
  Prefill, windowed calls and row views, slot counts that no block of 16 or more divides and head dims
  that are not a power of two from 16 stay chunked. Not yet measured on a GPU: opt-in.
- ``"pallas_tpu"``: the prefill of an empty cache through JAX's Pallas TPU splash attention
  (``jax.experimental.pallas.ops.tpu.splash_attention``, causal mask, one kernel per KV head); every
  other call stays chunked. JAX's TPU ragged paged attention kernel is not used because it does not run
  in Pallas' interpret mode on CPU, where the tests run; the paged one computes in bfloat16 over a
  head-major page layout.
- ``"auto"``: on a GPU, ``"dense"`` for calls of at most :data:`DENSE_MAX_T` queries per row (decode,
  verify, draft) whose float32 scores stay under :data:`DENSE_MAX_SCORES`, and ``"cudnn"`` for the
  prefill of an empty cache in bfloat16 or float16 (head dims up to 128 in steps of 8); ``"chunked"``
  for everything else and on every other backend. On an H200 the walk's loop and branch per chunk cost a
  host round trip each, about 12 ms per decode step of a 36-layer model, several times the step's
  weight reads, while the dense scores of a decode call over every slot cost less than the loop; see
  docs/performance.md, "Accelerators". A choice changes here only after ``scripts/device_check.sh`` has
  checked and timed it on the device.

The Pallas kernels run on their device, or anywhere in interpret mode inside :func:`pallas_interpret`.
The score and softmax arithmetic is float32 whatever the cache dtype (the matmuls of JAX's Pallas GPU
kernel use the device's default precision, TF32 for float32 on NVIDIA GPUs; ``"split_gpu"``'s are full
float32 products under ``jax.default_matmul_precision("highest")``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from retrace_jax.attention import kernels
from retrace_jax.attention.chunked import walk_cache, walk_rows
from retrace_jax.attention.kernels import pallas_interpret
from retrace_jax.attention.reference import attention_beside_context, dense_cached, reference_attention

IMPLEMENTATIONS = ("auto", "chunked", "dense", "cudnn", "pallas_gpu", "split_gpu", "pallas_tpu")
FRESH_KERNELS = ("cudnn", "pallas_tpu")  # implementations with their own empty-cache prefill (fresh_attention)
PALLAS_GPU_MAX_T = 64  # queries per row up to which "pallas_gpu" and "split_gpu" use their decode kernels
KV_CHUNK = 512  # cache slots per chunk; caches longer than this are allocated in multiples of it
SMALL_CHUNK = 128  # ... and caches of up to KV_CHUNK slots in multiples of this, walked in chunks of it
Q_CHUNK = 512  # queries per chunk (prefill)
ROW_WALK_MAX_T = 64  # queries per row up to which a batch's rows walk their own chunks (walk_rows)
DENSE_MAX_T = 64  # queries per row up to which "auto" is "dense" on a GPU ...
DENSE_MAX_SCORES = 2**29  # ... while a call's float32 scores (B * H * T * S) stay within this (2 GiB)

__all__ = ["DENSE_MAX_SCORES", "DENSE_MAX_T", "FRESH_KERNELS", "IMPLEMENTATIONS", "KV_CHUNK", "PALLAS_GPU_MAX_T",
           "Q_CHUNK", "ROW_WALK_MAX_T", "SMALL_CHUNK", "attention_beside_context", "auto_cached", "auto_fresh", "cache_slots",
           "cached_attention", "fresh_attention", "fresh_kernel", "pallas_interpret", "reference_attention",
           "walk_chunk"]


def auto_cached(b: int, t: int, h: int, s: int, backend: str | None = None) -> str:
    """What ``"auto"`` runs for ``T`` queries per row of ``B`` rows and ``H`` heads over ``S`` cache slots:
    ``"dense"`` on a GPU for decode-sized calls (no loop, no branch: each would cost a host round trip
    per chunk and layer there), else ``"chunked"``."""
    backend = backend or jax.default_backend()
    if backend == "gpu" and t <= DENSE_MAX_T and b * h * t * s <= DENSE_MAX_SCORES:
        return "dense"
    return "chunked"


def auto_fresh(dtype, d: int, backend: str | None = None) -> str | None:
    """The kernel that ``"auto"`` runs the prefill of an empty cache with (see :func:`fresh_attention`), or
    None to attend through the cache as any other call: cuDNN's flash attention on a GPU for bfloat16 or
    float16 activations and head dims it takes (up to 128, in steps of 8)."""
    backend = backend or jax.default_backend()
    if backend == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and d % 8 == 0 and d <= 128:
        return "cudnn"
    return None


def fresh_kernel(implementation: str, dtype, d: int, backend: str | None = None) -> str | None:
    """The kernel that the prefill of an empty cache runs through (:func:`fresh_attention`) for the
    ``implementation`` asked for, or None to attend through the cache as any other call: the kernel
    itself for ``"cudnn"`` and ``"pallas_tpu"``, :func:`auto_fresh`'s choice for ``"auto"``."""
    if implementation in FRESH_KERNELS:
        return implementation
    return auto_fresh(dtype, d, backend) if implementation == "auto" else None


def cache_slots(n: int, chunk: int = KV_CHUNK) -> int:
    """The number of slots to allocate for ``n`` positions, so that the chunked walk tiles the cache
    exactly: ``n`` itself up to one small chunk (read whole), the next multiple of the small chunk up to
    one chunk, else the next multiple of the chunk. Only tiny caches are read whole: a short text in a
    larger one then costs what its filled chunks cost."""
    small = min(SMALL_CHUNK, chunk)
    if n <= small:
        return n
    return -(-n // small) * small if n <= chunk else -(-n // chunk) * chunk


def walk_chunk(slots: int, chunk: int = KV_CHUNK) -> int:
    """The chunk size that the walk uses over a cache of ``slots``: small chunks for a cache of up to one
    chunk that they tile (as :func:`cache_slots` allocates it), else the whole of such a cache; whole
    chunks for a longer one, which they must tile."""
    small = min(SMALL_CHUNK, chunk)
    if slots <= small:
        return slots
    if slots <= chunk:
        return small if slots % small == 0 else slots
    if slots % chunk == 0:
        return chunk
    raise ValueError(f"a KV cache of {slots} slots does not tile into chunks of {chunk}; allocate "
                     f"cache_slots(n) slots")


def cached_attention(q_bthd, k_lbksd, v_lbksd, layer, limit_bt, extra_k_bekd=None, extra_v_bekd=None, *,
                     start_bt=None, extra_valid_be=None, implementation: str = "auto", kv_chunk: int = KV_CHUNK,
                     q_chunk: int = Q_CHUNK, first_row=None):
    """Attention of ``T`` queries over layer ``layer`` of a KV cache ``[L, B, K, S, D]``.

    Query ``(b, t)`` sees the cache slots ``start[b, t] <= s < limit[b, t]`` (``start`` 0 unless given:
    a sliding window's first visible slot) and the ``E`` extra keys (when given: all of them, or those
    where ``extra_valid_be`` ``[B, E]`` holds). ``layer`` may be traced
    (a scan over layers). Returns ``[B, T, H, D]`` in the query dtype. A windowed call (``start``) is
    walked by the chunked path, whatever the implementation: the Pallas GPU kernels assume that every
    query sees the slots from 0. ``first_row`` (traced, or None): the queries' ``B`` rows are the cache's
    rows ``first_row .. first_row + B - 1`` (a row view, as a refilled slot's prefill reads one row of a
    batch's cache); such a call is walked by the chunked path or dense, never a Pallas GPU kernel."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation in ("auto", "cudnn"):  # "cudnn" has a kernel for fresh prefills only: the rest as "auto"
        implementation = auto_cached(q_bthd.shape[0], q_bthd.shape[1], q_bthd.shape[2], k_lbksd.shape[3])
    if implementation == "dense":  # "pallas_tpu" has a kernel for fresh prefills only: here chunked
        return dense_cached(q_bthd, k_lbksd, v_lbksd, layer, limit_bt, extra_k_bekd, extra_v_bekd, start_bt,
                            extra_valid_be, first_row)
    if implementation in ("pallas_gpu", "split_gpu", "pallas_tpu"):
        kernels.check_pallas_backend(implementation)
    b, t, h, d = q_bthd.shape
    kv_heads, s = k_lbksd.shape[2:4]
    chunk = walk_chunk(s, kv_chunk)
    q = q_bthd.reshape(b, t, kv_heads, h // kv_heads, d)
    extra = None if extra_k_bekd is None else (extra_k_bekd, extra_v_bekd)
    small = min(SMALL_CHUNK, chunk)
    tail = small if chunk % small == 0 else chunk  # a short filled tail in small chunks (see walk_cache)
    walk = functools.partial(walk_cache, k_lbksd=k_lbksd, v_lbksd=v_lbksd, layer=layer, chunk=chunk, extra=extra,
                             extra_valid=extra_valid_be, tail_chunk=tail, first_row=first_row)
    use_kernel = t <= PALLAS_GPU_MAX_T and start_bt is None and first_row is None
    plan = kernels.decode_kernel_plan(s, d) if use_kernel and implementation == "pallas_gpu" else None
    if plan is not None:
        return kernels.decode_kernel_cached(q, limit_bt, k_lbksd, v_lbksd, layer, plan, walk).astype(q_bthd.dtype)
    split = kernels.pallas_op("split_gpu") if use_kernel and implementation == "split_gpu" else None
    plan = None if split is None else split.split_plan(b, kv_heads, t * (h // kv_heads), s, d)
    if plan is not None:
        return split.split_cached(q, limit_bt, k_lbksd, v_lbksd, layer, plan, extra,
                                  extra_valid_be).astype(q_bthd.dtype)
    start = jnp.zeros_like(limit_bt) if start_bt is None else jnp.broadcast_to(start_bt, limit_bt.shape)
    if b > 1 and t <= ROW_WALK_MAX_T and first_row is None and chunk < s:
        # decode, verify and draft over a cache of several chunks: each row reads its own filled chunks
        return walk_rows(q, limit_bt, k_lbksd=k_lbksd, v_lbksd=v_lbksd, layer=layer, chunk=tail, extra=extra,
                         extra_valid=extra_valid_be, lo_b=None if start_bt is None else start).astype(q_bthd.dtype)
    walk_from = (lambda q_, limit_, start_: walk(q_, limit_)) if start_bt is None else (
        lambda q_, limit_, start_: walk(q_, limit_, lo_b=start_))
    qc = min(q_chunk, t)
    if t <= qc:
        out = walk_from(q, limit_bt, start)
    else:  # chunks of queries, each walking only the cache chunks it can see
        n = -(-t // qc)
        pad = n * qc - t
        q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
        limit = jnp.pad(limit_bt, ((0, 0), (0, pad)))
        start = jnp.pad(start, ((0, 0), (0, pad)))
        q_n = q.reshape(b, n, qc, *q.shape[2:]).swapaxes(0, 1)
        limit_n = limit.reshape(b, n, qc).swapaxes(0, 1)
        start_n = start.reshape(b, n, qc).swapaxes(0, 1)
        out = jax.lax.map(lambda args: walk_from(*args), (q_n, limit_n, start_n))  # [N, B, Qc, H, D]
        out = out.swapaxes(0, 1).reshape(b, n * qc, h, d)[:, :t]
    return out.astype(q_bthd.dtype)


def fresh_attention(q_bthd, k_btkd, v_btkd, implementation: str = "cudnn"):
    """Causal attention of ``T`` new tokens over their own keys only: the prefill of an empty cache, where
    query ``t`` sees keys ``0..t`` (right-padded rows: the outputs at padding positions are never used).

    ``implementation``: ``"cudnn"`` (``jax.nn.dot_product_attention``'s flash attention on NVIDIA GPUs;
    bfloat16 or float16), ``"xla"`` (the same function's dense ``T x T`` scores: tests on any backend)
    or ``"pallas_tpu"`` (Pallas splash attention on TPUs; interpret mode elsewhere, see
    :func:`pallas_interpret`)."""
    if implementation == "pallas_tpu":
        kernels.check_pallas_backend(implementation)
        return kernels.splash_fresh(q_bthd, k_btkd, v_btkd)
    if implementation == "cudnn":
        if jax.default_backend() != "gpu":
            raise ValueError(f"attention='cudnn' needs an NVIDIA GPU (JAX's backend here is "
                             f"{jax.default_backend()!r}); use attention='auto' or 'chunked'")
        if q_bthd.dtype not in (jnp.bfloat16, jnp.float16):
            raise ValueError(f"attention='cudnn' needs bfloat16 or float16 activations, got {q_bthd.dtype}; "
                             f"load the model in bfloat16 or use attention='chunked'")
    out = jax.nn.dot_product_attention(q_bthd, k_btkd.astype(q_bthd.dtype), v_btkd.astype(q_bthd.dtype),
                                       is_causal=True, implementation=implementation)
    return out.astype(q_bthd.dtype)
