"""Reading safetensors checkpoints: one ``model.safetensors`` or shards listed in an index file."""

from __future__ import annotations

import json
import os
from typing import Iterable

import numpy as np
from safetensors import SafetensorError, safe_open

from retrace_jax.errors import CheckpointError

SINGLE_FILE = "model.safetensors"


INDEX_FILE = "model.safetensors.index.json"


# Tensors that some checkpoints carry but no model here uses.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class TensorReader:
    """Reads tensors by name from ``model.safetensors`` or from shards listed in the index file.

    Every file is opened once here, so a truncated or corrupt one is reported by name before any weight
    is read; a directory holding both layouts is refused (one of them would silently win)."""

    def __init__(self, directory: str):
        index_path = os.path.join(directory, INDEX_FILE)
        single_path = os.path.join(directory, SINGLE_FILE)
        if os.path.isfile(index_path) and os.path.isfile(single_path):
            raise CheckpointError(f"{directory} holds both {SINGLE_FILE} and {INDEX_FILE}; one of them is stale "
                                  f"(remove it)")
        if os.path.isfile(index_path):
            weight_map = _read_weight_map(index_path)
            for file in sorted(set(weight_map.values())):
                path = os.path.join(directory, file)
                if not os.path.isfile(path):
                    raise FileNotFoundError(f"{INDEX_FILE} lists {file}, which is missing from {directory}")
                stored = set(_tensor_names(path))
                absent = sorted(n for n, f in weight_map.items() if f == file and n not in stored)
                if absent:
                    raise CheckpointError(f"{path} lacks tensors that {INDEX_FILE} places there: {short_names(absent)}")
        elif os.path.isfile(single_path):
            weight_map = {name: SINGLE_FILE for name in _tensor_names(single_path)}
        else:
            raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {directory}")
        self.directory = directory
        self.weight_map = weight_map

    def names(self) -> set[str]:
        return set(self.weight_map)

    def file(self, name: str) -> str:
        return os.path.join(self.directory, self.weight_map[name])

    def get(self, name: str, index: tuple | None = None) -> np.ndarray:
        """The tensor, or only ``tensor[index]`` (a tuple of slices) read from disk; non-finite values
        (NaN, inf) are an error naming the tensor."""
        try:
            with safe_open(self.file(name), framework="numpy") as f:
                array = f.get_tensor(name) if index is None else f.get_slice(name)[index]
        except SafetensorError as err:
            raise CheckpointError(f"cannot read tensor {name} from {self.file(name)}: {err}") from None
        bad = int(array.size - np.count_nonzero(np.isfinite(array.astype(np.float32, copy=False))))
        if bad:
            where = "" if index is None else f" (in the slice {index})"
            raise CheckpointError(f"tensor {name} in {self.file(name)} has {bad} non-finite values (NaN or inf)"
                                  f"{where}")
        return array

    def shape(self, name: str) -> tuple[int, ...]:
        with safe_open(self.file(name), framework="numpy") as f:
            return tuple(f.get_slice(name).get_shape())


def _tensor_names(path: str) -> list[str]:
    """The tensor names in a safetensors file's header; a ``CheckpointError`` naming a truncated or
    corrupt file."""
    try:
        with safe_open(path, framework="numpy") as f:
            return list(f.keys())
    except SafetensorError as err:
        raise CheckpointError(f"{path} is not a readable safetensors file (truncated or corrupt?): {err}") from None


def _read_weight_map(index_path: str) -> dict[str, str]:
    """``weight_map`` of a ``model.safetensors.index.json``, checked."""
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{index_path} is not valid JSON: {err}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path} has no 'weight_map' object (tensor name -> file)")
    bad = [n for n, f in weight_map.items() if not isinstance(f, str) or os.path.basename(f) != f]
    if bad:
        raise CheckpointError(f"{index_path}: weight_map entries must be file names in the same directory: "
                              f"{short_names(sorted(bad))}")
    return weight_map


def strip_prefix(names: Iterable[str], prefix: str) -> dict[str, str]:
    """Maps names without ``prefix`` to the stored names (for checkpoints saved with a ``model.`` prefix)."""
    return {n[len(prefix) :] if n.startswith(prefix) else n: n for n in names}


def short_names(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
