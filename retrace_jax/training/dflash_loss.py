"""The DFlash training objective: many anchored blocks per sequence, each drafted in one pass.

Block ``i`` is ``[x[anchor_i], MASK, ...]`` at positions ``anchor_i + 0..W-1``. It sees the target
features of positions strictly before its anchor and its own block (bidirectionally), never another
block. Slot ``k`` is labelled ``x[anchor_i + k]``; loss weights ``exp(-(k-1)/gamma)`` times the loss mask
(the published rule), or one of the other :data:`SLOT_WEIGHTS` rules (:func:`adaptive_weights`).

With ``train.distill_topk`` (k > 0) a slot's label is soft as well: the target's next-token distribution
at the position before it (the one that predicted ``x[anchor_i + k]``), over the drafter's head vocabulary,
cut to its top k and renormalised (:func:`teacher_top_k`). Shape letter ``Z``: the k entries.
"""

from __future__ import annotations

import contextvars
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from retrace_jax.decoding.sampling import largest_k
from retrace_jax.models.draft_vocab import (
    DraftHead,
    draft_head,
    head_logits,
    to_draft_index,
    to_target_ids,
    vocab_head,
)
from retrace_jax.models.drafter import DFlashDrafter
from retrace_jax.models.target import TargetModel

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
# How the drafted slots of a block weigh in the loss: "gamma" exp(-(k-1)/gamma) (the DFlash paper's);
# "uniform" 1; "reach" the probability that slots 1..k-1 are all right (a first-error focus: the slot where
# the chain breaks now gets the weight); "expected_length" the gradient of log E[accepted length] (the
# direction D-PACE, arXiv 2605.18810, follows): slot k weighs the share of the expected length that slots
# k.. bring. The last two come from the drafter's own label probabilities, without gradient.
SLOT_WEIGHTS = ("gamma", "uniform", "reach", "expected_length")


def default_gamma(block_size: int) -> float:
    """The published loss-decay constants (7 for B=16, 5 for B=10, 4 for B=8), else B/2 - 1."""
    return DEFAULT_GAMMA.get(block_size, max(1.0, block_size / 2 - 1))


def sample_anchors(key, loss_mask_bs, num_anchors: int, block_size: int):
    """Up to ``num_anchors`` distinct anchors per row among response positions ``p <= S - block_size``.

    Returns ``anchors [B, A]`` (sorted) and ``valid [B, A]`` (False where a row has fewer candidates).
    """
    b, s = loss_mask_bs.shape
    pos = jnp.arange(s)
    candidate = loss_mask_bs.astype(bool) & (pos <= s - block_size)[None, :]
    scores = jnp.where(candidate, jax.random.uniform(key, (b, s)), -1.0)
    top, idx = jax.lax.top_k(scores, num_anchors)
    valid = top >= 0.0
    order = jnp.argsort(jnp.where(valid, idx, s), axis=1)
    return jnp.take_along_axis(idx, order, 1).astype(jnp.int32), jnp.take_along_axis(valid, order, 1)


class BlockBatch(NamedTuple):
    tokens_baw: jax.Array  # [B, A, W] block inputs: x[anchor], then MASK
    positions_baw: jax.Array  # [B, A, W]
    labels_baw: jax.Array  # [B, A, W] x[anchor + k]
    weights_baw: jax.Array  # [B, A, W] loss weight (0 for slot 0, padding and non-response labels)
    mask_bt_st: jax.Array  # [B, A*W, S + A*W] attention visibility


def build_blocks(tokens_bs, loss_mask_bs, anchors_ba, valid_ba, block_size: int, mask_token_id: int,
                 gamma: float) -> BlockBatch:
    b, s = tokens_bs.shape
    a = anchors_ba.shape[1]
    k = jnp.arange(block_size)
    positions = anchors_ba[:, :, None] + k  # [B, A, W]
    inside = positions < s
    safe = jnp.minimum(positions, s - 1).reshape(b, -1)
    labels = jnp.take_along_axis(tokens_bs, safe, 1).reshape(b, a, block_size)
    label_mask = jnp.take_along_axis(loss_mask_bs, safe, 1).reshape(b, a, block_size).astype(bool)
    slot_weight = jnp.where(k >= 1, jnp.exp(-(k - 1.0) / gamma), 0.0)
    weights = slot_weight * (inside & label_mask & valid_ba[:, :, None])
    inputs = jnp.where(k == 0, labels, mask_token_id)
    return BlockBatch(inputs, positions, labels, weights, block_visibility(anchors_ba, s, block_size, causal=False))


