"""The registry assets' readers (no download here): the cut-short ShareGPT array, HumanEval, and the
drafter shipped for the demo."""

import gzip
import json
import os
import re
import shutil
import tomllib

import pytest
from safetensors import safe_open

import retrace_jax as rj
from retrace_jax.assets import prompts, shipped
from retrace_jax.errors import CheckpointError

# config.json of SmolLM2-135M-Instruct as retrace_jax.assets writes it
from retrace_jax.io.checkpoints import read_draft_vocab
from retrace_jax.models.config import ModelConfig
from retrace_jax.models.drafter import DrafterConfig, check_drafter_matches

# config.json of SmolLM2-135M-Instruct as retrace_jax.assets writes it
SMOLLM2 = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
           "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
           "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
           "tie_word_embeddings": True, "hidden_act": "silu"}
# the fields of Qwen2.5-Coder-0.5B-Instruct's config.json (as rj.assets.fetch converts it) that a drafter must match
QWEN25_CODER = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
                "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "head_dim": 64,
                "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                "tie_word_embeddings": False, "hidden_act": "silu"}


def test_sharegpt_array_cut_short_yields_whole_records(tmp_path):
    records = [{"id": "a", "conversations": [{"from": "human", "value": " Hi there "}, {"from": "gpt", "value": "x"}]},
               {"id": "b", "conversations": [{"from": "gpt", "value": "starts with the model"}]},
               {"id": "c", "conversations": []},
               {"id": "d", "conversations": [{"from": "human", "value": "Second"}]}]
    text = json.dumps(records, indent=1)
    cut = text[: text.index('"Second"') + 4]  # the last record is incomplete
    src = tmp_path / "sharegpt.json"
    src.write_text(cut)
    assert [r["id"] for r in prompts.sharegpt_records(str(src))] == ["a", "b", "c"]
    src.write_text(text)
    assert [r["id"] for r in prompts.sharegpt_records(str(src))] == ["a", "b", "c", "d"]
    out = tmp_path / "sharegpt.jsonl"
    assert prompts.write_sharegpt(str(src), str(out)) == 2
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0] == {"id": "a", "messages": [{"role": "user", "content": "Hi there"}]}
    assert lines[1]["id"] == "d"


def test_humaneval_prompts(tmp_path):
    src = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(src, "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f(x):\n    \"\"\"Doc.\"\"\"\n"}) + "\n")
    out = tmp_path / "humaneval.jsonl"
    assert prompts.write_humaneval(str(src), str(out)) == 1
    record = json.loads(out.read_text())
    assert record["task_id"] == "HumanEval/0" and record["prompt"].endswith("```python\ndef f(x):\n    \"\"\"Doc.\"\"\"\n```")


@pytest.mark.parametrize("model, variant, hf, layers", [
    ("smollm2-135m-instruct", "default", SMOLLM2, 2),
    ("smollm2-135m-instruct", "retrace", SMOLLM2, 1),
    ("qwen2.5-coder-0.5b-instruct", "default", QWEN25_CODER, 2),
    ("qwen2.5-coder-0.5b-instruct", "retrace", QWEN25_CODER, 2),
])
def test_shipped_drafters_fit_their_targets(model, variant, hf, layers):
    """Each shipped drafter fits its target and stays small: the demo's defaults (DFlash, two layers, a
    draft vocabulary beside the official layout) and the ReTrace drafters. Each is a plain
    directory of bfloat16 tensors (package data cannot hold the symbolic link of rj.save_drafter's
    versioned layout)."""
    path = shipped.shipped_drafter(model, variant)
    if variant == "default":
        assert path == shipped.shipped_drafter(model)
    assert os.path.isdir(path) and not os.path.islink(path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = DrafterConfig.from_hf(json.load(f))
    check_drafter_matches(cfg, ModelConfig.from_hf(hf))
    assert (cfg.retrace is not None) == (variant == "retrace") and cfg.num_layers == layers
    with safe_open(os.path.join(path, "model.safetensors"), "np") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    d = hf["hidden_size"]
    assert shapes["fc.weight"] == [d, d * len(cfg.target_layer_ids)] and dtypes == {"BF16"}
    assert os.path.getsize(os.path.join(path, "model.safetensors")) < 30 << 20
    if cfg.draft_vocab_size is not None:
        ids = read_draft_vocab(path, cfg)
        assert cfg.draft_vocab_size == len(ids) == len(set(ids.tolist())) and ids.max() < hf["vocab_size"]


@pytest.fixture
def shipped_copy(tmp_path, monkeypatch):
    """The shipped drafters copied to ``tmp_path``, where ``shipped_drafter`` now finds them."""
    copy = tmp_path / "drafters"
    shutil.copytree(shipped.DRAFTERS_DIR, copy)
    monkeypatch.setattr(shipped, "DRAFTERS_DIR", str(copy))
    return copy


def _flip_a_bit(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))


