"""benchmarks/rejected_alignment.py: the stepper's rounds are generate's, and the counting of rejected slots."""

import numpy as np
import pytest

import retrace_jax as rj
from benchmarks.rejected_alignment import Tally, measure, merge, stepped_generate
from retrace_jax.models.retrace import ReTraceConfig
from retrace_jax.models.tiny import tiny_target
from tests.helpers import randomize

PROMPTS = [[5, 17, 99, 3, 42], [7, 7, 8, 300, 12, 1, 9, 77, 401, 6, 2], [250]]


@pytest.fixture(scope="module")
def models():
    target = tiny_target(seed=3)
    drafter = rj.init_drafter(target.cfg, mask_token_id=127, num_layers=1, block_size=5, seed=1,
                              retrace=ReTraceConfig())
    # random everywhere, the ReTrace fusion included, so that the memory changes the drafts
    return target, randomize(drafter, seed=2, scale=0.1)


@pytest.mark.parametrize("use_retrace", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_stepper_commits_what_generate_commits(models, use_retrace):
    target, drafter = models
    stops = [11, 300]
    want = rj.generate(target, PROMPTS, 23, drafter=drafter, stop_token_ids=stops, use_retrace=use_retrace)
    rounds = []
    got, lens, block_size = stepped_generate(target, drafter, PROMPTS, 23, stop_token_ids=stops,
                                             use_retrace=use_retrace, on_round=lambda i, t: rounds.append((i, t)))
    assert got == want.tokens
    assert got == rj.generate(target, PROMPTS, 23, stop_token_ids=stops).tokens  # lossless
    assert block_size == 5 and list(lens[:3]) == [5, 11, 1]
    # the rounds seen are generate's rounds: per row, the a + 1 of every active round
    for b in range(len(PROMPTS)):
        seen = [int(i.accepted_b[b]) + 1 for i, _ in rounds if i.active_b[b]]
        assert seen == want.acceptance_lengths[b]
    info, top = rounds[0]
    assert top.shape == (4, 4, 5) and np.array_equal(top[..., 0], info.proposals_bj)


def test_memory_changes_the_counts(models):
    # a random, non-zero fusion drafts differently with the memory on: the measurement sees that
    target, drafter = models
    on, _ = measure(target, drafter, PROMPTS, 40, use_retrace=True)
    off, _ = measure(target, drafter, PROMPTS, 40, use_retrace=False)
    assert on.n.sum() > 0 and off.n.sum() > 0
    assert (on.n.tolist(), on.top1.tolist(), on.topk.tolist()) != (off.n.tolist(), off.top1.tolist(),
                                                                 off.topk.tolist())


def test_counting_on_a_hand_made_round():
    # Block size 5: slots 1..4, slot k at position start + k, new-token index start + k - prompt length.
    # Round 1, row 0: prompt length 3, start 4, a = 1: slot 2 (index 3) is the first rejection (d = 0),
    # slot 3 (index 4) the rejected suffix (d = 1); slot 4 (index 5) lies past the 5 final tokens, so it is
    # never counted. Row 1: a = 4, no rejection. Row 2: inactive.
    final = [[10, 11, 12, 13, 14], [20, 21, 22, 23, 24, 25, 26], [0]]
    top = np.zeros((3, 4, 5), np.int64)
    top[0, 0] = [11, 0, 0, 0, 0]
    top[0, 1] = [99, 12, 13, 1, 2]
    top[0, 2] = [14, 1, 2, 3, 4]
    top[0, 3] = [14, 1, 2, 3, 4]
    top[1] = 7
    lens = np.array([3, 8, 3])
    # the next round starts at 4 + 1 + 1 = 6 and drafts slot 3's position (index 4: 14) at its slot 1
    next_top = np.zeros((3, 4, 5), np.int64)
    next_top[0, 0] = [5, 14, 0, 0, 0]
    t = Tally(5)
    t.add_round(np.array([True, True, False]), np.array([4, 8, 3]), np.array([1, 4, 0]), top, final, lens,
                np.array([6, 8, 3]), next_top)
    assert t.n.tolist() == [1, 1, 0, 0]
    assert t.top1.tolist() == [0, 1, 0, 0] and t.topk.tolist() == [1, 1, 0, 0]
    # Round 2, row 0: start 3 (= the prompt length: slot k at index k), a = 0: slot 1 (11) is the first
    # rejection and the drafter's top-1 (impossible at greedy, but the counting must not assume it);
    # slot 2 (12): top-5 only; slot 3 (13): neither; slot 4 (14): top-1.
    next_top[0, :3] = [[12, 0, 0, 0, 0], [13, 0, 0, 0, 0], [1, 2, 3, 4, 5]]  # next round: start 4
    with pytest.raises(ValueError, match="row 0"):  # a suffix inside the output needs the next round
        Tally(5).add_round(np.array([True, False, False]), np.array([3, 0, 0]), np.array([0, 0, 0]), top, final,
                           lens, np.array([5, 0, 0]), next_top)
    t.add_round(np.array([True, False, False]), np.array([3, 0, 0]), np.array([0, 0, 0]), top, final, lens,
                np.array([4, 0, 0]), next_top)
    assert t.n.tolist() == [2, 2, 1, 1]
    assert t.top1.tolist() == [1, 1, 0, 1] and t.topk.tolist() == [2, 2, 0, 1]
    assert t.fresh_top1.tolist() == [0, 1, 1, 0] and t.fresh_topk.tolist() == [0, 2, 1, 0]
    assert t.stale_only_top1.tolist() == [0, 1, 0, 1]
    s = merge([t, Tally(5)]).summary()
    assert s["rounds"] == 3 and s["tau_pooled"] == round((2 + 5 + 1) / 3, 4)
    assert s["first_rejected"] == {"positions": 2, "top1_pct": 50.0, "top5_pct": 100.0}
    assert s["rejected_suffix"] == {"positions": 4, "top1_pct": 50.0, "top5_pct": 75.0, "fresh_top1_pct": 50.0,
                                    "fresh_top5_pct": 75.0, "stale_only_top1_pct": 50.0}
    assert s["by_distance"]["2"] == {"positions": 1, "top1_pct": 0.0, "top5_pct": 0.0, "fresh_top1_pct": 100.0,
                                     "fresh_top5_pct": 100.0, "stale_only_top1_pct": 0.0}
    assert s["by_distance"]["3"] == {"positions": 1, "top1_pct": 100.0, "top5_pct": 100.0, "fresh_top1_pct": 0.0,
                                     "fresh_top5_pct": 0.0, "stale_only_top1_pct": 100.0}
