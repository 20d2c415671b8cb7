"""train.py end to end on CPU: prepare -> train -> checkpoint -> exact resume -> export -> lossless
decoding, for DFlash and then ReTrace; resumable data preparation; clear errors that lose nothing."""

import json
import os
import re
import shutil

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

import retrace_jax as rj
import train
from retrace_jax.training.config import load_config
from retrace_jax.training.prepare import check_prepared
from retrace_jax.training.data import (
    DataError,
    PrepareSettings,
    check_prompt_lengths,
    drop_long,
    prepare_shards,
    read_prompts,
)
from tests.helpers import cli_error, edit_config, make_hf_model, save_hf_model, save_word_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT_LINES = [
    {"conversations": [{"from": "human", "value": "w5 w6 w7 w8"}, {"from": "gpt", "value": "w9"}]},
    {"messages": [{"role": "system", "content": "w3"}, {"role": "user", "content": "w10 w11 w12"}]},
    {"prompt": "w20 w21 w22 w23 w24"},
] + [{"prompt": " ".join(f"w{(7 * i + j) % 120 + 3}" for j in range(4 + i % 5))} for i in range(37)]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target_dir = save_hf_model(make_hf_model("qwen3"), str(root / "target"))
    save_word_tokenizer(target_dir)
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in PROMPT_LINES) + "\n")
    config = {
        "target": target_dir,
        "data": {"prompts": str(prompts), "num_prompts": None, "eval_prompts": 4, "max_new_tokens": 32,
                 "shard_size": 16, "dir": str(root / "data"), "max_prompt_len": 200},  # 232 of 256 positions
        "drafter": {"num_layers": 1, "block_size": 4, "mask_token_id": 127},
        "train": {"steps": 40, "batch_size": 8, "seq_len": 48, "num_anchors": 6, "lr": 3e-3, "log_every": 1,
                  "checkpoint_every": 20, "eval_max_new_tokens": 24},
    }
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return root, str(path)


def _records(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def _tensors(out):
    return load_file(os.path.join(out, "drafter", "model.safetensors"))


@pytest.fixture(scope="module")
def dflash_run(workspace):
    root, config = workspace
    out = str(root / "dflash")
    summary = train.main(["--config", config, "--set", f"out={out}"])
    return out, summary


def test_dflash_end_to_end(workspace, dflash_run):
    root, config = workspace
    out, summary = dflash_run
    losses = [r["loss"] for r in _records(out) if "loss" in r]
    assert len(losses) == 40
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])  # the loss falls
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["20", "40"]
    target = rj.load_target(yaml.safe_load(open(config))["target"])
    drafter = rj.load_drafter(os.path.join(out, "drafter"), target)
    prompts = json.load(open(root / "data" / "eval_prompts.json"))
    assert rj.generate(target, prompts, 24, drafter=drafter).tokens == rj.generate(target, prompts, 24).tokens
    # A drafter that is never right has τ 1.0; 40 steps of this seeded run reach 1.09 (1.15 from the random
    # draws of separate q/k/v and gate/up parameters; from the same weights the two layouts train alike).
    assert summary["eval_tau"] > 1.05, summary["eval_tau"]


def test_resume_repeats_the_uninterrupted_run(workspace, dflash_run):
    root, config = workspace
    out = str(root / "interrupted")
    train.main(["--config", config, "--set", f"out={out}", "--set", "train.stop_after=25"])
    assert not os.path.exists(os.path.join(out, "drafter"))  # not finished: nothing exported
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["20", "25"]
    train.main(["--config", config, "--set", f"out={out}"])
    full = {r["step"]: r for r in _records(dflash_run[0]) if "loss" in r}
    resumed = {r["step"]: r for r in _records(out) if "loss" in r}
    assert any(r.get("event") == "resumed" and r["step"] == 25 for r in _records(out))
    for step in (26, 27, 40):
        assert resumed[step]["loss"] == full[step]["loss"], step
        # tokens seen count from step 0 in the resumed run too
        for key in ("tokens_seen", "response_tokens_seen"):
            assert resumed[step][key] == full[step][key], (step, key)
    assert 0 < full[40]["response_tokens_seen"] < full[40]["tokens_seen"]
    a, b = _tensors(dflash_run[0]), _tensors(out)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_a_branch_from_another_runs_checkpoint_goes_on_as_that_run(workspace, dflash_run, tmp_path):
    """train.branch_from: a new out directory starts from another run's checkpoint (drafter, optimizer state,
    step count); with that run's own schedule it repeats it exactly, and the other run is left as it was."""
    _, config = workspace
    parent = dflash_run[0]
    before = sorted(os.listdir(os.path.join(parent, "checkpoints")))
    out = str(tmp_path / "branch")
    train.main(["--config", config, "--set", f"out={out}", "--set", f"train.branch_from={parent}",
                "--set", "train.branch_step=20"])
    records = _records(out)
    branched = [r for r in records if r.get("event") == "branched"]
    assert branched and branched[0]["step"] == 20 and branched[0]["lr_then"] == branched[0]["lr_now"] > 0
    assert not any(r.get("event") in ("resumed", "warning") for r in records), records
    full = {r["step"]: r for r in _records(parent) if "loss" in r}
    ran = {r["step"]: r for r in records if "loss" in r}
    assert min(ran) == 21 and max(ran) == 40
    for step in (21, 22, 40):
        assert ran[step]["loss"] == full[step]["loss"], step
        assert ran[step]["tokens_seen"] == full[step]["tokens_seen"], step  # counted from step 0
    a, b = _tensors(parent), _tensors(out)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["40"]
    assert sorted(os.listdir(os.path.join(parent, "checkpoints"))) == before


