"""Attention: one interface for target prefill, verification, plain decoding and drafting.

Shape letters used across the library:

    B  batch rows                      T  query tokens of this call (prompt, block or 1)
    S  KV-cache slots (max_len)        L  layers
    H  query heads                     K  KV heads (H = K * G)
    G  query heads per KV head         D  head dim (``d``: model width)
    C  cache slots per chunk           E  extra keys attended next to the cache (the drafter's block)
    V  vocabulary

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

``implementation`` chooses the backend: ``"chunked"`` (the JAX path above; every backend),
``"dense"`` (the reference over the whole cache; for tests and tiny caches), ``"cudnn"`` (the prefill of
an empty cache through cuDNN's flash attention, ``jax.nn.dot_product_attention``: NVIDIA GPUs, bfloat16
or float16; every other call, decode, verify and draft, stays chunked: see :func:`fresh_attention`) or
``"auto"`` (``"chunked"`` for now: the cuDNN path has not yet run on a GPU in this project, and
``scripts/device_check.sh`` checks and times it when one is at hand). The score and softmax arithmetic
is float32 whatever the cache dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("auto", "chunked", "dense", "cudnn")
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
    if implementation == "dense":  # "cudnn" applies to fresh prefills only (fresh_attention); here it is chunked
        return _dense_cached(q_bthd, k_lbskd, v_lbskd, layer, limit_bt, extra_k_bekd, extra_v_bekd)
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

    ``implementation`` is ``jax.nn.dot_product_attention``'s: ``"cudnn"`` (flash attention on NVIDIA
    GPUs; bfloat16 or float16) or ``"xla"`` (dense scores ``T x T``: tests on any backend)."""
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


def _walk_cache(q_btkgd, limit_bt, *, k_lbskd, v_lbskd, layer, chunk, extra):
    """Online softmax over the extra keys, then over cache chunks ``0 .. ceil(max(limit) / C) - 1``."""
    b, t, kv, g, d = q_btkgd.shape
    m = jnp.full((b, kv, g, t), _NEG, jnp.float32)
    l = jnp.zeros((b, kv, g, t), jnp.float32)
    acc = jnp.zeros((b, kv, g, t, d), jnp.float32)
    state = (m, l, acc)
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
        visible = (start + jnp.arange(chunk))[None, None, :] < limit_bt[:, :, None]  # [B, T, C]
        return _online_update(state, scores, visible, v_c)

    n_chunks = (jnp.max(limit_bt) + chunk - 1) // chunk
    m, l, acc = jax.lax.fori_loop(0, n_chunks, one_chunk, state)
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
