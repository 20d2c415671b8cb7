"""benchmarks/rejected_alignment.py: the stepper's rounds are generate's, the counting of rejected slots, the
target's stale choices and the oracle ceilings."""

import numpy as np
import pytest

import retrace_jax as rj
from benchmarks.rejected_alignment import Round, Tally, measure, merge, stepped_generate
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
                                             use_retrace=use_retrace,
                                             on_round=lambda i, t, v: rounds.append((i, t, v)))
    assert got == want.tokens
    assert got == rj.generate(target, PROMPTS, 23, stop_token_ids=stops).tokens  # lossless
    assert block_size == 5 and list(lens[:3]) == [5, 11, 1]
    # the rounds seen are generate's rounds: per row, the a + 1 of every active round
    for b in range(len(PROMPTS)):
        seen = [int(i.accepted_b[b]) + 1 for i, _, _ in rounds if i.active_b[b]]
        assert seen == want.acceptance_lengths[b]
    info, top, verify = rounds[0]
    assert top.shape == (4, 4, 5) and np.array_equal(top[..., 0], info.proposals_bj)
    # greedy: the target's top-1 is its choice, so the round's tokens are the proposals up to a, then it
    assert verify.shape == (4, 5, 5)
    for b in range(len(PROMPTS)):
        a = int(info.accepted_b[b])
        assert list(info.tokens_bw[b, : a + 1]) == list(verify[b, : a + 1, 0])


def test_memory_changes_the_counts(models):
    # a random, non-zero fusion drafts differently with the memory on: the measurement sees that
    target, drafter = models
    on, _ = measure(target, drafter, PROMPTS, 40, use_retrace=True)
    off, _ = measure(target, drafter, PROMPTS, 40, use_retrace=False)
    assert on.n.sum() > 0 and off.n.sum() > 0
    assert (on.n.tolist(), on.top1.tolist(), on.topk.tolist()) != (off.n.tolist(), off.top1.tolist(),
                                                                 off.topk.tolist())


def _round(active, start, accepted, draft_top, target_top=None):
    draft_top = np.asarray(draft_top)
    if target_top is None:  # a target whose stale choices are never right (no truth below is 0)
        target_top = np.zeros((draft_top.shape[0], draft_top.shape[1] + 1, 5), np.int64)
    return Round(np.array(active), np.array(start), np.array(accepted), draft_top, np.asarray(target_top))


def _only(row: dict, keys) -> dict:
    return {k: row[k] for k in keys}