def block_visibility(anchors_ba, seq_len: int, block_size: int, causal: bool):
    """``[B, A*W, S + A*W]``: each block slot sees the sequence strictly before its block's anchor and
    its own block (all of it, or with ``causal`` only the slots up to itself), never another block."""
    b, a = anchors_ba.shape
    t = a * block_size
    anchor_t = jnp.repeat(anchors_ba, block_size, axis=1)  # [B, T]
    ctx = jnp.arange(seq_len)[None, None, :] < anchor_t[:, :, None]  # [B, T, S]
    block_id = jnp.repeat(jnp.arange(a), block_size)
    own = block_id[:, None] == block_id[None, :]
    if causal:
        slot = jnp.tile(jnp.arange(block_size), a)
        own = own & (slot[None, :] <= slot[:, None])
    return jnp.concatenate([ctx, jnp.broadcast_to(own, (b, t, t))], axis=-1)


TRAIN_MESH: contextvars.ContextVar = contextvars.ContextVar("retrace_jax_train_mesh", default=None)


def batch_sharded(x):
    """Keeps an activation's leading batch dimension on the mesh's batch axes while a train step is traced
    with ``TRAIN_MESH`` set (otherwise unchanged). Without it, XLA may gather activations to match
    weights sharded over ``fsdp`` instead of gathering the weights."""
    mesh = TRAIN_MESH.get()
    if mesh is None:
        return x
    axes = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1)
    if not axes or x.shape[0] % math.prod(mesh.shape[a] for a in axes):
        return x
    spec = jax.sharding.PartitionSpec(axes, *([None] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))


def target_forward(target: TargetModel, tokens_bs, layer_ids):
    """The frozen target's final-norm states ``[B, S, d]`` and features ``[B, S, F]`` of every position (no
    gradient)."""
    b, s = tokens_bs.shape
    out = target(tokens_bs, target.init_cache(b, s), feature_layers=tuple(layer_ids))
    return jax.lax.stop_gradient(out.hidden), batch_sharded(jax.lax.stop_gradient(out.features))


def target_features(target: TargetModel, tokens_bs, layer_ids):
    """The frozen target's features of every position (no gradient)."""
    return target_forward(target, tokens_bs, layer_ids)[1]


# The most teacher logits (:func:`teacher_top_k`) held at once: 2^24 float32 values, 64 MiB.
TEACHER_LOGITS = 1 << 24


class TeacherTopK(NamedTuple):
    """``train.distill_topk``'s soft labels (:func:`teacher_top_k`)."""

    ids: jax.Array  # [..., Z] int32: head-vocabulary indices (draft-vocabulary ones, or token ids without one)
    probs: jax.Array  # [..., Z] float32: their probabilities, renormalised over the Z


