"""A demo shows a right answer and a claim that holds, or is not offered (#58 first contact):
``--target smollm2-135m-instruct`` explained speculative decoding as "Spatial Discrepancy Detection" at
0.40x, and ``--target lab`` printed 128 tokens of "#" lines at 0.94x while ``--help`` called the lab pair
"where speculative decoding pays on a CPU"."""

import os

import pytest

import retrace_jax as rj
from retrace_jax.cli import decode as cli_decode
from tests.helpers import cli_error

import decode  # the script at the repository's root

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LICENCE = "# Copyright 2024 The Authors.\n#\n# Licensed under the Apache License, Version 2.0 (the \"License\");\n"


def test_the_help_claims_no_speedup_and_offers_no_laboratory_demo(capsys):
    with pytest.raises(SystemExit):
        cli_decode.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "pays" not in text and "--target lab " not in text and '"lab"' not in text, text
    assert "slower than plain" in text  # SmolLM2's drafter, said where the pair is offered
    assert "lab" not in cli_decode.named_targets()


def test_each_demo_records_the_right_answer_it_shows():
    """Each shipped pair's demo prompt comes with the start of the right answer its target gives
    (checked against the real models by test_the_demo_answers_are_the_targets_own below)."""
    assert set(cli_decode.DEMO_PAIRS) == set(rj.assets.SHIPPED)
    code = cli_decode.DEMO_PAIRS["qwen2.5-coder-0.5b-instruct"]
    assert code.prompt.startswith("def binary_search(") and "while left <= right:" in code.answer
    chat = cli_decode.DEMO_PAIRS["smollm2-135m-instruct"]
    assert "reverses a string" in chat.prompt and "[::-1]" in chat.answer
    assert cli_decode.DEFAULT_PROMPT == chat.prompt


@pytest.mark.parametrize("cwd", [ROOT, None])
def test_target_lab_is_refused_with_the_command_that_runs_the_pair(cwd, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RETRACE_JAX_TRACEBACK", raising=False)
    monkeypatch.chdir(cwd or tmp_path)  # in the repository, lab/ is a directory (with no config.json)
    assert cli_error(capsys, decode.main, ["--target", "lab"]) == f"error: {cli_decode.LAB_NO_DEMO}"
    assert "--target lab/target --drafter lab/drafters/B --raw" in cli_decode.LAB_NO_DEMO


def test_the_laboratory_pair_runs_from_its_directories(monkeypatch, capsys):
    """What the refusal of --target lab says to run: lab/target with lab/drafters/B on raw text, lossless."""
    monkeypatch.setenv("RETRACE_JAX_CACHE_DIR", "")
    monkeypatch.chdir(ROOT)
    decode.main(["--target", "lab/target", "--drafter", "lab/drafters/B", "--raw", "--prompt", LICENCE,
                 "--max-new-tokens", "24", "--runs", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("prompt (") and "chat template" not in line for line in lines)
    table = [line for line in lines if line.startswith(("plain ", "dflash "))]
    assert len(table) == 2 and all(line.endswith("yes") for line in table)
    assert float(table[1].split()[2]) > 2  # the trained pair drafts the licence text well


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(cli_decode.DEMO_PAIRS))
def test_the_demo_answers_are_the_targets_own(name):
    """The real target's greedy float32 answer to its demo prompt starts with the recorded right answer
    (needs the model fetched: python scripts/fetch_assets.py NAME; Qwen2.5-Coder-0.5B takes 2.5 GB)."""
    from retrace_jax.training.data import chat_encoder, load_tokenizer

    directory = os.path.join(rj.assets.DEFAULT_CACHE, name)
    if not os.path.isfile(os.path.join(directory, "model.safetensors")):
        pytest.skip(f"{name} is not fetched")
    pair = cli_decode.DEMO_PAIRS[name]
    target, tokenizer = rj.load_target(directory, dtype="float32"), load_tokenizer(directory)
    chat = [{"role": "user", "content": pair.prompt}]
    ids = tokenizer.encode(pair.prompt) if pair.raw else chat_encoder(tokenizer)(chat)
    out = rj.generate(target, [ids], 64, stop_token_ids=[tokenizer.eos_token_id])
    assert tokenizer.decode(out.tokens[0]).startswith(pair.answer)
