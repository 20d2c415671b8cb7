"""The on-disk feature store of train.feature_cache: ragged layout, reads, resumable filling, keys."""

import json
import os

import numpy as np
import pytest

from retrace_jax.training.feature_store import FeatureStore, as_dtype, store_key

LENGTHS = [5, 9, 3, 12, 7]  # sequence 3 is longer than seq_len 10 and is cut
SEQ = [np.arange(100 * i, 100 * i + n, dtype=np.int32) for i, n in enumerate(LENGTHS)]


def rows_of(idx):
    out = np.zeros((len(idx), 10), np.int32)
    for r, i in enumerate(idx):
        out[r, : min(10, len(SEQ[i]))] = SEQ[i][:10]
    return out


def features_of(tokens):  # a stand-in for the target: each position's features from its token
    return np.stack([tokens, -2 * tokens], -1).astype(np.float32) + 0.5


def store(tmp_path, **change):
    key = store_key(tmp_path / "target", [1, 2], 10, np.float32, len(LENGTHS))
    return FeatureStore(str(tmp_path), {**key, **change}, LENGTHS, 2)


def test_reads_give_each_sequence_its_features_padded_with_zeros(tmp_path):
    s = store(tmp_path).build(features_of, rows_of, batch_size=2)
    got = s[[3, 0, 2]]
    assert got.shape == (3, 10, 2)
    want = features_of(rows_of([3, 0, 2]))
    for r, i in enumerate([3, 0, 2]):
        n = min(10, LENGTHS[i])
        np.testing.assert_array_equal(got[r, :n], want[r, :n])
        assert not got[r, n:].any()
    assert s.nbytes == sum(min(10, n) for n in LENGTHS) * 2 * 4  # ragged: no padding on disk


def test_an_interrupted_build_resumes_after_its_last_batch(tmp_path):
    calls = []

    def failing(tokens):
        calls.append(tokens[:, 0].tolist())
        if len(calls) == 2:
            raise KeyboardInterrupt
        return features_of(tokens)

    with pytest.raises(KeyboardInterrupt):
        store(tmp_path).build(failing, rows_of, batch_size=2)
    assert store(tmp_path).done == 2
    with pytest.raises(RuntimeError, match="not finished"):
        store(tmp_path)[[0]]
    calls.clear()
    events = []
    s = store(tmp_path).build(lambda t: (calls.append(1), features_of(t))[1], rows_of, batch_size=2, log=events.append)
    assert len(calls) == 2 and events[0]["computed"] == 3  # sequences 2, 3 and 4
    whole = store(tmp_path / "other").build(features_of, rows_of, batch_size=2)
    np.testing.assert_array_equal(s[range(5)], whole[range(5)])
    calls.clear()
    store(tmp_path).build(lambda t: (calls.append(1), features_of(t))[1], rows_of, batch_size=2)
    assert not calls  # finished: reused as it is


def test_another_key_is_another_store(tmp_path):
    a, b = store(tmp_path), store(tmp_path, layer_ids=[1, 3])
    assert a.dir != b.dir and a.dir == store(tmp_path).dir


def test_batches_of_short_sequences_are_computed_only_as_wide_as_they_need(tmp_path):
    lengths = [5, 30, 3, 50, 7]
    seqs = [np.arange(1000 * i, 1000 * i + n, dtype=np.int32) for i, n in enumerate(lengths)]

    def rows(idx):
        out = np.zeros((len(idx), 40), np.int32)
        for r, i in enumerate(idx):
            out[r, : min(40, lengths[i])] = seqs[i][:40]
        return out

    widths = []
    key = store_key(tmp_path / "target", [1], 40, np.float32, len(lengths))
    s = FeatureStore(str(tmp_path), key, lengths, 2).build(lambda t: (widths.append(t.shape[1]), features_of(t))[1],
                                                           rows, batch_size=2)
    assert widths == [16, 32, 40]  # lengths 3 and 5, then 7 and 30, then 50 (cut to seq_len)
    for i, n in enumerate(lengths):
        np.testing.assert_array_equal(s[[i]][0, : min(n, 40)], features_of(rows([i]))[0, : min(n, 40)])


def test_a_store_begun_in_sequence_order_resumes_in_that_order(tmp_path):
    """A store an earlier release began (its meta has no "order") continues sequence by sequence."""
    with pytest.raises(KeyboardInterrupt):
        store(tmp_path).build(lambda t: (_ for _ in ()).throw(KeyboardInterrupt), rows_of, batch_size=2)
    s = store(tmp_path)
    path = os.path.join(s.dir, "features.npy")
    array = np.lib.format.open_memmap(path, mode="r+")
    first = features_of(rows_of([0, 1]))
    for r, i in enumerate([0, 1]):  # what the earlier release stored: sequences 0 and 1
        array[s.offsets[i]:s.offsets[i + 1]] = first[r, : s.lengths[i]]
    array.flush()
    with open(os.path.join(s.dir, "meta.json")) as f:
        meta = json.load(f)
    meta.pop("order")
    meta["done"] = 2
    with open(os.path.join(s.dir, "meta.json"), "w") as f:
        json.dump(meta, f)
    computed = []
    done = store(tmp_path).build(lambda t: (computed.append(t[:, 0].tolist()), features_of(t))[1], rows_of, 2)
    assert computed == [[200, 300], [400, 0]]  # sequences 2 and 3, then 4 (and a padding row)
    np.testing.assert_array_equal(done[range(5)], store(tmp_path / "new").build(features_of, rows_of, 2)[range(5)])


