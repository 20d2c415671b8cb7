"""generate refuses what it cannot run, or would run wrongly, before anything is compiled: a block the
drafter cannot address, token ids that are not integers, stop lists that are not lists, temperatures whose
float32 scaling overflows. Only the last test compiles (it runs a block longer than the budget)."""

import dataclasses
import re
import warnings

import numpy as np
import pytest

import retrace_jax as rj
from retrace_jax.validation import MAX_BLOCK_SIZE, MAX_TEMPERATURE, MIN_TEMPERATURE


@pytest.fixture(scope="module")
def target():
    return rj.tiny.tiny_target()


def _drafter(target, block_size=8, **kwargs):
    return rj.init_drafter(target.cfg, mask_token_id=511, num_layers=kwargs.pop("num_layers", 1),
                           block_size=block_size, **kwargs)


def _refused(target, error, pattern, **kwargs):
    kwargs = {"prompts": [[1, 2, 3]], "max_new_tokens": 4, **kwargs}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RuntimeWarning (a float32 overflow) on the way to the error
        with pytest.raises(error, match=pattern):
            rj.generate(target, **kwargs)


# ------------------------------------------------------------------------------------ block size

def test_a_huge_block_is_refused_before_anything_is_allocated(target):
    """block_size=10**6 asked for 21.7 GB of caches and logits while compiling."""
    _refused(target, ValueError, rf"generate: block_size: must be <= {MAX_BLOCK_SIZE}, got 1000000",
             drafter=_drafter(target), block_size=10**6)
    _refused(target, ValueError, rf"block_size: must be <= {MAX_BLOCK_SIZE}", drafter=_drafter(target),
             block_size=MAX_BLOCK_SIZE + 1)


def test_a_drafter_whose_own_block_is_too_large_is_refused(target):
    _refused(target, ValueError, rf"the drafter's block_size 300 exceeds {MAX_BLOCK_SIZE}.*pass block_size=",
             drafter=_drafter(target, block_size=300))


def test_a_block_beyond_the_drafter_positions_is_refused(target):
    drafter = _drafter(target)
    drafter.cfg = dataclasses.replace(drafter.cfg, max_position_embeddings=64)
    _refused(target, ValueError, r"block_size 100 needs 100 positions in one block, more than the drafter's "
                                 r"max_position_embeddings=64", drafter=drafter, block_size=100)


def test_a_block_wider_than_the_sliding_window_is_refused(target):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # two drafter layers over the tiny target repeat a target layer
        drafter = _drafter(target, num_layers=2)
        drafter.cfg = dataclasses.replace(drafter.cfg, layer_types=("sliding_attention", "full_attention"),
                                          sliding_window=8)
    _refused(target, ValueError, r"block_size 9 is larger than the drafter's sliding_window 8", drafter=drafter,
             block_size=9)


def test_a_block_longer_than_the_budget_runs_as_given(target):
    """Neither refused nor shortened: the same tokens as plain decoding, the budget respected."""
    prompts = [[1, 2, 3], [4, 5]]
    plain = rj.generate(target, prompts, 3)
    out = rj.generate(target, prompts, 3, drafter=_drafter(target, block_size=8))
    assert out.tokens == plain.tokens and all(len(t) == 3 for t in out.tokens)


# ------------------------------------------------------------------------------------ token ids

@pytest.mark.parametrize("prompts, error, pattern", [
    ([[1, True]], TypeError, r"prompt 0 must hold integer token ids; position 1 is bool True"),
    ([[1, 2], [3, np.bool_(False)]], TypeError, r"prompt 1 must hold integer token ids; position 1 is bool"),
    ([[1, [2]]], TypeError, r"prompt 0 must hold integer token ids; position 1 is list \[2\]"),
    ([[1, 2.0]], TypeError, r"prompt 0 must hold integer token ids; position 1 is float 2\.0"),
    ([[1, "2"]], TypeError, r"prompt 0 must hold integer token ids; position 1 is str '2'"),
    ([[1, 2], np.array([1.0, 2.0])], TypeError, r"prompt 1 must be a flat list of integer token ids, got an array "
                                                r"of shape \(2,\) and dtype float64"),
    ([np.array([1, 2], bool)], TypeError, r"prompt 0 must be a flat list of integer token ids"),
    ([{1: 2}], TypeError, r"prompt 0 must be a list of token ids, got dict"),
    ([[1, 2, 999]], ValueError, r"prompt 0: position 2 holds token id 999, outside the vocabulary \[0, 512\)"),
    ([[1, 2**70]], ValueError, r"prompt 0: position 1 holds token id 1180591620717411303424, outside"),
])
def test_prompt_entries_that_are_not_token_ids_are_named(target, prompts, error, pattern):
    _refused(target, error, pattern, prompts=prompts)