def test_a_branch_may_change_only_the_schedule(workspace, dflash_run, tmp_path, capsys):
    _, config = workspace
    parent = dflash_run[0]
    branch = ["--set", f"train.branch_from={parent}", "--set", "train.branch_step=20"]
    # a cooldown: the parent's cosine is halfway down at step 20, a constant schedule's peak is a jump up
    out = str(tmp_path / "cooldown")
    train.main(["--config", config, "--set", f"out={out}", *branch, "--set", "train.schedule=constant",
                "--set", "train.decay_frac=0.5", "--set", "train.stop_after=2"])
    records = _records(out)
    branched = next(r for r in records if r.get("event") == "branched")
    assert branched["lr_now"] == pytest.approx(3e-3) and branched["lr_then"] < 0.75 * branched["lr_now"]
    assert any(r.get("event") == "warning" and "learning rate jumps at the branch step 20" in r["message"]
               for r in records), records
    full = {r["step"]: r for r in _records(parent) if "loss" in r}
    ran = {r["step"]: r for r in records if "loss" in r}
    assert ran[21]["loss"] == full[21]["loss"] and ran[22]["loss"] != full[22]["loss"]  # the update differs
    # resuming the branch needs the branch's settings: its own checkpoint, not the other run's, is read
    message = cli_error(capsys, train.main, ["--config", config, "--set", f"out={out}", "--set",
                                            "train.schedule=constant", "--set", "train.decay_frac=0.5"])
    assert "other settings (branch_from:" in message, message
    message = cli_error(capsys, train.main, ["--config", config, "--set", f"out={tmp_path}/seq", *branch,
                                            "--set", "train.seq_len=64"])
    assert message.startswith(f"error: train.branch_from: checkpoint 20 in {parent}/checkpoints was written with "
                              f"other settings (seq_len: 48 then, 64 now); a branch may change only the schedule"), message
    message = cli_error(capsys, train.main, ["--config", config, "--set", f"out={tmp_path}/step", "--set",
                                            f"train.branch_from={parent}", "--set", "train.branch_step=30"])
    assert message == f"error: train.branch_step: no checkpoint of step 30 in {parent}/checkpoints; there are: 20, 40"
    message = cli_error(capsys, train.main, ["--config", config, "--set", f"out={tmp_path}/half", "--set",
                                            f"train.branch_from={parent}"])
    assert "a branch needs both, the run and its step" in message, message
    message = cli_error(capsys, train.main, ["--config", config, "--set", f"out={tmp_path}/past", *branch[:2],
                                            "--set", "train.branch_step=40"])
    assert "train.branch_step: 40 leaves nothing to train (train.steps 40)" in message, message
    for name in ("seq", "step", "half", "past"):  # refused before a step: no checkpoint written
        ckpts = tmp_path / name / "checkpoints"
        assert not ckpts.exists() or not os.listdir(ckpts), name


