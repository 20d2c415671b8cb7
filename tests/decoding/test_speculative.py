"""Speculative generation: lossless, batch-invariant, equal to the PyTorch reference loop, one program."""

import jax
import numpy as np
import pytest

import retrace_jax as rj
import retrace_jax.decoding.generation as generation
from tests.decoding.test_generate import PROMPTS
from tests.dflash_reference import RefDFlashDraftModel, reference_spec_generate
from tests.helpers import count_compiles, hf_greedy, randomize
from tests.oracle import Oracle


def random_drafter(target, block_size=4, seed=0):
    d = rj.init_drafter(target.cfg, mask_token_id=127, num_layers=2, block_size=block_size, seed=seed)
    return randomize(d, seed=seed, scale=0.1)


def test_every_family_is_lossless_at_every_acceptance_length(family, hf_model_dir):
    """Qwen3, Qwen2 and Llama targets with the oracle drafter (tests/oracle.py): rounds that accept
    0..3 proposals give plain decoding's tokens, which are transformers' greedy tokens."""
    model, directory = hf_model_dir(family)
    target = rj.load_target(directory)
    oracle = Oracle.build(target, PROMPTS, 20, 4)
    out = rj.generate(target, PROMPTS, max_new_tokens=20, drafter=oracle.drafter)
    assert out.tokens == oracle.expected_tokens() == rj.generate(target, PROMPTS, max_new_tokens=20).tokens
    assert out.acceptance_lengths == oracle.expected_acceptance()
    assert {n for row in out.acceptance_lengths for n in row} == {1, 2, 3, 4}
    assert out.tokens[1] == hf_greedy(model, PROMPTS[1], 20)


def test_a_random_drafter_is_lossless(hf_model_dir):
    target = rj.load_target(hf_model_dir("qwen3")[1])
    out = rj.generate(target, PROMPTS, max_new_tokens=20, drafter=random_drafter(target))
    assert out.tokens == rj.generate(target, PROMPTS, max_new_tokens=20).tokens
    for tokens, rounds in zip(out.tokens, out.acceptance_lengths):
        # The first token comes from prefill; every round commits its a + 1 (the last one possibly cut).
        assert all(1 <= r <= 4 for r in rounds) and 1 + sum(rounds) >= len(tokens) > sum(rounds[:-1])


@pytest.fixture(scope="module")
def fresh_prompts():
    rng = np.random.RandomState(7)
    return [rng.randint(0, 127, (n,)).tolist() for n in (4, 9, 2, 6, 4, 13)]


def test_trained_drafter_is_lossless_and_often_right(qwen3, trained_drafter, fresh_prompts):
    drafter, train_prompts = trained_drafter
    for prompts in (train_prompts[:8], fresh_prompts):
        spec = rj.generate(qwen3, prompts, max_new_tokens=40, drafter=drafter)
        assert spec.tokens == rj.generate(qwen3, prompts, max_new_tokens=40).tokens
    spec = rj.generate(qwen3, train_prompts[:8], max_new_tokens=40, drafter=drafter)
    assert spec.tau() > 1.5  # a random drafter stays near 1.0
    assert max(max(r) for r in spec.acceptance_lengths) == 4


def test_traces_equal_the_pytorch_reference_loop(qwen3, trained_drafter, hf_model_dir, tmp_path):
    drafter, train_prompts = trained_drafter
    rj.save_drafter(drafter, str(tmp_path))
    ref = RefDFlashDraftModel.from_pretrained(str(tmp_path)).eval()
    model, _ = hf_model_dir("qwen3")
    prompts = train_prompts[:3]
    out = rj.generate(qwen3, prompts, max_new_tokens=24, drafter=drafter)
    for prompt, tokens, rounds in zip(prompts, out.tokens, out.acceptance_lengths):
        assert (tokens, rounds) == reference_spec_generate(model, ref, prompt, 24)


@pytest.mark.slow  # CI time; pytest -m slow runs it
def test_traces_equal_the_reference_loop_for_a_drafter_reading_the_last_layer(qwen3, trained_drafter,
                                                                              hf_model_dir, tmp_path):
    """The last layer's feature is transformers' hidden_states[L] (after the final norm), as in the
    official loop: a drafter reading it (the trained one, pointed at layer L-1) drafts the same rounds."""
    import dataclasses

    from flax import nnx

    drafter, train_prompts = trained_drafter
    last = qwen3.cfg.num_layers - 1
    graphdef, state = nnx.split(drafter)
    drafter_last = nnx.merge(graphdef, state)
    drafter_last.cfg = dataclasses.replace(drafter.cfg, target_layer_ids=(last,))
    rj.save_drafter(drafter_last, str(tmp_path))
    drafter_last = rj.load_drafter(str(tmp_path), qwen3)
    assert drafter_last.cfg.target_layer_ids == (last,)
    ref = RefDFlashDraftModel.from_pretrained(str(tmp_path)).eval()
    model, _ = hf_model_dir("qwen3")
    prompts = train_prompts[:3]
    out = rj.generate(qwen3, prompts, max_new_tokens=24, drafter=drafter_last)
    assert max(max(r) for r in out.acceptance_lengths) > 1  # some rounds accept: the features matter
    for prompt, tokens, rounds in zip(prompts, out.tokens, out.acceptance_lengths):
        assert (tokens, rounds) == reference_spec_generate(model, ref, prompt, 24)