def teacher_top_k(target: TargetModel, head: DraftHead | None, hidden, k: int) -> TeacherTopK:
    """The target's ``k`` most likely next tokens after the final-norm states ``hidden [..., d]`` among the
    head vocabulary of ``head`` (:func:`~retrace_jax.models.draft_vocab.draft_head`; None: the whole
    vocabulary), and their probabilities renormalised over the ``k`` (a softmax of those logits alone: the
    vocabulary's normaliser is never computed). The LM head runs over the head vocabulary only, over at
    most :data:`TEACHER_LOGITS` logits at a time (positions in sequence, ``lax.map``): a store pass over
    8 x 576 positions of the whole 151,936-token vocabulary would otherwise hold 2.8 GB of logits."""
    lead, d = hidden.shape[:-1], hidden.shape[-1]
    vocab = target.cfg.vocab_size if head is None else head.weight_du.shape[-1]
    flat = jax.lax.stop_gradient(hidden).reshape(-1, d)

    def top(h_nd):
        return largest_k(head_logits(target, head, h_nd).astype(jnp.float32), k)

    chunk = max(1, TEACHER_LOGITS // vocab)
    values, ids = top(flat) if flat.shape[0] <= chunk else jax.lax.map(top, flat, batch_size=chunk)
    return TeacherTopK(ids.reshape(*lead, k), jax.nn.softmax(values, -1).reshape(*lead, k))


def before_labels(x_bs, positions_baw):
    """``x [B, S, ...]`` at the position before each drafted slot's label, ``[B, A, J, ...]``: slot ``k``
    (label ``x[anchor + k]``) takes position ``anchor + k - 1``, whose target state predicted its label
    (clipped to the sequence; a slot past its end has no weight)."""
    b, a, w = positions_baw.shape
    idx = jnp.minimum(positions_baw[:, :, :-1], x_bs.shape[1] - 1).reshape(b, -1)
    idx = idx.reshape(idx.shape + (1,) * (x_bs.ndim - 2))
    return jnp.take_along_axis(x_bs, idx, axis=1).reshape(b, a, w - 1, *x_bs.shape[2:])


def features_fn(target: TargetModel, layer_ids, top_k: int = 0, head_ids=None):
    """A jitted ``tokens [B, S] -> features [B, S, F]`` of the frozen ``target`` (:func:`target_features`),
    its weights an argument of the program rather than constants compiled into it. With ``top_k``
    (``train.distill_topk``) the same pass gives the target's :func:`teacher_top_k` at every position too:
    ``(features, ids [B, S, Z], probs [B, S, Z])``, over the head vocabulary of the token ids ``head_ids``
    (a draft vocabulary's; None: the whole vocabulary)."""
    graphdef, state = nnx.split(target)

    def run(st, tokens_bs):
        model = nnx.merge(graphdef, st)
        if not top_k:
            return target_features(model, tokens_bs, layer_ids)
        hidden, features = target_forward(model, tokens_bs, layer_ids)
        head = None if head_ids is None else vocab_head(model, jnp.asarray(head_ids, jnp.int32))
        return features, *teacher_top_k(model, head, hidden, top_k)

    fn = jax.jit(run)
    return lambda tokens_bs: fn(state, tokens_bs)


def sequence_context(drafter: DFlashDrafter, features_bsf):
    """The drafter's per-layer context keys/values of every sequence position."""
    b, s, _ = features_bsf.shape
    return drafter.context_kv(features_bsf, jnp.broadcast_to(jnp.arange(s), (b, s)))


def draft_blocks(drafter: DFlashDrafter, target: TargetModel, ctx_kv, blocks: BlockBatch, memory=None, beta=1.0,
                 remat=False):
    """Drafter final-norm hidden states of every block slot ``[B, A, W, d]``. A ReTrace ``memory``
    ``[B, A*W, ...]`` is fused into the block embeddings first, or (fusion "keys") its target features
    become extra keys that each block's slots see for their own block, where valid."""
    b, a, k = blocks.tokens_baw.shape
    emb = batch_sharded(target.embed(blocks.tokens_baw.reshape(b, a * k)).astype(drafter.dtype))
    positions = blocks.positions_baw.reshape(b, a * k)
    extra = {}
    if memory is not None and drafter.cfg.retrace.fusion == "keys":
        mem_kv, mem_positions = drafter.memory_kv(memory, positions)
        own = blocks.mask_bt_st[:, :, -a * k:]  # [B, T, A*W]: each slot's own block (the drafter's is whole)
        mask = jnp.concatenate([blocks.mask_bt_st, own & memory.valid[:, None, :]], axis=-1)
        extra = dict(memory_kv=mem_kv, memory_positions_be=mem_positions)
    else:
        mask = blocks.mask_bt_st
        if memory is not None:
            emb = batch_sharded(drafter.retrace(emb, memory, beta))
    hidden = drafter.forward(emb, positions, ctx_kv, mask, remat=remat, **extra)
    return batch_sharded(hidden).reshape(b, a, k, -1)


class LossMetrics(NamedTuple):
    loss: jax.Array
    slot_accuracy: jax.Array  # [W]: top-1 accuracy per block slot (slot 0 is the given token)
    tau: jax.Array  # mean over blocks of 1 + leading correct slots: the acceptance length they imply


def adaptive_weights(ce_baj, counted_baj, rule: str):
    """Slot weights ``[B, A, J]`` of the ``reach`` and ``expected_length`` rules (:data:`SLOT_WEIGHTS`)
    from the cross-entropies of the labels (``p_k = exp(-ce_k)``, 0 where not ``counted``), without
    gradient. With ``P_k = p_1 ... p_k`` and ``S_k = P_k + ... + P_J``: reach ``w_k = P_{k-1}``
    (``w_1 = 1``); expected length ``w_k = S_k / S_1``, so that ``sum_k w_k ce_k`` has the gradient of
    ``-log E[accepted length]`` (``E = S_1``; ``w_1 = 1``). ``S_k / S_1`` does not depend on ``p_1``: it is
    computed as ``T_k / T_1`` with ``Q_k = p_2 ... p_k`` (``Q_1 = 1``) and ``T_k = Q_k + ... + Q_J``, which
    no small ``p_1`` can underflow. A block whose first slot is not counted weighs nothing."""
    p = jnp.where(counted_baj, jnp.exp(-jax.lax.stop_gradient(ce_baj)), 0.0)
    if rule == "reach":
        return jnp.concatenate([jnp.ones_like(p[..., :1]), jnp.cumprod(p, axis=-1)[..., :-1]], axis=-1) * counted_baj
    if rule == "expected_length":
        q = jnp.cumprod(jnp.concatenate([jnp.ones_like(p[..., :1]), p[..., 1:]], axis=-1), axis=-1)  # Q_k
        tail = jnp.flip(jnp.cumsum(jnp.flip(q, -1), -1), -1)  # T_k; T_1 >= 1
        return tail / tail[..., :1] * counted_baj * counted_baj[..., :1]
    raise ValueError(f"adaptive slot weights are 'reach' or 'expected_length', got {rule!r}")


def slot_loss(logits_bajv, labels_baj, weights_baj, slot_weights: str = "gamma", teacher: TeacherTopK | None = None,
              distill_weight: float = 1.0) -> LossMetrics:
    """Loss and metrics of the drafted slots ``1..W-1`` of each block (``J = W - 1``; the given slot 0
    has no loss). A label ``-1`` is a token outside the draft vocabulary: its slot counts as wrong and
    adds no loss (no logit can score it). ``slot_weights`` "reach" or "expected_length" replace the given
    weights where they are positive by :func:`adaptive_weights`. ``teacher`` (``[B, A, J, Z]``,
    ``train.distill_topk``): a slot's loss becomes ``(1 - distill_weight) * hard + distill_weight * soft``,
    ``soft = -sum_i p_i log q(i)`` the cross-entropy of the drafter's ``q`` against the teacher's ``p``. The
    slots that count, their weights and the metrics stay those of the hard labels."""
    learnable = labels_baj >= 0
    logits = logits_bajv.astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels_baj, 0))
    w = weights_baj
    if slot_weights in ("reach", "expected_length"):
        w = adaptive_weights(ce, (weights_baj > 0) & learnable, slot_weights)
    if teacher is not None:
        soft = -jnp.sum(teacher.probs * jnp.take_along_axis(jax.nn.log_softmax(logits), teacher.ids, -1), -1)
        ce = (1 - distill_weight) * ce + distill_weight * soft
    loss = jnp.sum(ce * w * learnable) / jnp.maximum(jnp.sum(w * learnable), 1e-6)
    counted = w > 0
    correct = (jnp.argmax(logits_bajv, -1) == labels_baj) & counted
    slot_acc = jnp.sum(correct, (0, 1)) / jnp.maximum(jnp.sum(counted, (0, 1)), 1)
    # Leading run of correct slots (a slot without a label ends the run).
    lead = jnp.sum(jnp.cumprod(correct.astype(jnp.int32), axis=-1), -1)
    block_valid = counted[:, :, 0]
    tau = jnp.sum((1 + lead) * block_valid) / jnp.maximum(jnp.sum(block_valid), 1)
    return LossMetrics(loss, jnp.concatenate([jnp.zeros((1,), slot_acc.dtype), slot_acc]), tau)