def test_a_store_with_nothing_done_is_filled_in_the_order_asked_for(tmp_path):
    """A store that a pass made (length order) but filled nothing of is filled in the order its next user
    asks for, and records it: the meta of a store with nothing done does not impose its order."""
    s = store(tmp_path)
    _, order, arrays = s._open()  # as a pass opens it
    del arrays
    assert not np.array_equal(order, np.arange(len(LENGTHS)))  # LENGTHS are not sorted
    again = store(tmp_path)
    done, order, arrays = again._open(np.arange(len(LENGTHS)))  # as a copy from kept features opens it
    del arrays
    assert done == 0 and order.tolist() == list(range(len(LENGTHS)))
    again._write_meta(0)
    with open(os.path.join(again.dir, "meta.json")) as f:
        assert json.load(f)["order"] == "sequence"


def test_a_copy_recorded_in_length_order_is_copied_again(tmp_path):
    """fill_from_kept copies in sequence order. A store whose meta says it copied some sequences in length
    order (an earlier release's record) is copied again from the first, not resumed."""
    from types import SimpleNamespace

    from retrace_jax.training.feature_store import KEPT, fill_from_kept, kept_features_meta

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    expected = kept_features_meta(tmp_path / "target", [1, 2], np.float32, "float32", 2)
    (data_dir / KEPT).write_text(json.dumps(expected))
    features = [features_of(seq[None])[0] for seq in SEQ]  # every position, past seq_len too
    np.save(data_dir / "shard_00000.features.npy", np.concatenate(features))
    data = SimpleNamespace(dir=str(data_dir), shards=[(0, len(LENGTHS))], tokens=SEQ)
    s = store(tmp_path)
    _, _, arrays = s._open()
    arrays[0][:] = -1.0  # what the stale copy left
    arrays[0].flush()
    del arrays
    s._order_name, s._source = "length", "prepared"
    s._write_meta(3)
    events = []
    assert fill_from_kept(store(tmp_path), data, expected, events.append)
    assert events[-1]["copied"] == len(LENGTHS), events
    got = store(tmp_path)[range(len(LENGTHS))]
    for i, n in enumerate(LENGTHS):
        np.testing.assert_array_equal(got[i, :min(n, 10)], features[i][:10])
    with open(os.path.join(s.dir, "meta.json")) as f:
        meta = json.load(f)
    assert meta["order"] == "sequence" and meta["done"] == len(LENGTHS) and meta["source"] == "prepared"


def test_a_bfloat16_store_reads_back_as_bfloat16_and_resumes(tmp_path):
    """numpy has no bfloat16 of its own: the store keeps the bits (uint16 on disk) and reads them back as
    ml_dtypes' bfloat16, also when an interrupted fill reopens the file."""
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    key = store_key(tmp_path / "target", [1, 2], 10, bf16, len(LENGTHS))

    def values(tokens):
        return features_of(tokens).astype(bf16)

    calls = []

    def failing(tokens):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return values(tokens)

    with pytest.raises(KeyboardInterrupt):
        FeatureStore(str(tmp_path), key, LENGTHS, 2).build(failing, rows_of, batch_size=2)
    s = FeatureStore(str(tmp_path), key, LENGTHS, 2).build(values, rows_of, batch_size=2)
    assert np.load(os.path.join(s.dir, "features.npy"), mmap_mode="r").dtype == np.uint16
    got = s[[3, 0]]
    assert got.dtype == bf16
    # a finished store written before (numpy's opaque two-byte type, the same bits) reads and reopens alike
    path = os.path.join(s.dir, "features.npy")
    np.save(path, np.load(path).view(bf16))
    assert np.load(path).dtype == np.dtype("V2")
    old = FeatureStore(str(tmp_path), key, LENGTHS, 2)
    np.testing.assert_array_equal(old[[3, 0]].astype(np.float32), got.astype(np.float32))
    del old._open()[2][0]
    with pytest.raises(ValueError, match="does not hold"):
        as_dtype(np.zeros(3, np.float16), bf16)
    want = values(rows_of([3, 0]))
    for r, i in enumerate([3, 0]):
        n = min(10, LENGTHS[i])
        np.testing.assert_array_equal(got[r, :n].astype(np.float32), want[r, :n].astype(np.float32))
