"""benchmarks/recipe_probe.py end to end on a tiny model: train a probe, measure it, compare two."""

import json
import os

import numpy as np
import pytest

import train
from benchmarks import recipe_probe
from tests.training.test_training import workspace  # noqa: F401  (the tiny target, its prompts and config)


@pytest.fixture(scope="module")
def prepared(workspace):  # noqa: F811
    root, config = workspace
    train.main(["--config", config, "--set", f"out={root}/prep", "--stage", "prepare"])
    return root, config


def test_probes_train_measure_and_compare(prepared, tmp_path, capsys):
    root, config = prepared
    common = ["--config", config, "--root", str(tmp_path), "--dev", str(root / "prompts.jsonl"), "--dev-lines", "0:6",
              "--fit", "5", "--blocks", "3,4", "--anchors", "5", "--set", "train.steps=12",
              "--set", "train.checkpoint_every=6"]
    assert recipe_probe.main(["run", "base", *common, "--sets-only"]) is None
    assert len(os.listdir(tmp_path / "_sets")) == 4  # dev, fit and their features
    base = recipe_probe.main(["run", "base", *common])
    other = recipe_probe.main(["run", "lr", *common, "--set", "train.lr=1e-2", "--set", "drafter.draft_vocab=40"])
    for r in (base, other):
        assert r["steps"] == 12 and os.path.exists(tmp_path / r["name"] / "drafter")
        for name, n in (("dev", 6), ("fit", 5)):
            for b in ("3", "4"):
                m = r[name]["blocks"][b]
                assert len(m["tau_per_sequence"]) == n and 1.0 <= m["tau"] <= int(b)
                assert len(m["slot_acceptance"]) == int(b) - 1 and m["blocks"] > 0
    assert base["dev"]["draft_vocab_coverage"] is None and 0.3 < other["dev"]["draft_vocab_coverage"] < 1
    assert other["set"][-2] == "train.lr=1e-2" and other["dev"]["blocks"]["4"] != base["dev"]["blocks"]["4"]
    # the sets are made once and shared: both probes saw the same sequences
    assert len([f for f in os.listdir(tmp_path / "_sets") if f.startswith(("dev-", "fit-"))]) == 2
    assert recipe_probe.main(["run", "base", *common]) == base  # measured already: its result
    with pytest.raises(SystemExit, match="holds the probe of .* use another NAME, or --again"):
        recipe_probe.main(["run", "base", *common, "--set", "train.lr=1e-2"])
    os.remove(tmp_path / "base" / "probe.json")  # measuring was interrupted: the trained drafter is measured
    assert recipe_probe.main(["run", "base", *common])["dev"] == base["dev"]
    again = recipe_probe.main(["run", "base", *common, "--again"])  # trained and measured anew: the same run
    assert again["dev"] == base["dev"] and again["fit"] == base["fit"]
    capsys.readouterr()
    out = tmp_path / "table.json"
    rows = recipe_probe.main(["table", str(tmp_path / "base" / "probe.json"), str(tmp_path / "lr" / "probe.json"),
                              "--out", str(out)])
    text = capsys.readouterr().out
    assert text.splitlines()[0].startswith("| probe | steps | dev τ@3 | dev τ@4 | / base @3 | / base @4 |")
    assert rows[0]["ratio@4"]["ratio"] == pytest.approx(1.0)
    lr = rows[1]["ratio@4"]
    assert lr["low"] <= lr["ratio"] <= lr["high"]
    tau = np.mean(other["dev"]["blocks"]["4"]["tau_per_sequence"]) / np.mean(base["dev"]["blocks"]["4"]["tau_per_sequence"])
    assert lr["ratio"] == pytest.approx(tau)
    assert json.loads(out.read_text())["baseline"] == "base"
    with pytest.raises(SystemExit, match="--baseline 'nope' is none of the probes"):
        recipe_probe.main(["table", str(tmp_path / "base" / "probe.json"), "--baseline", "nope"])


