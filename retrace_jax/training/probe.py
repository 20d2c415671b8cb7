"""Teacher-forced acceptance of a drafter on regenerated sequences: what a recipe probe measures.

For a greedy target, the sequence ``prompt + the target's greedy response`` holds exactly the tokens a
speculative round would be checked against: a round whose block starts at response position ``p`` (slot 0
holds ``x[p]``, the last committed token) accepts the leading slots ``k = 1, 2, ...`` whose proposal equals
``x[p + k]``, and its drafter reads the target's features of positions ``< p``, the same features a
teacher-forced forward pass gives. So drafting a block at an anchor ``p`` of such a sequence, in one pass
of the drafter and without the target, gives that round's acceptance (up to floating-point rounding of the
features, which the verify pass computes in other shapes). Drafting at many anchors of many sequences
gives the per-slot acceptance and the τ of a block size at the cost of drafter passes alone, which makes
short training probes comparable lever by lever.

Anchors are spread evenly over each response, each one with its whole block inside the response (a block
that runs past the response's end would be cut short as a real generation's last round is, which would
mix the generation length into the measure). Real decoding starts rounds where the previous round's
acceptance leaves it, so its τ weights response positions a little differently: the drafters that ship
are measured by real decoding (``benchmarks/speculative_eval.py``) as well.

Shape letters as elsewhere (``retrace_jax/attention/``): ``B`` sequences, ``S`` positions, ``A`` anchors,
``W`` block slots, ``J = W - 1`` drafted slots, ``F`` feature width.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from retrace_jax.models.draft_vocab import draft_head
from retrace_jax.training.data import spread_indices
from retrace_jax.training.dflash_loss import build_blocks, draft_blocks, score_blocks, sequence_context


def acceptance_anchors(loss_mask_bs: np.ndarray, block_size: int, max_anchors: int) -> tuple[np.ndarray, np.ndarray]:
    """``anchors [B, A]`` and ``valid [B, A]`` (``A = max_anchors``): up to ``max_anchors`` positions per
    row, evenly spread over those whose whole block (``block_size`` positions) lies in the response."""
    if block_size < 2 or max_anchors < 1:
        raise ValueError(f"need block_size >= 2 and max_anchors >= 1, got {block_size} and {max_anchors}")
    mask = np.asarray(loss_mask_bs).astype(bool)
    b, s = mask.shape
    anchors = np.zeros((b, max_anchors), np.int32)
    valid = np.zeros((b, max_anchors), bool)
    # whole[p]: positions p .. p + W - 1 are all response positions
    run = np.zeros((b, s + 1), np.int64)
    run[:, 1:] = np.cumsum(mask, axis=1)
    for row in range(b):
        starts = np.arange(0, s - block_size + 1)
        whole = starts[run[row, starts + block_size] - run[row, starts] == block_size]
        if len(whole) == 0:
            continue
        pick = whole[spread_indices(len(whole), max_anchors)]
        anchors[row, : len(pick)] = pick
        valid[row, : len(pick)] = True
    return anchors, valid


@nnx.jit(static_argnames=("block_size",))
def block_acceptance(drafter, target, tokens_bs, loss_mask_bs, features_bsf, anchors_ba, valid_ba, block_size: int):
    """``[B, A, J]``: whether the drafter's proposal at each drafted slot of the block at each anchor
    equals the sequence's token there (False at invalid anchors), the block drafted at ``block_size``
    whatever the drafter was trained at, from the given target features (ReTrace drafters: their DFlash
    path, without memory)."""
    blocks = build_blocks(tokens_bs, loss_mask_bs, anchors_ba, valid_ba, block_size, drafter.cfg.mask_token_id, 1.0)
    hidden = draft_blocks(drafter, target, sequence_context(drafter, features_bsf.astype(drafter.dtype)), blocks)
    _, proposals = score_blocks(target, draft_head(target, drafter), hidden, blocks)
    return (proposals == blocks.labels_baw[:, :, 1:]) & (blocks.weights_baw[:, :, 1:] > 0)


class Acceptance(NamedTuple):
    """What the anchored blocks of a set of sequences accept, at one block size."""

    tau: np.ndarray  # [B]: each sequence's mean over its anchors of 1 + the leading accepted slots
    blocks: np.ndarray  # [B]: anchors counted per sequence
    slot_acceptance: np.ndarray  # [J]: P(slot k accepted | slots < k accepted), pooled over all blocks
    slot_reached: np.ndarray  # [J]: blocks that reached slot k (its acceptance's denominator)


def acceptance_stats(correct_baj: np.ndarray, valid_ba: np.ndarray) -> Acceptance:
    """Per-sequence τ and pooled conditional slot acceptance of ``correct [B, A, J]`` at ``valid [B, A]``
    anchors. A sequence without anchors has τ NaN (left out of means by the caller)."""
    correct = np.asarray(correct_baj, bool) & np.asarray(valid_ba, bool)[:, :, None]
    valid = np.asarray(valid_ba, bool)
    prefix = np.cumprod(correct, axis=-1)  # [B, A, J]: slots 1..k all accepted
    lead = prefix.sum(-1)  # [B, A]
    counted = valid.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        tau = np.where(counted > 0, ((1 + lead) * valid).sum(1) / counted, np.nan)
    reached = np.concatenate([[valid.sum()], prefix[:, :, :-1].sum((0, 1))])  # blocks with slots < k accepted
    accepted = prefix.sum((0, 1))
    with np.errstate(invalid="ignore", divide="ignore"):
        slot = np.where(reached > 0, accepted / np.maximum(reached, 1), np.nan)
    return Acceptance(tau, counted, slot, reached)


def in_padded_batches(fn, arrays, batch_size: int) -> np.ndarray:
    """``fn(*batch)`` over ``arrays`` (each ``[N, ...]``) ``batch_size`` rows at a time, every batch of one
    shape (the last one padded with zero rows, so one program serves all), the results concatenated
    (``[N, ...]`` on the host)."""
    n = len(arrays[0])
    parts = []
    for i in range(0, n, batch_size):
        rows = min(batch_size, n - i)

        def padded(x):
            x = np.asarray(x[i : i + rows])
            pad = batch_size - rows
            return np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)]) if pad else x

        parts.append(np.asarray(jax.device_get(fn(*(jnp.asarray(padded(x)) for x in arrays))))[:rows])
    return np.concatenate(parts)


def teacher_forced_acceptance(drafter, target, tokens_bs, loss_mask_bs, features_bsf, block_size: int,
                              max_anchors: int, batch_size: int = 8) -> Acceptance:
    """:func:`acceptance_stats` of the blocks at up to ``max_anchors`` anchors per sequence
    (:func:`acceptance_anchors`), drafted ``batch_size`` sequences at a time. ``features_bsf``: the
    target's features at the drafter's layers for every position (``[B, S, F]``, host or device)."""
    tokens_bs, loss_mask_bs = np.asarray(tokens_bs, np.int32), np.asarray(loss_mask_bs, np.int32)
    anchors, valid = acceptance_anchors(loss_mask_bs, block_size, max_anchors)
    correct = in_padded_batches(
        lambda *batch: block_acceptance(drafter, target, *batch, block_size),
        (tokens_bs, loss_mask_bs, features_bsf, anchors, valid), batch_size)
    return acceptance_stats(correct, valid)
