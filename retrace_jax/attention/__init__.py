"""Attention: one interface for target prefill, verification, plain decoding and drafting.

Shape letters used across the library:

    B  batch rows                      T  query tokens of this call (prompt, block or 1)
    S  KV-cache slots (max_len)        L  layers
    H  query heads                     K  KV heads (H = K * G)
    G  query heads per KV head         D  head dim (``d``: model width)
    C  cache slots per chunk           E  extra keys attended next to the cache (the drafter's block)
    V  vocabulary                      U  draft vocabulary (``retrace_jax/models/draft_vocab.py``)

Two implementations share one meaning:

- :func:`reference_attention`: dense scores over every key with an explicit mask ``[B, T, S]``. It is
  the definition that the tests compare everything against, and training uses it (its masks are
  arbitrary and its sequences short).
- :func:`cached_attention`: queries over a fixed-size KV cache ``[L, B, S, K, D]`` in which query
  ``(b, t)`` sees the slots ``s < limit[b, t]`` (and, optionally, ``E`` extra keys that every query
  sees). It walks the cache in chunks of ``C`` slots only up to the batch's largest limit, with an
  online softmax (flash-decoding), so decode, verify and draft cost grows with the filled length, not
  with ``S``; long query sequences (prefill) are split into chunks of queries as well, each walking
  only the chunks it can see, so memory grows with the chunk sizes, not with the prompt squared.
  Nothing of size ``S`` is materialised and the cache is only read, by slices.

``implementation`` chooses the backend:

- ``"chunked"``: the JAX path above; every backend.
- ``"dense"``: the reference over the whole cache; for tests and tiny caches.
- ``"cudnn"``: the prefill of an empty cache through cuDNN's flash attention,
  ``jax.nn.dot_product_attention`` (NVIDIA GPUs, bfloat16 or float16); every other call (decode, verify,
  draft) stays chunked: see :func:`fresh_attention`.
- ``"pallas_gpu"``: decode, verify and draft calls (at most :data:`PALLAS_GPU_MAX_T` queries per row)
  through JAX's Pallas GPU decode kernel (``jax.experimental.pallas.ops.gpu.decode_attention.gqa``,
  flash-decoding with per-row lengths), over the slots that every query of a row sees; the few slots
  that only some of them see (a verify block's own keys) and the extra keys are merged in by the chunked
  walk, through the kernel's softmax residuals. Prefill, caches whose slot count does not split into the
  kernel's blocks and head dims that are not a power of two from 16 stay chunked: see
  :func:`_decode_kernel_plan`. The kernel reads a contiguous ``[B, S, K, D]`` layer, so each call copies
  its layer of the cache (a transposed slice) before the kernel walks the filled part.
- ``"pallas_tpu"``: the prefill of an empty cache through JAX's Pallas TPU splash attention
  (``jax.experimental.pallas.ops.tpu.splash_attention``, causal mask, one kernel per KV head); every
  other call stays chunked. JAX's TPU paged and ragged paged attention kernels are not used: the ragged
  one does not run in interpret mode on CPU (jax 0.10.2), so it could not be tested here, and the paged
  one computes in bfloat16 over a head-major page layout.
- ``"auto"``: ``"chunked"`` for now. None of the kernels has run on a GPU or TPU in this project yet;
  ``scripts/device_check.sh`` checks and times them when one is at hand.

The Pallas kernels run on their device only, unless :data:`PALLAS_INTERPRET` is set: then they run in
Pallas' interpret mode on any backend (slow; the CPU tests compare them with the reference that way).
The kernels are imported when first used, so a JAX without them fails with a clear error at that call,
never at ``import retrace_jax``. The score and softmax arithmetic is float32 whatever the cache dtype
(the Pallas GPU kernel's matmuls use the device's default precision).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("auto", "chunked", "dense", "cudnn", "pallas_gpu", "pallas_tpu")
FRESH_KERNELS = ("cudnn", "pallas_tpu")  # implementations with their own empty-cache prefill (fresh_attention)
PALLAS_INTERPRET = False  # True: run the Pallas kernels in interpret mode on any backend (slow; for tests)
PALLAS_GPU_MAX_T = 64  # queries per row up to which "pallas_gpu" uses the decode kernel (decode, verify, draft)
KV_CHUNK = 512  # cache slots per chunk; caches longer than this are allocated in multiples of it
Q_CHUNK = 512  # queries per chunk (prefill)
_NEG = -1e30  # finite "minus infinity": fully masked chunks stay NaN-free


def cache_slots(n: int, chunk: int = KV_CHUNK) -> int:
    """The number of slots to allocate for ``n`` positions: ``n`` itself up to one chunk, else the next
    multiple of the chunk (so that the chunked walk tiles the cache exactly)."""
    return n if n <= chunk else -(-n // chunk) * chunk


def reference_attention(q_bthd, k_bskd, v_bskd, mask_bts):
    """Grouped-query attention of ``T`` queries over ``S`` keys; ``mask[b, t, s]`` marks visible keys.

    Scores and softmax run in float32; the probabilities are cast to the value dtype (as transformers
    does) and the output has the query dtype."""
    b, t, h, d = q_bthd.shape
    kv_heads = k_bskd.shape[2]
    q = q_bthd.reshape(b, t, kv_heads, h // kv_heads, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k_bskd, preferred_element_type=jnp.float32) * (d**-0.5)
    scores = jnp.where(mask_bts[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bskd.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_bskd)
    return out.reshape(b, t, h, d).astype(q_bthd.dtype)


def attention_beside_context(q_bthd, k_btkd, v_btkd, ctx_k_bskd, ctx_v_bskd, mask_bt_st):
    """Reference attention over a fixed context followed by the new tokens' own keys: ``mask[:, :, :S]``
    covers the context, ``mask[:, :, S:]`` the new tokens (training's block drafting and verification)."""
    keys = jnp.concatenate([ctx_k_bskd, k_btkd.astype(ctx_k_bskd.dtype)], axis=1)
    values = jnp.concatenate([ctx_v_bskd, v_btkd.astype(ctx_v_bskd.dtype)], axis=1)
    return reference_attention(q_bthd, keys, values, mask_bt_st)


def cached_attention(q_bthd, k_lbskd, v_lbskd, layer, limit_bt, extra_k_bekd=None, extra_v_bekd=None, *,
                     implementation: str = "auto", kv_chunk: int = KV_CHUNK, q_chunk: int = Q_CHUNK):
    """Attention of ``T`` queries over layer ``layer`` of a KV cache ``[L, B, S, K, D]``.

    Query ``(b, t)`` sees the cache slots ``s < limit[b, t]`` and all ``E`` extra keys (when given).
    ``layer`` may be traced (a scan over layers). Returns ``[B, T, H, D]`` in the query dtype."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "dense":  # "cudnn" and "pallas_tpu" have kernels for fresh prefills only; here chunked
        return _dense_cached(q_bthd, k_lbskd, v_lbskd, layer, limit_bt, extra_k_bekd, extra_v_bekd)
    if implementation in ("pallas_gpu", "pallas_tpu"):
        _check_pallas_backend(implementation)
    b, t, h, d = q_bthd.shape
    s = k_lbskd.shape[2]
    chunk = min(kv_chunk, s)
    if s % chunk:
        raise ValueError(f"a KV cache of {s} slots does not tile into chunks of {chunk}; allocate "
                         f"cache_slots(n) slots")
    kv_heads = k_lbskd.shape[3]
    q = q_bthd.reshape(b, t, kv_heads, h // kv_heads, d)
    extra = None if extra_k_bekd is None else (extra_k_bekd, extra_v_bekd)
    walk = functools.partial(_walk_cache, k_lbskd=k_lbskd, v_lbskd=v_lbskd, layer=layer, chunk=chunk, extra=extra)
    plan = _decode_kernel_plan(s, d) if implementation == "pallas_gpu" and t <= PALLAS_GPU_MAX_T else None
    if plan is not None:
        return _decode_kernel_cached(q, limit_bt, k_lbskd, v_lbskd, layer, plan, walk).astype(q_bthd.dtype)
    qc = min(q_chunk, t)
    if t <= qc:
        out = walk(q, limit_bt)
    else:  # chunks of queries, each walking only the cache chunks it can see
        n = -(-t // qc)
        pad = n * qc - t
        q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
        limit = jnp.pad(limit_bt, ((0, 0), (0, pad)))
        q_n = q.reshape(b, n, qc, *q.shape[2:]).swapaxes(0, 1)
        limit_n = limit.reshape(b, n, qc).swapaxes(0, 1)
        out = jax.lax.map(lambda args: walk(*args), (q_n, limit_n))  # [N, B, Qc, H, D]
        out = out.swapaxes(0, 1).reshape(b, n * qc, h, d)[:, :t]
    return out.astype(q_bthd.dtype)


def fresh_attention(q_bthd, k_btkd, v_btkd, implementation: str = "cudnn"):
    """Causal attention of ``T`` new tokens over their own keys only: the prefill of an empty cache, where
    query ``t`` sees keys ``0..t`` (right-padded rows: the outputs at padding positions are never used).

    ``implementation``: ``"cudnn"`` (``jax.nn.dot_product_attention``'s flash attention on NVIDIA GPUs;
    bfloat16 or float16), ``"xla"`` (the same function's dense ``T x T`` scores: tests on any backend)
    or ``"pallas_tpu"`` (Pallas splash attention on TPUs; interpret mode elsewhere, see
    :data:`PALLAS_INTERPRET`)."""
    if implementation == "pallas_tpu":
        _check_pallas_backend(implementation)
        return _splash_fresh(q_bthd, k_btkd, v_btkd)
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


_PALLAS_BACKENDS = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}


def _check_pallas_backend(implementation: str) -> None:
    backend = _PALLAS_BACKENDS[implementation]
    if jax.default_backend() != backend and not PALLAS_INTERPRET:
        raise ValueError(f"attention={implementation!r} needs a {backend.upper()} (JAX's backend here is "
                         f"{jax.default_backend()!r}); use attention='auto' or 'chunked', or set "
                         f"retrace_jax.attention.PALLAS_INTERPRET = True to run the kernel in Pallas' "
                         f"interpret mode (slow; for tests)")


def _pallas_op(module: str):
    """Imports ``jax.experimental.pallas.ops.<module>`` when a kernel is first used, with a clear error
    where this JAX does not ship it."""
    import importlib

    name = f"jax.experimental.pallas.ops.{module}"
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise RuntimeError(f"this attention implementation needs {name}, which JAX {jax.__version__} does not "
                           f"provide ({e}); use attention='auto' or 'chunked'") from e


def _decode_kernel_plan(s: int, d: int) -> tuple[int, int] | None:
    """``(k_splits, block_k)`` for the Pallas GPU decode kernel over ``S`` slots, or None where the call
    stays chunked: the kernel splits the slots into ``k_splits`` parts walked in parallel, each in blocks
    of ``block_k >= 16`` slots, and its tiles need a power-of-two head dim of at least 16."""
    if d < 16 or d & (d - 1):
        return None
    for block_k in (64, 32, 16):
        for k_splits in (16, 8, 4, 2, 1):
            if s % (k_splits * block_k) == 0:
                return k_splits, block_k
    return None


def _decode_kernel_cached(q_btkgd, limit_bt, k_lbskd, v_lbskd, layer, plan, walk):
    """The Pallas GPU decode kernel over the slots ``s < min_t limit[b, t]`` that every query of row ``b``
    sees (all ``T * G`` queries of a KV head go through the kernel as one head group), then the chunked
    walk over the extra keys and the slots ``min_t limit[b, t] <= s < limit[b, t]``, continuing the
    kernel's online softmax from its residuals (row maximum and sum)."""
    b, t, kv, g, d = q_btkgd.shape
    k_splits, block_k = plan
    lo_b = jnp.min(limit_bt, axis=1)
    k = jax.lax.dynamic_index_in_dim(k_lbskd, layer, 0, keepdims=False).astype(q_btkgd.dtype)
    v = jax.lax.dynamic_index_in_dim(v_lbskd, layer, 0, keepdims=False).astype(q_btkgd.dtype)
    q_bhd = q_btkgd.transpose(0, 2, 1, 3, 4).reshape(b, kv * t * g, d)  # head (k, t, g): one group per KV head
    decode = _pallas_op("gpu.decode_attention")
    o_bhd, (l_bh, m_bh) = decode.gqa(q_bhd, k, v, kv_seq_len=lo_b, block_k=block_k, k_splits=k_splits,
                                     return_residuals=True, interpret=PALLAS_INTERPRET)
    m = m_bh.reshape(b, kv, t, g).transpose(0, 1, 3, 2)  # [B, K, G, T]
    l = l_bh.reshape(b, kv, t, g).transpose(0, 1, 3, 2)
    o = o_bhd.reshape(b, kv, t, g, d).transpose(0, 1, 3, 2, 4).astype(jnp.float32)  # [B, K, G, T, D]
    return walk(q_btkgd, limit_bt, lo_b=lo_b, state=(m, l, o * l[..., None]))


def _splash_fresh(q_bthd, k_btkd, v_btkd):
    """Causal prefill through Pallas TPU splash attention: one MQA kernel per (row, KV head) with its
    ``G`` query heads. ``T`` is padded up to the block size (128, or 512 where it divides): padding keys
    come after every real query, so the causal mask hides them and the real outputs are exact."""
    splash = _pallas_op("tpu.splash_attention")
    b, t, h, d = q_bthd.shape
    kv = k_btkd.shape[2]
    g = h // kv
    padded = -(-t // 128) * 128
    blk = 512 if padded % 512 == 0 else 128
    pad = ((0, 0), (0, padded - t), (0, 0), (0, 0))
    q = jnp.pad(q_bthd.astype(jnp.float32) * d**-0.5, pad).astype(q_bthd.dtype)
    k = jnp.pad(k_btkd.astype(q_bthd.dtype), pad)
    v = jnp.pad(v_btkd.astype(q_bthd.dtype), pad)
    mask = splash.MultiHeadMask([splash.CausalMask((padded, padded))] * g)
    sizes = splash.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk)
    kernel = splash.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=PALLAS_INTERPRET)
    q_bkgtd = q.reshape(b, padded, kv, g, d).transpose(0, 2, 3, 1, 4)
    k_bktd, v_bktd = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    out = jax.vmap(jax.vmap(kernel))(q_bkgtd, k_bktd, v_bktd)  # [B, K, G, T', D]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, padded, h, d)[:, :t].astype(q_bthd.dtype)


def _walk_cache(q_btkgd, limit_bt, *, k_lbskd, v_lbskd, layer, chunk, extra, lo_b=None, state=None):
    """Online softmax over the extra keys, then over the cache chunks that hold visible slots: query
    ``(b, t)`` sees the slots ``lo[b] <= s < limit[b, t]`` (``lo`` 0 unless given), so the walk covers
    chunks ``floor(min(lo) / C) .. ceil(max(limit) / C) - 1``. ``state`` continues a softmax already
    started (``(m, l, acc)``, ``[B, K, G, T]`` and ``[B, K, G, T, D]``; empty by default)."""
    b, t, kv, g, d = q_btkgd.shape
    if state is None:
        state = (jnp.full((b, kv, g, t), _NEG, jnp.float32), jnp.zeros((b, kv, g, t), jnp.float32),
                 jnp.zeros((b, kv, g, t, d), jnp.float32))
    if extra is not None:
        k_e, v_e = extra
        scores = jnp.einsum("btkgd,bekd->bkgte", q_btkgd, k_e.astype(q_btkgd.dtype),
                            preferred_element_type=jnp.float32) * d**-0.5
        state = _online_update(state, scores, jnp.ones((b, t, k_e.shape[1]), bool), v_e)

    def one_chunk(j, state):
        start = j * chunk
        k_c = jax.lax.dynamic_slice_in_dim(jax.lax.dynamic_index_in_dim(k_lbskd, layer, 0, keepdims=False),
                                           start, chunk, axis=1)
        v_c = jax.lax.dynamic_slice_in_dim(jax.lax.dynamic_index_in_dim(v_lbskd, layer, 0, keepdims=False),
                                           start, chunk, axis=1)
        scores = jnp.einsum("btkgd,bckd->bkgtc", q_btkgd, k_c.astype(q_btkgd.dtype),
                            preferred_element_type=jnp.float32) * d**-0.5
        slots = (start + jnp.arange(chunk))[None, None, :]
        visible = slots < limit_bt[:, :, None]  # [B, T, C]
        if lo_b is not None:
            visible &= slots >= lo_b[:, None, None]
        return _online_update(state, scores, visible, v_c)

    n_chunks = (jnp.max(limit_bt) + chunk - 1) // chunk
    first = 0
    if lo_b is not None:  # nothing left past lo (decode, draft): walk no chunk at all
        first = jnp.min(lo_b) // chunk
        n_chunks = jnp.where(jnp.any(limit_bt > lo_b[:, None]), n_chunks, first)
    _, l, acc = jax.lax.fori_loop(first, n_chunks, one_chunk, state)
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # [B, K, G, T, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, kv * g, d)


def _online_update(state, scores_bkgtc, visible_btc, v_bckd):
    m, l, acc = state
    visible = visible_btc[:, None, None]
    scores = jnp.where(visible, scores_bkgtc, _NEG)
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    p = jnp.where(visible, jnp.exp(scores - m_new[..., None]), 0.0)
    scale = jnp.exp(m - m_new)
    l = l * scale + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkgtc,bckd->bkgtd", p.astype(v_bckd.dtype), v_bckd, preferred_element_type=jnp.float32)
    return m_new, l, acc * scale[..., None] + pv


def _dense_cached(q_bthd, k_lbskd, v_lbskd, layer, limit_bt, extra_k, extra_v):
    s = k_lbskd.shape[2]
    k = jax.lax.dynamic_index_in_dim(k_lbskd, layer, 0, keepdims=False)
    v = jax.lax.dynamic_index_in_dim(v_lbskd, layer, 0, keepdims=False)
    mask = jnp.arange(s)[None, None, :] < limit_bt[:, :, None]
    if extra_k is None:
        return reference_attention(q_bthd, k, v, mask)
    b, t = limit_bt.shape
    mask = jnp.concatenate([mask, jnp.ones((b, t, extra_k.shape[1]), bool)], axis=-1)
    return attention_beside_context(q_bthd, extra_k, extra_v, k, v, mask)