def test_a_curve_trains_in_segments_measures_each_and_resumes(prepared, tmp_path, capsys):
    """curve: the run trained in segments of --every steps ends where one uninterrupted probe ends (its
    last point measures the same drafter), each point carries the tokens seen so far, and a rerun measures
    only what is missing."""
    root, config = prepared
    common = ["--config", config, "--root", str(tmp_path), "--dev", str(root / "prompts.jsonl"), "--dev-lines", "0:6",
              "--fit", "5", "--blocks", "3,4", "--anchors", "5", "--set", "train.steps=12",
              "--set", "train.checkpoint_every=6"]
    assert recipe_probe.curve_points(12, 5) == [5, 10, 12] and recipe_probe.curve_points(12, 6) == [6, 12]
    base = recipe_probe.main(["run", "base", *common])
    early = recipe_probe.main(["curve", "long", *common, "--every", "5", "--until", "9"])
    assert [p["step"] for p in early["points"]] == [5]
    c = recipe_probe.main(["curve", "long", *common, "--every", "5"])  # goes on from step 5
    assert [p["step"] for p in c["points"]] == [5, 10, 12] and c["points"][0] == early["points"][0]
    last = c["points"][-1]
    assert last["dev"] == base["dev"] and last["fit"] == base["fit"]  # segments resume exactly
    logged = [r for r in recipe_probe._records(str(tmp_path / "long")) if r.get("step") == 12 and "loss" in r]
    assert last["tokens_seen"] == logged[-1]["tokens_seen"] and last["response_tokens_seen"] == logged[-1][
        "response_tokens_seen"]
    assert 0 < c["points"][0]["response_tokens_seen"] < c["points"][1]["response_tokens_seen"] < last["tokens_seen"]
    assert not any(name.startswith("drafter_step") for name in os.listdir(tmp_path / "long"))
    # a point lost (stopped after training, before measuring): measured again from its checkpoint, untrained
    path = tmp_path / "long" / "curve.json"
    kept = json.loads(path.read_text())
    path.write_text(json.dumps({**kept, "points": kept["points"][:2]}))
    before = len(recipe_probe._records(str(tmp_path / "long")))
    assert recipe_probe.main(["curve", "long", *common, "--every", "5"])["points"] == kept["points"]
    assert not any("loss" in r for r in recipe_probe._records(str(tmp_path / "long"))[before:])
    # a branch from step 10 with the run's own schedule: only the point after it, the run's own there
    branch = recipe_probe.main(["curve", "long-branch", *common, "--every", "5", "--set",
                                f"train.branch_from={tmp_path / 'long'}", "--set", "train.branch_step=10"])
    assert [p["step"] for p in branch["points"]] == [12] and branch["points"][0] == kept["points"][2]
    with pytest.raises(SystemExit, match="holds a curve of other settings"):
        recipe_probe.main(["curve", "long", *common, "--every", "4"])
    with pytest.raises(SystemExit, match="holds a run that is not a curve's"):
        recipe_probe.main(["curve", "base", *common, "--every", "5"])
    assert recipe_probe._branch_of(branch) == ("long", 10) and recipe_probe._branch_of(c) is None
    image = tmp_path / "curve.png"
    recipe_probe.main(["plot", str(path), str(tmp_path / "long-branch" / "curve.json"), "--out", str(image)])
    assert image.stat().st_size > 1000


def test_snapshot_fixes_the_first_finished_shards(prepared, tmp_path):
    root, config = prepared
    source = root / "data"
    manifest = json.loads((source / "manifest.json").read_text())
    assert len(manifest["done"]) >= 2
    dest = tmp_path / "snap"
    got = recipe_probe.main(["snapshot", str(source), str(dest), "--shards", "2"])
    assert got["done"] == [0, 1] and got["settings"] == manifest["settings"]
    assert sorted(os.listdir(dest)) == ["eval_prompts.json", "manifest.json", "shard_00000.npz", "shard_00001.npz"]
    assert recipe_probe.main(["snapshot", str(source), str(dest), "--shards", "2"]) == got  # again: unchanged
    with pytest.raises(SystemExit, match="holds another snapshot"):
        recipe_probe.main(["snapshot", str(source), str(dest), "--shards", "1"])
    with pytest.raises(SystemExit, match="are not finished yet"):
        recipe_probe.main(["snapshot", str(source), str(tmp_path / "x"), "--shards", "99"])
    from retrace_jax.training.config import load_config
    from retrace_jax.training.data import SequenceData
    from retrace_jax.training.prepare import check_prepared

    check_prepared(load_config(config, [f"data.dir={dest}"]))  # the same settings and target
    assert len(SequenceData(str(dest), 64)) == 2 * manifest["settings"]["shard_size"]


@pytest.mark.slow  # about 18 s of training; a diagnostic beside the probes and curves tested by default
def test_memorize_fits_the_same_sequences_and_writes_its_curve(prepared, tmp_path, capsys):
    """memorize trains on one fixed batch: the loss falls on it, and the result holds the curve, the
    sequences, and the steps it was logged at."""
    root, config = prepared
    common = ["--config", config, "--root", str(tmp_path), "--sequences", "3", "--steps", "30", "--every", "10",
              "--set", "train.lr=1e-2"]
    r = recipe_probe.main(["memorize", "fit", *common])
    assert [row["step"] for row in r["curve"]] == [10, 20, 30] and len(r["indices"]) == 3
    assert r["curve"][-1]["loss"] < 0.8 * r["curve"][0]["loss"]
    assert json.loads((tmp_path / "_memorize" / "fit.json").read_text()) == r
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [row["step"] for row in lines] == [10, 20, 30]
    with pytest.raises(SystemExit):
        recipe_probe.main(["memorize", "bad", *common, "--steps", "0"])
    # from the feature store, with the top-k store of train.distill_topk beside it
    soft = recipe_probe.main(["memorize", "soft", *common, "--steps", "10", "--set", "train.feature_cache=true",
                              "--set", "train.distill_topk=4"])
    assert len(soft["curve"]) == 1 and np.isfinite(soft["curve"][0]["loss"])


