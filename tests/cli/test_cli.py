"""The command lines: train.py writes a drafter that decode.py runs; decode.py reads HF directories."""

import json
import os
import shutil

import pytest

import decode
import retrace_jax as rj
import train
from tests.helpers import save_word_tokenizer

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "tiny_dflash.yaml")


def test_train_then_decode_tiny(tmp_path, capsys):
    out = str(tmp_path / "run")
    train.main(["--config", CONFIG, "--set", "train.steps=3", "--set", "data.num_prompts=8", "--set",
                "data.eval_prompts=2", "--set", "data.max_new_tokens=12", "--set", "train.seq_len=24",
                "--set", "train.batch_size=4", "--set", f"out={out}"])
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert records[0]["event"] == "prepared" and records[-1]["event"] == "done"
    assert any("loss" in r for r in records)
    capsys.readouterr()
    decode.main(["--target", "tiny", "--drafter", os.path.join(out, "drafter"), "--max-new-tokens", "12",
                 "--runs", "1"])
    lines = capsys.readouterr().out.splitlines()
    table = [line for line in lines if line.startswith(("plain ", "dflash "))]
    assert len(table) == 2 and all(line.endswith("yes") for line in table)
    decode.main(["--target", "tiny", "--max-new-tokens", "12", "--runs", "1"])  # the smoke run: a random drafter
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("A smoke run")
    table = [line for line in lines if line.startswith(("plain ", "dflash "))]
    assert len(table) == 2 and all(line.endswith("yes") for line in table)


@pytest.mark.parametrize("argv, message", [
    (["--set", "train.stpes=3"], "error: --set train.stpes: unknown key; did you mean 'steps'?"),
    (["--config", "NONE"], "error: config file not found: "),
])
def test_train_config_errors_are_one_line(argv, message, tmp_path, capsys):
    argv = [str(tmp_path / "none.yaml") if a == "NONE" else a for a in argv]
    with pytest.raises(SystemExit) as exit_:
        train.main(argv if "--config" in argv else ["--config", CONFIG, *argv])
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1 and "Traceback" not in err


def _target_and_drafter_dirs(hf_model_dir, trained_drafter, tmp_path):
    """A copy of the tiny qwen3 Hugging Face directory with a word tokenizer, and the trained drafter saved
    beside it."""
    _, directory = hf_model_dir("qwen3")
    target_dir = str(tmp_path / "target")
    shutil.copytree(directory, target_dir)
    save_word_tokenizer(target_dir)
    drafter_dir = str(tmp_path / "drafter")
    rj.save_drafter(trained_drafter[0], drafter_dir)
    return target_dir, drafter_dir


def test_decode_with_hf_directories(hf_model_dir, trained_drafter, tmp_path, capsys):
    target_dir, drafter_dir = _target_and_drafter_dirs(hf_model_dir, trained_drafter, tmp_path)
    decode.main(["--target", target_dir, "--drafter", drafter_dir, "--prompt", "w5 w6 w7 w8", "--raw",
                 "--max-new-tokens", "20", "--runs", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("w") for line in lines)  # decoded text
    table = [line for line in lines if line.startswith(("plain ", "dflash "))]
    assert len(table) == 2 and all(line.endswith("yes") for line in table)


def test_decode_tiny_runs_and_says_the_dtype_it_was_given(monkeypatch, capsys):
    """--dtype applies to the tiny smoke run's target and drafter, and the model lines say it (the runs are
    replaced: only what decode.py hands to generate is checked)."""
    import jax.numpy as jnp

    from retrace_jax.cli import decode as cli_decode

    seen = []

    def fake(target, ids, label, runs, **kwargs):
        seen.append((target.dtype, kwargs.get("drafter", target).dtype))
        return rj.GenerateOutput([[5, 6]], [[2]]), 1.0, 0.5, 0.1

    monkeypatch.setattr(cli_decode, "timed_generate", fake)
    monkeypatch.setenv("RETRACE_JAX_CACHE_DIR", "")
    decode.main(["--target", "tiny", "--dtype", "bfloat16", "--runs", "1"])
    assert seen == [(jnp.bfloat16, jnp.bfloat16)] * 2  # plain, then DFlash
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("target:") and line.endswith("bfloat16)") for line in lines), lines
    assert any(line.startswith("drafter:") and line.endswith("bfloat16)") for line in lines), lines


