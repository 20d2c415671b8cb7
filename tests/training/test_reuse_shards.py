"""``data.reuse_from``: a preparation takes the finished shards of another one that regeneration would
write again (the same prompts shard for shard, the same target and generation settings) instead of
regenerating them, and regenerates the rest."""

import json
import os

import pytest

from retrace_jax.training.data import DataError, kept_features_path

LAYERS = [0, 3]


def config(tmp_path, name, **data):
    return {"target": "tiny", "out": str(tmp_path / name),
            "data": {"num_prompts": 10, "eval_prompts": 2, "prompt_len": 7, "max_new_tokens": 6, "gen_batch_size": 3,
                     "shard_size": 4, "keep_features": True, **data},
            "drafter": {"num_layers": 1, "block_size": 4, "target_layer_ids": LAYERS}}


def prepare(cfg, events=None):
    from retrace_jax.training.prepare import prepare as run

    return run(cfg, log=(events.append if events is not None else lambda record: None))


def shard_files(out):
    return sorted(f for f in os.listdir(out) if f.startswith("shard_") and not f.endswith(".tmp"))


def same_files(a, b, names):
    for name in names:
        with open(os.path.join(a, name), "rb") as f, open(os.path.join(b, name), "rb") as g:
            assert f.read() == g.read(), name


def test_a_grown_preparation_reuses_the_shards_it_shares_and_ends_as_a_fresh_one(tmp_path):
    small = prepare(config(tmp_path, "small"))  # prompts 0-9 in shards of 4: 0-3, 4-7, 8-9
    events = []
    grown = prepare(config(tmp_path, "grown", num_prompts=14, reuse_from=small), events)  # 0-3, 4-7, 8-11, 12-13
    fresh = prepare(config(tmp_path, "fresh", num_prompts=14))
    reused = [e for e in events if e["event"] == "reused_shards"]
    assert reused == [{"event": "reused_shards", "from": small, "shards": 2, "differ": 1, "first_differing": 2}]
    for i in (0, 1):  # hard links: no disk taken
        for path in (os.path.join("shard_%05d.npz" % i), os.path.basename(kept_features_path(small, i))):
            assert os.path.samefile(os.path.join(small, path), os.path.join(grown, path))
    assert not os.path.samefile(os.path.join(small, "shard_00002.npz"), os.path.join(grown, "shard_00002.npz"))
    assert shard_files(grown) == shard_files(fresh)
    same_files(grown, fresh, shard_files(fresh) + ["eval_prompts.json"])
    with open(os.path.join(grown, "manifest.json")) as f, open(os.path.join(fresh, "manifest.json")) as g:
        assert json.load(f) == json.load(g)  # reuse_from is recorded nowhere
    again = []
    prepare(config(tmp_path, "grown", num_prompts=14, reuse_from=small), again)  # finished: nothing to copy
    assert [e for e in again if e["event"] == "reused_shards"][0]["shards"] == 0
    assert not any(e["event"] == "warning" for e in again)  # nothing left to regenerate: no warning


def test_only_the_shards_with_the_same_prompts_are_reused(tmp_path):
    lines = [f"def function_{i}(x):" for i in range(12)]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in lines))
    lines[5] = "class Other:"  # shard 1 differs
    b.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in lines))
    first = prepare(config(tmp_path, "a", prompts=str(a), max_prompt_len=32))
    events = []
    prepare(config(tmp_path, "b", prompts=str(b), max_prompt_len=32, reuse_from=first), events)
    assert [e for e in events if e["event"] == "reused_shards"][0] == {
        "event": "reused_shards", "from": first, "shards": 2, "differ": 1, "first_differing": 1}


def test_shards_without_the_features_this_preparation_keeps_are_regenerated(tmp_path):
    plain = prepare(config(tmp_path, "plain", keep_features=False))
    events = []
    out = prepare(config(tmp_path, "kept", reuse_from=plain), events)
    assert [e for e in events if e["event"] == "reused_shards"][0]["shards"] == 0
    assert any("no shard of" in e.get("message", "") for e in events if e["event"] == "warning")
    assert all(os.path.isfile(kept_features_path(out, i)) for i in range(3))
    other_layers = prepare({**config(tmp_path, "other"), "drafter": {"num_layers": 1, "block_size": 4,
                                                                    "target_layer_ids": [1, 2]}})
    events = []
    prepare(config(tmp_path, "kept2", reuse_from=other_layers), events)
    assert [e for e in events if e["event"] == "reused_shards"][0]["shards"] == 0
    events = []  # a preparation that keeps no features takes the shards alone
    out = prepare(config(tmp_path, "plain2", keep_features=False, reuse_from=other_layers), events)
    assert [e for e in events if e["event"] == "reused_shards"][0]["shards"] == 3
    assert not any(os.path.exists(kept_features_path(out, i)) for i in range(3))


@pytest.mark.parametrize("change, message", [
    ({"max_new_tokens": 5}, r"prepared otherwise \(max_new_tokens: 6 then, 5 now\)"),
    ({"shard_size": 5}, r"shard_size: 4 then, 5 now"),
    ({"temperature": 1.0}, r"temperature: 0.0 then, 1.0 now"),
])
def test_a_preparation_made_otherwise_is_refused(tmp_path, change, message):
    source = prepare(config(tmp_path, "source"))
    with pytest.raises(DataError, match=message):
        prepare(config(tmp_path, "new", reuse_from=source, **change))
    assert not os.path.exists(os.path.join(tmp_path, "new", "data"))  # refused before anything is written


def test_reuse_from_no_preparation_or_its_own_directory_is_refused(tmp_path):
    with pytest.raises(DataError, match="holds no prepared data"):
        prepare(config(tmp_path, "new", reuse_from=str(tmp_path / "nothing")))
    out = prepare(config(tmp_path, "own"))
    with pytest.raises(DataError, match="this preparation's own directory"):
        prepare(config(tmp_path, "own", reuse_from=out))


def test_another_target_is_refused(tmp_path):
    source = prepare(config(tmp_path, "source"))
    with open(os.path.join(source, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["target"]["dtype"] = "bfloat16"
    with open(os.path.join(source, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(DataError, match="dtype: 'bfloat16' then, 'float32' now"):
        prepare(config(tmp_path, "new", reuse_from=source))


def test_without_hard_links_the_shards_are_copied(tmp_path, monkeypatch):
    source = prepare(config(tmp_path, "source"))

    def no_links(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_links)
    events = []
    out = prepare(config(tmp_path, "copy", reuse_from=source), events)
    assert [e for e in events if e["event"] == "reused_shards"][0]["shards"] == 3
    names = [f"shard_{i:05d}.npz" for i in range(3)] + [os.path.basename(kept_features_path(out, i)) for i in range(3)]
    assert not any(os.path.samefile(os.path.join(source, n), os.path.join(out, n)) for n in names)
    same_files(source, out, names)
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]
