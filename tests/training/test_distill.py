"""train.distill_topk: the drafted slots learn the target's top-k next-token distribution (soft labels), from
the target pass in the step or from a store filled once beside the feature store."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import retrace_jax as rj
from retrace_jax.errors import ConfigError
from retrace_jax.models.draft_vocab import vocab_head
from retrace_jax.models.drafter import with_draft_vocab
from retrace_jax.models.tiny import TINY_QWEN3
from retrace_jax.training.config import load_config
from retrace_jax.training.data import SequenceData
from retrace_jax.training.dflash_loss import (
    TeacherTopK,
    dflash_loss,
    features_fn,
    sample_anchors,
    slot_loss,
    teacher_top_k,
)
from retrace_jax.training.evaluate import cached_features
from retrace_jax.training.feature_store import FeatureStore, build_stores, store_key, top_k_key
from retrace_jax.training.loop import check_resume, run_settings
from retrace_jax.training.step import StepOptions

DRAFT_IDS = np.arange(3, 120, 3, dtype=np.int32)  # a draft vocabulary of 39 of the 128 token ids


def _drafter(target, vocab=True):
    drafter = rj.init_drafter(target.cfg, mask_token_id=127, num_layers=1, block_size=4, seed=0)
    return with_draft_vocab(drafter, DRAFT_IDS) if vocab else drafter


def _batch(seed=0, b=2, s=24):
    tokens = jnp.asarray(np.random.RandomState(seed).randint(0, 120, (b, s)), jnp.int32)
    mask = jnp.ones_like(tokens).at[:, :6].set(0)
    anchors, valid = sample_anchors(jax.random.PRNGKey(seed), mask, 4, 4)
    return tokens, mask, anchors, valid


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_without_distill_topk_the_loss_is_the_hard_labels_alone(qwen3):
    drafter = _drafter(qwen3)
    tokens, mask, anchors, valid = _batch()
    hard = dflash_loss(drafter, qwen3, tokens, mask, anchors, valid)
    assert float(dflash_loss(drafter, qwen3, tokens, mask, anchors, valid, distill_topk=0).loss) == float(hard.loss)
    no_share = dflash_loss(drafter, qwen3, tokens, mask, anchors, valid, distill_topk=4, distill_weight=0.0)
    np.testing.assert_allclose(float(no_share.loss), float(hard.loss), rtol=1e-6)
    soft = dflash_loss(drafter, qwen3, tokens, mask, anchors, valid, distill_topk=4)
    assert abs(float(soft.loss) - float(hard.loss)) > 1e-3
    for m in (no_share, soft):  # the metrics stay the hard labels'
        np.testing.assert_array_equal(m.slot_accuracy, hard.slot_accuracy)
        assert float(m.tau) == float(hard.tau)


def test_the_soft_loss_is_the_cross_entropy_against_the_renormalised_top_k(qwen3):
    """Against numpy: the target's top 3 over a draft vocabulary, renormalised, mixed with the hard labels;
    a label outside the draft vocabulary (-1) counts no loss, as without distillation."""
    rng = np.random.RandomState(1)
    b, a, j, k, w_soft = 2, 2, 3, 3, 0.7
    hidden = rng.randn(b, a, j, qwen3.cfg.hidden_size).astype(np.float32)
    teacher = teacher_top_k(qwen3, vocab_head(qwen3, jnp.asarray(DRAFT_IDS)), jnp.asarray(hidden), k)
    full = hidden @ np.asarray(qwen3.head_weight(), np.float32).T  # [B, A, J, V]
    over_vocab = full[..., DRAFT_IDS]
    want_ids = np.argsort(-over_vocab, -1, kind="stable")[..., :k]
    np.testing.assert_array_equal(teacher.ids, want_ids)
    want_p = _softmax(np.take_along_axis(over_vocab, want_ids, -1))
    np.testing.assert_allclose(teacher.probs, want_p, rtol=1e-5)

    logits = rng.randn(b, a, j, len(DRAFT_IDS)).astype(np.float32) * 2
    labels = rng.randint(0, len(DRAFT_IDS), (b, a, j)).astype(np.int32)
    labels[0, 1, 2] = -1
    weights = rng.rand(b, a, j).astype(np.float32)
    weights[1, 0, 0] = 0.0
    got = slot_loss(jnp.asarray(logits), jnp.asarray(labels), jnp.asarray(weights), teacher=teacher,
                    distill_weight=w_soft)
    logq = np.log(_softmax(logits))
    soft = -np.sum(want_p * np.take_along_axis(logq, want_ids, -1), -1)
    hard = -np.take_along_axis(logq, np.maximum(labels, 0)[..., None], -1)[..., 0]
    counted = weights * (labels >= 0)
    want = np.sum(((1 - w_soft) * hard + w_soft * soft) * counted) / np.sum(counted)
    np.testing.assert_allclose(float(got.loss), want, rtol=1e-5)


@pytest.mark.parametrize("vocab", ["draft", "whole"])
def test_the_teacher_logits_taken_a_few_positions_at_a_time_give_the_same_top_k(qwen3, monkeypatch, vocab):
    """:data:`TEACHER_LOGITS` bounds the logits held at once; positions in chunks (a remainder included)
    give what one pass gives."""
    import retrace_jax.training.dflash_loss as dl

    head = vocab_head(qwen3, jnp.asarray(DRAFT_IDS)) if vocab == "draft" else None
    width = len(DRAFT_IDS) if vocab == "draft" else qwen3.cfg.vocab_size
    hidden = jnp.asarray(np.random.RandomState(2).randn(2, 7, qwen3.cfg.hidden_size).astype(np.float32))
    whole = teacher_top_k(qwen3, head, hidden, 4)
    monkeypatch.setattr(dl, "TEACHER_LOGITS", 3 * width)  # 3 positions at a time: 14 = 4 x 3 + 2
    chunked = teacher_top_k(qwen3, head, hidden, 4)
    assert chunked.ids.shape == whole.ids.shape == (2, 7, 4)
    np.testing.assert_array_equal(chunked.ids, whole.ids)
    np.testing.assert_allclose(chunked.probs, whole.probs, rtol=1e-6)


def test_with_the_whole_head_vocabulary_the_target_distribution_minimises_the_soft_loss():
    rng = np.random.RandomState(2)
    target_logits = jnp.asarray(rng.randn(2, 3, 4, 10) * 2, jnp.float32)
    values, ids = jax.lax.top_k(target_logits, 10)  # k = the head vocabulary: no renormalisation left
    teacher = TeacherTopK(ids, jax.nn.softmax(values, -1))
    labels, weights = jnp.zeros((2, 3, 4), jnp.int32), jnp.ones((2, 3, 4))

    def loss(logits):
        return slot_loss(logits, labels, weights, teacher=teacher).loss

    np.testing.assert_allclose(jax.grad(loss)(target_logits), 0.0, atol=1e-7)  # q = p: a stationary point
    best = float(loss(target_logits))
    one_hot = jax.nn.one_hot(jnp.argmax(target_logits, -1), 10) * 20.0
    assert best < float(loss(one_hot)) and best < float(loss(target_logits * 1.5))
    p = np.asarray(teacher.probs)
    np.testing.assert_allclose(best, np.mean(-np.sum(p * np.log(p), -1)), rtol=1e-5)  # its minimum: H(p)


def _data(root, lengths, seed=0):
    """Prepared data of one shard: random sequences of ``lengths``, the second half of each the response."""
    rng = np.random.RandomState(seed)
    tokens = [rng.randint(0, 120, n).astype(np.int32) for n in lengths]
    masks = [(np.arange(n) >= n // 2).astype(np.int32) for n in lengths]
    os.makedirs(root, exist_ok=True)
    np.savez(os.path.join(root, "shard_00000.npz"), tokens=np.concatenate(tokens), loss_mask=np.concatenate(masks),
             offsets=np.cumsum([0, *lengths]))
    with open(os.path.join(root, "manifest.json"), "w") as f:
        json.dump({"done": [0]}, f)
    return str(root)


@pytest.mark.parametrize("vocab", [True, False], ids=["draft_vocab", "whole_vocab"])
def test_the_stored_top_k_gives_the_loss_of_the_live_one(qwen3, tmp_path, vocab):
    drafter = _drafter(qwen3, vocab)
    ids = DRAFT_IDS if vocab else None
    data = SequenceData(_data(tmp_path / "data", [24, 17, 30, 9, 24]), seq_len=24)
    events = []
    stores = cached_features(qwen3, drafter.cfg.target_layer_ids, data, 2, events.append, str(tmp_path), "t",
                             top_k=4, head_ids=ids)
    assert [e["computed"] for e in events] == [5, 5] and os.path.basename(stores[1].dir).startswith("topk-")
    idx = [0, 1, 2, 4]
    tokens, mask, _ = data.rows(idx)
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    features, (top_ids, top_probs) = stores[0].get(idx), stores[1].get(idx)
    assert top_ids.dtype == np.int32 and top_probs.dtype == np.float32 and top_ids.shape == (4, 24, 4)
    np.testing.assert_allclose(top_probs[1, :17].sum(-1), 1.0, rtol=1e-5)
    assert not top_probs[1, 17:].any()  # past the sequence's end: nothing stored
    anchors, valid = sample_anchors(jax.random.PRNGKey(3), mask, 4, 4)
    live = dflash_loss(drafter, qwen3, tokens, mask, anchors, valid, distill_topk=4)
    stored = dflash_loss(drafter, qwen3, tokens, mask, anchors, valid, features_bsf=jnp.asarray(features),
                         distill_topk=4, teacher_bsz=TeacherTopK(jnp.asarray(top_ids), jnp.asarray(top_probs)))
    np.testing.assert_allclose(float(stored.loss), float(live.loss), rtol=1e-5)
    hard = dflash_loss(drafter, qwen3, tokens, mask, anchors, valid)
    assert abs(float(stored.loss) - float(hard.loss)) > 1e-3
    with pytest.raises(ValueError, match="needs the target's top 4 of every position"):
        dflash_loss(drafter, qwen3, tokens, mask, anchors, valid, features_bsf=jnp.asarray(features), distill_topk=4)


def test_the_top_k_store_sits_beside_the_feature_store_and_resumes(qwen3, tmp_path):
    """The feature store keeps its directory whether a run distils or not; a top-k store of another k or
    vocabulary is another store; an interrupted pass resumes after its last batch, filling only what is
    missing."""
    drafter = _drafter(qwen3)
    layers = drafter.cfg.target_layer_ids
    data = SequenceData(_data(tmp_path / "data", [24, 17, 30, 9, 24, 12]), seq_len=24)
    plain = cached_features(qwen3, layers, data, 2, None, str(tmp_path), "t")
    assert len(plain) == 1
    calls = []
    fn = features_fn(qwen3, layers, 4, DRAFT_IDS)
    lengths = [len(t) for t in data.tokens]
    top_key = top_k_key("t", 24, qwen3.dtype, len(data), "float32", "v", 4)

    def top_store():
        return FeatureStore(str(tmp_path), top_key, lengths, arrays={"ids": (4, np.int32), "probs": (4, np.float32)},
                            kind="topk")

    interrupted = []

    def values_of(tokens):
        calls.append(1)
        if len(calls) == 2 and not interrupted:  # the first pass stops in its second batch
            interrupted.append(True)
            raise KeyboardInterrupt
        out = jax.device_get(fn(tokens))
        return out[0], tuple(out[1:])

    def rows(idx):
        return data.rows(idx)[0]

    with pytest.raises(KeyboardInterrupt):
        build_stores([plain[0], top_store()], values_of, rows, 2)
    assert top_store().done == 2 and plain[0].done == 6
    calls.clear()
    events = []
    build_stores([plain[0], top_store()], values_of, rows, 2, events.append)
    assert len(calls) == 2 and [e["computed"] for e in events] == [0, 4]
    with open(os.path.join(top_store().dir, "meta.json")) as f:
        assert json.load(f)["widths"] == {"ids": 4, "probs": 4}
    whole = FeatureStore(str(tmp_path / "whole"), top_key, lengths, arrays=top_store().arrays, kind="topk")
    build_stores([whole], lambda t: (tuple(jax.device_get(fn(t))[1:]),), rows, 2)
    for a, b in zip(top_store()[range(6)], whole[range(6)]):
        np.testing.assert_array_equal(a, b)
    # the key: what decides the values, and no layers
    key = store_key("t", layers, 24, np.float32, 6)
    assert top_key == {**{k: v for k, v in key.items() if k != "layer_ids"}, "vocab": "v", "top_k": 4}
    dirs = {FeatureStore(str(tmp_path), top_k_key("t", 24, np.float32, 6, "float32", v, k), lengths,
                         arrays={"ids": (k, np.int32)}, kind="topk").dir for v, k in [("v", 4), ("w", 4), ("v", 8)]}
    assert len(dirs) == 3
    events.clear()
    again = cached_features(qwen3, layers, data, 2, events.append, str(tmp_path), "t", top_k=4, head_ids=DRAFT_IDS)
    assert again[0].dir == plain[0].dir and [e["computed"] for e in events] == [0, 6]


def test_the_settings_refuse_what_distillation_cannot_do(tmp_path):
    for overrides, message in [
        (["train.distill_topk=-1"], "train.distill_topk: must be >= 0"),
        (["train.distill_topk=2.5"], "train.distill_topk"),
        (["train.objective=retrace", "train.distill_topk=4"], "train.distill_topk: serves the dflash objective only"),
        (["drafter.draft_vocab=16", "train.distill_topk=32"],
         "train.distill_topk: 32 exceeds the draft vocabulary (16 tokens, drafter.draft_vocab)"),
        (["train.distill_weight=0.5"], "train.distill_weight: mixes in the soft loss of train.distill_topk"),
        (["train.distill_topk=4", "train.distill_weight=1.5"], "train.distill_weight"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_config(None, overrides)
        assert message in str(err.value), (overrides, str(err.value))
    load_config(None, ["drafter.draft_vocab=16", "train.distill_topk=16", "train.distill_weight=0.5"])
    with pytest.raises(ValueError, match="distill_topk serves the dflash objective only"):
        StepOptions(objective="retrace", distill_topk=4)
    with pytest.raises(ValueError, match="distill_topk must be a non-negative integer"):
        StepOptions(distill_topk=-1)
    with pytest.raises(ValueError, match="distill_weight must be a number in"):
        StepOptions(distill_topk=4, distill_weight=2.0)
    # a resumed run must distil as the run that wrote the checkpoint did
    class Saved:
        def __init__(self, meta):
            self.meta = meta

        def read_meta(self, step):
            return self.meta

        def verify(self, step):
            return True

    drafter_cfg = rj.init_drafter(TINY_QWEN3, mask_token_id=127, num_layers=1, block_size=4).cfg
    base, four = (run_settings(load_config(None, o), drafter_cfg, 10) for o in ([], ["train.distill_topk=4"]))
    assert (base["distill_topk"], base["distill_weight"]) == (0, None)
    assert (four["distill_topk"], four["distill_weight"]) == (4, 1.0)
    with pytest.raises(ConfigError, match="distill_topk: 0 then, 4 now"):
        check_resume(Saved(base), 5, four, "out")
    check_resume(Saved({k: v for k, v in base.items() if not k.startswith("distill")}), 5, base, "out")  # older