@pytest.mark.parametrize("stops, error, pattern", [
    ([True], TypeError, r"stop_token_ids must hold integer token ids; entry 0 is bool True"),
    ([2, np.True_], TypeError, r"stop_token_ids must hold integer token ids; entry 1 is bool"),
    (True, TypeError, r"stop_token_ids must be a list of token ids, got bool True$"),
    ({1: 2}, TypeError, r"stop_token_ids must be a list or set of token ids, got dict \{1: 2\}"),
    ([[1]], TypeError, r"stop_token_ids must hold integer token ids; entry 0 is list \[1\]"),
    ({1, "x"}, TypeError, r"stop_token_ids must hold integer token ids; an entry is str 'x'"),
    ([3, 600], ValueError, r"stop_token_ids: entry 1 holds token id 600, outside the vocabulary \[0, 512\)"),
])
def test_stop_lists_that_are_not_lists_of_token_ids_are_refused(target, stops, error, pattern):
    _refused(target, error, pattern, stop_token_ids=stops)


def test_stop_ids_may_be_any_list_tuple_array_or_set():
    from retrace_jax.decoding.generation import _pad_stops

    for stops in ([3, 4], (3, 4), np.array([3, 4]), {4, 3}, frozenset({3, 4}), range(3, 5)):
        assert sorted(_pad_stops(stops, 512)[:2].tolist()) == [3, 4]
        assert (_pad_stops(stops, 512)[2:] == -1).all()


# ------------------------------------------------------------------------------------ temperature

@pytest.mark.parametrize("temperature", [1e300, MAX_TEMPERATURE * 2, 1e-300, MIN_TEMPERATURE / 2, 1e-45])
def test_temperatures_whose_float32_scaling_overflows_are_refused(target, temperature):
    """1e300 became inf in float32 (with a RuntimeWarning) while inf itself was refused; 1e-300 became 0."""
    bounds = re.escape(f"between {MIN_TEMPERATURE:g} and {MAX_TEMPERATURE:g}, got {temperature!r}")
    _refused(target, ValueError, rf"generate: temperature: must be 0 \(greedy\) or {bounds}$", temperature=temperature)


@pytest.mark.parametrize("temperature", [float("inf"), float("nan")])
def test_a_temperature_that_is_not_finite_is_refused(target, temperature):
    _refused(target, ValueError, r"generate: temperature: must be a finite number", temperature=temperature)


def test_temperature_bounds_are_accepted():
    from retrace_jax.validation import generate_arguments

    for temperature in (0, 0.0, MIN_TEMPERATURE, 0.7, MAX_TEMPERATURE):
        args = generate_arguments(max_new_tokens=4, temperature=temperature, top_k=0, top_p=1.0, seed=0,
                                  block_size=MAX_BLOCK_SIZE, use_retrace=True)
        assert args.temperature == temperature and np.isfinite(np.float32(1 / (temperature or 1)))


# ------------------------------------------------------------------------------------ top_k

@pytest.mark.parametrize("top_k", [2**31, 2**40, 10**30])
def test_a_top_k_past_the_int32_it_is_compiled_as_is_refused_by_name(target, top_k):
    """top_k=2**40 raised NumPy's OverflowError ("Python integer ... out of bounds for int32")."""
    _refused(target, ValueError, rf"^generate: top_k: must be <= 2147483647, got {top_k}$", temperature=1.0,
             top_k=top_k)