def block_loss(logits_bawv, blocks: BlockBatch) -> LossMetrics:
    """:func:`slot_loss` of full-vocabulary logits of every slot (slot 0 included and ignored)."""
    return slot_loss(logits_bawv[:, :, 1:], blocks.labels_baw[:, :, 1:], blocks.weights_baw[:, :, 1:])


def score_blocks(target: TargetModel, head: DraftHead | None, hidden_bawd, blocks: BlockBatch, mix=None,
                 slot_weights: str = "gamma", teacher: TeacherTopK | None = None, distill_weight: float = 1.0):
    """The loss metrics of drafted blocks and their proposals ``[B, A, J]`` (the argmax of each slot, as
    target token ids). The LM head runs on the drafted slots only, over the draft vocabulary of ``head``
    (:func:`~retrace_jax.models.draft_vocab.draft_head`; None: the whole vocabulary). ``mix(logits,
    hidden)`` (ReTrace's output mixture) turns the slots' logits into the log-probabilities they draft from.
    ``teacher``, ``distill_weight``: the soft labels of the drafted slots (:func:`slot_loss`)."""
    logits = batch_sharded(head_logits(target, head, hidden_bawd[:, :, 1:]))
    if mix is not None:
        logits = batch_sharded(mix(logits, hidden_bawd[:, :, 1:]))
    labels = to_draft_index(head, blocks.labels_baw[:, :, 1:], target.cfg.vocab_size)
    metrics = slot_loss(logits, labels, blocks.weights_baw[:, :, 1:], slot_weights, teacher, distill_weight)
    return metrics, to_target_ids(head, jnp.argmax(logits, -1).astype(jnp.int32))


