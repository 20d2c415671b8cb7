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
