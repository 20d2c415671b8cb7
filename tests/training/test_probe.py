"""The recipe probe's teacher-forced acceptance (retrace_jax/training/probe.py)."""

import jax.numpy as jnp
import numpy as np
import pytest

import retrace_jax as rj
from retrace_jax.training.dflash_loss import target_features
from retrace_jax.training.probe import (
    acceptance_anchors,
    acceptance_stats,
    block_acceptance,
    teacher_forced_acceptance,
)


def test_anchors_keep_whole_blocks_inside_the_response_evenly_spread():
    mask = np.zeros((3, 20), np.int32)
    mask[0, 4:14] = 1  # 10 response positions: blocks of 4 start at 4..10
    mask[1, 2:4] = 1  # too short for a block of 4
    mask[2, 0:20] = 1
    anchors, valid = acceptance_anchors(mask, 4, 3)
    assert valid.tolist() == [[True] * 3, [False] * 3, [True] * 3]
    assert anchors[0].tolist() == [4, 7, 10]
    assert anchors[2].tolist() == [0, 8, 16]
    for row in (0, 2):
        for p in anchors[row]:
            assert mask[row, p : p + 4].all()
    few, ok = acceptance_anchors(mask[:1], 4, 50)  # fewer candidates than asked: each once
    assert few[0, ok[0]].tolist() == list(range(4, 11)) and ok.sum() == 7
    with pytest.raises(ValueError):
        acceptance_anchors(mask, 1, 3)


def test_stats_count_leading_slots_and_conditional_acceptance():
    correct = np.array([[[1, 1, 0], [0, 1, 1], [1, 1, 1]],  # leads 2, 0, 3
                        [[1, 0, 1], [1, 1, 1], [0, 0, 0]]], bool)  # leads 1, 3, (invalid anchor)
    valid = np.array([[True, True, True], [True, True, False]])
    s = acceptance_stats(correct, valid)
    np.testing.assert_allclose(s.tau, [(3 + 1 + 4) / 3, (2 + 4) / 2])
    assert s.blocks.tolist() == [3, 2]
    # slot 1: 4 of 5 blocks; slot 2: 3 of those 4; slot 3: 2 of those 3
    np.testing.assert_allclose(s.slot_acceptance, [4 / 5, 3 / 4, 2 / 3])
    assert s.slot_reached.tolist() == [5, 4, 3]
    empty = acceptance_stats(np.zeros((1, 2, 3), bool), np.zeros((1, 2), bool))
    assert np.isnan(empty.tau[0])


def test_teacher_forced_blocks_accept_what_real_rounds_accept(qwen3, trained_drafter):
    """At the positions where speculative decoding's rounds start, drafting the block from teacher-forced
    features accepts exactly as many slots as the round did (greedy, float32)."""
    drafter, prompts = trained_drafter
    prompts, new = prompts[:6], 40
    out = rj.generate(qwen3, prompts, new, drafter=drafter)
    plain = rj.generate(qwen3, prompts, new)
    assert out.tokens == plain.tokens
    width = drafter.cfg.block_size
    length = max(len(p) for p in prompts) + new
    tokens = np.zeros((len(prompts), length), np.int32)
    mask = np.zeros_like(tokens)
    anchors, expected = [], []
    for i, (p, r) in enumerate(zip(prompts, out.tokens)):
        tokens[i, : len(p) + len(r)] = p + r
        mask[i, len(p) : len(p) + len(r)] = 1
        starts = len(p) + np.concatenate([[0], np.cumsum(out.acceptance_lengths[i])[:-1]])
        whole = starts + width <= len(p) + len(r)  # rounds whose whole block lies inside the response
        anchors.append(starts[whole])
        expected.append(np.asarray(out.acceptance_lengths[i])[whole])
    a = max(len(x) for x in anchors)
    anchors_ba = np.zeros((len(prompts), a), np.int32)
    valid_ba = np.zeros((len(prompts), a), bool)
    for i, x in enumerate(anchors):
        anchors_ba[i, : len(x)], valid_ba[i, : len(x)] = x, True
    features = target_features(qwen3, jnp.asarray(tokens), drafter.cfg.target_layer_ids)
    correct = np.asarray(block_acceptance(drafter, qwen3, jnp.asarray(tokens), jnp.asarray(mask), features,
                                          jnp.asarray(anchors_ba), jnp.asarray(valid_ba), width))
    lead = np.cumprod(correct, -1).sum(-1)
    got = [1 + lead[i, : len(x)] for i, x in enumerate(anchors)]
    assert sum(len(x) for x in expected) > 20 and max(x.max() for x in expected) > 1  # rounds that accept
    for g, e in zip(got, expected):
        assert g.tolist() == e.tolist()
    # the batched form agrees with itself across batch sizes (padding rows change nothing)
    one = teacher_forced_acceptance(drafter, qwen3, tokens, mask, np.asarray(features), width, 8, batch_size=4)
    two = teacher_forced_acceptance(drafter, qwen3, tokens, mask, np.asarray(features), width, 8, batch_size=6)
    np.testing.assert_allclose(one.tau, two.tau)
    np.testing.assert_allclose(one.slot_acceptance, two.slot_acceptance)
    assert one.tau.mean() > 1.2
