"""Model configurations: ``config.json`` fields are checked by type and range before anything is built,
and every refusal names the file and the field. Keys that the library does not read are ignored (real
Hugging Face configs carry many)."""

import dataclasses
import json

import pytest

import retrace_jax as rj
from retrace_jax.models.tiny import TINY_QWEN3, tiny_target

TARGET = TINY_QWEN3.to_hf()
DRAFTER = rj.init_drafter(TINY_QWEN3, mask_token_id=5, num_layers=1, block_size=4, target_layer_ids=(1,),
                          retrace=rj.ReTraceConfig()).cfg.to_hf()


def _with(base, **changes):
    return {**base, **changes}


TARGET_CASES = {
    "a negative rms_norm_eps": (dict(rms_norm_eps=-1), r"rms_norm_eps: must be > 0, got -1"),
    "rms_norm_eps as a string": (dict(rms_norm_eps="1e-6"), r"rms_norm_eps: expected a number, got '1e-6'"),
    "a negative rope_theta": (dict(rope_parameters=None, rope_theta=-5), r"rope_theta: must be > 0, got -5"),
    "rope_theta 0 under rope_parameters": (dict(rope_parameters={"rope_type": "default", "rope_theta": 0}),
                                           r"rope_parameters\.rope_theta: must be > 0, got 0"),
    "rope_scaling as a string": (dict(rope_scaling="linear"), r"rope_scaling: expected a mapping, got 'linear'"),
    "linear rope_scaling": (dict(rope_scaling={"type": "linear", "factor": 2.0}),
                            r"rope_scaling: unsupported RoPE scaling 'linear'"),
    "no attention heads": (dict(num_attention_heads=0), r"num_attention_heads: must be >= 1, got 0"),
    "no KV heads": (dict(num_key_value_heads=0), r"num_key_value_heads: must be >= 1, got 0"),
    "layers as a string": (dict(num_hidden_layers="1"), r"num_hidden_layers: expected an integer, got '1'"),
    "layers as a float": (dict(num_hidden_layers=4.0), r"num_hidden_layers: expected an integer, got 4\.0"),
    "tie_word_embeddings as a string": (dict(tie_word_embeddings="false"),
                                        r"tie_word_embeddings: expected true or false, got 'false'"),
    "attention_bias as 1": (dict(attention_bias=1), r"attention_bias: expected true or false, got 1"),
    "heads not a multiple of KV heads": (dict(num_key_value_heads=3), r"not a multiple of num_key_value_heads=3"),
    "an unsupported model_type": (dict(model_type="mistral"),
                                  r"model_type: must be 'qwen3', 'qwen2' or 'llama', got 'mistral'"),
    "no max_position_embeddings": (dict(max_position_embeddings=0), r"max_position_embeddings: must be >= 1"),
}


@pytest.mark.parametrize("case", sorted(TARGET_CASES))
def test_bad_target_config_fields_are_refused(case):
    changes, pattern = TARGET_CASES[case]
    with pytest.raises(rj.ConfigError, match=pattern):
        rj.ModelConfig.from_hf(_with(TARGET, **changes))


def test_every_problem_is_named_and_other_keys_are_ignored():
    with pytest.raises(rj.ConfigError) as err:
        rj.ModelConfig.from_hf(_with(TARGET, rms_norm_eps=0.0, num_hidden_layers="2"))
    assert "rms_norm_eps: must be > 0" in str(err.value) and "num_hidden_layers: expected an integer" in str(err.value)
    with pytest.raises(rj.ConfigError, match=r"vocab_size: missing"):
        rj.ModelConfig.from_hf({k: v for k, v in TARGET.items() if k != "vocab_size"})
    extra = _with(TARGET, torch_dtype="bfloat16", use_cache=True, transformers_version="5.0", initializer_range=0.02)
    assert rj.ModelConfig.from_hf(extra) == TINY_QWEN3


