"""A prompt file that is not there is refused by the pre-flight check, before ``out`` is created, when
the data still has to be prepared from it; training from prepared data does not need it."""

import json
import os

import pytest
import yaml

import retrace_jax as rj
import train
from retrace_jax.training.config import load_config
from retrace_jax.training.preflight import needs_preparing, preflight
from tests.helpers import cli_error


@pytest.fixture()
def config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "target": "tiny", "out": str(tmp_path / "out"),
        "data": {"prompts": str(tmp_path / "missing.jsonl"), "num_prompts": 8, "eval_prompts": 2,
                 "max_new_tokens": 4, "gen_batch_size": 4, "shard_size": 4, "max_prompt_len": 16},
        "drafter": {"block_size": 4}, "train": {"steps": 2, "batch_size": 2, "seq_len": 12, "num_anchors": 2}}))
    return str(path)


def _manifest(cfg, done):
    os.makedirs(cfg.data_dir)
    with open(os.path.join(cfg.data_dir, "manifest.json"), "w") as f:
        json.dump({"settings": {"num_prompts": 8, "shard_size": 4}, "done": done}, f)


def test_train_py_refuses_a_missing_prompt_file_before_creating_anything(config, tmp_path, capsys):
    for stage in ("all", "prepare"):
        message = cli_error(capsys, train.main, ["--config", config, "--stage", stage])
        assert not os.path.exists(tmp_path / "out")  # no out dir, no train.lock, no metrics.jsonl
        assert message == (f"error: data.prompts: prompt file not found: {tmp_path}/missing.jsonl (the data in "
                           f"{tmp_path}/out/data is still to be prepared from it)"), message


def test_prepared_data_does_not_need_the_prompt_file(config):
    cfg = load_config(config)
    preflight(cfg, stage="train")  # reads the prepared data only
    _manifest(cfg, done=[0])  # one shard of two: still to be prepared
    assert needs_preparing(cfg, "all")
    with pytest.raises(rj.ConfigError, match="data.prompts: prompt file not found"):
        preflight(cfg)
    with open(os.path.join(cfg.data_dir, "manifest.json"), "w") as f:
        json.dump({"settings": {"num_prompts": 8, "shard_size": 4}, "done": [0, 1]}, f)
    assert not needs_preparing(cfg, "all") and needs_preparing(cfg, "prepare")
    preflight(cfg)  # finished: --stage all goes straight to training
    with pytest.raises(rj.ConfigError, match="data.prompts: prompt file not found"):
        preflight(cfg, stage="prepare")