def test_unseen_tokens_counts_what_the_context_already_holds():
    from benchmarks.vocab_coverage import unseen_tokens

    seen = np.zeros(10, bool)
    seen[[1, 2]] = True
    tokens = np.array([[5, 6, 1, 5, 7, 7, 2, 0], [3, 1, 2, 4, 0, 0, 0, 0]])
    mask = np.array([[0, 0, 1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0, 0, 0]])
    # responses: 1 5 7 7 2 and 1 2 4; unseen: 5 (in its prompt), 7 (new), 7 (earlier in the response), 4 (new)
    got = unseen_tokens(tokens, mask, seen)
    assert got == {"response_tokens": 8, "unseen_share": 4 / 8, "unseen_in_prompt": 1 / 4, "unseen_in_context": 2 / 4}


def test_vocab_coverage_of_a_prompt_set(prepared, tmp_path, capsys):
    from benchmarks import vocab_coverage
    from retrace_jax.training.data import SequenceData

    root, config = prepared
    data = SequenceData(str(root / "data"), 1 << 30)
    distinct = len(set(np.concatenate([t[m.astype(bool)] for t, m in zip(data.tokens, data.mask)]).tolist()))
    target = str(root / "target")
    args = ["--data", str(root / "data"), "--target", target, "--prompts", f"dev={root / 'prompts.jsonl'}:0:6",
            "--sizes", f"4,{distinct},128", "--max-new-tokens", "12", "--cache", str(tmp_path), "--out",
            str(tmp_path / "cov.json")]
    r = vocab_coverage.main(args)
    assert r["distinct_training_response_tokens"] == distinct
    dev = r["sets"]["dev"]
    assert dev["sequences"] == 6 and dev["response_tokens"] > 0
    cov = dev["coverage"]
    assert cov["top 4"] <= cov[f"top {distinct}"] <= cov["top 128"] == 1.0  # the whole tiny vocabulary
    assert cov[f"top {distinct}"] == pytest.approx(1 - dev["unseen_share"])  # exactly the tokens seen
    assert "| dev | " in capsys.readouterr().out
    assert vocab_coverage.main(args) == r  # the set is kept: the same answer without the target
    with pytest.raises(SystemExit, match="has no draft vocabulary"):
        vocab_coverage.main(args + ["--drafter", target])
    with pytest.raises(SystemExit, match="NAME=JSONL"):
        vocab_coverage.main(args[:4] + ["--prompts", "nope"])


def test_a_snapshot_takes_the_kept_features_of_its_shards(prepared, tmp_path):
    import shutil

    root, _ = prepared
    source = tmp_path / "data"
    shutil.copytree(root / "data", source)
    done = json.loads((source / "manifest.json").read_text())["done"]
    for i in done:
        np.save(source / f"shard_{i:05d}.features.npy", np.full((3, 2), i, np.float32))
    (source / "features.json").write_text("{}")
    recipe_probe.main(["snapshot", str(source), str(tmp_path / "snap"), "--shards", "1"])
    assert sorted(os.listdir(tmp_path / "snap")) == ["eval_prompts.json", "features.json", "manifest.json",
                                                     "shard_00000.features.npy", "shard_00000.npz"]


def _point(step, dev_tau, fit_tau, digest="d1"):
    def measured(taus, digest):
        block = {"tau": float(np.mean(taus)), "tau_per_sequence": list(taus), "blocks": 10,
                 "slot_acceptance": [0.5, 0.2, 0.1], "slot_reached": [1, 1, 1]}
        return {"sequences": len(taus), "blocks": {"4": block}, "draft_vocab_coverage": None,
                **({"digest": digest} if digest else {})}

    return {"step": step, "tokens_seen": 100 * step, "response_tokens_seen": 60 * step,
            "dev": measured(dev_tau, digest), "fit": measured(fit_tau, digest and "f1")}