# Keys that change the maths and are not implemented for a target: refused with their value, never ignored.
UNIMPLEMENTED_TARGET_CASES = {
    "a GELU MLP": (dict(hidden_act="gelu"), r"hidden_act: 'gelu' is not implemented; retrace-jax implements 'silu'"),
    "hidden_act as a number": (dict(hidden_act=1), r"hidden_act: expected a string, got 1"),
    "partial RoPE": (dict(partial_rotary_factor=0.5),
                     r"partial_rotary_factor: 0\.5 is not implemented; retrace-jax rotates the whole head \(1\.0\)"),
    "partial RoPE under rope_parameters": (
        dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}),
        r"rope_parameters\.partial_rotary_factor: 0\.25 is not implemented"),
    "a sliding layer": (
        dict(layer_types=["full_attention", "sliding_attention", "full_attention", "full_attention"]),
        r"layer_types\[1\]: 'sliding_attention' is not implemented for a target; retrace-jax implements "
        r"'full_attention'"),
    "layer_types for other layers": (dict(layer_types=["full_attention"] * 3),
                                     r"layer_types has 3 entries for num_hidden_layers 4"),
    "a sliding window over the upper layers": (
        dict(use_sliding_window=True, sliding_window=64, max_window_layers=2),
        r"use_sliding_window: true with sliding_window 64 makes layers 2\.\.3 \(from max_window_layers 2\) "
        r"sliding-window layers, which are not implemented for a target"),
    "a sliding window without max_window_layers past transformers' default": (
        dict(use_sliding_window=True, sliding_window=64, num_hidden_layers=30),
        r"use_sliding_window: true with sliding_window 64 makes layers 28\.\.29 \(max_window_layers not given: "
        r"transformers' default 28\)"),
    "use_sliding_window as a string": (dict(use_sliding_window="false"),
                                       r"use_sliding_window: expected true or false, got 'false'"),
}


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("case", sorted(UNIMPLEMENTED_TARGET_CASES))
def test_target_keys_that_change_the_maths_are_refused_with_their_value(case, model_type, tmp_path):
    changes, pattern = UNIMPLEMENTED_TARGET_CASES[case]
    hf = _with(TARGET, model_type=model_type, **changes)
    with pytest.raises(rj.ConfigError, match=pattern):
        rj.ModelConfig.from_hf(hf)
    with pytest.raises(rj.ConfigError, match=r"t/config\.json: " + pattern):  # loading names the file
        rj.load_target(_config_dir(tmp_path / "t", hf))


QWEN25_CODER_05B = {  # Qwen/Qwen2.5-Coder-0.5B-Instruct's config.json (its keys and values; the shape shrunk)
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
    "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 4,
    "num_hidden_layers": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 512}
QWEN3 = {  # Qwen/Qwen3-4B's
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "head_dim": 32,
    "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 96, "max_position_embeddings": 40960,
    "max_window_layers": 36, "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": 4,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 512}
SMOLLM2 = {  # HuggingFaceTB/SmolLM2-135M-Instruct's
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
    "hidden_size": 64, "intermediate_size": 96, "max_position_embeddings": 8192, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 2,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 100000, "tie_word_embeddings": True,
    "vocab_size": 512}


@pytest.mark.parametrize("hf", [
    QWEN25_CODER_05B, QWEN3, SMOLLM2, TARGET,
    _with(TARGET, hidden_act="swish"),  # transformers' name for the same function
    _with(TARGET, partial_rotary_factor=1.0),
    _with(TARGET, layer_types=["full_attention"] * 4, use_sliding_window=False, sliding_window=4096),
    _with(TARGET, use_sliding_window=True, sliding_window=64, max_window_layers=4),  # no layer from 4 on
    _with(TARGET, use_sliding_window=True, sliding_window=None, max_window_layers=0),  # no window to slide
    _with(TARGET, use_sliding_window=True, sliding_window=64, layer_types=["full_attention"] * 4),
    _with(TARGET, use_sliding_window=True, sliding_window=64),  # transformers' default max_window_layers, 28
], ids=["qwen2.5-coder", "qwen3", "smollm2", "ours", "swish", "whole rotary", "full layer types", "no layer past",
        "no window", "explicit full layers", "default max_window_layers"])
def test_keys_at_values_that_keep_the_maths_load(hf):
    """Real configs ship the sliding-window keys switched off (Qwen2: sliding_window 32768 beside
    use_sliding_window false, as transformers reads it: no window); such values load."""
    assert rj.ModelConfig.from_hf(hf).num_layers == 4


def test_the_drafters_hidden_act_and_partial_rotary_factor_are_read_too():
    for changes, pattern in ((dict(hidden_act="gelu_pytorch_tanh"), r"hidden_act: 'gelu_pytorch_tanh' is not "
                                                                     r"implemented; retrace-jax implements 'silu'"),
                             (dict(partial_rotary_factor=0.5), r"partial_rotary_factor: 0\.5 is not implemented")):
        with pytest.raises(rj.ConfigError, match=pattern):
            rj.DrafterConfig.from_hf(_with(DRAFTER, **changes))
    assert rj.DrafterConfig.from_hf(_with(DRAFTER, hidden_act="silu", partial_rotary_factor=1.0)).retrace is not None


