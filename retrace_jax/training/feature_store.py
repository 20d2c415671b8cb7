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

A store holds one or more named arrays of the same positions, one file each: the features
(``features-*/features.npy``), or ``train.distill_topk``'s top-k of the target's next-token distribution
(``topk-*/ids.npy`` and ``probs.npy``, :func:`top_k_key`), in a store of their own so that a feature store
stays valid whether a run distils or not. Stores of the same sequences that one target pass fills are
filled together (:func:`build_stores`).

A feature store can also be filled without a target pass, from the features that the regeneration kept
(``data.keep_features``: one ``shard_NNNNN.features.npy`` per shard, described by the data directory's
``features.json``, :func:`kept_features_meta`) when they are those the store's key asks for
(:func:`fill_from_kept`): a copy, in sequence order, resumable like a pass. The generation computed those
features a prompt chunk or a token at a time, a pass computes them over whole sequences: the same values to
float rounding, so both fill the same store (with bfloat16 products the rounding differs by about 1e-3 of
the features' RMS, more at single positions: two stores of the same key made the two ways are close, not
equal; runs compared with each other should share one).
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import ml_dtypes
import numpy as np

META = "meta.json"
KEPT = "features.json"  # in a data directory: what its shards' kept features are (kept_features_meta)


def store_key(target_path: str, layer_ids, seq_len: int, dtype, num_sequences: int,
              precision: str = "float32") -> dict:
    """What decides a store's values. ``precision`` (the target's products) is a key only when it is not
    float32, so stores made before it existed keep their directories."""
    key = {"target": os.path.abspath(os.path.expanduser(str(target_path))), "layer_ids": [int(i) for i in layer_ids],
           "seq_len": int(seq_len), "dtype": np.dtype(dtype).name, "num_sequences": int(num_sequences)}
    return key if precision == "float32" else {**key, "precision": precision}


def top_k_key(target_path: str, seq_len: int, dtype, num_sequences: int, precision: str, vocab: str | None,
              k: int) -> dict:
    """What decides a top-k store's values: a feature store's key without the layers, the head vocabulary
    (``vocab``: a draft vocabulary's digest, :func:`~retrace_jax.models.draft_vocab.vocab_digest`; None: the
    whole vocabulary) and ``k``."""
    key = store_key(target_path, (), seq_len, dtype, num_sequences, precision)
    del key["layer_ids"]
    return {**key, "vocab": vocab, "top_k": int(k)}


BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
OPAQUE_2 = np.dtype("V2")  # what numpy writes for bfloat16 (files made before disk_dtype): the same bits


def disk_dtype(dtype) -> np.dtype:
    """How an array of ``dtype`` is kept in a ``.npy`` file: bfloat16 as its bits (``uint16``), which numpy
    would otherwise write as an opaque 2-byte type that reads back as no number type."""
    dtype = np.dtype(dtype)
    return np.dtype(np.uint16) if dtype == BFLOAT16 else dtype


def on_disk_as(found: np.dtype, dtype) -> bool:
    """Whether a ``.npy`` file of dtype ``found`` holds values of ``dtype``: :func:`disk_dtype`'s, or for
    bfloat16 also the opaque type that numpy wrote for it before."""
    dtype = np.dtype(dtype)
    return found == disk_dtype(dtype) or (dtype == BFLOAT16 and found == OPAQUE_2)


def as_dtype(array: np.ndarray, dtype) -> np.ndarray:
    """``array`` as read from (or opened in) a ``.npy`` file of :func:`disk_dtype` ``dtype``, seen as
    ``dtype`` (a view: a memory map stays one). Raises ``ValueError`` for an array of another dtype."""
    dtype = np.dtype(dtype)
    if array.dtype == dtype:
        return array
    if not on_disk_as(array.dtype, dtype):
        raise ValueError(f"an array of {array.dtype} does not hold {dtype} values")
    return array.view(dtype)