def _truncate_largest_file(directory):
    largest = max((os.path.join(d, f) for d, _, files in os.walk(directory) for f in files), key=os.path.getsize)
    with open(largest, "r+b") as f:
        f.truncate(os.path.getsize(largest) // 2)


def test_an_unreadable_newest_checkpoint_is_set_aside_and_the_run_resumes_exactly(workspace, dflash_run, tmp_path,
                                                                                 capsys):
    """One truncated file in the newest Orbax checkpoint: the rerun warns, resumes from the one before and
    repeats the uninterrupted run; with no readable checkpoint it is one error line naming the directory."""

    _, config = workspace
    out = tmp_path / "corrupt"
    shutil.copytree(os.path.join(dflash_run[0], "checkpoints"), out / "checkpoints")
    _truncate_largest_file(out / "checkpoints" / "40")
    capsys.readouterr()
    train.main(["--config", config, "--set", f"out={out}"])
    err = capsys.readouterr().err
    assert f"warning: checkpoint 40 in {out}/checkpoints cannot be read (" in err, err
    assert f"resuming from step 20, the newest readable one; it is moved to {out}/checkpoints/40.unreadable" in err
    assert "Traceback" not in err
    assert sorted(os.listdir(out / "checkpoints")) == ["20", "40", "40.unreadable"]  # and the run saved 40 again
    assert [r["step"] for r in _records(str(out)) if r.get("event") == "resumed"] == [20]
    a, b = _tensors(dflash_run[0]), _tensors(str(out))
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    # nothing readable: one error line naming the directory, and nothing moved
    for step in ("20", "40"):
        _truncate_largest_file(out / "checkpoints" / step)
    message = cli_error(capsys, train.main, ["--config", config, "--set", f"out={out}"])
    assert message.startswith(f"error: no checkpoint in {out}/checkpoints can be read (checkpoint 40 cannot be "
                              f"read ("), message
    assert "; checkpoint 20 cannot be read (" in message and "move them away to train from the start" in message
    assert sorted(os.listdir(out / "checkpoints")) == ["20", "40", "40.unreadable"]
    message = cli_error(capsys, train.main, ["--config", config, "--set", f"out={out}", "--stage", "export"])
    assert message.startswith(f"error: checkpoint 40 in {out}/checkpoints cannot be read ("), message


def test_retrace_from_the_dflash_checkpoint(workspace, dflash_run):
    root, config = workspace
    out = str(root / "retrace")
    summary = train.main(["--config", config, "--set", f"out={out}", "--set", "train.objective=retrace",
                          "--set", f"drafter.init={dflash_run[0]}/drafter", "--set", "train.steps=12",
                          "--set", "train.lr=1e-3", "--set", "train.beta_warmup_steps=4"])
    records = [r for r in _records(out) if "loss" in r]
    assert records[0]["beta"] == 0.0 and records[-1]["beta"] == 1.0
    assert {"loss_round1", "loss_round2", "tau_round2", "accepted_round1"} <= set(records[0])  # two-round names
    assert {"loss_round4", "tau_round4", "slot_accuracy_round4", "accepted_round4"} <= set(records[0])  # 4 rounds
    assert "loss_round5" not in records[0]
    target = rj.load_target(yaml.safe_load(open(config))["target"])
    drafter = rj.load_drafter(summary["drafter"], target)
    assert drafter.cfg.retrace == rj.ReTraceConfig()
    assert np.any(np.asarray(drafter.retrace.value.full.kernel[...]))  # it learned past zero
    prompts = json.load(open(root / "data" / "eval_prompts.json"))
    assert rj.generate(target, prompts, 24, drafter=drafter).tokens == rj.generate(target, prompts, 24).tokens
    # The τ curve shows the memory on and off: the final evaluation ran the exported drafter both ways.
    final = [r for r in _records(out) if r.get("event") == "eval"][-1]
    assert final["step"] == 12
    for key, use_retrace in (("eval_tau", True), ("eval_tau_memory_off", False)):
        tau = rj.generate(target, prompts, 24, drafter=drafter, use_retrace=use_retrace).tau()
        assert final[key] == round(tau, 4), key
    assert not any("eval_tau_memory_off" in r for r in _records(dflash_run[0]))  # no memory, no second τ


@pytest.mark.slow  # a non-default fusion (about 25 s); its rollout is checked against inference by default
def test_retrace_with_the_keys_fusion_trains_the_drafter_itself(workspace, dflash_run):
    """``retrace.fusion: keys`` (an ablation): no fusion module; the memory's target features reach the
    drafter's attention, so the rollout's later rounds train the drafter's own weights through them."""
    root, config = workspace
    out = str(root / "retrace_keys")
    summary = train.main(["--config", config, "--set", f"out={out}", "--set", "train.objective=retrace",
                          "--set", f"drafter.init={dflash_run[0]}/drafter", "--set", "train.steps=4",
                          "--set", "retrace.fusion=keys", "--set", "train.retrace_lr_multiplier=2.0"])
    target = rj.load_target(yaml.safe_load(open(config))["target"])
    drafter = rj.load_drafter(summary["drafter"], target)
    assert drafter.cfg.retrace == rj.ReTraceConfig(fusion="keys") and not hasattr(drafter, "retrace")
    records = [r for r in _records(out) if "loss" in r]
    assert {"loss_round4", "tau_round4"} <= set(records[0]) and np.isfinite(records[-1]["loss"])
    prompts = json.load(open(root / "data" / "eval_prompts.json"))
    assert rj.generate(target, prompts, 24, drafter=drafter).tokens == rj.generate(target, prompts, 24).tokens


@pytest.mark.slow  # about 25 s; by default their rollouts are checked against inference (test_losses.py)
def test_retrace_with_token_hints_a_zero_scale_a_mixture_and_memory_training_options(workspace, dflash_run):
    """``retrace.hints: tokens``, ``retrace.zero_start: scale`` and ``retrace.mixture: target``, with
    ``train.memory_dropout`` and ``train.miss_weight``: the hint projection W_h, the scale and the
    mixture's scale start at zero and learn; the exported
    drafter says its design in config.json and decodes losslessly; the run's settings record the options."""
    root, config = workspace
    out = str(root / "retrace_hints")
    summary = train.main(["--config", config, "--set", f"out={out}", "--set", "train.objective=retrace",
                          "--set", f"drafter.init={dflash_run[0]}/drafter", "--set", "train.steps=4",
                          "--set", "retrace.hints=tokens", "--set", "retrace.zero_start=scale",
                          "--set", "retrace.mixture=target",
                          "--set", "train.beta_warmup_steps=0", "--set", "train.memory_dropout=0.5",
                          "--set", "train.miss_weight=2.0"])
    target = rj.load_target(yaml.safe_load(open(config))["target"])
    drafter = rj.load_drafter(summary["drafter"], target)
    assert drafter.cfg.retrace == rj.ReTraceConfig(hints="tokens", zero_start="scale", mixture="target")
    assert np.any(np.asarray(drafter.retrace.hint.full.kernel[...]))  # it learned past zero
    assert np.any(np.asarray(drafter.retrace.scale[...])) and np.any(np.asarray(drafter.retrace.mix_scale[...]))
    from retrace_jax.training.checkpoints import Checkpoints

    meta = Checkpoints(os.path.join(out, "checkpoints"), read_only=True).read_meta(4)
    assert (meta["memory_dropout"], meta["miss_weight"]) == (0.5, 2.0), meta
    prompts = json.load(open(root / "data" / "eval_prompts.json"))
    assert rj.generate(target, prompts, 24, drafter=drafter).tokens == rj.generate(target, prompts, 24).tokens


def test_data_preparation_resumes_and_keeps_finished_shards(tmp_path):
    prompts = [[i % 7 + 1, 3] for i in range(10)]
    settings = PrepareSettings(num_prompts=10, shard_size=4, max_prompt_len=8, max_new_tokens=3)
    calls = []

    def failing(chunk, first):
        calls.append(len(chunk))
        if len(calls) == 2:
            raise KeyboardInterrupt  # interrupted in the second shard
        return [[5, 6, 7]] * len(chunk)

    with pytest.raises(KeyboardInterrupt):
        prepare_shards(str(tmp_path), prompts, settings, failing, progress=False)
    first = tmp_path / "shard_00000.npz"
    stamp = first.stat().st_mtime_ns
    calls.clear()
    manifest = prepare_shards(str(tmp_path), prompts, settings,
                              lambda c, first: calls.append((len(c), first)) or [[5]] * len(c), progress=False)
    assert calls == [(4, 4), (2, 8)] and manifest["done"] == [0, 1, 2]
    assert first.stat().st_mtime_ns == stamp
    other = PrepareSettings(num_prompts=10, shard_size=5, max_prompt_len=8, max_new_tokens=3)
    with pytest.raises(DataError, match="other settings"):
        prepare_shards(str(tmp_path), prompts, other, lambda c, first: [[1]] * len(c), progress=False)
    assert first.stat().st_mtime_ns == stamp


def test_a_shard_that_does_not_fit_on_the_disk_is_named(tmp_path, monkeypatch):
    import errno

    def full(file, **arrays):
        with open(file, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "savez", full)
    settings = PrepareSettings(num_prompts=2, shard_size=2, max_prompt_len=8, max_new_tokens=3)
    with pytest.raises(OSError, match=r"could not write .*/shard_00000\.npz: No space left on device$"):
        prepare_shards(str(tmp_path), [[1, 2], [3, 4]], settings, lambda c, first: [[5]] * len(c), progress=False)
    assert sorted(os.listdir(tmp_path)) == ["manifest.json"]  # no partial file left


def test_prompt_files(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text("\n".join(json.dumps(r) for r in PROMPT_LINES[:3]) + "\n\n")
    got = read_prompts(str(good))
    assert got[0] == [{"role": "user", "content": "w5 w6 w7 w8"}]
    assert got[1] == [{"role": "system", "content": "w3"}, {"role": "user", "content": "w10 w11 w12"}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "w1"}\n{"prompt": \n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        read_prompts(str(bad))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="no prompts"):
        read_prompts(str(empty))
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"content": "w1"}\n')  # none of the known fields
    with pytest.raises(DataError, match="odd.jsonl:1: a record needs"):
        read_prompts(str(odd))
    with pytest.raises(FileNotFoundError, match="prompt file not found: .*missing.jsonl"):
        read_prompts(str(tmp_path / "missing.jsonl"))


def test_long_prompts_are_dropped_not_cut_and_paths_expand(tmp_path, monkeypatch):
    ids = [[1] * n for n in (3, 9, 4, 12, 5, 2)]
    assert drop_long(ids, 5) == ([[1] * 3, [1] * 4, [1] * 5, [1] * 2], 2)
    assert drop_long(ids, 5, limit=2) == ([[1] * 3, [1] * 4], 2)
    check_prompt_lengths(ids, 12)
    with pytest.raises(DataError, match=r"2 of 6 prompts are longer than max_prompt_len=5 tokens \(the longest, "
                                        r"prompt 3, has 12\)\. Prompts are never cut"):
        check_prompt_lengths(ids, 5)
    # Preparation refuses a prompt that does not fit before it writes or generates anything.
    settings = PrepareSettings(num_prompts=6, shard_size=4, max_prompt_len=5, max_new_tokens=3)
    with pytest.raises(DataError, match="drop_long_prompts"):
        prepare_shards(str(tmp_path / "data"), ids, settings, lambda c, first: pytest.fail("generated"),
                       progress=False)
    assert not (tmp_path / "data").exists()
    monkeypatch.setenv("HOME", str(tmp_path))
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"target": "~/model", "data": {"prompts": "~/p.jsonl"}}))
    cfg = load_config(str(config))
    assert cfg["target"] == str(tmp_path / "model") and cfg["data"]["prompts"] == str(tmp_path / "p.jsonl")
    assert cfg["data"]["drop_long_prompts"] is True  # dropping is the default


