"""Loading Hugging Face checkpoints: sharded files, and clear errors for what does not fit."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

import retrace_jax as rj
from tests.helpers import copy_model_dir, edit_config, edit_tensors, make_hf_model, save_hf_model


@pytest.fixture
def qwen3_copy(hf_model_dir, tmp_path):
    return copy_model_dir(hf_model_dir("qwen3")[1], tmp_path / "model")


def test_sharded_checkpoint_loads_identically(hf_model_dir, tmp_path):
    model, directory = hf_model_dir("qwen3")
    sharded = save_hf_model(model, str(tmp_path / "sharded"), max_shard_size="100KB")
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    a, b = rj.load_target(directory), rj.load_target(sharded)
    np.testing.assert_array_equal(np.asarray(a.lm_head.kernel[...]), np.asarray(b.lm_head.kernel[...]))


def test_missing_directory_and_files(tmp_path, qwen3_copy):
    with pytest.raises(FileNotFoundError, match="not found"):
        rj.load_target(str(tmp_path / "nope"))
    os.remove(os.path.join(qwen3_copy, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        rj.load_target(qwen3_copy)
    os.remove(os.path.join(qwen3_copy, "config.json"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        rj.load_target(qwen3_copy)


def test_missing_shard_file(hf_model_dir, tmp_path):
    model, _ = hf_model_dir("qwen3")
    sharded = save_hf_model(model, str(tmp_path / "sharded"), max_shard_size="100KB")
    shard = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))[0]
    os.remove(os.path.join(sharded, shard))
    with pytest.raises(FileNotFoundError, match=shard):
        rj.load_target(sharded)


def test_unsupported_model_type(qwen3_copy):
    edit_config(qwen3_copy, lambda c: c.update(model_type="mistral"))
    with pytest.raises(rj.ConfigError, match="unsupported model_type 'mistral'"):
        rj.load_target(qwen3_copy)


def test_unsupported_rope_scaling(qwen3_copy):
    edit_config(qwen3_copy, lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(rj.ConfigError, match="yarn"):
        rj.load_target(qwen3_copy)


def test_missing_and_extra_tensors(qwen3_copy):
    def edit(t):
        t["model.extra.weight"] = np.zeros((2,), np.float32)
        del t["model.layers.1.mlp.up_proj.weight"]

    edit_tensors(qwen3_copy, edit)
    with pytest.raises(rj.CheckpointError, match=r"missing tensors model.layers.1.mlp.up_proj.weight.*model.extra.weight"):
        rj.load_target(qwen3_copy)


def test_wrong_shape(qwen3_copy):
    edit_tensors(qwen3_copy, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((32, 64), np.float32)}))
    with pytest.raises(rj.CheckpointError, match=r"k_proj.weight has shape \(32, 64\), the config implies \(64, 64\)"):
        rj.load_target(qwen3_copy)


def test_rope_theta_under_rope_parameters_and_top_level():
    base = dict(model_type="qwen3", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=2)
    assert rj.ModelConfig.from_hf({**base, "rope_theta": 5.0}).rope_theta == 5.0
    assert rj.ModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}).rope_theta == 7.0
    with pytest.raises(rj.ConfigError, match="num_hidden_layers"):
        rj.ModelConfig.from_hf({k: v for k, v in base.items() if k != "num_hidden_layers"})


def test_bad_dtype(qwen3_copy):
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        rj.load_target(qwen3_copy, dtype="float16")


def test_bfloat16_checkpoint(tmp_path):
    model = make_hf_model("qwen2").to(dtype=__import__("torch").bfloat16)
    directory = save_hf_model(model, str(tmp_path / "bf16"))
    target = rj.load_target(directory, dtype="bfloat16")
    assert target.embed_tokens.embedding.dtype == jnp.bfloat16
    assert rj.load_target(directory).embed_tokens.embedding.dtype == jnp.float32
