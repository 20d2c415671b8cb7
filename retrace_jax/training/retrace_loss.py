"""ReTrace training: the R-round on-policy rollout of ``docs/retrace.md`` in fixed shapes.

Round 1 drafts every anchored block as DFlash does (no memory) and counts ``a``, the leading proposals
that match the sequence (the target's own response, so a match is an acceptance). The verify signal
is the frozen target run on the drafted block (``verify``: what inference sees) or the teacher-forced
target states (``teacher``). Round ``k + 1`` re-anchors at ``s' = s + a + 1`` with round ``k``'s rejected
suffix as its memory, shifted exactly as at inference, fuses it with weight ``beta`` and is trained on
that block's labels; its own (memory-conditioned) rejected suffix is the memory of round ``k + 2``, as
at inference. Two rounds (``rounds=2``) is the minimum: one memory-free round, one with memory.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from retrace_jax.decoding.verify import accepted_count
from retrace_jax.models.draft_vocab import draft_head, to_draft_index
from retrace_jax.models.drafter import DFlashDrafter
from retrace_jax.models.retrace import Memory, shift_memory, stale_top_k, token_hints
from retrace_jax.models.target import TargetModel, forward_beside_context
from retrace_jax.training.dflash_loss import (
    LossMetrics,
    batch_sharded,
    block_visibility,
    build_blocks,
    default_gamma,
    draft_blocks,
    score_blocks,
    sequence_context,
)

CORRECTION_SOURCES = ("verify", "teacher")
DEFAULT_ROUNDS = 4


class Rollout(NamedTuple):
    """Everything of the R rounds, one tuple entry per round (round 1 first)."""

    rounds: tuple[LossMetrics, ...]
    accepted: tuple[jax.Array, ...]  # [B, A] a of each round
    anchors: tuple[jax.Array, ...]  # [B, A] each round's anchors (clipped into the sequence)
    valid: tuple[jax.Array, ...]  # [B, A] each round's valid blocks (a round past the sequence is not)
    memories: tuple[Memory, ...]  # [B, A*W, ...] the memory fused into rounds 2..R (one fewer entry)
    hidden: tuple[jax.Array, ...]  # [B, A*W, d] each round's drafter states

    # Shorthands for rounds 1 and 2, the names of two-round training (the step's metrics read round1).
    round1 = property(lambda self: self.rounds[0])
    round2 = property(lambda self: self.rounds[1])
    accepted_ba = property(lambda self: self.accepted[0])  # a of round 1
    memory = property(lambda self: self.memories[0])  # the memory fused into round 2
    hidden2_btd = property(lambda self: self.hidden[1])
    anchors2_ba = property(lambda self: self.anchors[1])
    valid2_ba = property(lambda self: self.valid[1])


def loss_weights(rounds: int = DEFAULT_ROUNDS, weights=None, round1_weight=None) -> tuple[float, ...]:
    """The loss weight of each round: ``weights`` (one per round), or ``round1_weight`` for round 1 and
    1.0 for every later round (the meaning of ``round1_weight`` in two-round training); not both."""
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 2:
        raise ValueError(f"rounds must be an integer >= 2 (one memory-free round, then rounds with memory), "
                         f"got {rounds!r}")
    if weights is not None and round1_weight is not None:
        raise ValueError("give round_weights or round1_weight, not both (round1_weight means "
                         "round_weights [round1_weight, 1.0, ...])")
    if weights is None:
        return (1.0 if round1_weight is None else float(round1_weight),) + (1.0,) * (rounds - 1)
    weights = tuple(weights)
    if len(weights) != rounds:
        raise ValueError(f"round_weights needs one weight per round ({rounds}), got {list(weights)!r}")
    return tuple(float(w) for w in weights)


def verify_blocks(target: TargetModel, seq_cache, blocks_baw, anchors_ba, feature_layers=()):
    """The target's final-norm states of drafted blocks ``[B, A, W, d]``: block ``i`` sits at positions
    ``anchor_i + 0..W-1``, sees the sequence strictly before its anchor and its own earlier slots. With
    ``feature_layers``, also their features ``[B, A, W, F]``."""
    b, a, k = blocks_baw.shape
    mask = block_visibility(anchors_ba, seq_cache.max_len, k, causal=True)
    positions = (anchors_ba[:, :, None] + jnp.arange(k)).reshape(b, a * k)
    out = forward_beside_context(target, blocks_baw.reshape(b, a * k), positions, seq_cache, mask, feature_layers)
    if feature_layers:
        return tuple(batch_sharded(x).reshape(b, a, k, -1) for x in out)
    return batch_sharded(out).reshape(b, a, k, -1)


class MemoryTraining(NamedTuple):
    """Options of the rollout that decide what the memory is trained on (all off by default: the
    paper's rollout).

    - ``dropout``: the probability that a block's memory is dropped in a round after the first (the
      block then drafts as DFlash would), drawn from ``key``; the drafter must stay good without the
      memory, so what the memory adds is its own.
    - ``miss_weight``: slots that the same round's memory-off draft gets wrong weigh ``1 + miss_weight``
      in the loss (a second, gradient-free draft of each later round without its memory).
    """

    dropout: float = 0.0
    miss_weight: float = 0.0
    key: jax.Array | None = None

    def check(self):
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout <= 1.0):
            raise ValueError(f"memory dropout must be a probability in [0, 1], got {self.dropout!r}")
        if not (isinstance(self.miss_weight, (int, float)) and 0.0 <= self.miss_weight < float("inf")):
            raise ValueError(f"miss_weight must be a number >= 0, got {self.miss_weight!r}")


def retrace_rollout(drafter: DFlashDrafter, target: TargetModel, tokens_bs, loss_mask_bs, anchors_ba, valid_ba,
                    beta, correction_source: str = "verify", gamma: float | None = None, remat: bool = False,
                    memory_dtype=None, *, rounds: int = DEFAULT_ROUNDS,
                    memory_training: MemoryTraining = MemoryTraining()) -> Rollout:
    """The ``rounds``-round rollout from the sampled anchors. Each memory carried into the next round is
    detached (no gradient flows into a round through it); ``memory_dtype`` (e.g. ``"float16"``) stores
    it rounded to that type. Blocks whose anchor runs past the sequence are invalid from then on.
    ``memory_training``: see :class:`MemoryTraining`."""
    if correction_source not in CORRECTION_SOURCES:
        raise ValueError(f"correction_source must be one of {CORRECTION_SOURCES}, got {correction_source!r}")
    loss_weights(rounds)  # checks rounds
    mt = memory_training
    mt.check()
    if mt.dropout > 0 and mt.key is None:
        raise ValueError("memory dropout needs a random key")
    cfg = drafter.cfg
    k = cfg.block_size
    gamma = default_gamma(k) if gamma is None else gamma
    b, s = tokens_bs.shape
    a_count = anchors_ba.shape[1]
    seq = target(tokens_bs, target.init_cache(b, s), feature_layers=cfg.target_layer_ids)
    seq = jax.lax.stop_gradient(seq)
    ctx_kv = sequence_context(drafter, seq.features)
    head = draft_head(target, drafter)

    metrics, accepted_all, anchors_all, valid_all, memories, hiddens = [], [], [], [], [], []
    anchors, valid, memory, accepted = anchors_ba, valid_ba, None, None  # accepted: set by each round
    for r in range(rounds):
        if r > 0:  # re-anchored after the accepted prefix and its correction token
            anchors = anchors + accepted + 1
            valid = valid & (anchors < s)
            anchors = jnp.minimum(anchors, s - 1)
            keep = valid
            if mt.dropout > 0:
                keep = keep & jax.random.bernoulli(jax.random.fold_in(mt.key, r), 1.0 - mt.dropout, valid.shape)
            memory = memory.replace(valid=memory.valid & jnp.repeat(keep, k, axis=1))
            memories.append(memory)
        blocks = build_blocks(tokens_bs, loss_mask_bs, anchors, valid, k, cfg.mask_token_id, gamma)
        if r > 0 and mt.miss_weight > 0:  # weigh up the slots that this round's memory-off draft gets wrong
            off = jax.lax.stop_gradient(draft_blocks(drafter, target, ctx_kv, blocks, None, beta))
            missed = score_blocks(target, head, off, blocks)[1] != blocks.labels_baw[:, :, 1:]
            scale = jnp.concatenate([jnp.ones_like(anchors, jnp.float32)[..., None], 1.0 + mt.miss_weight * missed], -1)
            blocks = blocks._replace(weights_baw=blocks.weights_baw * scale)
        hidden = draft_blocks(drafter, target, ctx_kv, blocks, memory, beta, remat=remat)
        mix = None
        if memory is not None and cfg.retrace.mixture == "target":  # the proposals mix in the stale target
            def mix(logits, slots, memory=memory):
                per_block = lambda x: x.reshape((b * a_count, -1) + x.shape[3:])  # noqa: E731
                mem = jax.tree.map(lambda x: x.reshape((b * a_count, k) + x.shape[2:]), memory)
                return drafter.retrace.mix(per_block(logits), per_block(slots), mem).reshape(logits.shape)
        m, proposals = score_blocks(target, head, hidden, blocks, mix)  # proposals [B, A, J]
        metrics.append(m)
        # A proposal is accepted when it equals the sequence token, as long as that token is a real label.
        labelled = blocks.weights_baw[:, :, 1:] > 0
        truth = jnp.where(labelled, blocks.labels_baw[:, :, 1:], -1)
        accepted = accepted_count(proposals.reshape(-1, k - 1), truth.reshape(-1, k - 1)).reshape(b, a_count)
        accepted_all.append(accepted)
        anchors_all.append(anchors)
        valid_all.append(valid)
        hiddens.append(hidden.reshape(b, a_count * k, -1))
        if r == rounds - 1:
            break
        # The target states that scored this round's proposals, and the next round's memory.
        keys_fusion = cfg.retrace is not None and cfg.retrace.fusion == "keys"
        if correction_source == "verify":
            drafted = jnp.concatenate([blocks.labels_baw[:, :, :1], proposals], axis=-1)
            if keys_fusion:  # the memory keeps the target's features; the agreed rule reads its states
                target_states, scored = verify_blocks(target, seq.cache, drafted, anchors, cfg.target_layer_ids)
            else:
                target_states = scored = verify_blocks(target, seq.cache, drafted, anchors)
        else:
            idx = jnp.minimum(blocks.positions_baw, s - 1).reshape(b, -1)
            target_states = jnp.take_along_axis(seq.hidden, idx[..., None], axis=1).reshape(b, a_count, k, -1)
            scored = (jnp.take_along_axis(seq.features, idx[..., None], axis=1).reshape(b, a_count, k, -1)
                      if keys_fusion else target_states)
        agreed = hint = mix_bwk = None
        rc = cfg.retrace
        target_logits = None
        if rc is not None and rc.mixture == "target":  # the target's stale distribution of every verify slot
            target_logits = target.logits(target_states)  # [B, A, W, V]
            ids, p = stale_top_k(target_logits, lambda i: to_draft_index(head, i, target.cfg.vocab_size))
            mix_bwk = (ids.reshape(b * a_count, k, -1), p.reshape(b * a_count, k, -1))
        if rc is not None and (rc.slots == "agreed" or rc.hints == "tokens"):
            # the target's own tokens where its states scored the proposals: the argmax of the verify pass, or
            # with teacher states the sequence itself
            if correction_source == "verify":
                scores = target_logits[:, :, :-1] if target_logits is not None else target.logits(
                    target_states[:, :, :-1])
                own = jnp.argmax(scores, -1).astype(jnp.int32)
            else:
                own = blocks.labels_baw[:, :, 1:]
            if rc.slots == "agreed":
                agreed = (proposals == own).reshape(b * a_count, k - 1)
            if rc.hints == "tokens":
                hint = token_hints(target.embed, own, proposals, hidden.dtype).reshape(b * a_count, k - 1, -1)
        memory = shift_memory(hidden.reshape(b * a_count, k, -1),
                              scored.reshape(b * a_count, k, -1).astype(hidden.dtype), accepted.reshape(-1),
                              agreed, hint, mix_bwk)
        memory = jax.tree.map(lambda x: x.reshape((b, a_count * k) + x.shape[2:]), memory)
        if memory_dtype is not None:  # stored in memory_dtype, used in the compute dtype
            rounded = lambda x: None if x is None else x.astype(memory_dtype).astype(x.dtype)  # noqa: E731
            memory = memory.replace(mem_d=rounded(memory.mem_d), mem_t=rounded(memory.mem_t),
                                    hint=rounded(memory.hint))
    return Rollout(tuple(metrics), tuple(accepted_all), tuple(anchors_all), tuple(valid_all), tuple(memories),
                   tuple(hiddens))


def retrace_loss(drafter, target, tokens_bs, loss_mask_bs, anchors_ba, valid_ba, beta, *, round1_weight=None,
                 correction_source="verify", gamma=None, remat=False, memory_dtype=None, rounds=DEFAULT_ROUNDS,
                 round_weights=None, memory_training: MemoryTraining = MemoryTraining()):
    """The weighted sum of the rounds' losses (weights from :func:`loss_weights`: by default 1.0 each,
    so two rounds give round 2 + ``round1_weight`` × round 1); metrics of every round."""
    weights = loss_weights(rounds, round_weights, round1_weight)
    r = retrace_rollout(drafter, target, tokens_bs, loss_mask_bs, anchors_ba, valid_ba, beta, correction_source,
                        gamma, remat, memory_dtype, rounds=rounds, memory_training=memory_training)
    return sum(w * m.loss for w, m in zip(weights, r.rounds)), r