@pytest.mark.parametrize("argv, name, raw", [
    ([], "qwen2.5-coder-0.5b-instruct", True),  # the demo: the code model continues a function, raw text
    (["--target", "smollm2-135m-instruct"], "smollm2-135m-instruct", False),  # a chat question
])
def test_decode_demo_runs_a_shipped_pair_with_its_prompt(argv, name, raw, hf_model_dir, trained_drafter, tmp_path,
                                                         monkeypatch, capsys):
    """Without --target (or with the name of a model that has a shipped drafter) decode.py fetches that
    model, loads its shipped drafter and runs its demo prompt: raw for the code model, through the chat
    template for SmolLM2 (fetching and the timed runs are replaced here)."""
    from retrace_jax.cli import decode as cli_decode

    target_dir, drafter_dir = _target_and_drafter_dirs(hf_model_dir, trained_drafter, tmp_path)
    asked, prompts, blocks = [], [], []
    monkeypatch.setattr(rj.assets, "fetch", lambda model: asked.append(("fetch", model)) or target_dir)
    monkeypatch.setattr(rj.assets, "shipped_drafter", lambda model: asked.append(("drafter", model)) or drafter_dir)

    def fake(target, ids, label, runs, **kwargs):
        prompts.append(ids)
        blocks.append(kwargs.get("block_size"))
        return rj.GenerateOutput([[5, 6]], [[2]]), 1.0, 0.5, 0.1

    monkeypatch.setattr(cli_decode, "timed_generate", fake)
    monkeypatch.setenv("RETRACE_JAX_CACHE_DIR", "")
    if cli_decode.DEMO_PAIRS[name].block_size is not None:  # a block other than the test drafter's 4
        monkeypatch.setitem(cli_decode.DEMO_PAIRS, name, cli_decode.DEMO_PAIRS[name]._replace(block_size=2))
    decode.main([*argv, "--runs", "1"])
    assert asked == [("drafter", name), ("fetch", name)]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"Demo: {name} as the target")
    prompt_line = next(line for line in lines if line.startswith("prompt ("))
    assert ("chat template applied" in prompt_line) is not raw
    assert prompt_line.endswith(cli_decode.DEMO_PAIRS[name].prompt.splitlines()[0]), prompt_line
    assert len(prompts) == 2 and prompts[0] == prompts[1]  # plain and DFlash on the same ids
    block = cli_decode.DEMO_PAIRS[name].block_size
    assert blocks == [None, block]  # the pair's demo block (None: the drafter's own)
    drafter_line = next(line for line in lines if line.startswith("drafter:"))
    assert (f"run at block {block}" in drafter_line) is (block is not None), drafter_line


def test_decode_with_a_tiny_top_p_prints_the_greedy_tokens(monkeypatch, capsys):
    """decode.py --temperature 1 --top-p 1e-40 printed token id 0 everywhere: a top_p this small keeps only
    the most likely token (the tiny float32 target has no ties)."""
    monkeypatch.setenv("RETRACE_JAX_CACHE_DIR", "")
    printed = []
    for argv in (["--temperature", "1", "--top-p", "1e-40"], []):
        decode.main(["--target", "tiny", "--max-new-tokens", "8", "--runs", "1", *argv])
        printed.append(next(line for line in capsys.readouterr().out.splitlines() if line.startswith("token ids:")))
    assert printed[0] == printed[1] and printed[0] != "token ids: [0, 0, 0, 0, 0, 0, 0, 0]", printed


@pytest.mark.parametrize("argv, demo", [([], True), (["--prompt", "w5 w6"], False),
                                        (["--target", "smollm2", "--prompt", "w5 w6"], False)])
def test_decode_announces_the_demo_only_when_it_runs_the_demo_prompt(argv, demo, hf_model_dir, tmp_path, monkeypatch,
                                                                     capsys):
    """The "Demo: qwen2.5-coder-0.5b-instruct ..." banner was printed above the user's own --prompt."""
    from retrace_jax.cli import decode as cli_decode

    target_dir = str(tmp_path / "target")
    shutil.copytree(hf_model_dir("qwen3")[1], target_dir)
    save_word_tokenizer(target_dir)
    cfg = rj.load_target(target_dir).cfg
    drafter_dir = str(tmp_path / "drafter")
    rj.save_drafter(rj.init_drafter(cfg, mask_token_id=cfg.vocab_size - 1, num_layers=1, block_size=4), drafter_dir)
    monkeypatch.setattr(rj.assets, "fetch", lambda model: target_dir)
    monkeypatch.setattr(rj.assets, "shipped_drafter", lambda model: drafter_dir)
    monkeypatch.setattr(cli_decode, "timed_generate",
                        lambda target, ids, label, runs, **kwargs: (rj.GenerateOutput([[5, 6]], [[2]]), 1.0, 0.5, 0.1))
    monkeypatch.setenv("RETRACE_JAX_CACHE_DIR", "")
    capsys.readouterr()
    decode.main([*argv, "--runs", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Demo: ") is demo, lines
    assert any(line.startswith("drafter:") and drafter_dir in line for line in lines)  # the shipped drafter all the same
