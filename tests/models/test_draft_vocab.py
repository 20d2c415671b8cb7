"""The draft vocabulary (retrace_jax/models/draft_vocab.py): choosing it, drafting and training with it,
lossless output, and its file beside the official checkpoint layout."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import retrace_jax as rj
from retrace_jax.decoding.generation import _pad_stops
from retrace_jax.decoding.sampling import SamplingParams
from retrace_jax.decoding.speculative import SpeculativeStepper
from retrace_jax.models.draft_vocab import coverage, frequent_tokens, token_counts
from retrace_jax.models.drafter import with_draft_vocab
from retrace_jax.training.dflash_loss import dflash_loss, sample_anchors, slot_loss
from retrace_jax.training.retrace_loss import retrace_loss
from tests.helpers import with_random_retrace


def test_frequent_tokens_and_counts():
    counts = token_counts([np.array([5, 5, 2, 9, 2, 5]), np.array([7, 2])],
                          [np.array([1, 1, 1, 0, 1, 1]), np.array([1, 1])], 10)
    assert counts.tolist() == [0, 0, 3, 0, 0, 3, 0, 1, 0, 0]  # the masked-out 9 is not counted
    assert frequent_tokens(counts, 2).tolist() == [2, 5]
    assert frequent_tokens(counts, 3).tolist() == [2, 5, 7]
    assert frequent_tokens(counts, 4).tolist() == [0, 2, 5, 7]  # ties among zeros: the lowest id
    assert coverage(counts, [2, 5]) == pytest.approx(6 / 7)
    for bad in (0, 11, True, 2.5):
        with pytest.raises(ValueError, match="draft vocabulary size"):
            frequent_tokens(counts, bad)


def test_bad_ids_are_refused(qwen3):
    for ids, match in (([3, 2, 7], "ascending"), ([1, 1], "ascending"), ([], "non-empty"), ([0, 128], r"\[0, 128\)"),
                       ([[1, 2]], "1-D"), ([0.5, 2.0], "token ids")):
        with pytest.raises(ValueError, match=match):
            rj.init_drafter(qwen3.cfg, mask_token_id=127, block_size=4, draft_vocab=ids)


@pytest.mark.parametrize("ids, match", [
    (np.array([100, -100], np.int8), r"must lie in \[0, 512\), got -100\.\.\.100"),  # -100 - 100 wraps to 56
    (np.array([30000, -30000], np.int16), r"must lie in \[0, 512\)"),
    (np.array([200, 10], np.uint8), "ascending"),  # 10 - 200 wraps to 66
    (np.array([True, True]), "token ids"),
])
def test_small_integer_ids_are_checked_without_overflow(ids, match):
    drafter = rj.init_drafter(rj.tiny.TINY_QWEN3, mask_token_id=5, block_size=4)
    with pytest.raises(ValueError, match=match):
        with_draft_vocab(drafter, ids)


# Each setting compiles two speculative programs; the default run keeps greedy and one sampling rule.
@pytest.mark.parametrize("kwargs", [
    {},
    dict(temperature=0.8, top_k=20, top_p=0.9, draft_rule="sample"),
    pytest.param(dict(temperature=1.0), marks=pytest.mark.slow),
    pytest.param(dict(temperature=1.0, draft_rule="target_sample"), marks=pytest.mark.slow),
], ids=["greedy", "sample", "argmax", "target_sample"])
def test_the_whole_vocabulary_as_draft_vocabulary_changes_nothing(qwen3, trained_drafter, kwargs):
    """Ids 0..V-1: the same logits in the same order, so the same tokens and rounds at T = 0 and under
    every draft rule at T = 1 (same seed)."""
    drafter, prompts = trained_drafter
    full = with_draft_vocab(drafter, np.arange(qwen3.cfg.vocab_size))
    a = rj.generate(qwen3, prompts[:4], 32, drafter=drafter, **kwargs)
    b = rj.generate(qwen3, prompts[:4], 32, drafter=full, **kwargs)
    assert a.tokens == b.tokens and a.acceptance_lengths == b.acceptance_lengths


def test_a_partial_draft_vocabulary_is_lossless_and_proposes_only_its_tokens(qwen3, trained_drafter):
    drafter, prompts = trained_drafter
    plain = rj.generate(qwen3, prompts[:8], 32)
    before = rj.generate(qwen3, prompts[:8], 32, drafter=drafter)
    proposed = np.concatenate([np.asarray(t) for t in plain.tokens])
    counts = np.bincount(proposed, minlength=qwen3.cfg.vocab_size)
    ids = frequent_tokens(counts, 24)  # the target's most common tokens here: most proposals survive
    small = with_draft_vocab(drafter, ids)
    out = rj.generate(qwen3, prompts[:8], 32, drafter=small)
    assert out.tokens == plain.tokens
    assert 1.0 < out.tau() <= before.tau()
    # Round by round: proposals are draft-vocabulary tokens and the drafter's logits are -inf elsewhere.
    stepper = SpeculativeStepper(qwen3, small, capacity=32, block_size=4)
    tokens = jnp.asarray([prompts[0]], jnp.int32)
    stepper.init(tokens, jnp.asarray([4], jnp.int32), jnp.asarray([True]), np.int32(32),
                 _pad_stops([], qwen3.cfg.vocab_size), SamplingParams.make(0.0, 0, 1.0, 0))
    info = stepper.step()
    assert set(np.asarray(info.proposals_bj).ravel().tolist()) <= set(ids.tolist())
    logits = np.asarray(info.draft_logits_bjv)
    outside = np.setdiff1d(np.arange(qwen3.cfg.vocab_size), ids)
    assert np.all(np.isneginf(logits[..., outside])) and np.all(np.isfinite(logits[..., ids]))
    # Sampling stays exact in distribution (tests/decoding/test_sampling.py); here it runs and keeps to the vocabulary.
    sampled = rj.generate(qwen3, prompts[:4], 32, drafter=small, temperature=1.0, draft_rule="sample", seed=3)
    assert all(len(t) == 32 for t in sampled.tokens)


def test_slot_loss_counts_labels_outside_the_vocabulary_as_wrong_without_loss():
    logits = jnp.log(jnp.asarray([[[[0.7, 0.1, 0.1, 0.1], [0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]]]]))
    weights = jnp.asarray([[[1.0, 0.5, 0.25]]])
    inside = slot_loss(logits, jnp.asarray([[[0, 1, 3]]]), weights)
    outside = slot_loss(logits, jnp.asarray([[[0, -1, 3]]]), weights)
    want = (-np.log(0.7) * 1.0 - np.log(0.25) * 0.25) / 1.25
    np.testing.assert_allclose(float(outside.loss), want, rtol=1e-5)
    assert float(inside.tau) == 3.0 and float(outside.tau) == 2.0  # the run of right slots ends at the -1
    np.testing.assert_allclose(np.asarray(outside.slot_accuracy), [0.0, 1.0, 0.0, 0.0])


@pytest.mark.slow  # CI time; pytest -m slow runs it
@pytest.mark.parametrize("method", ["dflash", "retrace"])
def test_losses_with_the_whole_vocabulary_as_draft_vocabulary_are_unchanged(qwen3, trained_drafter, tmp_path,
                                                                             method):
    drafter, _ = trained_drafter
    rng = np.random.RandomState(0)
    tokens = jnp.asarray(rng.randint(0, 128, (2, 24)), jnp.int32)
    mask = jnp.asarray((np.arange(24) >= 4)[None].repeat(2, 0), jnp.int32)
    anchors, valid = sample_anchors(jax.random.PRNGKey(0), mask, 5, drafter.cfg.block_size)
    if method == "dflash":
        model, loss = drafter, lambda d: dflash_loss(d, qwen3, tokens, mask, anchors, valid)
    else:
        rj.save_drafter(drafter, str(tmp_path / "d"))
        model = with_random_retrace(rj.load_drafter(str(tmp_path / "d"), qwen3, retrace=True), seed=2)
        loss = lambda d: retrace_loss(d, qwen3, tokens, mask, anchors, valid, 1.0, rounds=3)[1]  # noqa: E731
    whole = jax.tree.leaves(loss(model))
    same = jax.tree.leaves(loss(with_draft_vocab(model, np.arange(128))))
    for x, y in zip(whole, same):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=1e-5, atol=1e-6)
    part = jax.tree.leaves(loss(with_draft_vocab(model, np.arange(0, 128, 2))))
    assert all(np.all(np.isfinite(np.asarray(x, np.float32))) for x in part)


def test_saved_beside_the_official_layout(qwen3, trained_drafter, tmp_path):
    drafter, prompts = trained_drafter
    ids = np.arange(0, 128, 3)
    rj.save_drafter(drafter, str(tmp_path / "plain"))
    rj.save_drafter(with_draft_vocab(drafter, ids), str(tmp_path / "vocab"))
    assert sorted(os.listdir(tmp_path / "vocab")) == ["config.json", "draft_vocab.safetensors", "model.safetensors"]
    plain_w, vocab_w = load_file(tmp_path / "plain" / "model.safetensors"), load_file(tmp_path / "vocab" / "model.safetensors")
    assert sorted(plain_w) == sorted(vocab_w)  # the official tensors, nothing else
    cfg = json.load(open(tmp_path / "vocab" / "config.json"))
    assert cfg["draft_vocab_size"] == len(ids) and "draft_vocab_size" not in json.load(open(tmp_path / "plain" / "config.json"))
    loaded = rj.load_drafter(str(tmp_path / "vocab"), qwen3)
    np.testing.assert_array_equal(np.asarray(loaded.draft_vocab.get_value()), ids)
    assert rj.generate(qwen3, prompts[:2], 16, drafter=loaded).tokens == rj.generate(qwen3, prompts[:2], 16).tokens
    # Saving again over it, without a vocabulary, removes the file (nothing stale is left to load).
    rj.save_drafter(with_draft_vocab(loaded, None), str(tmp_path / "vocab"))
    assert not (tmp_path / "vocab" / "draft_vocab.safetensors").exists()


def test_bad_draft_vocabulary_files(qwen3, trained_drafter, tmp_path):
    drafter, _ = trained_drafter
    path = tmp_path / "d"
    rj.save_drafter(with_draft_vocab(drafter, np.arange(0, 128, 4)), str(path))
    file = path / "draft_vocab.safetensors"
    good = load_file(file)
    cases = [
        (lambda: os.remove(file), FileNotFoundError, "draft_vocab.safetensors is missing"),
        (lambda: save_file({"ids": good["draft_token_ids"]}, str(file)), rj.CheckpointError, "lacks the tensor"),
        (lambda: save_file({"draft_token_ids": good["draft_token_ids"][::-1].copy()}, str(file)), rj.CheckpointError,
         "ascending"),
        (lambda: save_file({"draft_token_ids": good["draft_token_ids"][:5].copy()}, str(file)), rj.CheckpointError,
         "holds 5 token ids"),
        (lambda: file.write_bytes(b"not safetensors"), rj.CheckpointError, "cannot be read"),
        (lambda: save_file({"draft_token_ids": np.append(good["draft_token_ids"][:-1], -100).astype(np.int8)},
                           str(file)), rj.CheckpointError, r"draft_vocab\.safetensors: token ids must lie in \[0, 128\)"),
    ]
    for spoil, error, match in cases:
        save_file(good, str(file))
        spoil()
        with pytest.raises(error, match=match):
            rj.load_drafter(str(path), qwen3)
    save_file(good, str(file))
    cfg = json.load(open(path / "config.json"))
    del cfg["draft_vocab_size"]
    json.dump(cfg, open(path / "config.json", "w"))
    with pytest.raises(rj.CheckpointError, match="has no draft_vocab_size"):
        rj.load_drafter(str(path), qwen3)
