"""Greedy verification: how many proposals the target accepts, and which tokens a round commits."""

from __future__ import annotations

import jax.numpy as jnp


def accepted_count(proposals_bk, target_bk):
    """``a[b]``: the number of leading proposals that equal the target's own choice.

    ``proposals[b, k]`` is the drafter's token for block slot ``k + 1``; ``target[b, k]`` is the target's
    token after slot ``k`` (so it is compared with the proposal at slot ``k + 1``). Shapes ``[B, K]`` with
    ``K = block_size - 1``; ``0 <= a <= K``.
    """
    k = proposals_bk.shape[1]
    match = proposals_bk == target_bk[:, :k]
    return jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def committed_tokens(proposals_bk, target_bt, a_b):
    """The ``a + 1`` tokens a round commits, padded to ``[B, K + 1]``: ``proposals[:a]`` then ``target[a]``.

    ``target_bt`` has ``K + 1`` columns (the target's choice after every block slot).
    """
    b, k = proposals_bk.shape
    slot = jnp.arange(k + 1)[None, :]
    padded = jnp.concatenate([proposals_bk, jnp.zeros((b, 1), proposals_bk.dtype)], axis=1)
    return jnp.where(slot < a_b[:, None], padded, target_bt).astype(jnp.int32)
