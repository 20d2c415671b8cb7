"""Sharding by logical axis names: one table maps them to the mesh axes ``data``, ``fsdp``, ``tensor``.

Parameters name their dimensions with logical axes (in the weight tables of ``retrace_jax/io/weights.py``);
activations and caches do the same here. Heads, KV heads, MLP width and vocabulary go over ``tensor``
(tensor parallelism), the model dimension over ``fsdp`` (fully sharded parameters), the batch over
``data`` (and ``fsdp``).
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axes (the one table of rules for parameters, activations and caches)
LOGICAL_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp"),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
}


def make_mesh(spec: str | dict[str, int] | None = None, devices: Sequence | None = None) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh from a spec such as ``"data=2,tensor=4"`` (missing axes are 1;
    ``None`` puts every device on ``data``). The sizes must multiply to the number of devices."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = {"data": len(devices), "fsdp": 1, "tensor": 1} if spec is None else {"data": 1, "fsdp": 1, "tensor": 1}
    if isinstance(spec, str):
        spec = parse_mesh_spec(spec)
    for name, size in (spec or {}).items():
        _check_axis(name, size)
        sizes[name] = size
    total = math.prod(sizes.values())
    if total != len(devices):
        raise ValueError(f"mesh {sizes} needs {total} devices, but {len(devices)} are available")
    return Mesh(np.asarray(devices).reshape([sizes[a] for a in MESH_AXES]), MESH_AXES)


def parse_mesh_spec(spec: str) -> dict[str, int]:
    """``"data=2,tensor=4"`` -> ``{"data": 2, "tensor": 4}``; a malformed entry, an unknown axis, a size
    below 1 or an axis named twice is a ``ValueError``."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not value.isdigit():
            raise ValueError(f"mesh spec entries look like 'tensor=4', got {part!r}")
        if name in sizes:
            raise ValueError(f"mesh axis {name!r} is named twice in {spec!r}")
        _check_axis(name, int(value))
        sizes[name] = int(value)
    return sizes


def _check_axis(name: str, size: int) -> None:
    if name not in MESH_AXES:
        raise ValueError(f"unknown mesh axis {name!r}; the axes are {', '.join(MESH_AXES)}")
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
        raise ValueError(f"mesh axis {name} must have an integer size >= 1, got {size!r}")


def axis_size(mesh: Mesh, logical: str) -> int:
    return math.prod(mesh.shape[a] for a in LOGICAL_RULES.get(logical, ()))


def partition_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """The mesh placement of a value whose dimensions carry ``axes``. A dimension whose size the mesh
    axes do not divide is replicated (heads are checked beforehand: see :func:`check_divisible`)."""
    out, used = [], set()
    for name, dim in zip(axes, shape):
        mesh_axes = tuple(a for a in LOGICAL_RULES.get(name, ()) if mesh.shape[a] > 1 and a not in used)
        if not mesh_axes or dim % math.prod(mesh.shape[a] for a in mesh_axes):
            out.append(None)
            continue
        used.update(mesh_axes)
        out.append(mesh_axes if len(mesh_axes) > 1 else mesh_axes[0])
    return PartitionSpec(*out)


def named_sharding(axes, shape, mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(axes, shape, mesh))


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Leading batch dimension over the data axes (the batch size must divide), the rest replicated."""
    axes = tuple(a for a in LOGICAL_RULES["batch"] if mesh.shape[a] > 1)
    return NamedSharding(mesh, PartitionSpec(axes or None, *([None] * (ndim - 1))))


def constrain(x, axes, mesh: Mesh | None):
    """``with_sharding_constraint`` by logical axes (a no-op without a mesh)."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, named_sharding(axes, x.shape, mesh))


def check_divisible(what: str, num_heads: int, num_kv_heads: int, mesh: Mesh | None) -> None:
    """Heads and KV heads must split evenly over the tensor axis."""
    if mesh is None:
        return
    tensor = axis_size(mesh, "heads")
    bad = [f"{n} {name}" for name, n in (("attention heads", num_heads), ("KV heads", num_kv_heads)) if n % tensor]
    if bad:
        raise ValueError(f"{what}: {' and '.join(bad)} do not divide over the tensor axis of size {tensor}; "
                         f"choose a tensor size that divides both")


CACHE_AXES = (None, "batch", "kv_heads", None, None)  # [layers, batch, kv_heads, max_len, head_dim]
