"""The frozen target's features of every prepared sequence, computed once and kept on disk.

DFlash training reads the target only through the features of a few layers at every position. With
``train.feature_cache`` they are computed once, in batches, and stored memory-mapped beside the prepared
data, so a training step reads them instead of running the target. The store is ragged (each sequence's
first ``min(length, seq_len)`` positions, one after another), fills resumably (a killed run continues at
the next unfinished batch, and later runs, resumed or new, reuse it) and is keyed by what decides its
values: the target, the layers, the sequence length and the dtype. A different key gets its own
directory, so a stale store is never read.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import numpy as np

META = "meta.json"
ARRAY = "features.npy"


def store_key(target_path: str, layer_ids, seq_len: int, dtype, num_sequences: int) -> dict:
    return {"target": os.path.abspath(os.path.expanduser(str(target_path))), "layer_ids": [int(i) for i in layer_ids],
            "seq_len": int(seq_len), "dtype": np.dtype(dtype).name, "num_sequences": int(num_sequences)}


class FeatureStore:
    """Features ``[total, width]`` of the sequences of ``lengths`` (each cut to ``seq_len``), in
    ``{root}/features-{hash of key}/``. ``store[idx]`` gives ``[len(idx), seq_len, width]`` (zero past
    each sequence's end, which no block sees)."""

    def __init__(self, root: str, key: dict, lengths, width: int):
        self.key, self.width = key, int(width)
        self.seq_len = key["seq_len"]
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
        self.dir = os.path.join(root, f"features-{digest}")
        self.lengths = np.minimum(np.asarray(lengths, np.int64), self.seq_len)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        self.dtype = np.dtype(key["dtype"])
        self.nbytes = int(self.offsets[-1]) * self.width * self.dtype.itemsize
        self._array = None

    def _meta(self) -> dict | None:
        path = os.path.join(self.dir, META)
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            return json.load(f)

    def _write_meta(self, done: int) -> None:
        tmp = os.path.join(self.dir, META + ".tmp")
        with open(tmp, "w") as f:
            json.dump({**self.key, "width": self.width, "total": int(self.offsets[-1]), "done": done}, f)
        os.replace(tmp, os.path.join(self.dir, META))

    @property
    def done(self) -> int:
        """How many sequences (from the first) are stored."""
        meta = self._meta()
        return 0 if meta is None else int(meta["done"])

    def build(self, features_of, rows_of, batch_size: int, log=None) -> "FeatureStore":
        """Fills the store: ``rows_of(idx)`` gives ``tokens [len(idx), seq_len]`` and ``features_of(tokens)``
        their features ``[batch_size, seq_len, width]`` (a padded batch). Resumes after the last finished
        batch; logs a ``feature_cache`` event."""
        os.makedirs(self.dir, exist_ok=True)
        path = os.path.join(self.dir, ARRAY)
        shape = (int(self.offsets[-1]), self.width)
        meta = self._meta()
        if meta is None or not os.path.isfile(path):
            array = np.lib.format.open_memmap(path, mode="w+", dtype=self.dtype, shape=shape)
            self._write_meta(0)
            done = 0
        else:
            array = np.lib.format.open_memmap(path, mode="r+")
            if array.shape != shape or array.dtype != self.dtype:
                raise ValueError(f"{path} holds {array.shape} {array.dtype}, expected {shape} {self.dtype}")
            done = int(meta["done"])
        n = len(self.lengths)
        start, first = time.perf_counter(), done
        for i in range(done, n, batch_size):
            idx = np.arange(i, min(i + batch_size, n))
            tokens = np.zeros((batch_size, self.seq_len), np.int32)
            tokens[: len(idx)] = rows_of(idx)
            feats = np.asarray(features_of(tokens))
            for row, j in enumerate(idx):
                array[self.offsets[j]:self.offsets[j + 1]] = feats[row, : self.lengths[j]]
            array.flush()
            self._write_meta(int(idx[-1]) + 1)
        del array
        if log is not None:
            log({"event": "feature_cache", "sequences": n, "computed": n - first, "gib": round(self.nbytes / 2**30, 3),
                 "seconds": round(time.perf_counter() - start, 1), "dir": self.dir})
        return self

    def __getitem__(self, idx) -> np.ndarray:
        if self._array is None:
            if self.done < len(self.lengths):
                raise RuntimeError(f"feature store {self.dir} is not finished ({self.done} of {len(self.lengths)})")
            self._array = np.load(os.path.join(self.dir, ARRAY), mmap_mode="r")
        idx = np.asarray(idx)
        out = np.zeros((len(idx), self.seq_len, self.width), self.dtype)
        for row, j in enumerate(idx):
            out[row, : self.lengths[j]] = self._array[self.offsets[j]:self.offsets[j + 1]]
        return out