def test_bad_configs_fail_clearly_and_lose_nothing(workspace, dflash_run, tmp_path, capsys):
    root, config = workspace
    message = cli_error(capsys, train.main, ["--config", str(tmp_path / "nope.yaml")])
    assert re.search("config file not found", message), message
    message = cli_error(capsys, train.main, ["--config", config, "--set", f"target={tmp_path}/missing",
                                            "--set", f"out={tmp_path}/a"])
    assert re.search("model directory not found", message), message
    message = cli_error(capsys, train.main, ["--config", config, "--set",
                                            f"data.prompts={tmp_path}/none.jsonl", "--set",
                                            f"data.dir={tmp_path}/d", "--set", f"out={tmp_path}/b"])
    assert re.search("prompt file not found", message), message
    # A drafter made for another target.
    other = tmp_path / "other"
    rj.save_drafter(rj.init_drafter(rj.tiny.TINY_QWEN3, mask_token_id=3, num_layers=1, block_size=4), str(other))
    message = cli_error(capsys, train.main, ["--config", config, "--set", f"drafter.init={other}", "--set",
                                            f"out={tmp_path}/c"])
    assert re.search("does not match the target", message), message
    message = cli_error(capsys, train.main, ["--config", config, "--set", "train.num_anchors=60", "--set",
                                            f"out={tmp_path}/e"])
    assert re.search("num_anchors: 60 exceeds", message), message
    message = cli_error(capsys, train.main, ["--config", config, "--set", "train.log_every=0"])
    assert re.search("train.log_every: must be >= 1", message), message
    # A finished run is not disturbed by a bad rerun.
    before = _tensors(dflash_run[0])
    cli_error(capsys, train.main, ["--config", config, "--set", f"out={dflash_run[0]}", "--set",
                                  f"drafter.init={other}"])
    # a resume with another seed is refused
    message = cli_error(capsys, train.main, ["--config", config, "--set", f"out={dflash_run[0]}", "--set",
                                            "train.seed=5"])
    assert re.search("other settings", message), message
    after = _tensors(dflash_run[0])
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert sorted(os.listdir(os.path.join(dflash_run[0], "checkpoints"))) == ["20", "40"]


def test_a_prompt_file_that_is_not_utf8_is_named_with_its_line(workspace, tmp_path, capsys):
    _, config = workspace
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in PROMPT_LINES[:5]) + b'{"prompt": "w\xe9"}\n')
    message = cli_error(capsys, train.main, ["--config", config, "--set", f"data.prompts={bad}", "--set",
                                            f"data.dir={tmp_path}/data", "--set", f"out={tmp_path}/out"])
    assert message == f"error: {bad}:6: not UTF-8 text (invalid continuation byte at byte 13 of the line)", message


def test_a_full_disk_stops_train_py_with_one_error_line(workspace, dflash_run, tmp_path, monkeypatch, capsys):
    """A checkpoint that does not fit is refused before Orbax writes it; an export that fails (safetensors
    raises its own error type) is an OSError naming the drafter. Either way: one line, no traceback."""
    from collections import namedtuple

    from safetensors import SafetensorError

    from retrace_jax.io import checkpoints as io_checkpoints
    from retrace_jax.training import checkpoints as training_checkpoints

    _, config = workspace
    out = tmp_path / "full"
    args = ["--config", config, "--set", f"out={out}", "--set", "train.steps=2", "--set", "train.checkpoint_every=2"]
    usage = namedtuple("usage", "total used free")
    with monkeypatch.context() as m:
        m.setattr(training_checkpoints.shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 100_000))
        message = cli_error(capsys, train.main, args)
    assert message.startswith(f"error: no space left on device for checkpoint 2 in {out}/checkpoints: it needs "
                              f"about "), message
    assert message.endswith(" MiB, 0.10 MiB are free"), message

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(io_checkpoints, "save_file", full)
    message = cli_error(capsys, train.main, args)
    assert message == f"error: save_drafter could not write {out}/drafter: No space left on device", message
    assert os.listdir(out / "checkpoints") == ["2"] and not os.path.exists(out / "drafter")


