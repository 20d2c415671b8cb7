"""ReTrace training: the two-round on-policy rollout of ``docs/retrace.md`` in fixed shapes.

Round 1 drafts every anchored block as DFlash does (no memory) and counts ``a``, the leading proposals
that match the sequence (the target's own response, so a match is an acceptance). The verify signal
is the frozen target run on the drafted block (``verify``: what inference sees) or the teacher-forced
target states (``teacher``). Round 2 re-anchors at ``s' = s + a + 1`` with the memory shifted exactly as
at inference, fuses it with weight ``beta`` and is trained on the next block's labels.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from retrace_jax.dflash_loss import (LossMetrics, batch_sharded, block_loss, block_visibility, build_blocks,
                                     default_gamma, draft_blocks, sequence_context)
from retrace_jax.drafter import DFlashDrafter
from retrace_jax.retrace import Memory, shift_memory
from retrace_jax.target import TargetModel, forward_beside_context
from retrace_jax.verify import accepted_count

CORRECTION_SOURCES = ("verify", "teacher")


class Rollout(NamedTuple):
    round1: LossMetrics
    round2: LossMetrics
    accepted_ba: jax.Array  # [B, A] a of round 1
    memory: Memory  # [B, A*K, ...] the memory fused into round 2
    hidden2_btd: jax.Array  # [B, A*K, d] round-2 drafter states
    anchors2_ba: jax.Array
    valid2_ba: jax.Array


def verify_blocks(target: TargetModel, seq_cache, blocks_bak, anchors_ba):
    """The target's final-norm states of drafted blocks ``[B, A, K, d]``: block ``i`` sits at positions
    ``anchor_i + 0..K-1``, sees the sequence strictly before its anchor and its own earlier slots."""
    b, a, k = blocks_bak.shape
    mask = block_visibility(anchors_ba, seq_cache.max_len, k, causal=True)
    positions = (anchors_ba[:, :, None] + jnp.arange(k)).reshape(b, a * k)
    hidden = forward_beside_context(target, blocks_bak.reshape(b, a * k), positions, seq_cache, mask)
    return batch_sharded(hidden).reshape(b, a, k, -1)


def retrace_rollout(drafter: DFlashDrafter, target: TargetModel, tokens_bs, loss_mask_bs, anchors_ba, valid_ba,
                    beta, correction_source: str = "verify", gamma: float | None = None, remat: bool = False,
                    memory_dtype=None) -> Rollout:
    """The two-round rollout. The memory carried into round 2 is detached (no gradient flows into round
    1 through it); ``memory_dtype`` (e.g. ``"float16"``) stores it rounded to that type."""
    if correction_source not in CORRECTION_SOURCES:
        raise ValueError(f"correction_source must be one of {CORRECTION_SOURCES}, got {correction_source!r}")
    cfg = drafter.cfg
    k = cfg.block_size
    gamma = default_gamma(k) if gamma is None else gamma
    b, s = tokens_bs.shape
    a_count = anchors_ba.shape[1]
    seq = target(tokens_bs, target.init_cache(b, s), feature_layers=cfg.target_layer_ids)
    seq = jax.lax.stop_gradient(seq)
    ctx_kv = sequence_context(drafter, seq.features)

    # Round 1: DFlash drafting, no memory.
    blocks1 = build_blocks(tokens_bs, loss_mask_bs, anchors_ba, valid_ba, k, cfg.mask_token_id, gamma)
    hidden1 = draft_blocks(drafter, target, ctx_kv, blocks1, remat=remat)
    logits1 = batch_sharded(target.logits(hidden1))
    round1 = block_loss(logits1, blocks1)
    proposals = jnp.argmax(logits1[:, :, 1:], -1).astype(jnp.int32)  # [B, A, K-1]
    # A proposal is accepted when it equals the sequence token, as long as that token is a real label.
    labelled = blocks1.weights_bak[:, :, 1:] > 0
    truth = jnp.where(labelled, blocks1.labels_bak[:, :, 1:], -1)
    accepted = accepted_count(proposals.reshape(-1, k - 1), truth.reshape(-1, k - 1)).reshape(b, a_count)

    # The target states that scored the round-1 proposals.
    if correction_source == "verify":
        drafted = jnp.concatenate([blocks1.labels_bak[:, :, :1], proposals], axis=-1)
        target_states = verify_blocks(target, seq.cache, drafted, anchors_ba)
    else:
        idx = jnp.minimum(blocks1.positions_bak, s - 1).reshape(b, -1)
        target_states = jnp.take_along_axis(seq.hidden, idx[..., None], axis=1).reshape(b, a_count, k, -1)
    memory = shift_memory(hidden1.reshape(b * a_count, k, -1),
                          target_states.reshape(b * a_count, k, -1).astype(hidden1.dtype), accepted.reshape(-1))
    memory = jax.tree.map(lambda x: x.reshape((b, a_count * k) + x.shape[2:]), memory)
    if memory_dtype is not None:  # stored in memory_dtype, used in the compute dtype
        memory = memory.replace(mem_d=memory.mem_d.astype(memory_dtype).astype(memory.mem_d.dtype),
                                mem_t=memory.mem_t.astype(memory_dtype).astype(memory.mem_t.dtype))

    # Round 2: re-anchored after the accepted prefix and its correction token.
    anchors2 = anchors_ba + accepted + 1
    valid2 = valid_ba & (anchors2 < s)
    anchors2 = jnp.minimum(anchors2, s - 1)
    blocks2 = build_blocks(tokens_bs, loss_mask_bs, anchors2, valid2, k, cfg.mask_token_id, gamma)
    memory = memory.replace(valid=memory.valid & jnp.repeat(valid2, k, axis=1))
    hidden2 = draft_blocks(drafter, target, ctx_kv, blocks2, memory, beta, remat=remat)
    round2 = block_loss(batch_sharded(target.logits(hidden2)), blocks2)
    return Rollout(round1, round2, accepted, memory, hidden2.reshape(b, a_count * k, -1), anchors2, valid2)


def retrace_loss(drafter, target, tokens_bs, loss_mask_bs, anchors_ba, valid_ba, beta, *, round1_weight=1.0,
                 correction_source="verify", gamma=None, remat=False, memory_dtype=None):
    """Round-2 loss plus ``round1_weight`` times the round-1 (DFlash) loss; metrics of both rounds."""
    r = retrace_rollout(drafter, target, tokens_bs, loss_mask_bs, anchors_ba, valid_ba, beta, correction_source,
                        gamma, remat, memory_dtype)
    return r.round2.loss + round1_weight * r.round1.loss, r
