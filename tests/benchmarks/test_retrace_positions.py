"""The arithmetic of ``benchmarks/retrace_positions.py``: where a round sits, τ per position range, and
the paired bootstrap of the on / off ratio, over prompts and over seeds, and the combination of runs of
several seeds."""

import json

import numpy as np
import pytest

from benchmarks.retrace_positions import against_items, binned_tau, combine, paired_ratio, round_positions


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


def test_one_seed_a_side_is_the_bootstrap_over_prompts_alone():
    rng = np.random.default_rng(1)
    on, off = rng.uniform(1, 6, 30), rng.uniform(1, 6, 30)
    assert paired_ratio(on[None], off[None]) == paired_ratio(on, off)
    # the same drafter twice: the same ratio, the interval of one seed (the seed draw changes nothing)
    two = paired_ratio(np.stack([on, on]), np.stack([off, off]))
    one = paired_ratio(on, off)
    assert two["seeds"] == [2, 2] and np.isclose(two["ratio"], one["ratio"])
    assert abs(two["low"] - one["low"]) < 0.02 and abs(two["high"] - one["high"]) < 0.02


def test_seeds_that_disagree_widen_the_interval_and_each_side_averages_its_seeds():
    rng = np.random.default_rng(2)
    base = rng.uniform(3, 5, 40)
    on = np.stack([base * 1.2, base * 0.8, base])  # three seeds of one drafter, far apart
    off = np.stack([base, base, base])
    pooled = paired_ratio(on, off, same_seeds=False)
    assert np.isclose(pooled["ratio"], 1.0) and pooled["seeds"] == [3, 3]
    assert pooled["low"] < 0.9 and pooled["high"] > 1.1  # the seeds' spread, which prompts alone do not show
    assert paired_ratio(on[0], off[0])["high"] < 1.25
    # a prompt counts only where every seed of both sides has rounds
    on[1, 0] = np.nan
    assert paired_ratio(on, off)["prompts"] == 39


def test_memory_on_and_off_need_the_same_seeds():
    with pytest.raises(ValueError, match="same_seeds"):
        paired_ratio(np.ones((2, 3)), np.ones((3, 3)))


def test_against_names_default_and_refuse_clashes():
    assert against_items(["lab/B"]) == {"against": "lab/B"}
    assert against_items(["B=lab/B", "B512=x"]) == {"B": "lab/B", "B512": "x"}
    for bad in (["on=x"], ["a b=x"], ["B=x", "B=y"]):
        with pytest.raises(SystemExit):
            against_items(bad)


def _write_run(path, runs, drafter="C", **args):
    args = {"target": "t", "prompts": "code", "prompt_lengths": "10,20", "num_prompts": 2, "new_tokens": 8,
            "bin_width": 16, **args}
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"target": "t", "drafter": drafter, "against": {"B": "b"}, "args": args, "runs": runs}, f)
    return str(path)


def test_combining_seeds_averages_them_and_refuses_other_settings(tmp_path):
    def runs(scale):
        return {str(n): {"prompt_lens": [n, n], "on": [[2 * scale, 4 * scale], [3 * scale]], "off": [[2, 4], [3]],
                         "B": [[1, 1, 2], [3]]} for n in (10, 20)}

    one = _write_run(tmp_path / "s0.json", runs(1.0))
    two = _write_run(tmp_path / "s1.json", runs(1.5))
    res = combine([one, two])
    # on: the mean over the seeds of each prompt's mean: (3 * 1.25 + 3 * 1.25) / 2 against off 3
    assert np.isclose(res["by_length"]["10"]["ratio"], 1.25)
    assert res["by_length"]["10"]["seeds"] == [2, 2]
    assert np.isclose(res["by_length_off_B"]["20"]["ratio"], 3.0 / ((4 / 3 + 3) / 2))  # B: one seed twice
    assert set(res) >= {"by_position", "by_position_on_B", "by_length_on_B", "by_position_off_B"}
    other = _write_run(tmp_path / "s2.json", runs(1.0), new_tokens=16)
    with pytest.raises(SystemExit, match="new_tokens"):
        combine([one, other])
    fewer = runs(1.0)
    del fewer["20"]
    with pytest.raises(SystemExit, match="other prompts"):
        combine([one, _write_run(tmp_path / "s3.json", fewer)])


def test_a_drafter_measured_with_one_seed_joins_the_others(tmp_path):
    """A fixed drafter (``--against`` given with one seed's run) joins every seed with that run's rounds:
    the tables equal those of files that each decoded it; a different drafter of that name is refused."""
    def runs(scale, with_b=True):
        return {str(n): {"prompt_lens": [n, n], "on": [[2 * scale, 4 * scale], [3 * scale]], "off": [[2, 4], [3]],
                         **({"B": [[1, 1, 2], [3]]} if with_b else {})} for n in (10, 20)}

    both = combine([_write_run(tmp_path / "a0.json", runs(1.0)), _write_run(tmp_path / "a1.json", runs(1.5))])
    path = _write_run(tmp_path / "b1.json", runs(1.5, with_b=False))
    with open(path, encoding="utf-8") as f:
        lacking = json.load(f)
    del lacking["against"]["B"]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(lacking, f)
    once = combine([_write_run(tmp_path / "b0.json", runs(1.0)), path])
    for key in ("by_length_on_B", "by_length_off_B", "by_position_on_B", "by_length"):
        assert once[key] == both[key]
    other = _write_run(tmp_path / "c0.json", runs(1.0))
    with open(other, encoding="utf-8") as f:
        moved = json.load(f)
    moved["against"]["B"] = "elsewhere"
    with open(other, "w", encoding="utf-8") as f:
        json.dump(moved, f)
    with pytest.raises(SystemExit, match="same drafter"):
        combine([other, path, _write_run(tmp_path / "c2.json", runs(1.0))])
