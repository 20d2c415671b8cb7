"""train.length_buckets: batches of similar lengths, each padded only as wide as it needs."""

import json
import os

import numpy as np

from retrace_jax.training.data import BUCKET_WIDTH, SequenceData


def _data(tmp_path, lengths):
    tokens = [np.arange(n, dtype=np.int32) % 50 + 1 for n in lengths]
    masks = [np.r_[np.zeros(2, np.int32), np.ones(n - 2, np.int32)] for n in lengths]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    np.savez(tmp_path / "shard_00000.npz", tokens=np.concatenate(tokens), loss_mask=np.concatenate(masks),
             offsets=offsets)
    (tmp_path / "manifest.json").write_text(json.dumps({"done": [0], "settings": {}}))
    return SequenceData(str(tmp_path), 600)


def test_bucketed_epochs_hold_every_sequence_once_in_batches_of_similar_length(tmp_path):
    rng = np.random.RandomState(0)
    lengths = rng.choice([40, 60, 90, 200, 300, 450, 700], size=200)
    data = _data(tmp_path, lengths)
    batch = 8
    steps = len(data) // batch  # 25 steps: one epoch exactly
    idx = [data.indices(s, batch, seed=3, bucketed=True) for s in range(steps)]
    assert sorted(np.concatenate(idx).tolist()) == list(range(len(data)))
    plain = [data.indices(s, batch, seed=3) for s in range(steps)]
    capped = np.minimum(lengths, 600)
    spread = lambda batches: np.mean([capped[b].max() - capped[b].min() for b in batches])  # noqa: E731
    assert spread(idx) < 0.5 * spread(plain)
    widths = [data.width(b) for b in idx]
    assert all(w % BUCKET_WIDTH == 0 or w == 600 for w in widths) and min(widths) < 600
    for b, w in zip(idx, widths):
        assert capped[b].max() <= w < capped[b].max() + BUCKET_WIDTH
        tokens, mask, lens = data.rows(b, w)
        assert tokens.shape == (batch, w) and lens.tolist() == capped[b].tolist()
    # a pure function of (seed, step): the same batches again, other seeds other batches
    assert all(np.array_equal(a, data.indices(s, batch, seed=3, bucketed=True)) for s, a in enumerate(idx))
    assert not np.array_equal(idx[0], data.indices(0, batch, seed=4, bucketed=True))
    assert os.path.exists(tmp_path / "manifest.json")


def test_a_bucket_leaves_room_for_the_last_anchors_block_and_for_every_anchor(tmp_path):
    """A batch's width keeps every anchor a full-width batch allows (a block at the longest sequence's
    last token) and at least num_anchors candidates."""
    data = _data(tmp_path, [120, 60, 127])
    assert data.width([0, 1]) == 128
    assert data.width([0, 1], block_size=16) == 256  # 120 + 15 > 128
    assert data.width([1], block_size=4, num_anchors=200) == 256  # top_k needs 200 candidates
    assert data.width([2], block_size=16, num_anchors=2000) == 600  # never past seq_len


def test_tokens_seen_count_every_batch_from_step_zero_in_either_order(tmp_path):
    """SequenceData.seen (the trainer's tokens_seen on resume) equals the sum over the batches it serves,
    across epoch boundaries, plain and bucketed, with sequences cut to seq_len."""
    data = _data(tmp_path, [40, 60, 90, 200, 700, 450, 33])
    for bucketed in (False, True):
        tokens = response = 0
        for step in range(12):  # 12 steps of 3: five epochs of 7 and one sequence more
            assert data.seen(step, 3, seed=5, bucketed=bucketed) == (tokens, response), (bucketed, step)
            _, mask, lengths = data.rows(data.indices(step, 3, seed=5, bucketed=bucketed))
            tokens, response = tokens + int(lengths.sum()), response + int(mask.sum())
        assert data.seen(12, 3, seed=5, bucketed=bucketed) == (tokens, response)
    full = 40 + 60 + 90 + 200 + 600 + 450 + 33  # the 700-token sequence counts its first 600
    assert data.seen(7, 1, seed=0) == (full, full - 2 * 7)
