"""Loading Hugging Face checkpoints: sharded files, and clear errors for what does not fit."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

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
    leaves_a, leaves_b = (nnx.to_flat_state(nnx.state(m)) for m in (a, b))
    assert [p for p, _ in leaves_a] == [p for p, _ in leaves_b]
    for (path, x), (_, y) in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x.get_value()), np.asarray(y.get_value()), err_msg=str(path))


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
    with pytest.raises(rj.ConfigError, match="model_type: must be 'qwen3', 'qwen2' or 'llama', got 'mistral'"):
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


def test_model_config_to_hf_round_trips(family):
    cfg = rj.ModelConfig.from_hf(make_hf_model(family).config.to_dict())
    assert rj.ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_model_config_to_hf_refuses_what_the_family_cannot_express():
    import dataclasses

    from retrace_jax.models.tiny import TINY_QWEN3

    with pytest.raises(rj.ConfigError, match="qk_norm"):
        dataclasses.replace(TINY_QWEN3, model_type="llama").to_hf()
    with pytest.raises(rj.ConfigError, match="attention_bias"):
        dataclasses.replace(TINY_QWEN3, qkv_bias=True).to_hf()


def test_save_target_round_trips_and_transformers_agrees(family, hf_model_dir, tmp_path):
    """A loaded checkpoint saved again loads to the same parameters here and in transformers (float32
    logits agree); the save keeps other files (a tokenizer) and replaces the weights atomically."""
    import torch
    import transformers

    _, directory = hf_model_dir(family)
    target = rj.load_target(directory, dtype="float32")
    out = str(tmp_path / "saved")
    os.makedirs(out)
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        f.write("{}")
    rj.save_target(target, out, extra_config={"eos_token_id": 2})
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]
    again = rj.load_target(out, dtype="float32")
    for (p, a), (_, b) in zip(nnx_flat(target), nnx_flat(again)):
        np.testing.assert_array_equal(a, b, err_msg=str(p))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.config.eos_token_id == 2
    tokens = [[3, 17, 5, 99, 42, 8]]
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    mine = again(jnp.asarray(tokens), again.init_cache(1, 6), attention="dense")
    np.testing.assert_allclose(np.asarray(again.logits(mine.hidden)), ref, atol=2e-5, rtol=2e-5)


def test_save_target_bfloat16_halves_the_file(hf_model_dir, tmp_path):
    target = rj.load_target(hf_model_dir("qwen3")[1], dtype="float32")
    rj.save_target(target, str(tmp_path / "f32"))
    rj.save_target(target, str(tmp_path / "bf16"), dtype="bfloat16")
    size = lambda d: os.path.getsize(os.path.join(tmp_path, d, "model.safetensors"))  # noqa: E731
    assert size("bf16") < 0.55 * size("f32")
    assert rj.load_target(str(tmp_path / "bf16"), dtype="bfloat16").embed_tokens.embedding.dtype == jnp.bfloat16


def nnx_flat(module):
    from flax import nnx

    return [(p, np.asarray(v.get_value())) for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))]