def test_a_second_run_on_the_same_out_is_refused_at_once(workspace, tmp_path, capsys):
    """A run holds OUT's lock for its lifetime: another run on OUT exits at once naming the holder; a lock
    left by a killed run does not block the next one."""
    import signal
    import subprocess
    import sys

    from retrace_jax.training.lock import hold_out_dir

    _, config = workspace
    out = tmp_path / "busy"
    code = ("import sys, time\n"
            "from retrace_jax.training.lock import hold_out_dir\n"
            "with hold_out_dir(sys.argv[1]):\n"
            "    print('locked', flush=True)\n"
            "    time.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                              env=dict(os.environ, JAX_PLATFORMS="cpu"))
    try:
        assert holder.stdout.readline() == "locked\n"
        message = cli_error(capsys, train.main, ["--config", config, "--set", f"out={out}"])
        assert message.startswith(f"error: {out} is in use by another run (pid {holder.pid} on "), message
        assert "train into another out directory" in message
        assert os.listdir(out) == ["train.lock"]  # nothing else written: no metrics.jsonl, no data
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with hold_out_dir(str(out)), hold_out_dir(str(out)):  # the killed run's lock is gone; re-entrant
        assert (out / "train.lock").read_text().startswith(f"pid {os.getpid()} on ")


def test_sigterm_saves_a_checkpoint_and_exits_143_then_the_rerun_finishes(workspace, dflash_run, tmp_path, monkeypatch,
                                                                          capsys):
    import signal

    from retrace_jax.training import loop

    _, config = workspace
    out = tmp_path / "preempted"
    args = ["--config", config, "--set", f"out={out}", "--set", "train.steps=6", "--set", "train.checkpoint_every=6"]
    batch = loop.global_batch

    def preempted(data, step, *rest, **kwargs):
        if step == 2:  # during the third step, as a scheduler would
            os.kill(os.getpid(), signal.SIGTERM)
        return batch(data, step, *rest, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(loop, "global_batch", preempted)
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            train.main(args)
    assert exit_.value.code == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (f"stopped by SIGTERM at step 3 of 6 (checkpoint saved in {out}/checkpoints); "
                                    f"rerun the same command to resume"), err
    assert os.listdir(out / "checkpoints") == ["3"] and not os.path.exists(out / "drafter")
    summary = train.main(args)
    assert summary["step"] == 6 and os.path.isdir(summary["drafter"])
    assert [r["step"] for r in _records(str(out)) if r.get("event") == "resumed"] == [3]


def _data_state(directory):
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))
            if name.endswith((".json", ".npz"))}


def test_prepared_data_of_other_settings_is_refused_by_every_stage(workspace, dflash_run, tmp_path, capsys):
    """Finished data in data.dir and a configuration that would have made other data: every stage refuses,
    naming what differs, and changes nothing (train.py --stage all used to train on the old data)."""
    root, config = workspace
    other = tmp_path / "other.jsonl"
    other.write_text("\n".join(json.dumps(r) for r in PROMPT_LINES[::-1]) + "\n")
    before = _data_state(root / "data")
    changes = ["--set", "data.max_new_tokens=16", "--set", "data.temperature=0.7", "--set", f"data.prompts={other}"]
    for stage in ("all", "train", "prepare"):
        message = cli_error(capsys, train.main, ["--config", config, "--set", f"out={tmp_path}/{stage}", *changes,
                                                "--stage", stage])
        assert message.startswith(f"error: {root}/data holds data prepared with other settings ("), message
        for part in ("max_new_tokens: 32 then, 16 now", "temperature: 0.0 then, 0.7 now",
                     f"source: '{root}/prompts.jsonl' then, '{other}' now", "source_sha256: '"):
            assert part in message, (stage, message)
        assert f"use a new out directory (or data.dir), or delete {root}/data to prepare it again" in message
        assert not os.path.exists(tmp_path / stage / "checkpoints")
    assert _data_state(root / "data") == before


def test_prepared_data_of_another_target_is_refused(workspace, dflash_run, tmp_path, capsys):
    root, config = workspace
    target = load_config(config).target
    before = _data_state(root / "data")
    message = cli_error(capsys, train.main, ["--config", config, "--set", f"out={tmp_path}/a", "--set",
                                            "target_dtype=bfloat16"])
    assert message.startswith(f"error: {root}/data was prepared with another target: {target} (float32, "
                              f"config.json sha256 "), message
    assert f") then, {target} (bfloat16, config.json sha256 " in message and "delete" in message, message
    other = tmp_path / "other_target"
    shutil.copytree(target, other)
    edit_config(str(other), lambda c: c.update(rms_norm_eps=1e-5))  # another model of the same shape
    message = cli_error(capsys, train.main, ["--config", config, "--set", f"out={tmp_path}/b", "--set",
                                            f"target={other}", "--stage", "prepare"])
    assert f"was prepared with another target: {target} (float32" in message and f"then, {other} (float32" in message
    assert "same model moved" not in message
    moved = tmp_path / "moved_target"
    shutil.copytree(target, moved)
    message = cli_error(capsys, train.main, ["--config", config, "--set", f"out={tmp_path}/c", "--set",
                                            f"target={moved}"])
    assert f"then, {moved} (float32" in message, message
    assert message.endswith(f"if it is the same model moved, set \"path\" in {root}/data/manifest.json to "
                            f"'{moved}'"), message
    assert _data_state(root / "data") == before


def test_data_of_an_earlier_release_is_used_with_a_warning(workspace, dflash_run, tmp_path):
    """A manifest without the target and the later settings (an earlier release's) is still accepted: what
    it records is checked, what it lacks is named in a warning."""
    from retrace_jax.training.prepare import check_prepared

    root, config = workspace
    shutil.copytree(root / "data", tmp_path / "data")
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    old = ("num_prompts", "shard_size", "max_prompt_len", "max_new_tokens", "temperature", "source")
    manifest = {"settings": {k: manifest["settings"][k] for k in old}, "done": manifest["done"]}
    (tmp_path / "data" / "manifest.json").write_text(json.dumps(manifest))
    records = []
    cfg = load_config(config, [f"data.dir={tmp_path}/data"])
    check_prepared(cfg, records.append)
    assert [r["event"] for r in records] == ["warning"]
    assert records[0]["message"] == (
        f"{tmp_path}/data/manifest.json does not record the target, source_sha256, requested_prompts, "
        f"eval_prompts, drop_long_prompts, prompt_len, thinking, seed (an earlier release wrote it): they are "
        f"not checked; delete {tmp_path}/data to prepare it again if they may differ")
    with pytest.raises(DataError, match=r"max_new_tokens: 32 then, 16 now"):  # what it records still counts
        check_prepared(load_config(config, [f"data.dir={tmp_path}/data", "data.max_new_tokens=16"]), records.append)


