"""Reading safetensors checkpoints: one ``model.safetensors`` or shards listed in an index file."""

from __future__ import annotations

import json
import os
import struct
import sys
import threading
import weakref
from typing import Iterable

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from retrace_jax.errors import CheckpointError
from retrace_jax.io.files import regular_file

SINGLE_FILE = "model.safetensors"


INDEX_FILE = "model.safetensors.index.json"


# safetensors' names of floating-point types: F64, F32, F16, BF16, the F8 variants.
FLOATING_PREFIXES = ("F", "BF")


# Tensors that some checkpoints carry but no model here uses.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# safetensors' type names -> numpy (little-endian, as safetensors stores them); a type not here is read
# through safetensors itself
NUMPY_TYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
               "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64,
               "I32": np.int32, "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32,
               "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_}


# the non-finite check looks at this many values at a time (a bool array of the whole tensor would be one
# more temporary copy of it, a quarter of its float32 size)
FINITE_CHUNK = 1 << 22


def host_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts at a multiple of ``align`` bytes: what
    ``jax.device_put(array, may_alias=True)`` takes without a copy on the CPU."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


class TensorReader:
    """Reads tensors by name from ``model.safetensors`` or from shards listed in the index file.

    Every file is opened once here, so a truncated or corrupt one is reported by name before any weight
    is read; a directory holding both layouts is refused (one of them would silently win). The tensors'
    types and shapes are kept from that reading, and each file stays open for the reads that follow:
    opening a file parses its whole header, so opening it again for every tensor would make loading
    quadratic in the number of tensors.

    A whole tensor, or a range of its leading rows, is read with plain reads into a new array: through
    safetensors' memory map, every page read stays in the process's resident memory until the file is
    closed, so loading a model held the whole file in memory beside the loaded weights (a 2.5 GB
    Qwen2.5-Coder-0.5B loaded at a peak of 6.25 GB). Other slices (a device's shard) go through the map."""

    def __init__(self, directory: str):
        index_path = os.path.join(directory, INDEX_FILE)
        single_path = os.path.join(directory, SINGLE_FILE)
        # what is there must be a file (a directory or a FIFO is said to be one, and never opened)
        present = [p for p in (index_path, single_path) if os.path.lexists(p) and regular_file(p, p)]
        if len(present) == 2:
            raise CheckpointError(f"{directory} holds both {SINGLE_FILE} and {INDEX_FILE}; one of them is stale "
                                  f"(remove it)")
        self._files: dict[str, object] = {}  # file name -> its open safe_open handle
        self._headers: dict[str, tuple[str, tuple[int, ...]]] = {}  # tensor -> (type, shape) in its file
        self._fds: dict[str, int] = {}  # file name -> a descriptor of the same file, for plain reads
        self._offsets: dict[str, tuple[int, int]] = {}  # tensor -> (first, end) byte in its file
        self._lock = threading.Lock()  # for the systems without os.preadv (seek and read)
        if index_path in present:
            weight_map = _read_weight_map(index_path)
            for file in sorted(set(weight_map.values())):
                path = regular_file(os.path.join(directory, file),
                                    f"{INDEX_FILE} lists {file}, which is missing from {directory}")
                stored = self._open(path, file)
                absent = sorted(n for n, f in weight_map.items() if f == file and n not in stored)
                if absent:
                    raise CheckpointError(f"{path} lacks tensors that {INDEX_FILE} places there: {short_names(absent)}")
                self._headers.update((n, stored[n]) for n, f in weight_map.items() if f == file)
        elif present:
            self._headers = self._open(single_path, SINGLE_FILE)
            weight_map = {name: SINGLE_FILE for name in self._headers}
        else:
            raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {directory}")
        self.directory = directory
        self.weight_map = weight_map

    def _open(self, path: str, file: str) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Opens ``path`` (kept as ``file``); the type and shape of each tensor in its header. A
        ``CheckpointError`` names a truncated or corrupt file."""
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        weakref.finalize(self, os.close, fd)
        try:
            handle = safe_open(path, framework="numpy")
            header = {}
            for name in handle.keys():
                view = handle.get_slice(name)
                header[name] = (view.get_dtype(), tuple(view.get_shape()))
        except SafetensorError as err:
            raise CheckpointError(f"{path} is not a readable safetensors file (truncated or corrupt?): {err}") from None
        # the byte offsets, from the descriptor's own reading of the header that safetensors has checked:
        # the same file, unless it was replaced between the two openings
        size = struct.unpack("<Q", _read_exactly(fd, 8, 0, path))[0]
        stored = json.loads(_read_exactly(fd, size, 8, path))
        for name, (kind, shape) in header.items():
            entry = stored.get(name)
            if not isinstance(entry, dict) or entry.get("dtype") != kind or tuple(entry.get("shape", ())) != shape:
                raise CheckpointError(f"{path} changed while it was opened (its header differs between two readings)")
            first, end = entry["data_offsets"]
            self._offsets[name] = (8 + size + first, 8 + size + end)
        self._files[file] = handle
        self._fds[file] = fd
        return header

    def names(self) -> set[str]:
        return set(self.weight_map)

    def file(self, name: str) -> str:
        return os.path.join(self.directory, self.weight_map[name])

    def get(self, name: str, index: tuple | None = None) -> np.ndarray:
        """The tensor, or only ``tensor[index]`` (a tuple of slices) read from disk; non-finite values
        (NaN, inf) are an error naming the tensor."""
        rows = self._rows(name, index)
        if rows is not None:
            array = self._read_rows(name, *rows)
        else:
            f = self._files[self.weight_map[name]]
            try:
                array = f.get_tensor(name) if index is None else f.get_slice(name)[index]
            except SafetensorError as err:
                raise CheckpointError(f"cannot read tensor {name} from {self.file(name)}: {err}") from None
        flat = array.reshape(-1)
        bad = sum(int(part.size - np.count_nonzero(np.isfinite(part.astype(np.float32, copy=False))))
                  for part in (flat[i:i + FINITE_CHUNK] for i in range(0, flat.size, FINITE_CHUNK)))
        if bad:
            where = "" if index is None else f" (in the slice {index})"
            raise CheckpointError(f"tensor {name} in {self.file(name)} has {bad} non-finite values (NaN or inf)"
                                  f"{where}")
        return array

    def _rows(self, name: str, index: tuple | None) -> tuple[int, int] | None:
        """``(start, stop)`` when ``index`` is the whole tensor (None) or a range of its leading rows
        (a step-1 slice, then only whole dimensions) of a type :data:`NUMPY_TYPES` knows; else None."""
        kind, shape = self._headers[name]
        if kind not in NUMPY_TYPES or not shape or sys.byteorder != "little":
            return None
        if index is None:
            return 0, shape[0]
        index = tuple(index) if isinstance(index, tuple) else (index,)
        if (len(index) > len(shape) or not all(isinstance(i, slice) for i in index)
                or any(i != slice(None) and i.indices(n) != (0, n, 1) for i, n in zip(index[1:], shape[1:]))):
            return None
        start, stop, step = index[0].indices(shape[0])
        return (start, max(start, stop)) if step == 1 else None

    def _read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of the tensor, read from its file into a new (aligned) array."""
        kind, shape = self._headers[name]
        dtype = np.dtype(NUMPY_TYPES[kind])
        row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        first, end = self._offsets[name]
        if end - first != shape[0] * row:
            raise CheckpointError(f"tensor {name} in {self.file(name)}: its byte range does not fit its shape {shape}")
        out = host_empty((stop - start,) + shape[1:], dtype)
        view = memoryview(out.reshape(-1).view(np.uint8))
        offset, fd = first + start * row, self._fds[self.weight_map[name]]
        try:
            done = 0
            while done < len(view):
                if hasattr(os, "preadv"):
                    got = os.preadv(fd, [view[done:]], offset + done)
                else:  # (Windows)
                    with self._lock:
                        os.lseek(fd, offset + done, os.SEEK_SET)
                        data = os.read(fd, min(len(view) - done, 1 << 26))
                    view[done:done + len(data)] = data
                    got = len(data)
                if got == 0:
                    raise CheckpointError(f"cannot read tensor {name} from {self.file(name)}: the file ends early "
                                          f"(truncated?)")
                done += got
        except OSError as err:
            raise CheckpointError(f"cannot read tensor {name} from {self.file(name)}: {err.strerror or err}") from None
        return out

    def shape(self, name: str) -> tuple[int, ...]:
        return self._headers[name][1]

    def dtype(self, name: str) -> str:
        """The stored type's safetensors name: ``F32``, ``BF16``, ``I8``, ``BOOL``..."""
        return self._headers[name][0]

    def check_floating(self, name: str) -> None:
        """A ``CheckpointError`` naming the file and the tensor unless the tensor is stored as floating
        point: an integer or bool tensor where a weight belongs would otherwise be cast (int8 3 -> 3.0)."""
        kind = self.dtype(name)
        if not kind.startswith(FLOATING_PREFIXES):
            raise CheckpointError(f"tensor {name} in {self.file(name)} is stored as {kind}; a weight must be "
                                  f"floating point (F32, BF16, F16...)")


