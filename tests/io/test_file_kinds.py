"""A checkpoint file that is there but is no regular file (a directory, a FIFO) is reported as what it is,
not as missing, and never read: opening a FIFO would wait for a writer forever."""

import os
import re
import signal

import pytest

import retrace_jax as rj
from tests.helpers import copy_model_dir, save_hf_model

@pytest.fixture(autouse=True)
def never_hang():
    """Opening a FIFO blocks until a writer comes: such a test fails after a minute instead of hanging."""
    def fail(*_):
        raise TimeoutError("a FIFO was opened (waiting for a writer)")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def qwen3_copy(hf_model_dir, tmp_path):
    return copy_model_dir(hf_model_dir("qwen3")[1], tmp_path / "model")


def _replace(path, kind):
    os.remove(path)
    if kind == "directory":
        os.mkdir(path)
    else:
        os.mkfifo(path)


@pytest.mark.parametrize("kind, described", [("directory", "is a directory"), ("fifo", "is a FIFO (named pipe)")])
def test_a_config_json_that_is_no_file_says_what_it_is(qwen3_copy, kind, described):
    path = os.path.join(qwen3_copy, "config.json")
    _replace(path, kind)
    with pytest.raises(rj.ConfigError, match=re.escape(f"{path} {described}, not a regular file")):
        rj.load_target(qwen3_copy)


@pytest.mark.parametrize("name", ["model.safetensors", "model.safetensors.index.json"])
@pytest.mark.parametrize("kind, described", [("directory", "is a directory"), ("fifo", "is a FIFO (named pipe)")])
def test_weights_that_are_no_file_say_what_they_are(qwen3_copy, name, kind, described):
    path = os.path.join(qwen3_copy, name)
    if name != "model.safetensors":  # the index beside the weights: what it is comes before "both layouts"
        open(path, "w").close()
    _replace(path, kind)
    with pytest.raises(rj.CheckpointError, match=re.escape(f"{path} {described}, not a regular file")):
        rj.load_target(qwen3_copy)


def test_a_shard_that_is_no_file_says_what_it_is(hf_model_dir, tmp_path):
    model, _ = hf_model_dir("qwen3")
    sharded = save_hf_model(model, str(tmp_path / "sharded"), max_shard_size="100KB")
    shard = os.path.join(sharded, sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))[0])
    _replace(shard, "fifo")
    with pytest.raises(rj.CheckpointError, match=re.escape(f"{shard} is a FIFO (named pipe), not a regular file")):
        rj.load_target(sharded)


def test_a_drafter_with_a_directory_for_weights(tmp_path):
    target = rj.tiny.tiny_target()
    directory = str(tmp_path / "d")
    rj.save_drafter(rj.init_drafter(target.cfg, mask_token_id=3, num_layers=1, block_size=4), directory)
    real = os.path.realpath(directory)
    _replace(os.path.join(real, "model.safetensors"), "directory")
    with pytest.raises(rj.CheckpointError, match="model.safetensors is a directory, not a regular file"):
        rj.load_drafter(directory, target)


def test_both_layouts_as_files_are_still_refused(qwen3_copy):
    open(os.path.join(qwen3_copy, "model.safetensors.index.json"), "w").close()
    with pytest.raises(rj.CheckpointError, match="holds both model.safetensors and model.safetensors.index.json"):
        rj.load_target(qwen3_copy)


@pytest.mark.parametrize("kind, described", [("directory", "is a directory"), ("fifo", "is a FIFO (named pipe)")])
def test_a_draft_vocabulary_that_is_no_file_says_what_it_is(tmp_path, kind, described):
    """draft_vocab.safetensors that is a directory or a FIFO was reported as missing (#58 item 11)."""
    target = rj.tiny.tiny_target()
    directory = str(tmp_path / "d")
    drafter = rj.init_drafter(target.cfg, mask_token_id=3, num_layers=1, block_size=4, draft_vocab=list(range(64)))
    rj.save_drafter(drafter, directory)
    path = os.path.join(os.path.realpath(directory), "draft_vocab.safetensors")
    _replace(path, kind)
    with pytest.raises(rj.CheckpointError, match=re.escape(f"{path} {described}, not a regular file")):
        rj.load_drafter(directory, target)
