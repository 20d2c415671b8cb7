"""The registry assets' readers (no download here): the cut-short ShareGPT array, HumanEval, and the
drafter shipped for the demo."""

import gzip
import json
import os

import pytest
from safetensors import safe_open

from retrace_jax.assets import prompts, shipped

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