DRAFTER_CASES = {
    "block_size as a string": (dict(block_size="8"), r"block_size: expected an integer, got '8'"),
    "block_size as a float": (dict(block_size=8.7), r"block_size: expected an integer, got 8\.7"),
    "block_size 1": (dict(block_size=1), r"block_size: must be >= 2, got 1"),
    "a float layer id": (dict(dflash_config={"mask_token_id": 5, "target_layer_ids": [2.9]}),
                         r"dflash_config\.target_layer_ids\[0\]: expected an integer, got 2\.9"),
    "a layer id past the target": (dict(dflash_config={"mask_token_id": 5, "target_layer_ids": [7]}),
                                   r"target_layer_ids \[7\] .*num_target_layers 4"),
    "mask_token_id as a string": (dict(dflash_config={"mask_token_id": "5"}),
                                  r"dflash_config\.mask_token_id: expected an integer, got '5'"),
    "mask_token_id past the vocabulary": (dict(dflash_config={"mask_token_id": 512}),
                                          r"mask_token_id 512 .* vocab_size 512"),
    "a fractional ReTrace rank": (dict(retrace_config={"rank": 2.5}),
                                  r"retrace_config\.rank: expected an integer, got 2\.5"),
    "retrace_config as a list": (dict(retrace_config=["both"]), r"retrace_config: expected a mapping, got \['both'\]"),
    "the ReTrace gate as a string": (dict(retrace_config={"gate": "false"}),
                                     r"retrace_config\.gate: expected true or false, got 'false'"),
    "unknown ReTrace signals": (dict(retrace_config={"signals": "all"}),
                                r"retrace_config\.signals: must be 'drafter', 'target' or 'both', got 'all'"),
    "enabled as a string": (dict(retrace_config={"enabled": "no"}),
                            r"retrace_config\.enabled: expected true or false, got 'no'"),
    "an unknown ReTrace key": (dict(retrace_config={"rnak": 4}), r"retrace_config\.rnak: unknown key"),
    "num_target_layers as a string": (dict(num_target_layers="4"),
                                      r"num_target_layers: expected an integer, got '4'"),
    "no attention heads": (dict(num_attention_heads=0), r"num_attention_heads: must be >= 1, got 0"),
    "layers as a string": (dict(num_hidden_layers="1"), r"num_hidden_layers: expected an integer, got '1'"),
    "an empty draft vocabulary": (dict(draft_vocab_size=0), r"draft_vocab_size: must be >= 1, got 0"),
    "a draft vocabulary past the vocabulary": (dict(draft_vocab_size=600), r"draft_vocab_size .*600"),
    "not a drafter": (dict(dflash_config=None), r"not a DFlash drafter config"),
}


@pytest.mark.parametrize("case", sorted(DRAFTER_CASES))
def test_bad_drafter_config_fields_are_refused(case):
    changes, pattern = DRAFTER_CASES[case]
    with pytest.raises(rj.ConfigError, match=pattern):
        rj.DrafterConfig.from_hf(_with(DRAFTER, **changes))


def test_a_disabled_retrace_config_is_a_dflash_drafter():
    assert rj.DrafterConfig.from_hf(_with(DRAFTER, retrace_config={"enabled": False})).retrace is None
    assert rj.DrafterConfig.from_hf(_with(DRAFTER, retrace_config=None)).retrace is None
    assert rj.DrafterConfig.from_hf(DRAFTER).retrace == rj.ReTraceConfig()


@pytest.mark.parametrize("build, pattern", [
    (lambda: dataclasses.replace(TINY_QWEN3, num_layers="4"), r"num_layers: expected an integer, got '4'"),
    (lambda: dataclasses.replace(TINY_QWEN3, rms_norm_eps=0.0), r"rms_norm_eps: must be > 0, got 0\.0"),
    (lambda: dataclasses.replace(TINY_QWEN3, qk_norm="yes"), r"qk_norm: expected true or false, got 'yes'"),
    (lambda: rj.ReTraceConfig(rank=2.5), r"rank: expected an integer, got 2\.5"),
    (lambda: rj.ReTraceConfig(gate="false"), r"gate: expected true or false, got 'false'"),
    (lambda: rj.ReTraceConfig(signals="all"), r"signals: must be 'drafter', 'target' or 'both', got 'all'"),
    (lambda: rj.init_drafter(TINY_QWEN3, mask_token_id=5, target_layer_ids=[7]),
     r"target_layer_ids \[7\] .*num_target_layers 4"),
])
def test_configs_built_in_python_are_checked_too(build, pattern):
    with pytest.raises(rj.ConfigError, match=pattern):
        build()


def test_configs_stay_hashable_frozen_dataclasses():
    assert hash(TINY_QWEN3) == hash(dataclasses.replace(TINY_QWEN3))
    with pytest.raises(dataclasses.FrozenInstanceError):
        TINY_QWEN3.num_layers = 3
    cfg = rj.DrafterConfig.from_hf(DRAFTER)
    assert isinstance(cfg.target_layer_ids, tuple) and hash(cfg) == hash(rj.DrafterConfig.from_hf(cfg.to_hf()))


def _config_dir(path, hf):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf))
    return str(path)


def test_load_errors_name_the_file_and_the_field(tmp_path):
    target_dir = _config_dir(tmp_path / "t", _with(TARGET, rms_norm_eps=-1))
    with pytest.raises(rj.ConfigError, match=r"t/config\.json: rms_norm_eps: must be > 0, got -1"):
        rj.load_target(target_dir)
    drafter_dir = _config_dir(tmp_path / "d", _with(DRAFTER, retrace_config=["both"]))
    with pytest.raises(rj.ConfigError, match=r"d/config\.json: retrace_config: expected a mapping"):
        rj.load_drafter(drafter_dir, tiny_target())
