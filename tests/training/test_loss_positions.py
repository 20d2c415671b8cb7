"""train.loss_positions: blocks anchored and labelled at every real position, the prompt's too."""

import json

import numpy as np
import pytest

from retrace_jax.parallel.sharding import make_mesh
from retrace_jax.training import loop
from retrace_jax.training.config import ConfigError, as_config
from retrace_jax.training.data import SequenceData

PROMPTS = [3, 5, 2]  # prompt lengths; the rest of each sequence is its response
LENGTHS = [9, 12, 6]


def _data(tmp_path):
    tokens = [np.arange(n, dtype=np.int32) + 10 * i + 1 for i, n in enumerate(LENGTHS)]
    masks = [np.r_[np.zeros(p, np.int32), np.ones(n - p, np.int32)] for p, n in zip(PROMPTS, LENGTHS)]
    np.savez(tmp_path / "shard_00000.npz", tokens=np.concatenate(tokens), loss_mask=np.concatenate(masks),
             offsets=np.concatenate([[0], np.cumsum(LENGTHS)]))
    (tmp_path / "manifest.json").write_text(json.dumps({"done": [0], "settings": {}}))
    return SequenceData(str(tmp_path), 16)


def test_all_positions_mask_every_real_position_after_the_first_and_count_the_response(tmp_path):
    data, mesh = _data(tmp_path), make_mesh()
    (tokens, response_mask), counts = loop.global_batch(data, 0, 3, 0, mesh)
    (tokens_all, all_mask), counts_all = loop.global_batch(data, 0, 3, 0, mesh, loss_positions="all")
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(tokens_all))
    idx = data.indices(0, 3, 0)
    for row, i in enumerate(idx):
        want = np.zeros(16, np.int32)
        want[1:LENGTHS[i]] = 1
        np.testing.assert_array_equal(np.asarray(all_mask)[row], want)
        assert np.asarray(response_mask)[row].tolist() == [0] * PROMPTS[i] + [1] * (LENGTHS[i] - PROMPTS[i]) + \
            [0] * (16 - LENGTHS[i])
    assert counts == counts_all == (sum(LENGTHS), sum(n - p for p, n in zip(PROMPTS, LENGTHS)))
    with pytest.raises(ValueError, match="loss_positions"):
        loop.global_batch(data, 0, 3, 0, mesh, loss_positions="prompt")


def test_loss_positions_is_a_dflash_key(tmp_path):
    base = {"target": "tiny", "out": str(tmp_path / "out"), "data": {"prompts": "random", "num_prompts": 8},
            "drafter": {"num_layers": 1, "block_size": 4}}
    cfg = as_config({**base, "train": {"loss_positions": "all"}})
    assert cfg.train.loss_positions == "all"
    with pytest.raises(ConfigError, match="loss_positions"):
        as_config({**base, "train": {"loss_positions": "prompt"}})
    with pytest.raises(ConfigError, match="loss_positions: all serves the dflash objective only"):
        as_config({**base, "train": {"loss_positions": "all", "objective": "retrace"},
                   "retrace": {}})