def dflash_loss(drafter: DFlashDrafter, target: TargetModel, tokens_bs, loss_mask_bs, anchors_ba, valid_ba,
                gamma: float | None = None, remat: bool = False, features_bsf=None,
                slot_weights: str = "gamma", distill_topk: int = 0, distill_weight: float = 1.0,
                teacher_bsz: TeacherTopK | None = None) -> LossMetrics:
    """The DFlash loss; the target features are computed here unless precomputed ones are given.
    ``slot_weights``: one of :data:`SLOT_WEIGHTS` (``gamma`` applies only to "gamma"). ``distill_topk``
    (k > 0): the slots learn the target's top-k as well (:func:`slot_loss`, mixed in by ``distill_weight``),
    taken from the same target pass as the features, or with precomputed features from ``teacher_bsz``, the
    top-k of every position (:func:`features_fn`)."""
    cfg = drafter.cfg
    if slot_weights not in SLOT_WEIGHTS:
        raise ValueError(f"slot_weights must be one of {SLOT_WEIGHTS}, got {slot_weights!r}")
    gamma = default_gamma(cfg.block_size) if gamma is None else gamma
    gamma = gamma if slot_weights == "gamma" else float("inf")  # the others start from weight 1 everywhere
    blocks = build_blocks(tokens_bs, loss_mask_bs, anchors_ba, valid_ba, cfg.block_size, cfg.mask_token_id, gamma)
    head, teacher = draft_head(target, drafter), None
    if features_bsf is None:
        states, features = target_forward(target, tokens_bs, cfg.target_layer_ids)
        if distill_topk:
            teacher = teacher_top_k(target, head, before_labels(states, blocks.positions_baw), distill_topk)
    else:
        features = jax.lax.stop_gradient(features_bsf)
        if distill_topk:
            if teacher_bsz is None or teacher_bsz.ids.shape[-1] != distill_topk:
                raise ValueError(f"distill_topk {distill_topk} with precomputed features needs the target's top "
                                 f"{distill_topk} of every position (teacher_bsz)")
            teacher = jax.tree.map(lambda x: before_labels(jax.lax.stop_gradient(x), blocks.positions_baw),
                                   teacher_bsz)
    hidden = draft_blocks(drafter, target, sequence_context(drafter, features), blocks, remat=remat)
    return score_blocks(target, head, hidden, blocks, slot_weights=slot_weights, teacher=teacher,
                        distill_weight=distill_weight)[0]