class FeatureStore:
    """Arrays ``[total, width]`` of the positions of the sequences of ``lengths`` (each cut to ``seq_len``),
    in ``{root}/{kind}-{hash of key}/``: ``arrays`` maps each array's name (its file ``NAME.npy``) to its
    ``(width, dtype)``; by default one, ``features``, ``width`` wide in the key's dtype. ``store[idx]`` gives
    ``[len(idx), seq_len, width]`` (zero past each sequence's end, which no block sees), or with several
    arrays a tuple of them in the order of ``arrays``."""

    def __init__(self, root: str, key: dict, lengths, width: int | None = None, arrays: dict | None = None,
                 kind: str = "features"):
        self.key = key
        arrays = {"features": (width, key["dtype"])} if arrays is None else arrays
        self.arrays = {name: (int(w), np.dtype(dtype)) for name, (w, dtype) in arrays.items()}
        self.seq_len = key["seq_len"]
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
        self.dir = os.path.join(root, f"{kind}-{digest}")
        self.lengths = np.minimum(np.asarray(lengths, np.int64), self.seq_len)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        self.nbytes = int(self.offsets[-1]) * sum(w * dtype.itemsize for w, dtype in self.arrays.values())
        self._read = None
        self._order_name = "length"
        self._source = None  # "prepared": filled from the regeneration's kept features (fill_from_kept)

    def _meta(self) -> dict | None:
        path = os.path.join(self.dir, META)
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            return json.load(f)

    def _write_meta(self, done: int) -> None:
        widths = {name: w for name, (w, _) in self.arrays.items()}
        shape = {"width": widths["features"]} if list(widths) == ["features"] else {"widths": widths}
        source = {} if self._source is None else {"source": self._source}
        tmp = os.path.join(self.dir, META + ".tmp")
        with open(tmp, "w") as f:
            json.dump({**self.key, **shape, "total": int(self.offsets[-1]), "done": done, "order": self._order_name,
                       **source}, f)
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

    def _open(self, order: np.ndarray | None = None) -> tuple[int, np.ndarray, list]:
        """``(done, order, arrays)`` to go on filling the store: its files opened for writing (made, with a
        meta of nothing done, when the store is new). ``order``: the order to fill a new store, or one with
        nothing done yet, in (default: by length)."""
        os.makedirs(self.dir, exist_ok=True)
        paths = [os.path.join(self.dir, f"{name}.npy") for name in self.arrays]
        meta = self._meta()
        fresh = meta is None or not all(os.path.isfile(p) for p in paths)
        if not fresh and (order is None or int(meta["done"]) > 0):
            order = self._order(meta)  # a store with nothing done yet is filled in the order asked for
        elif order is None:
            order = np.argsort(self.lengths, kind="stable")
        self._order_name = "length" if np.array_equal(order, np.argsort(self.lengths, kind="stable")) else "sequence"
        arrays = []
        for path, (width, dtype) in zip(paths, self.arrays.values()):
            shape = (int(self.offsets[-1]), width)
            if fresh:
                arrays.append(as_dtype(np.lib.format.open_memmap(path, mode="w+", dtype=disk_dtype(dtype),
                                                                 shape=shape), dtype))
                continue
            array = np.lib.format.open_memmap(path, mode="r+")
            if array.shape != shape or not on_disk_as(array.dtype, dtype):
                raise ValueError(f"{path} holds {array.shape} {array.dtype}, expected {shape} {disk_dtype(dtype)}")
            arrays.append(as_dtype(array, dtype))
        if fresh:
            self._write_meta(0)
        return (0 if fresh else int(meta["done"])), order, arrays

    def build(self, features_of, rows_of, batch_size: int, log=None) -> FeatureStore:
        """Fills the store: ``rows_of(idx)`` gives ``tokens [len(idx), seq_len]`` and ``features_of(tokens)``
        the values ``[batch_size, T, width]`` of a padded batch of ``T <= seq_len`` tokens (``T`` is a
        prompt bucket of the batch's longest sequence; with several arrays, a tuple of them). Resumes
        after the last finished batch; logs a ``feature_cache`` event."""
        build_stores([self], lambda tokens: (features_of(tokens),), rows_of, batch_size, log)
        return self

    def __getitem__(self, idx):
        return self.get(idx)

    def get(self, idx, width: int | None = None):
        """``store[idx]``, ``[len(idx), width, F]`` (``width``: ``seq_len`` unless given; each sequence
        cut to it), or a tuple of them (several arrays)."""
        out = self.get_all(idx, width)
        return out[0] if len(out) == 1 else out

    def get_all(self, idx, width: int | None = None) -> tuple[np.ndarray, ...]:
        """Every array of the store at ``idx`` (as :meth:`get` gives them), in the order of ``arrays``."""
        if self._read is None:
            if self.done < len(self.lengths):
                raise RuntimeError(f"feature store {self.dir} is not finished ({self.done} of {len(self.lengths)})")
            self._read = [as_dtype(np.load(os.path.join(self.dir, f"{name}.npy"), mmap_mode="r"), dtype)
                          for name, (_, dtype) in self.arrays.items()]
        idx = np.asarray(idx)
        width = self.seq_len if width is None else width
        out = []
        for array in self._read:
            values = np.zeros((len(idx), width, array.shape[1]), array.dtype)
            for row, j in enumerate(idx):
                n = min(int(self.lengths[j]), width)
                values[row, :n] = array[self.offsets[j]:self.offsets[j] + n]
            out.append(values)
        return tuple(out)