OLD = ("positions", "top1_pct", "top5_pct", "fresh_top1_pct", "fresh_top5_pct", "stale_only_top1_pct")


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
    t.add_round(_round([True, True, False], [4, 8, 3], [1, 4, 0], top), final, lens,
                _round([True, True, False], [6, 8, 3], [0, 0, 0], next_top))
    assert t.n.tolist() == [1, 1, 0, 0]
    assert t.top1.tolist() == [0, 1, 0, 0] and t.topk.tolist() == [1, 1, 0, 0]
    # Round 2, row 0: start 3 (= the prompt length: slot k at index k), a = 0: slot 1 (11) is the first
    # rejection and the drafter's top-1 (impossible at greedy, but the counting must not assume it);
    # slot 2 (12): top-5 only; slot 3 (13): neither; slot 4 (14): top-1.
    next_top[0, :3] = [[12, 0, 0, 0, 0], [13, 0, 0, 0, 0], [1, 2, 3, 4, 5]]  # next round: start 4
    with pytest.raises(ValueError, match="row 0"):  # a suffix inside the output needs the next round
        Tally(5).add_round(_round([True, False, False], [3, 0, 0], [0, 0, 0], top), final, lens,
                           _round([True, False, False], [5, 0, 0], [0, 0, 0], next_top))
    t.add_round(_round([True, False, False], [3, 0, 0], [0, 0, 0], top), final, lens,
                _round([True, False, False], [4, 0, 0], [0, 0, 0], next_top))
    assert t.n.tolist() == [2, 2, 1, 1]
    assert t.top1.tolist() == [1, 1, 0, 1] and t.topk.tolist() == [2, 2, 0, 1]
    assert t.fresh_top1.tolist() == [0, 1, 1, 0] and t.fresh_topk.tolist() == [0, 2, 1, 0]
    assert t.stale_only_top1.tolist() == [0, 1, 0, 1]
    s = merge([t, Tally(5)]).summary()
    assert s["rounds"] == 3 and s["tau_pooled"] == round((2 + 5 + 1) / 3, 4)
    assert _only(s["first_rejected"], OLD[:3]) == {"positions": 2, "top1_pct": 50.0, "top5_pct": 100.0}
    assert _only(s["rejected_suffix"], OLD) == {"positions": 4, "top1_pct": 50.0, "top5_pct": 75.0,
                                                "fresh_top1_pct": 50.0, "fresh_top5_pct": 75.0,
                                                "stale_only_top1_pct": 50.0}
    assert _only(s["by_distance"]["2"], OLD) == {"positions": 1, "top1_pct": 0.0, "top5_pct": 0.0,
                                                 "fresh_top1_pct": 100.0, "fresh_top5_pct": 100.0,
                                                 "stale_only_top1_pct": 0.0}
    assert _only(s["by_distance"]["3"], OLD) == {"positions": 1, "top1_pct": 100.0, "top5_pct": 100.0,
                                                 "fresh_top1_pct": 0.0, "fresh_top5_pct": 0.0,
                                                 "stale_only_top1_pct": 100.0}
    # The drafter's oracle fires twice. Round 1's d = 1 (index 4: 14) fixes slot 1 of the round at start 6
    # (a = 0), whose slot 2 lies past the output: 1 more. Round 2's d = 3 (index 4) fixes slot 3 of the
    # round at start 4 (a = 0), behind its unfixed slot 1: nothing, although its slots 1 and 2 hold the
    # right tokens (12, 13; not a greedy round: the walk starts only from a fixed slot a + 1). The
    # target's stale choices (0) are never right: its ceiling is τ.
    assert (t.oracle_drafter, t.oracle_target, t.oracle_either) == (1, 0, 1)
    assert s["tau_oracle_drafter"] == s["tau_oracle_either"] == 3.0 and s["tau_oracle_target"] == s["tau_pooled"]


def _pad(rows, width):
    """Top-5 lists per slot, filled with 0 (a token no hand-made output below holds)."""
    out = np.zeros((2, width, 5), np.int64)
    for k, r in enumerate(rows):
        out[0, k, : len(r)] = r
    out[1] = 10  # row 1 is inactive: nothing of it may count
    return out


