"""``data.keep_features``: the regeneration keeps the target's features, and the feature store is filled
from them instead of a second pass of the target over the data."""

import json
import os

import numpy as np
import pytest

from retrace_jax.models.tiny import tiny_target
from retrace_jax.training.config import ConfigError, as_config
from retrace_jax.training.data import DataError, SequenceData, kept_features_path
from retrace_jax.training.evaluate import cached_features
from retrace_jax.training.feature_store import KEPT

LAYERS = [0, 3]


def config(tmp_path, name="out", **data):
    return {"target": "tiny", "out": str(tmp_path / name),
            "data": {"num_prompts": 10, "eval_prompts": 2, "prompt_len": 7, "max_new_tokens": 6, "gen_batch_size": 3,
                     "shard_size": 4, "keep_features": True, **data},
            "drafter": {"num_layers": 1, "block_size": 4, "target_layer_ids": LAYERS}}


def prepare(cfg):
    from retrace_jax.training.prepare import prepare as run

    return run(cfg, log=lambda record: None)


def stores(data, target, root, events):
    os.makedirs(root, exist_ok=True)
    return cached_features(target, LAYERS, data, 4, events.append, str(root), "tiny")


def test_the_store_is_copied_from_the_kept_features_as_a_pass_would_fill_it(tmp_path, monkeypatch):
    out = prepare(config(tmp_path))
    shards = sorted(f for f in os.listdir(out) if f.endswith(".features.npy"))
    assert shards == [f"shard_{i:05d}.features.npy" for i in range(3)]  # 4 + 4 + 2 prompts
    with open(os.path.join(out, KEPT)) as f:
        assert json.load(f)["layer_ids"] == LAYERS
    target, data = tiny_target(), SequenceData(out, seq_len=12)  # some sequences are cut to 12
    assert sum(np.load(os.path.join(out, s)).shape[0] for s in shards) == sum(len(t) for t in data.tokens)

    copied = []
    store = stores(data, target, out, copied)[0]
    assert [e.get("source") for e in copied if e["event"] == "feature_cache"] == ["prepared"]
    passed = []
    import retrace_jax.training.feature_store as fs

    monkeypatch.setattr(fs, "read_kept_meta", lambda d: None)  # as without kept features
    computed = stores(data, target, tmp_path / "pass", passed)[0]
    assert passed[0]["computed"] == len(data)
    got, want = store.get(range(len(data))), computed.get(range(len(data)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    monkeypatch.undo()

    again = []
    stores(data, target, out, again)  # finished: reused, neither copied nor computed
    assert [e.get("computed") for e in again if e["event"] == "feature_cache"] == [0]


def test_an_interrupted_copy_resumes(tmp_path, monkeypatch):
    out = prepare(config(tmp_path))
    target, data = tiny_target(), SequenceData(out, seq_len=16)
    import retrace_jax.training.feature_store as fs

    real = fs.FeatureStore._write_meta

    def stop_at_second_shard(self, done):  # killed before the second shard is recorded
        if done == 8:
            raise KeyboardInterrupt
        real(self, done)

    monkeypatch.setattr(fs.FeatureStore, "_write_meta", stop_at_second_shard)
    with pytest.raises(KeyboardInterrupt):
        stores(data, target, out, [])
    monkeypatch.undo()
    events = []
    store = stores(data, target, out, events)[0]
    assert [e["copied"] for e in events if e["event"] == "feature_cache"] == [len(data) - 4]
    whole = stores(data, target, tmp_path / "whole", [])[0]  # a store copied in one go
    np.testing.assert_array_equal(store.get(range(len(data))), whole.get(range(len(data))))


def test_features_of_other_layers_are_not_used(tmp_path):
    out = prepare(config(tmp_path))
    target, data = tiny_target(), SequenceData(out, seq_len=16)
    events = []
    cached_features(target, [1, 2], data, 4, events.append, out, "tiny")
    warnings = [e["message"] for e in events if e["event"] == "warning"]
    assert len(warnings) == 1 and "layer_ids" in warnings[0] and "not used" in warnings[0]
    assert [e["computed"] for e in events if e["event"] == "feature_cache"] == [len(data)]


def test_a_shard_without_kept_features_sends_the_store_to_a_pass(tmp_path):
    out = prepare(config(tmp_path))
    os.remove(kept_features_path(out, 1))
    target, data = tiny_target(), SequenceData(out, seq_len=16)
    events = []
    stores(data, target, out, events)
    assert any("shard 1 has none" in e.get("message", "") for e in events)
    assert [e["computed"] for e in events if e["event"] == "feature_cache"] == [len(data)]


def stop_before_last_shard(out):
    os.remove(os.path.join(out, "shard_00002.npz"))  # as if it stopped before the last shard
    with open(os.path.join(out, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["done"] = [0, 1]
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def prepare_logged(cfg):
    from retrace_jax.training.prepare import prepare as run

    events = []
    run(cfg, log=events.append)
    return [e["message"] for e in events if e.get("event") == "warning"]


def test_a_resumed_preparation_refuses_other_kept_layers(tmp_path):
    out = prepare(config(tmp_path))
    stop_before_last_shard(out)
    cfg = config(tmp_path)
    cfg["drafter"]["target_layer_ids"] = [1, 2]
    with pytest.raises(DataError, match="keep other features"):
        prepare(cfg)


def test_finished_data_with_other_kept_layers_is_used_with_a_warning(tmp_path):
    """With every shard finished nothing is left to keep: other layers only send the store to a pass."""
    out = prepare(config(tmp_path))
    def contents():  # the shards, their kept features, features.json (the manifest is rewritten as it was)
        return {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out) if f != "manifest.json"}

    before = contents()
    cfg = config(tmp_path)
    cfg["drafter"]["target_layer_ids"] = [1, 2]
    warnings = prepare_logged(cfg)
    assert len(warnings) == 1 and "fully prepared" in warnings[0] and "layer_ids" in warnings[0], warnings
    assert contents() == before


def test_shards_finished_without_kept_features_are_named_at_preparation(tmp_path):
    out = prepare(config(tmp_path, keep_features=False))
    stop_before_last_shard(out)
    warnings = prepare_logged(config(tmp_path))
    assert len(warnings) == 1 and "2 finished shard(s)" in warnings[0] and "kept no features" in warnings[0], warnings
    assert os.path.isfile(kept_features_path(out, 2)) and not os.path.isfile(kept_features_path(out, 0))


def test_kept_features_need_plain_regeneration(tmp_path):
    with pytest.raises(ConfigError, match="keep_features"):
        as_config(config(tmp_path, drafter=str(tmp_path / "drafter")))


def test_bfloat16_kept_features_fill_a_bfloat16_store(tmp_path):
    """A bfloat16 target keeps bfloat16 features: written as their bits, copied into the store as bfloat16."""
    import jax.numpy as jnp
    import ml_dtypes

    cfg = config(tmp_path)
    cfg["target_dtype"] = "bfloat16"
    out = prepare(cfg)
    with open(os.path.join(out, KEPT)) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    target, data = tiny_target(dtype=jnp.bfloat16), SequenceData(out, seq_len=16)
    events = []
    store = stores(data, target, out, events)[0]
    assert [e.get("source") for e in events if e["event"] == "feature_cache"] == ["prepared"], events
    got = store.get(range(len(data)))
    assert got.dtype == np.dtype(ml_dtypes.bfloat16)
    at = 0
    for i, shard in enumerate(sorted(f for f in os.listdir(out) if f.endswith(".features.npy"))):
        kept = np.load(os.path.join(out, shard)).view(ml_dtypes.bfloat16)
        first = len(data.tokens[4 * i])
        np.testing.assert_array_equal(got[4 * i, :first].astype(np.float32), kept[:first].astype(np.float32))
        at += kept.shape[0]
    assert at == sum(len(t) for t in data.tokens)
    assert np.abs(got.astype(np.float32)).max() > 0