def test_points_pair_each_point_with_the_previous_and_another_curve_of_the_same_sequences(capsys):
    rng = np.random.default_rng(0)
    dev = 1 + rng.random(20)
    a = {"name": "a", "points": [_point(200, dev, dev + 0.2), _point(400, dev * 1.1, dev + 0.5)]}
    rows = recipe_probe.print_points(a, 4, a)
    assert rows[0]["dev_vs_previous"] is None
    assert np.isclose(rows[1]["dev_vs_previous"]["ratio"], 1.1)
    assert rows[1]["dev_vs_previous"]["low"] <= 1.1 <= rows[1]["dev_vs_previous"]["high"]
    assert np.isclose(rows[1]["dev_vs_against"]["ratio"], 1.0)
    other = {"name": "b", "points": [_point(400, dev, dev, digest="d2")]}  # other dev sequences: not paired
    assert [r["dev_vs_against"] for r in recipe_probe.print_points(a, 4, other)] == [None, None]
    assert "not known to be the same sequences" in capsys.readouterr().out
    old = {"name": "old", "points": [_point(200, dev, dev, digest=None), _point(400, dev * 1.2, dev, digest=None)]}
    rows = recipe_probe.print_points(old, 4, a)  # no digests: paired within the curve, not across
    assert np.isclose(rows[1]["dev_vs_previous"]["ratio"], 1.2) and rows[1]["dev_vs_against"] is None
    with pytest.raises(SystemExit, match="was not measured"):
        recipe_probe.print_points(a, 8)


def test_points_against_one_step_of_another_curve_pair_every_point_with_it(capsys):
    rng = np.random.default_rng(1)
    dev = 1 + rng.random(20)
    shipped = {"name": "shipped", "points": [_point(800, dev, dev), _point(600, dev * 0.9, dev)]}
    branch = {"name": "branch", "points": [_point(900, dev * 1.05, dev), _point(1000, dev * 1.1, dev)]}
    assert [r["dev_vs_against"] for r in recipe_probe.print_points(branch, 4, shipped)] == [None, None]
    rows = recipe_probe.print_points(branch, 4, shipped, against_step=800)
    assert np.allclose([r["dev_vs_against"]["ratio"] for r in rows], [1.05, 1.1])
    assert "dev / shipped step 800 @4" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"no point at step 700 \(its steps: \[600, 800\]\)"):
        recipe_probe.print_points(branch, 4, shipped, against_step=700)
    with pytest.raises(SystemExit, match="needs --against"):
        recipe_probe.print_points(branch, 4, None, against_step=800)


def test_publish_copies_a_curve_but_never_drops_the_points_its_destination_holds(tmp_path):
    dev = np.linspace(1.0, 1.5, 8)

    def curve(path, *points):
        with open(path, "w") as f:
            json.dump({"name": "c", "points": list(points)}, f)
        return str(path)

    dest = str(tmp_path / "results" / "tau_curve.json")
    short = curve(tmp_path / "short.json", _point(200, dev, dev))
    recipe_probe.main(["publish", short, dest])  # no destination yet: written
    longer = curve(tmp_path / "longer.json", _point(200, dev, dev), _point(400, dev * 1.1, dev))
    recipe_probe.main(["publish", longer, dest])  # every old point kept: the destination grows
    with open(dest) as f:
        assert [p["step"] for p in json.load(f)["points"]] == [200, 400]
    with pytest.raises(SystemExit, match=r"steps \[400\], which .* lacks"):
        recipe_probe.main(["publish", short, dest])  # a run started again from step 0
    other = curve(tmp_path / "other.json", _point(200, dev, dev, digest="d2"), _point(400, dev, dev, digest="d2"))
    with pytest.raises(SystemExit, match=r"other dev sequences at steps \[200, 400\]"):
        recipe_probe.main(["publish", other, dest])
    with open(dest) as f:
        assert [p["step"] for p in json.load(f)["points"]] == [200, 400]  # both refusals left it as it was


def test_holds_says_whether_a_curve_has_every_point_up_to_a_step(tmp_path, capsys):
    dev = np.linspace(1.0, 1.5, 8)
    path = str(tmp_path / "curve.json")
    with pytest.raises(SystemExit) as e:  # no curve yet: every step is missing
        recipe_probe.main(["holds", path, "--until", "400", "--every", "200"])
    assert e.value.code == 1 and "[200, 400]" in capsys.readouterr().out
    with open(path, "w") as f:
        json.dump({"name": "c", "points": [_point(200, dev, dev), _point(400, dev, dev)]}, f)
    assert recipe_probe.main(["holds", path, "--until", "400", "--every", "200"]) == []
    assert recipe_probe.missing_points(path, 600, 200) == [600]
    assert recipe_probe.missing_points(path, 500, 200) == [500]  # a curve's last point need not be on the grid
    with pytest.raises(SystemExit):
        recipe_probe.main(["holds", path, "--until", "0", "--every", "200"])
