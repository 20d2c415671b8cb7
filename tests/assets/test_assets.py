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


@pytest.mark.parametrize("variant", ["default", "retrace"])
def test_shipped_drafters_match_smollm2(variant):
    """The demo's default (DFlash, two layers, a draft vocabulary beside the official layout) and the
    earlier ReTrace drafter both fit SmolLM2-135M-Instruct and stay small."""
    path = shipped.shipped_drafter("smollm2-135m-instruct", variant)
    if variant == "default":
        assert path == shipped.shipped_drafter("smollm2-135m-instruct")
    with open(os.path.join(path, "config.json")) as f:
        cfg = DrafterConfig.from_hf(json.load(f))
    check_drafter_matches(cfg, ModelConfig.from_hf(SMOLLM2))
    assert (cfg.retrace is not None) == (variant == "retrace")
    with safe_open(os.path.join(path, "model.safetensors"), "np") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    assert shapes["fc.weight"] == [576, 576 * len(cfg.target_layer_ids)]
    assert os.path.getsize(os.path.join(path, "model.safetensors")) < 16 << 20
    if variant == "default":
        ids = read_draft_vocab(path, cfg)
        assert cfg.draft_vocab_size == len(ids) == len(set(ids.tolist())) and ids.max() < SMOLLM2["vocab_size"]