def test_feature_cache_gives_the_same_training(workspace, dflash_run):
    root, config = workspace
    out = str(root / "cached")
    short = ["--set", "train.steps=6", "--set", "train.checkpoint_every=6"]
    train.main(["--config", config, "--set", f"out={out}", "--set", "train.feature_cache=true", *short])
    live = str(root / "live")
    train.main(["--config", config, "--set", f"out={live}", *short])
    online = {r["step"]: r["loss"] for r in _records(live) if "loss" in r}
    cached = {r["step"]: r["loss"] for r in _records(out) if "loss" in r}
    assert any(r.get("event") == "feature_cache" for r in _records(out))
    # Same data, anchors and schedule: the same training, through five real updates (the first has
    # learning rate 0: the warm-up starts there).
    assert sorted(cached) == sorted(online) == list(range(1, 7))
    np.testing.assert_allclose([cached[s] for s in online], list(online.values()), rtol=1e-4)
    assert abs(online[6] - online[2]) > 1e-3  # the updates changed the drafter
    a, b = _tensors(live), _tensors(out)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], atol=1e-4, err_msg=name)
    # The features stay on disk beside the data: the next run reuses them.
    again = str(root / "cached_again")
    train.main(["--config", config, "--set", f"out={again}", "--set", "train.feature_cache=true",
                "--set", "train.steps=2", "--set", "train.checkpoint_every=2"])
    first, second = ([r for r in _records(o) if r.get("event") == "feature_cache"][0] for o in (out, again))
    assert first["computed"] == first["sequences"] > 0 and second["computed"] == 0 and first["dir"] == second["dir"]
    assert os.path.dirname(first["dir"]) == str(root / "data")


def test_distillation_trains_the_same_from_the_top_k_store_as_from_the_step(workspace, tmp_path):
    """train.distill_topk over a draft vocabulary: the top-k store beside the features gives the losses of
    the top-k computed in the step; the feature store is the one a run without distillation uses."""
    root, config = workspace
    common = ["--config", config, "--set", "train.steps=4", "--set", "train.checkpoint_every=4", "--set",
              "drafter.draft_vocab=64", "--set", "train.distill_topk=8", "--set", "train.distill_weight=0.5"]
    losses = {}
    for cache in ("true", "false"):
        out = str(tmp_path / cache)
        train.main([*common, "--set", f"out={out}", "--set", f"train.feature_cache={cache}"])
        losses[cache] = [r["loss"] for r in _records(out) if "loss" in r]
    assert len(losses["true"]) == 4
    np.testing.assert_allclose(losses["true"], losses["false"], rtol=1e-4)
    events = [r for r in _records(str(tmp_path / "true")) if r.get("event") == "feature_cache"]
    assert [os.path.basename(e["dir"]).split("-")[0] for e in events] == ["features", "topk"]
    assert all(os.path.dirname(e["dir"]) == str(root / "data") for e in events)
    again = str(tmp_path / "again")
    train.main([*common[:-2], "--set", f"out={again}", "--set", "train.feature_cache=true"])
    reused = [r for r in _records(again) if r.get("event") == "feature_cache"]
    assert [e["dir"] for e in reused] == [e["dir"] for e in events] and all(e["computed"] == 0 for e in reused)


def test_resume_with_other_settings_is_refused_before_anything_is_restored(workspace, dflash_run, monkeypatch, capsys):
    from retrace_jax.training.checkpoints import Checkpoints

    root, config = workspace
    monkeypatch.setattr(Checkpoints, "restore", lambda *a, **k: pytest.fail("Orbax restored a checkpoint"))
    before = sorted(os.listdir(os.path.join(dflash_run[0], "checkpoints")))
    message = cli_error(capsys, train.main, ["--config", config, "--set", f"out={dflash_run[0]}", "--set",
                                            "train.objective=retrace", "--set", "train.lr=1e-3", "--set",
                                            "train.num_anchors=5", "--set", "drafter.block_size=5"])
    assert message.startswith("error: ") and "\n" not in message and len(message) < 700, message
    for part in ("objective: 'dflash' then, 'retrace' now", "lr: 0.003 then, 0.001 now", "num_anchors: 6 then, 5 now",
                 "block_size: 4 then, 5 now"):
        assert part in message, message
    assert sorted(os.listdir(os.path.join(dflash_run[0], "checkpoints"))) == before


def test_resume_with_other_loss_positions_is_refused(workspace, dflash_run, capsys):
    root, config = workspace
    message = cli_error(capsys, train.main, ["--config", config, "--set", f"out={dflash_run[0]}", "--set",
                                            "train.loss_positions=all"])
    assert message.startswith("error: ") and "loss_positions: 'response' then, 'all' now" in message, message


def test_loss_positions_reach_every_batch_of_a_run(workspace, tmp_path, monkeypatch):
    from retrace_jax.training import loop

    root, config = workspace
    batch, seen = loop.global_batch, []

    def spy(*args, **kwargs):
        arrays, counts = batch(*args, **kwargs)
        seen.append((args[7] if len(args) > 7 else kwargs.get("loss_positions"), np.asarray(arrays[1]).copy(), counts))
        return arrays, counts

    monkeypatch.setattr(loop, "global_batch", spy)
    train.main(["--config", config, "--set", f"out={tmp_path / 'all'}", "--set", "train.steps=2", "--set",
                "train.loss_positions=all", "--set", "train.checkpoint_every=2"])
    assert [s[0] for s in seen] == ["all", "all"]
    for _, mask, (tokens, response) in seen:
        assert int(mask.sum()) == tokens - mask.shape[0] > response  # every real position but each first


def test_a_diverging_run_stops_and_keeps_its_last_good_checkpoint(workspace, tmp_path, capsys):
    root, config = workspace
    out = tmp_path / "diverged"
    # The first update has learning rate 0 (warm-up); the second one, 1e30, blows the weights up.
    message = cli_error(capsys, train.main, ["--config", config, "--set", f"out={out}", "--set",
                                            "train.lr=1e30", "--set", "train.steps=20", "--set",
                                            "train.checkpoint_every=2", "--set", "train.log_every=5", "--set",
                                            "data.eval_prompts=4"])
    assert message.startswith("error: training diverged at step 3: loss nan") and "\n" not in message, message
    assert "the last good checkpoint is step 2" in message and "train.lr" in message
    assert sorted(os.listdir(out / "checkpoints")) == ["2"]
    assert not (out / "drafter").exists()
    records = _records(str(out))
    assert all(np.isfinite(r["loss"]) for r in records if "loss" in r)