def build_stores(stores: list[FeatureStore], values_of, rows_of, batch_size: int, log=None) -> None:
    """Fills ``stores`` (of the same sequences) in one pass: ``values_of(tokens)`` gives each store's values
    of a padded batch (an array, or a tuple of them: :meth:`FeatureStore.build`), ``rows_of(idx)`` the
    tokens. Each store resumes after its last finished batch: the pass starts at the least finished one
    and writes a batch only to the stores that lack it. A new store is filled in the order of one that an
    earlier release began in sequence order. Logs a ``feature_cache`` event per store."""
    from retrace_jax.decoding.generation import prompt_bucket

    n = len(stores[0].lengths)
    done = [s.done for s in stores]
    begun = [s for s, d in zip(stores, done) if 0 < d < n]
    order = begun[0]._order(begun[0]._meta()) if begun else None
    opened = {i: s._open(order) for i, (s, d) in enumerate(zip(stores, done)) if d < n}
    orders = [o for _, o, _ in opened.values()]
    if any(not np.array_equal(o, orders[0]) for o in orders):
        raise ValueError(f"{', '.join(s.dir for s in begun)} were begun in different orders; delete all but one")
    done = [opened[i][0] if i in opened else d for i, d in enumerate(done)]  # a store without files: none
    lengths, start = stores[0].lengths, time.perf_counter()
    for i in range(min(done), n, batch_size):
        idx = orders[0][i : i + batch_size]
        wide = min(stores[0].seq_len, prompt_bucket(int(lengths[idx].max())))
        tokens = np.zeros((batch_size, wide), np.int32)
        tokens[: len(idx)] = rows_of(idx)[:, :wide]
        values = values_of(tokens)
        for k, (first, _, arrays) in opened.items():
            if i + len(idx) <= first:
                continue
            s, got = stores[k], values[k]
            for array, batch in zip(arrays, got if isinstance(got, tuple) else (got,)):
                batch = np.asarray(batch)
                for row, j in enumerate(idx):
                    array[s.offsets[j]:s.offsets[j + 1]] = batch[row, : s.lengths[j]]
                array.flush()
            s._write_meta(i + len(idx))
    opened.clear()  # the files are written
    if log is not None:
        for s, d in zip(stores, done):
            log({"event": "feature_cache", "sequences": n, "computed": n - d, "gib": round(s.nbytes / 2**30, 3),
                 "seconds": round(time.perf_counter() - start, 1), "dir": s.dir})