@pytest.mark.parametrize("model, variant", [(m, v) for m, variants in shipped.SHIPPED.items() for v in variants])
def test_a_shipped_drafter_is_checked_against_its_recorded_checksums(shipped_copy, model, variant):
    """Each shipped drafter records the sha256 of its files in SHA256SUMS (sha256sum's format) when it
    ships; shipped_drafter compares them, as a training checkpoint's are: a flipped bit in the weights
    (which would load without complaint) is refused, naming the file."""
    path = shipped.shipped_drafter(model, variant)
    with open(os.path.join(path, "SHA256SUMS")) as f:
        listed = sorted(line.split("  ", 1)[1] for line in f.read().splitlines())
    assert listed == sorted(n for n in os.listdir(path) if n != "SHA256SUMS") and "model.safetensors" in listed
    _flip_a_bit(os.path.join(path, "model.safetensors"), os.path.getsize(os.path.join(path, "model.safetensors")) - 3)
    with pytest.raises(CheckpointError, match=re.escape(
            f"the shipped drafter in {path} differs from the checksums recorded when it shipped: model.safetensors")):
        shipped.shipped_drafter(model, variant)


@pytest.mark.parametrize("damage, message", [
    (lambda path: os.remove(os.path.join(path, "SHA256SUMS")), "has no SHA256SUMS"),
    (lambda path: open(os.path.join(path, "SHA256SUMS"), "a").write("not a checksum line\n"), "SHA256SUMS is damaged"),
    (lambda path: open(os.path.join(path, "extra.safetensors"), "w").close(),
     "holds files that its SHA256SUMS does not list: extra.safetensors"),
    (lambda path: os.remove(os.path.join(path, "config.json")), "config.json (missing)"),
])
def test_a_shipped_drafter_without_its_checksums_or_with_other_files_is_refused(shipped_copy, damage, message):
    path = shipped.shipped_drafter("smollm2-135m-instruct")
    damage(path)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        shipped.shipped_drafter("smollm2-135m-instruct")


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "SHA256SUMS"])
@pytest.mark.parametrize("kind, described", [("directory", "is a directory"), ("fifo", "is a FIFO (named pipe)")])
def test_a_shipped_drafter_file_that_is_no_file_says_what_it_is(shipped_copy, name, kind, described):
    """A shipped drafter's model.safetensors that is a directory or a FIFO was reported as missing (and
    other files as "(missing)"); each is said to be what it is, and a FIFO is never opened (#58 item 11)."""
    import signal

    path = shipped.shipped_drafter("smollm2-135m-instruct")
    file = os.path.join(path, name)
    os.remove(file)
    os.mkdir(file) if kind == "directory" else os.mkfifo(file)

    def fail(*_):
        raise TimeoutError("a FIFO was opened (waiting for a writer)")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(60)
    try:
        with pytest.raises(CheckpointError, match=re.escape(
                f"the shipped drafter in {path} is damaged: {file} {described}, not a regular file (reinstall")):
            shipped.shipped_drafter("smollm2-135m-instruct")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_ship_drafter_writes_what_shipped_drafter_accepts(shipped_copy, monkeypatch):
    """The shipping path (scripts/qwen25coder05.sh, scripts/smollm2_demo.sh): a plain directory of bfloat16
    tensors and its SHA256SUMS, replacing what was there."""
    target = rj.tiny.tiny_target()
    drafter = rj.init_drafter(target.cfg, mask_token_id=3, num_layers=1, block_size=4)
    monkeypatch.setitem(shipped.SHIPPED, "tiny", {"default": "tiny-dflash"})
    destination = os.path.join(shipped_copy, "tiny-dflash")
    os.mkdir(destination)
    open(os.path.join(destination, "stale.safetensors"), "w").close()
    shipped.ship_drafter(drafter, destination)
    path = shipped.shipped_drafter("tiny")
    assert path == destination and not os.path.islink(path)
    assert sorted(os.listdir(path)) == ["SHA256SUMS", "config.json", "model.safetensors"]
    assert rj.load_drafter(path, target, dtype="bfloat16").cfg == drafter.cfg


def test_the_checksums_ship_as_package_data():
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "pyproject.toml"), "rb") as f:
        data = tomllib.load(f)["tool"]["setuptools"]["package-data"]["retrace_jax"]
    assert "assets/drafters/*/SHA256SUMS" in data