def test_metrics_go_to_tensorboard_when_it_is_installed(dflash_run):
    from tensorboardX.proto import event_pb2  # in the test extra: this test runs everywhere

    out = dflash_run[0]
    files = os.listdir(os.path.join(out, "tensorboard"))
    assert files and all(f.startswith("events.out.tfevents") for f in files)
    losses, tags = {}, set()
    for name in files:  # one per run that logged into this directory
        with open(os.path.join(out, "tensorboard", name), "rb") as f:
            data = f.read()
        pos = 0
        while pos < len(data):  # TFRecord: length, its CRC, the Event, its CRC
            n = int.from_bytes(data[pos:pos + 8], "little")
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 16 + n
            for v in event.summary.value:
                tags.add(v.tag)
                if v.tag == "train/loss":
                    losses[event.step] = v.simple_value
    assert {"train/grad_norm", "train/tau", "train/tokens_per_s", "eval/eval_tau"} <= tags
    jsonl = {r["step"]: r["loss"] for r in _records(out) if "loss" in r}
    assert sorted(losses) == sorted(jsonl)
    np.testing.assert_allclose([losses[s] for s in jsonl], list(jsonl.values()), rtol=1e-6)


def test_training_logs_without_tensorboard(tmp_path, monkeypatch):
    import sys

    from retrace_jax.errors import ConfigError
    from retrace_jax.training.evaluate import MetricsLog

    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if it were not installed
    log = MetricsLog(str(tmp_path), "auto", echo=False)
    log({"step": 1, "loss": 2.5})
    log.close()
    assert _records(str(tmp_path)) == [{"step": 1, "loss": 2.5}] and not (tmp_path / "tensorboard").exists()
    with pytest.raises(ConfigError, match="pip install 'retrace-jax\\[tensorboard\\]'"):
        MetricsLog(str(tmp_path / "b"), True)


@pytest.mark.slow  # CI time; pytest -m slow runs it
def test_a_draft_vocabulary_is_chosen_from_the_data_kept_on_resume_and_exported(workspace, dflash_run, capsys):
    from retrace_jax.models.draft_vocab import frequent_tokens, token_counts
    from retrace_jax.training.data import SequenceData

    root, config = workspace
    out = str(root / "vocab")
    args = ["--config", config, "--set", f"out={out}", "--set", "train.steps=6", "--set", "train.checkpoint_every=3"]
    train.main(args + ["--set", "drafter.draft_vocab=40", "--set", "train.stop_after=3"])
    # another vocabulary is another run
    message = cli_error(capsys, train.main, args + ["--set", "drafter.draft_vocab=30"])
    assert "draft_vocab: " in message and "then" in message
    # the same for an export
    message = cli_error(capsys, train.main, args + ["--set", "drafter.draft_vocab=30", "--stage", "export"])
    assert "draft_vocab: " in message
    early = train.main(args + ["--set", "drafter.draft_vocab=40", "--stage", "export"])  # the stopped run's step 3
    assert early == os.path.join(out, "drafter_step3")
    summary = train.main(args + ["--set", "drafter.draft_vocab=40"])
    last = train.main(args + ["--set", "drafter.draft_vocab=40", "--stage", "export", "--step", "6"])
    for name in ("model.safetensors", "draft_vocab.safetensors"):  # the export of the last step is the drafter
        a, b = load_file(os.path.join(out, "drafter", name)), load_file(os.path.join(last, name))
        assert sorted(a) == sorted(b)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"{name}: {key}")
    early_ids = load_file(os.path.join(early, "draft_vocab.safetensors"))["draft_token_ids"]
    np.testing.assert_array_equal(early_ids, load_file(os.path.join(last, "draft_vocab.safetensors"))["draft_token_ids"])
    assert any(not np.array_equal(v, _tensors(out)[k]) for k, v in load_file(os.path.join(early, "model.safetensors")).items())
    event = [r for r in _records(out) if r.get("event") == "draft_vocab"][0]
    assert event["size"] == 40 and 0.5 < event["coverage"] <= 1.0
    assert any(r.get("event") == "resumed" for r in _records(out))
    data = SequenceData(str(root / "data"), 48)
    ids = load_file(os.path.join(out, "drafter", "draft_vocab.safetensors"))["draft_token_ids"]
    np.testing.assert_array_equal(ids, frequent_tokens(token_counts(data.tokens, data.mask, 128), 40))
    assert sorted(_tensors(out)) == sorted(_tensors(dflash_run[0]))  # model.safetensors: the official layout
    target = rj.load_target(yaml.safe_load(open(config))["target"])
    drafter = rj.load_drafter(summary["drafter"], target)
    prompts = json.load(open(root / "data" / "eval_prompts.json"))
    assert rj.generate(target, prompts, 24, drafter=drafter).tokens == rj.generate(target, prompts, 24).tokens
    # a drafter keeps its draft vocabulary
    message = cli_error(capsys, train.main, ["--config", config, "--set", f"out={root / 'vocab_retrace'}",
                                            "--set", "train.objective=retrace", "--set",
                                            f"drafter.init={summary['drafter']}", "--set",
                                            "drafter.draft_vocab=50"])
    # (refused by the pre-flight check, before any work, naming both values)
    assert "drafter.draft_vocab: 50, but drafter.init" in message and "has 40" in message
    assert "keeps its own" in message


def test_export_reads_checkpoints_and_refuses_clearly(workspace, dflash_run, capsys):
    root, config = workspace
    out = dflash_run[0]
    args = ["--config", config, "--set", f"out={out}", "--stage", "export"]
    log = root / "dflash" / "metrics.jsonl"
    before = log.read_text()
    checkpoints = sorted(os.listdir(os.path.join(out, "checkpoints")))
    path = train.main(args + ["--step", "20"])
    assert path == os.path.join(out, "drafter_step20")
    target = rj.load_target(yaml.safe_load(open(config))["target"])
    drafter = rj.load_drafter(path, target)
    prompts = json.load(open(root / "data" / "eval_prompts.json"))
    assert rj.generate(target, prompts, 24, drafter=drafter).tokens == rj.generate(target, prompts, 24).tokens
    assert log.read_text() == before  # the run's log is left alone
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == checkpoints
    message = cli_error(capsys, train.main, args + ["--step", "30"])
    assert "no checkpoint of step 30" in message and "20, 40" in message
    message = cli_error(capsys, train.main, args + ["--set", "train.lr=0.1"])
    assert "lr: 0.003 then, 0.1 now" in message
    message = cli_error(capsys, train.main, ["--config", config, "--set", f"out={root / 'never_trained'}",
                                            "--stage", "export"])
    assert "no checkpoints in" in message
    assert not os.path.exists(root / "never_trained")
    with pytest.raises(SystemExit) as exit_:  # argparse: --step only with --stage export
        train.main(["--config", config, "--step", "20"])
    assert exit_.value.code == 2