def kept_features_meta(target_path: str, layer_ids, dtype, precision: str, width: int) -> dict:
    """What a data directory's kept features are (its ``features.json``): from which target, of which
    layers, in which dtype, from products of which precision, how wide."""
    return {"target": os.path.abspath(os.path.expanduser(str(target_path))), "layer_ids": [int(i) for i in layer_ids],
            "dtype": np.dtype(dtype).name, "precision": precision, "width": int(width)}


def read_kept_meta(data_dir: str) -> dict | None:
    path = os.path.join(data_dir, KEPT)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def fill_from_kept(store: FeatureStore, data, expected: dict, log=None) -> bool:
    """Fills ``store`` (a feature store of ``data``, a ``SequenceData``) by copying the regeneration's kept
    features of ``data``'s shards when they are ``expected`` (:func:`kept_features_meta` of the store's
    target, layers, dtype and precision) and every shard has them; resumes a copy that stopped. Returns
    whether it filled the store; where it cannot (other features, a shard without them, a store that a
    target pass began), ``log`` gets a warning with the reason and the store is left to the pass."""
    from retrace_jax.training.data import describe_differences, kept_features_path

    n = len(store.lengths)
    if store.done >= n:
        return False
    meta = read_kept_meta(data.dir)
    if meta is None:
        return False
    why, files = None, []
    if meta != expected:
        # a key on one side only differs too (settings_differences compares shared keys only)
        differ = {k: (meta.get(k), expected.get(k)) for k in sorted(set(meta) | set(expected))
                  if meta.get(k) != expected.get(k)}
        why = f"they differ from what the store needs ({describe_differences(differ)})"
    begun = store._meta()
    if why is None and begun is not None and int(begun.get("done", 0)) > 0 and begun.get("source") != "prepared":
        why = f"{store.dir} was begun by a target pass"
    j = 0
    for shard, count in data.shards if why is None else ():
        path = kept_features_path(data.dir, shard)
        if not os.path.isfile(path):
            why = f"shard {shard} has none ({path})"
            break
        kept = np.load(path, mmap_mode="r")
        need = sum(len(t) for t in data.tokens[j:j + count])
        dtype = np.dtype(expected["dtype"])  # ml_dtypes (imported) names bfloat16
        if kept.shape != (need, expected["width"]) or not on_disk_as(kept.dtype, dtype):
            why = f"{path} holds {kept.shape} {kept.dtype}, not ({need}, {expected['width']}) {disk_dtype(dtype)}"
            break
        kept = as_dtype(kept, dtype)
        files.append((j, count, kept))
        j += count
    if why is not None:
        if log is not None:
            log({"event": "warning", "message": f"the kept features in {data.dir} are not used: {why}; the feature "
                                                f"store is filled by a pass of the target"})
        return False
    start = time.perf_counter()
    store._source = "prepared"
    done, order, (array,) = store._open(np.arange(n))
    if done and not np.array_equal(order, np.arange(n)):
        # a copy that an earlier release recorded in length order: its sequences are in sequence order,
        # its meta says otherwise; copy again from the first (a copy is cheap)
        done, store._order_name = 0, "sequence"
        store._write_meta(0)
    first = done
    for j, count, kept in files:
        if j + count <= done:
            continue
        at = 0
        for k in range(j, j + count):
            if k >= done:
                array[store.offsets[k]:store.offsets[k + 1]] = kept[at:at + store.lengths[k]]
            at += len(data.tokens[k])
        array.flush()
        done = j + count
        store._write_meta(done)
    del array
    if log is not None:
        log({"event": "feature_cache", "source": "prepared", "sequences": n, "computed": 0, "copied": n - first,
             "gib": round(store.nbytes / 2**30, 3), "seconds": round(time.perf_counter() - start, 1), "dir": store.dir})
    return True
