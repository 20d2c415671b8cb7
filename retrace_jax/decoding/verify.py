"""Verification: how many proposals the target accepts (greedy, by rejection sampling, or by the
official DFlash rule of matching the target's own samples), and which tokens a round commits."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def accepted_count(proposals_bj, target_bw):
    """``a[b]``: the number of leading proposals that equal the target's own choice.

    ``proposals[b, k]`` is the drafter's token for block slot ``k + 1``; ``target[b, k]`` is the target's
    token after slot ``k`` (so it is compared with the proposal at slot ``k + 1``). Shapes ``[B, J]`` with
    ``J = W - 1 = block_size - 1``; ``0 <= a <= J``.
    """
    k = proposals_bj.shape[1]
    match = proposals_bj == target_bw[:, :k]
    return jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def committed_tokens(proposals_bj, target_bt, a_b):
    """The ``a + 1`` tokens a round commits, padded to ``[B, W]``: ``proposals[:a]`` then ``target[a]``.

    ``target_bt`` has ``W`` columns (the target's choice after every block slot).
    """
    b, k = proposals_bj.shape
    slot = jnp.arange(k + 1)[None, :]
    padded = jnp.concatenate([proposals_bj, jnp.zeros((b, 1), proposals_bj.dtype)], axis=1)
    return jnp.where(slot < a_b[:, None], padded, target_bt).astype(jnp.int32)


def _sample_rows(keys_b, logp_bv):
    return jax.vmap(jax.random.categorical)(keys_b, logp_bv).astype(jnp.int32)


def rejection_sample(keys_b, proposals_bj, target_logp_bwv, draft_logp_bjv=None):
    """Speculative sampling: ``(a, next_token)`` whose tokens follow the target's distribution exactly.

    ``target_logp[b, k]`` is the target's (filtered) distribution for the token after block slot ``k``
    (``W`` slots); proposal ``k`` is the drafter's token for slot ``k + 1``. With ``draft_logp``
    (proposals drawn from q), proposal ``x`` is accepted with probability ``min(1, p(x) / q(x))`` and a
    rejection resamples from ``max(p - q, 0)``; without it the draft distribution is one-hot (argmax
    proposals): accept with ``p(x)``, resample from ``p`` with ``x`` removed. After ``J`` acceptances the
    bonus token is drawn from ``p`` of the last slot. ``keys_b`` holds one key per row.
    """
    b, k = proposals_bj.shape
    keys = jax.vmap(lambda key: jax.random.split(key, 2))(keys_b)  # [B, 2, 2]
    p_x = jnp.exp(jnp.take_along_axis(target_logp_bwv[:, :k], proposals_bj[..., None], -1)[..., 0])
    if draft_logp_bjv is None:
        ratio = p_x
    else:
        q_x = jnp.exp(jnp.take_along_axis(draft_logp_bjv, proposals_bj[..., None], -1)[..., 0])
        ratio = jnp.minimum(1.0, p_x / jnp.maximum(q_x, 1e-30))
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(keys[:, 0])
    a = jnp.sum(jnp.cumprod((u < ratio).astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)

    rows = jnp.arange(b)
    p_a = jnp.exp(target_logp_bwv[rows, a])  # [B, V]
    slot = jnp.minimum(a, k - 1)
    if draft_logp_bjv is None:
        rejected = jax.nn.one_hot(proposals_bj[rows, slot], p_a.shape[-1], dtype=p_a.dtype)
        residual = p_a * (1.0 - rejected)
    else:
        residual = jnp.maximum(p_a - jnp.exp(draft_logp_bjv[rows, slot]), 0.0)
    residual = jnp.where((a < k)[:, None], residual, p_a)  # all accepted: the bonus comes from p
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_a)
    return a, _sample_rows(keys[:, 1], jnp.log(residual))


def target_sample_match(keys_b, proposals_bj, target_logp_bwv):
    """The official DFlash rule at T > 0: ``(a, tokens [B, W])``, of which the first ``a + 1`` commit.

    The target draws its own token ``y[k]`` from ``target_logp[b, k]`` at every block slot (independent
    draws, one key each from the row's key), proposals (the drafter's argmax) are accepted while
    ``proposal[k] == y[k]``, and the round commits the accepted proposals then ``y[a]``: exactly the
    tokens ``y[:a + 1]``. Lossless: each committed token is a draw from the target's distribution given
    the tokens before it. For a fixed proposal ``x`` a slot accepts with probability ``p(x)`` and on a
    mismatch commits ``y ~ p`` conditioned on ``y != x``, which is ``p`` without ``x``, renormalised: the
    same law as the one-hot rejection rule (:func:`rejection_sample` without ``draft_logp``), for the
    acceptance lengths as for the tokens; only the use of the random stream differs.
    """
    j = target_logp_bwv.shape[1]
    keys_bw = jax.vmap(lambda key: jax.random.split(key, j))(keys_b)  # [B, W, 2]
    sampled_bw = jax.vmap(_sample_rows)(keys_bw, target_logp_bwv)
    a = accepted_count(proposals_bj, sampled_bw)
    return a, committed_tokens(proposals_bj, sampled_bw, a)