def test_stale_target_shifts_and_oracles_on_hand_made_rounds():
    # Block size 5 (slots 1..4). Row 0: prompt length 2, so position p is new-token index p - 2; the
    # output is 10..16 (indices 0..6).
    final, lens = [[10, 11, 12, 13, 14, 15, 16], [1, 2]], np.array([2, 2])
    # R1: start 3 (slot k at index 1 + k: truths 12, 13, 14, 15), a = 0. Proposals 50, 14, 13, 15. The
    # target's stale top-1 per slot (verify slot k - 1): 12 (its correction), 14 (agreeing with the
    # drafter, both wrong), 14 (right), 15 (right, agreeing).
    r1 = _round([True, False], [3, 3], [0, 0], _pad([[50, 12], [14, 1], [13, 14], [15]], 4),
                _pad([[12], [14, 13], [14], [15], [0]], 5))
    # R2: start 4 (slot k at index 2 + k: truths 13, 14, 15, 16), a = 1, proposals 13, 16, 98, 16. It
    # drafts R1's d = 1, 2, 3 at its slots 1, 2, 3: right, wrong (14 in its top-5), wrong.
    r2 = _round([True, False], [4, 4], [1, 0], _pad([[13], [16, 14], [98], [16]], 4),
                _pad([[13], [14], [15], [0, 1, 2, 3, 4], [0]], 5))
    # R3: start 6 (slot k at index 4 + k: truths 15, 16, then past the output), a = 1, proposals 15, 0, 7,
    # 16; it drafts R2's d = 1, 2 at its slots 1, 2: right, wrong (16 in its top-5).
    r3 = _round([True, False], [6, 6], [1, 0], _pad([[15], [0, 16], [7], [16]], 4), _pad([[15], [16]], 5))
    t = Tally(5)
    t.add_round(r1, final, lens, r2)
    # R1 alone: slot 3's truth 14 is the proposal one slot before (-1), slot 2's truth 13 one slot after (+1)
    assert t.n.tolist() == [1, 1, 1, 1]
    assert [getattr(t, f"shift_{o}").tolist() for o in ("-2", "-1", "+1", "+2")] == [
        [0, 0, 0, 0], [0, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]]
    assert t.target_top1.tolist() == [1, 0, 1, 1] and t.target_topk.tolist() == [1, 1, 1, 1]
    # the oracles fix R2 at slots {3} (drafter) and {2, 3} (target, either). R2 accepted 1: the drafter's
    # fix sits behind the wrong slot 2 and adds nothing; the target's fixes slots 2 and 3, and slot 4 was
    # right already (16 at index 6), so R2 accepts 3 more, up to J = 4
    assert (t.oracle_drafter, t.oracle_target, t.oracle_either) == (0, 3, 3)
    # R2: slot 2 is its first rejection; d = 1 (slot 3, 15): the target's stale top-1 is right, and so is
    # R3's fresh one; d = 2 (slot 4, 16): the drafter's stale top-1 is right, the fresh one wrong, and it
    # is the proposal two slots before (-2). The drafter's oracle fixes R3's slot 2; slot 3 lies past the
    # output, so R3 accepts 1 more.
    t.add_round(r2, final, lens, r3)
    # R3: slot 2 (16) is its first rejection, the proposal two slots after it (+2); nothing after it is
    # inside the output, so no next round is needed
    t.add_round(r3, final, lens, None)
    assert (t.oracle_drafter, t.oracle_target, t.oracle_either) == (1, 3, 4)
    assert t.n.tolist() == [3, 2, 2, 1]
    assert t.top1.tolist() == [0, 0, 1, 1] and t.topk.tolist() == [3, 0, 2, 1]
    assert t.target_top1.tolist() == [3, 1, 1, 1] and t.target_topk.tolist() == [3, 2, 1, 1]
    assert t.fresh_top1.tolist() == [0, 2, 0, 0] and t.fresh_topk.tolist() == [0, 2, 2, 0]
    assert t.stale_only_top1.tolist() == [0, 0, 1, 1] and t.target_only_top1.tolist() == [0, 0, 1, 1]
    assert [getattr(t, f"shift_{o}").tolist() for o in ("-2", "-1", "+1", "+2")] == [
        [0, 0, 1, 0], [0, 0, 1, 0], [0, 1, 0, 0], [1, 0, 0, 0]]
    assert t.shift_only.tolist() == [1, 1, 1, 0]
    assert t.agreed.tolist() == [0, 1, 0, 1] and t.agreed_top1.tolist() == [0, 0, 0, 1]
    s = t.summary()
    assert s["rounds"] == 3 and s["tau_pooled"] == round(5 / 3, 4)
    assert (s["tau_oracle_drafter"], s["tau_oracle_target"], s["tau_oracle_either"]) == (2.0, round(8 / 3, 4), 3.0)
    r = s["rejected_suffix"]
    assert r["positions"] == 5 and (r["top1_pct"], r["target_top1_pct"], r["fresh_top1_pct"]) == (40.0, 60.0, 40.0)
    assert (r["stale_only_top1_pct"], r["target_only_top1_pct"], r["target_top5_pct"]) == (40.0, 40.0, 80.0)
    assert (r["shift_-2_pct"], r["shift_+2_pct"], r["shift_only_pct"]) == (20.0, 0.0, 40.0)
    assert (r["agreed_pct"], r["agreed_top1_pct"]) == (40.0, 50.0)  # of the agreed slots, half right
    first = s["first_rejected"]
    assert first["target_top1_pct"] == 100.0 and first["shift_+2_pct"] == round(100 / 3, 2)
    assert "fresh_top1_pct" not in first