def test_data_of_float32_products_is_refused_for_bfloat16_products_and_old_manifests_read_as_float32(
        workspace, dflash_run, tmp_path, capsys):
    """target_precision is part of the data's target: bfloat16 products do not continue float32 data, and
    a manifest written before the key existed counts as float32 products."""
    root, config = workspace
    target = load_config(config).target
    message = cli_error(capsys, train.main, ["--config", config, "--set", f"out={tmp_path}/a", "--set",
                                            "target_precision=bfloat16", "--stage", "prepare"])
    assert f"was prepared with another target: {target} (float32, config.json" in message, message
    assert f"then, {target} (float32, bfloat16 products, config.json" in message, message
    old = tmp_path / "old_data"
    shutil.copytree(root / "data", old)
    manifest = json.loads((old / "manifest.json").read_text())
    assert manifest["target"].pop("precision") == "float32"
    (old / "manifest.json").write_text(json.dumps(manifest))
    cfg = load_config(config, [f"data.dir={old}"])
    check_prepared(cfg)  # float32 products: accepted
    with pytest.raises(DataError, match="bfloat16 products"):
        check_prepared(load_config(config, [f"data.dir={old}", "target_precision=bfloat16"]))


def test_length_buckets_train_with_and_without_the_feature_store(workspace, dflash_run, tmp_path):
    """Batches of similar lengths, each as wide as it needs: the step runs at each width, from features
    computed in the step and from the store."""
    root, config = workspace
    for cache in ("false", "true"):
        out = tmp_path / cache
        summary = train.main(["--config", config, "--set", f"out={out}", "--set", "train.steps=6", "--set",
                              "train.length_buckets=true", "--set", f"train.feature_cache={cache}", "--set",
                              "train.seq_len=200", "--set", "train.checkpoint_every=6"])
        assert summary["steps_run"] == 6 and os.path.exists(out / "drafter")
        losses = [r["loss"] for r in _records(out) if "loss" in r]
        assert len(losses) == 6 and all(np.isfinite(losses))


def test_a_narrower_mlp_starts_from_the_most_active_neurons(workspace, dflash_run, tmp_path, capsys):
    root, config = workspace
    out = tmp_path / "active"
    common = ["--config", config, "--set", "train.steps=2", "--set", "drafter.init_layers=[1]", "--set",
              "drafter.intermediate_size=32", "--set", "train.checkpoint_every=2", "--set", "train.eval_every=0"]
    train.main([*common, "--set", f"out={out}", "--set", "drafter.init_mlp_neurons=active",
                "--set", "drafter.init_final_norm=true", "--set", "drafter.init_fc=mean"])
    events = [r for r in _records(out) if r.get("event") == "layer_statistics"]
    assert [{k: e[k] for k in ("layers", "sequences")} for e in events] == [{"layers": [1], "sequences": 32}]
    with pytest.raises(rj.ConfigError, match="drafter.init_mlp_neurons: chooses the neurons"):
        load_config(config, ["drafter.init_mlp_neurons=active"])
    with pytest.raises(rj.ConfigError, match="drafter.init_qk_norm: scales the q/k norms"):
        load_config(config, ["drafter.init_qk_norm=target"])
    # the workspace's target is a Qwen3, whose q/k norms init_layers copies
    error = cli_error(capsys, train.main, [*common, "--set", f"out={tmp_path / 'qk'}", "--set",
                                           "drafter.init_qk_norm=target"])
    assert error.startswith("error: drafter.init_layers:") and "q/k norms of their own" in error


def test_bfloat16_products_train_close_to_float32_and_are_part_of_the_settings(workspace, dflash_run, tmp_path,
                                                                                 capsys):
    """train.precision bfloat16: the same run with bfloat16 products in the forward and backward passes
    starts from the same weights and follows float32's losses closely, not exactly; resuming under the
    other precision is refused."""
    root, config = workspace
    losses = {}
    for precision in ("float32", "bfloat16"):
        out = tmp_path / precision
        summary = train.main(["--config", config, "--set", f"out={out}", "--set", "train.steps=6", "--set",
                              f"train.precision={precision}", "--set", "train.checkpoint_every=3"])
        assert summary["steps_run"] == 6
        losses[precision] = np.array([r["loss"] for r in _records(out) if "loss" in r])
    assert np.isfinite(losses["bfloat16"]).all() and not np.array_equal(losses["bfloat16"], losses["float32"])
    np.testing.assert_allclose(losses["bfloat16"], losses["float32"], rtol=0.02)
    # the checkpoint of step 3 of the float32 run does not resume under bfloat16 products
    shutil.rmtree(tmp_path / "float32" / "checkpoints" / "6")
    error = cli_error(capsys, train.main, ["--config", config, "--set", f"out={tmp_path / 'float32'}", "--set",
                                           "train.steps=6", "--set", "train.precision=bfloat16", "--set",
                                           "train.checkpoint_every=3"])
    assert "precision" in error


def test_preparation_streams_each_shard_through_gen_batch_size_slots(tmp_path, monkeypatch):
    """Regeneration runs each shard as one stream (generate's slots = gen_batch_size), and its greedy
    responses are the target's own for every prompt, as a static batch gives them."""
    import retrace_jax.training.prepare as prepare_module
    from retrace_jax.models.tiny import tiny_target
    from retrace_jax.training.config import as_config
    from retrace_jax.training.data import SequenceData

    seen = []
    real = prepare_module.generate

    def recording(*args, **kwargs):
        seen.append(kwargs.get("slots"))
        return real(*args, **kwargs)

    monkeypatch.setattr(prepare_module, "generate", recording)
    cfg = {"target": "tiny", "out": str(tmp_path / "out"),
           "data": {"num_prompts": 12, "eval_prompts": 2, "prompt_len": 5, "max_new_tokens": 6, "gen_batch_size": 3,
                    "shard_size": 8}}
    out = prepare_module.prepare(cfg, log=lambda record: None)
    assert seen == [3, 3]  # two shards (8 and 4 prompts), 3 slots each
    prompts = prepare_module.prompt_ids(as_config(cfg), 512, None, lambda record: None)[:12]
    expected = rj.generate(tiny_target(), prompts, 6).tokens
    got = [t.tolist() for t in SequenceData(out, seq_len=16).tokens]
    assert got == [p + r for p, r in zip(prompts, expected)]