def _read_exactly(fd: int, size: int, offset: int, path: str) -> bytes:
    data = os.pread(fd, size, offset) if hasattr(os, "pread") else None
    if data is None:
        os.lseek(fd, offset, os.SEEK_SET)
        data = os.read(fd, size)
    if len(data) != size:
        raise CheckpointError(f"{path} is not a readable safetensors file (truncated or corrupt?)")
    return data


def _read_weight_map(index_path: str) -> dict[str, str]:
    """``weight_map`` of a ``model.safetensors.index.json``, checked."""
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{index_path} is not valid JSON: {err}") from None
    except RecursionError:  # the decoder recurses once per nesting level
        raise CheckpointError(f"{index_path} is nested too deeply to be an index file") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path} has no 'weight_map' object (tensor name -> file)")
    bad = [n for n, f in weight_map.items() if not isinstance(f, str) or os.path.basename(f) != f]
    if bad:
        raise CheckpointError(f"{index_path}: weight_map entries must be file names in the same directory: "
                              f"{short_names(sorted(bad))}")
    return weight_map


def strip_prefix(names: Iterable[str], prefix: str, directory: str = "the checkpoint") -> dict[str, str]:
    """Maps names without ``prefix`` to the stored names (for checkpoints saved with a ``model.`` prefix).
    A tensor stored both with and without the prefix is a ``CheckpointError`` naming ``directory``: one of
    them is stale, and neither may silently win (as :class:`TensorReader` refuses two layouts side by side)."""
    names = set(names)
    twice = sorted(n for n in names if n.startswith(prefix) and n[len(prefix) :] in names)
    if twice:
        pairs = [f"{n[len(prefix):]} and {n}" for n in twice]
        raise CheckpointError(f"{directory} holds both {short_names(pairs, limit=3)}: the same tensors with and "
                              f"without the {prefix!r} prefix; one of each is stale (remove it)")
    return {n[len(prefix) :] if n.startswith(prefix) else n: n for n in names}


def short_names(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
