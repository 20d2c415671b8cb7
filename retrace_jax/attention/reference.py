"""The reference: dense scores over every key with an explicit mask. It is the definition that the tests
compare every other path against; training uses it (its masks are arbitrary and its sequences short).
Shape letters: :mod:`retrace_jax.attention`."""

from __future__ import annotations

import jax
import jax.numpy as jnp


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


def dense_cached(q_bthd, k_lbksd, v_lbksd, layer, limit_bt, extra_k, extra_v, start_bt=None, extra_valid_be=None,
                 first_row=None):
    """``cached_attention``'s meaning through the reference: every slot of layer ``layer`` scored, those
    ``s >= limit[b, t]`` (and ``s < start[b, t]`` when given) masked, the extra keys visible to every
    query (those where ``extra_valid_be`` holds, when given). ``first_row``: the queries' rows are the
    cache's rows from there (a row view)."""
    s = k_lbksd.shape[3]
    k, v = (jax.lax.dynamic_index_in_dim(buf, layer, 0, keepdims=False).swapaxes(1, 2) for buf in (k_lbksd, v_lbksd))
    if first_row is not None:
        k, v = (jax.lax.dynamic_slice_in_dim(x, first_row, q_bthd.shape[0], 0) for x in (k, v))
    mask = jnp.arange(s)[None, None, :] < limit_bt[:, :, None]
    if start_bt is not None:
        mask &= jnp.arange(s)[None, None, :] >= jnp.broadcast_to(start_bt, limit_bt.shape)[:, :, None]
    if extra_k is None:
        return reference_attention(q_bthd, k, v, mask)
    b, t = limit_bt.shape
    extra = (jnp.ones((b, t, extra_k.shape[1]), bool) if extra_valid_be is None
             else jnp.broadcast_to(extra_valid_be[:, None, :], (b, t, extra_k.shape[1])))
    mask = jnp.concatenate([mask, extra], axis=-1)
    return attention_beside_context(q_bthd, extra_k, extra_v, k, v, mask)
