"""The arithmetic of ``benchmarks/retrace_positions.py``: where a round sits, τ per position range, and
the paired bootstrap of the on / off ratio."""

import numpy as np

from benchmarks.retrace_positions import binned_tau, paired_ratio, round_positions


def test_a_round_sits_at_its_blocks_first_position():
    # prompt of 10 tokens: the prefill's token is at 10, the first round's block starts there
    assert round_positions(10, [3, 1, 16]).tolist() == [10, 13, 14]


def test_tau_per_range_averages_each_prompts_rounds_in_it():
    edges = np.array([0, 12, 14, 100])
    got = binned_tau([10, 13], [[1, 3, 5], [2, 4]], edges)  # rounds at 10, 11, 14 and 13, 15
    np.testing.assert_array_equal(got, [[2.0, np.nan, 5.0], [np.nan, 2.0, 4.0]])


def test_the_ratio_pairs_prompts_and_skips_those_missing_on_either_side():
    on = np.array([2.0, 4.0, np.nan, 6.0])
    off = np.array([2.0, 5.0, 3.0, np.nan])
    r = paired_ratio(on, off)
    assert r["prompts"] == 2 and np.isclose(r["ratio"], 6.0 / 7.0)
    assert r["low"] <= r["ratio"] <= r["high"]
    same = paired_ratio(np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, 3.0]))
    assert same["ratio"] == same["low"] == same["high"] == 1.0
    assert paired_ratio(np.array([np.nan]), np.array([1.0])) == {"prompts": 0}
