"""The frozen target's features of every prepared sequence, computed once and kept on disk.

DFlash training reads the target only through the features of a few layers at every position. With
``train.feature_cache`` they are computed once, in batches, and stored memory-mapped beside the prepared
data, so a training step reads them instead of running the target. The store is ragged (each sequence's
first ``min(length, seq_len)`` positions, one after another), fills resumably (a killed run continues at
the next unfinished batch, and later runs, resumed or new, reuse it) and is keyed by what decides its
values: the target, the layers, the sequence length and the dtype. A different key gets its own
directory, so a stale store is never read.

The sequences are computed in order of length, each batch only as wide as its longest sequence needs
(a prompt bucket, at most ``seq_len``): a causal model's features at a position do not depend on what
follows it, and a store of short sequences under a long ``seq_len`` would otherwise compute mostly
padding.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import numpy as np

META = "meta.json"
ARRAY = "features.npy"


def store_key(target_path: str, layer_ids, seq_len: int, dtype, num_sequences: int,
              precision: str = "float32") -> dict:
    """What decides a store's values. ``precision`` (the target's products) is a key only when it is not
    float32, so stores made before it existed keep their directories."""
    key = {"target": os.path.abspath(os.path.expanduser(str(target_path))), "layer_ids": [int(i) for i in layer_ids],
           "seq_len": int(seq_len), "dtype": np.dtype(dtype).name, "num_sequences": int(num_sequences)}
    return key if precision == "float32" else {**key, "precision": precision}


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
        self._order_name = "length"

    def _meta(self) -> dict | None:
        path = os.path.join(self.dir, META)
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            return json.load(f)

    def _write_meta(self, done: int) -> None:
        tmp = os.path.join(self.dir, META + ".tmp")
        with open(tmp, "w") as f:
            json.dump({**self.key, "width": self.width, "total": int(self.offsets[-1]), "done": done,
                       "order": self._order_name}, f)
        os.replace(tmp, os.path.join(self.dir, META))

    @property
    def done(self) -> int:
        """How many sequences are stored (the first ones in the order they are computed)."""
        meta = self._meta()
        return 0 if meta is None else int(meta["done"])

    def _order(self, meta: dict | None) -> np.ndarray:
        """The order in which sequences are computed (``done`` counts in it): by length, except for a
        store that an earlier release began in sequence order."""
        if meta is not None and meta.get("order") != "length" and int(meta.get("done", 0)) > 0:
            return np.arange(len(self.lengths))
        return np.argsort(self.lengths, kind="stable")

    def build(self, features_of, rows_of, batch_size: int, log=None) -> "FeatureStore":
        """Fills the store: ``rows_of(idx)`` gives ``tokens [len(idx), seq_len]`` and ``features_of(tokens)``
        the features ``[batch_size, T, width]`` of a padded batch of ``T <= seq_len`` tokens (``T`` is a
        prompt bucket of the batch's longest sequence). Resumes after the last finished batch; logs a
        ``feature_cache`` event."""
        from retrace_jax.decoding.generation import prompt_bucket

        os.makedirs(self.dir, exist_ok=True)
        path = os.path.join(self.dir, ARRAY)
        shape = (int(self.offsets[-1]), self.width)
        meta = self._meta()
        fresh = meta is None or not os.path.isfile(path)
        order = self._order(None if fresh else meta)
        self._order_name = "length" if np.array_equal(order, np.argsort(self.lengths, kind="stable")) else "sequence"
        if fresh:
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
            idx = order[i : i + batch_size]
            wide = min(self.seq_len, prompt_bucket(int(self.lengths[idx].max())))
            tokens = np.zeros((batch_size, wide), np.int32)
            tokens[: len(idx)] = rows_of(idx)[:, :wide]
            feats = np.asarray(features_of(tokens))
            for row, j in enumerate(idx):
                array[self.offsets[j]:self.offsets[j + 1]] = feats[row, : self.lengths[j]]
            array.flush()
            self._write_meta(i + len(idx))
        del array
        if log is not None:
            log({"event": "feature_cache", "sequences": n, "computed": n - first, "gib": round(self.nbytes / 2**30, 3),
                 "seconds": round(time.perf_counter() - start, 1), "dir": self.dir})
        return self

    def __getitem__(self, idx) -> np.ndarray:
        return self.get(idx)

    def get(self, idx, width: int | None = None) -> np.ndarray:
        """``store[idx]``, ``[len(idx), width, F]`` (``width``: ``seq_len`` unless given; each sequence
        cut to it)."""
        if self._array is None:
            if self.done < len(self.lengths):
                raise RuntimeError(f"feature store {self.dir} is not finished ({self.done} of {len(self.lengths)})")
            self._array = np.load(os.path.join(self.dir, ARRAY), mmap_mode="r")
        idx = np.asarray(idx)
        width = self.seq_len if width is None else width
        out = np.zeros((len(idx), width, self.width), self.dtype)
        for row, j in enumerate(idx):
            n = min(int(self.lengths[j]), width)
            out[row, :n] = self._array[self.offsets[j]:self.offsets[j] + n]
        return out