def test_batched_rows_equal_rows_alone(qwen3, trained_drafter, fresh_prompts):
    drafter, train_prompts = trained_drafter
    prompts = train_prompts[:3] + fresh_prompts[:3]
    batched = rj.generate(qwen3, prompts, max_new_tokens=30, drafter=drafter)
    for i, p in enumerate(prompts):
        alone = rj.generate(qwen3, [p], max_new_tokens=30, drafter=drafter)
        assert alone.tokens[0] == batched.tokens[i]
        assert alone.acceptance_lengths[0] == batched.acceptance_lengths[i]


def test_limits_and_stops_inside_an_accepted_block(qwen3, trained_drafter):
    drafter, train_prompts = trained_drafter
    prompts = train_prompts[:6]
    free = rj.generate(qwen3, prompts, max_new_tokens=30, drafter=drafter)
    plain = rj.generate(qwen3, prompts, max_new_tokens=30).tokens
    cut_inside = 0
    for n in range(1, 14):
        out = rj.generate(qwen3, prompts, max_new_tokens=n, drafter=drafter)
        assert out.tokens == [t[:n] for t in plain]
        # n falls inside a multi-token round when the rounds offered more than n tokens.
        cut_inside += sum(1 + sum(r) > n for r in out.acceptance_lengths)
    assert cut_inside > 0
    for stop in sorted({t for row in free.tokens for t in row[2:12]})[:6]:
        out = rj.generate(qwen3, prompts, max_new_tokens=30, drafter=drafter, stop_token_ids=[stop])
        assert out.tokens == [t[: t.index(stop) + 1] if stop in t else t for t in plain]


@pytest.mark.parametrize("block_size", [2, 7])
def test_block_size_override_is_lossless(qwen3, trained_drafter, block_size):
    drafter, train_prompts = trained_drafter
    out = rj.generate(qwen3, train_prompts[:4], max_new_tokens=20, drafter=drafter, block_size=block_size)
    assert out.tokens == rj.generate(qwen3, train_prompts[:4], max_new_tokens=20).tokens
    assert max(max(r) for r in out.acceptance_lengths) <= block_size


def test_one_program_per_generation(qwen3, monkeypatch):
    """Three rounds or thirty: one dispatch of one compiled program, no host transfer in between, and
    nothing compiled again for new prompts in the same bucket."""
    drafter = random_drafter(qwen3, seed=5)
    calls = []
    real = generation.speculative_generate

    class Counted:  # generate takes the program with its CPU options, then calls it
        def with_cpu_options(self, extra):
            program = real.with_cpu_options(extra)

            def call(*args, **kwargs):
                calls.append(1)
                return program(*args, **kwargs)

            return call

    monkeypatch.setattr(generation, "speculative_generate", Counted())
    for n, rounds_at_least in ((4, 1), (31, 15)):
        calls.clear()
        with jax.transfer_guard_device_to_host("disallow"):
            out = rj.generate(qwen3, [[1, 2, 3]], max_new_tokens=n, drafter=drafter)
        assert len(calls) == 1 and len(out.acceptance_lengths[0]) >= rounds_at_least
    with count_compiles() as compiled:
        rj.generate(qwen3, [[9, 8, 7, 6, 5]], max_new_tokens=30, drafter=drafter)
    assert compiled == []


def test_round_info_keeps_its_old_field_names_with_a_warning():
    from retrace_jax.decoding.speculative import RoundInfo

    info = RoundInfo(*range(6))
    for old, new in (("proposals_bk", "proposals_bj"), ("tokens_bk", "tokens_bw"),
                     ("draft_logits_bkv", "draft_logits_bjv")):
        with pytest.warns(DeprecationWarning, match=f"RoundInfo.{old} is now RoundInfo.{new}"):
            assert getattr(info, old) == getattr(info, new)


def test_mismatched_drafter_and_bad_block_size(qwen3, hf_model_dir):
    llama = rj.load_target(hf_model_dir("llama")[1])
    other = rj.init_drafter(llama.cfg, mask_token_id=3, num_layers=1, block_size=4)
    wide = rj.init_drafter(rj.tiny.TINY_QWEN3, mask_token_id=3, num_layers=1, block_size=4)
    with pytest.raises(rj.ConfigError, match="does not match"):
        rj.generate(qwen3, [[1]], drafter=wide)
    assert rj.generate(qwen3, [[1]], 3, drafter=other).tokens  # same shapes: allowed
    with pytest.raises(ValueError, match="block_size"):
        rj.generate(qwen3, [[1]], drafter=other, block_size=1)