def test_stale_target_choice_is_the_targets_greedy_token_on_that_context(models):
    # Every verify slot w of every round: the recorded top-1 must be the target's greedy next token after
    # prompt + committed tokens up to the anchor + the round's proposals of slots 1..w (rejected ones
    # included), computed here by plain prefill of that context.
    target, drafter = models
    rounds = []
    tokens, lens, block_size = stepped_generate(target, drafter, PROMPTS, 40,
                                                on_round=lambda i, d, v: rounds.append((i, v)))
    contexts, where = [], []
    for r, (info, _) in enumerate(rounds):
        for b in np.flatnonzero(info.active_b[: len(PROMPTS)]):
            anchor = int(info.start_b[b]) - int(lens[b])  # the anchor's new-token index
            seq = PROMPTS[b] + tokens[b][: anchor + 1] + info.proposals_bj[b].tolist()
            for w in range(block_size):
                contexts.append(seq[: int(info.start_b[b]) + 1 + w])
                where.append((r, b, w))
    greedy = [t[0] for t in rj.generate(target, contexts, 1).tokens]
    assert greedy == [int(rounds[r][1][b, w, 0]) for r, b, w in where]
    # and the tally counts those choices at the right slots: the target's stale top-1 right per distance d
    want = np.zeros((block_size - 1,), np.int64)
    choice = dict(zip(where, greedy))
    for r, (info, _) in enumerate(rounds):
        for b in np.flatnonzero(info.active_b[: len(PROMPTS)]):
            a, anchor = int(info.accepted_b[b]), int(info.start_b[b]) - int(lens[b])
            for slot in range(a + 1, block_size):
                if anchor + slot < len(tokens[b]):
                    want[slot - a - 1] += choice[(r, b, slot - 1)] == tokens[b][anchor + slot]
    tally, got = measure(target, drafter, PROMPTS, 40)
    assert got == tokens and tally.target_top1.tolist() == want.tolist()
    assert want[0] == tally.n[0] and want[1:].sum() > 0  # the correction itself, and some stale hits


@pytest.mark.slow  # about 20 s: two measured generations; the tally's counts are checked by default above
def test_oracle_ceiling_is_at_least_tau_and_equals_it_when_it_never_fires(models):
    target, drafter = models
    fired = {}
    for block_size in (None, 3):
        tally, _ = measure(target, drafter, PROMPTS, 40, block_size=block_size)
        s = tally.summary()
        # the measured τ is generate's: the a + 1 of every round, pooled
        out = rj.generate(target, PROMPTS, 40, drafter=drafter, block_size=block_size)
        lengths = sum(out.acceptance_lengths, [])
        assert tally.rounds == len(lengths) and s["tau_pooled"] == round(sum(lengths) / len(lengths), 4)
        fires = {"drafter": int(tally.stale_only_top1.sum()), "target": int(tally.target_only_top1.sum())}
        fires["either"] = fires["drafter"] + fires["target"]
        for o in ("drafter", "target", "either"):
            assert s[f"tau_oracle_{o}"] >= s["tau_pooled"]
            if fires[o] == 0:
                assert s[f"tau_oracle_{o}"] == s["tau_pooled"]
            fired[(block_size, o)] = (fires[o], s[f"tau_oracle_{o}"] > s["tau_pooled"])
        assert s["tau_oracle_either"] >= max(s["tau_oracle_drafter"], s["tau_oracle_target"])
    # both cases occur on this pair: an oracle that fires and raises the ceiling, and one that never fires
    assert any(n > 0 and raised for n, raised in fired.values())
    assert any(n == 0 for n, _ in fired.values())


def test_repeats_count_the_output_at_drafted_slots_only():
    # prompt length 1 (position p is index p - 1), output 7, 7, 8, 7, 9, 9. The round at start 1 (a = 0)
    # drafts indices 1..4 (7, 8, 7, 9): slot 1's 7 recurs two slots on, slot 3's 7 two slots back; slot
    # 4's 9 recurs at index 5 and slot 1's 7 at index 0, but those are slot 5 and the anchor, outside the
    # drafted slots, so they do not count.
    final, lens = [[7, 7, 8, 7, 9, 9]], np.array([1])
    t = Tally(5)
    t.add_round(_round([True], [1], [0], np.zeros((1, 4, 5), np.int64)), final, lens,
                _round([True], [2], [0], np.zeros((1, 4, 5), np.int64)))
    assert t.n.tolist() == [1, 1, 1, 1]
    assert [getattr(t, f"repeat_{o}").tolist() for o in ("-2", "-1", "+1", "+2")] == [
        [0, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]
    assert t.summary()["rejected_suffix"]["repeat_-2_pct"] == round(100 / 3, 2)
