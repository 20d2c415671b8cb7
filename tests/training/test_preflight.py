"""A training configuration is checked against its target, its starting drafter and the devices before
any work: a value that cannot run is refused at the start, not after data preparation or training."""

import os

import pytest
import yaml

import retrace_jax as rj
import train
from retrace_jax.models.tiny import TINY_QWEN3
from retrace_jax.training.config import load_config
from retrace_jax.training.preflight import preflight
from tests.helpers import cli_error


@pytest.fixture()
def config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "target": "tiny", "out": str(tmp_path / "out"),
        "data": {"num_prompts": 4, "eval_prompts": 2, "max_new_tokens": 4, "gen_batch_size": 4, "shard_size": 4},
        "drafter": {"block_size": 4}, "train": {"steps": 2, "batch_size": 2, "seq_len": 12, "num_anchors": 2}}))
    return str(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A one-layer drafter of block 4 for the tiny target."""
    path = str(tmp_path_factory.mktemp("init") / "drafter")
    rj.save_drafter(rj.init_drafter(TINY_QWEN3, mask_token_id=511, num_layers=1, block_size=4), path)
    return path


@pytest.mark.parametrize("overrides, message", [
    (["train.eval_max_new_tokens=5000"], ("train.eval_max_new_tokens: 5000 new tokens after a prompt of up to 8 "
                                          "tokens (data.prompt_len) need 5008 positions, more than the target's "
                                          "max_position_embeddings 2048")),
    (["data.prompts=p.jsonl", "data.max_prompt_len=2000", "data.max_new_tokens=100"],
     "data.max_new_tokens: 100 new tokens after a prompt of up to 2000 tokens (data.max_prompt_len) need 2100"),
    (["train.mesh=data=4"], "train.mesh: mesh {'data': 4, 'fsdp': 1, 'tensor': 1} needs 4 devices, but 1 are"),
    (["drafter.target_layer_ids=[7]"], "drafter: target_layer_ids [7] are not layers of the target"),
    (["drafter.init_layers=[9]"], "drafter.init_layers: [9] are not layers of the target (0..3)"),
    (["drafter.mask_token_id=512"], "drafter: mask_token_id 512 is not a token id of vocab_size 512"),
    (["drafter.draft_vocab=600"], "drafter.draft_vocab: 600 exceeds the target's vocabulary (512)"),
    (["train.distill_topk=600"], "train.distill_topk: 600 exceeds the target's vocabulary (512 tokens)"),
])
def test_what_cannot_run_on_the_target_or_the_devices_is_refused(config, overrides, message):
    with pytest.raises(rj.ConfigError) as err:
        preflight(load_config(config, overrides))
    assert message in str(err.value)


def test_a_starting_drafter_decides_its_own_shape(config, checkpoint):
    """With drafter.init the checkpoint's config.json decides the drafter: a key given beside it must say
    the same (a key left out is not compared), as drafter.draft_vocab must."""
    preflight(load_config(config, [f"drafter.init={checkpoint}"]))  # block_size: 4 in the file, as stored
    preflight(load_config(config, [f"drafter.init={checkpoint}", "drafter.num_layers=1", "drafter.mask_token_id=null"]))
    for override, message in (
        ("drafter.block_size=8", f"drafter.block_size: 8, but drafter.init {checkpoint} has 4"),
        ("drafter.num_layers=2", f"drafter.num_layers: 2, but drafter.init {checkpoint} has 1"),
        ("drafter.target_layer_ids=[1]", f"drafter.target_layer_ids: [1], but drafter.init {checkpoint} has [2]"),
        ("drafter.draft_vocab=8", f"drafter.draft_vocab: 8, but drafter.init {checkpoint} has None"),
        ("drafter.mask_token_id=3", f"drafter.mask_token_id: 3, but drafter.init {checkpoint} has 511"),
    ):
        with pytest.raises(rj.ConfigError, match="drafter.init") as err:
            preflight(load_config(config, [f"drafter.init={checkpoint}", override]))
        assert message in str(err.value)
    with pytest.raises(FileNotFoundError, match="drafter.init: model directory not found"):
        preflight(load_config(config, [f"drafter.init={checkpoint}-missing"]))
    preflight(load_config(config, [f"drafter.init={checkpoint}-missing"]), stage="prepare")  # not needed yet


def test_more_anchors_than_a_starting_drafters_block_leaves_room_for_are_refused(config, checkpoint, tmp_path, capsys):
    """With drafter.init the block size is the checkpoint's: 12-token sequences and blocks of 4 leave 9
    anchor positions, checked from the configs before any data is prepared."""
    preflight(load_config(config, [f"drafter.init={checkpoint}", "train.num_anchors=9"]))
    message = ("train.num_anchors: 10 exceeds the 9 anchor positions of a 12-token sequence (train.seq_len) with "
               f"block size 4 (drafter.init {checkpoint})")
    with pytest.raises(rj.ConfigError) as err:
        preflight(load_config(config, [f"drafter.init={checkpoint}", "train.num_anchors=10"]))
    assert message in str(err.value)
    line = cli_error(capsys, train.main, ["--config", config, "--set", f"drafter.init={checkpoint}",
                                          "--set", "train.num_anchors=10"])
    assert message in line
    assert not os.path.exists(tmp_path / "out" / "data")  # nothing prepared


@pytest.mark.parametrize("override", ["train.mesh=data=4", "train.eval_max_new_tokens=5000",
                                      "train.num_anchors=10"])
def test_train_py_refuses_before_preparing_data(config, override, tmp_path, capsys):
    line = cli_error(capsys, train.main, ["--config", config, "--set", override])
    assert override.split("=")[0] in line
    assert not os.path.exists(tmp_path / "out" / "data")  # nothing prepared


def test_the_tiny_configs_pass():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    preflight(load_config(os.path.join(root, "configs", "tiny_dflash.yaml")))
    preflight(load_config(os.path.join(root, "configs", "tiny_retrace.yaml")), stage="prepare")  # no drafter yet


def test_distill_topk_fits_a_starting_drafters_draft_vocabulary(config, tmp_path):
    """train.distill_topk takes the top k of the drafter's head vocabulary: with drafter.init, the
    checkpoint's draft vocabulary."""
    from retrace_jax.models.drafter import with_draft_vocab

    path = str(tmp_path / "vocab16")
    drafter = rj.init_drafter(TINY_QWEN3, mask_token_id=511, num_layers=1, block_size=4)
    rj.save_drafter(with_draft_vocab(drafter, list(range(0, 160, 10))), path)
    preflight(load_config(config, [f"drafter.init={path}", "train.distill_topk=16"]))
    with pytest.raises(rj.ConfigError) as err:
        preflight(load_config(config, [f"drafter.init={path}", "train.distill_topk=17"]))
    assert (f"train.distill_topk: 17 exceeds the draft vocabulary (16 tokens, drafter.init {path}), the drafter's "
            f"head vocabulary") in str(err.value)
