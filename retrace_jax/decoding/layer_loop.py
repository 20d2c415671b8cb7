"""How the decode programs run the target's layers: one ``lax.scan`` over the stacked blocks, or an
unrolled Python loop over per-layer copies of their weights that are made once and kept beside the
target."""

from __future__ import annotations

import weakref

import jax
from flax import nnx

from retrace_jax.models.target import TargetModel

LAYER_LOOPS = ("auto", "scan", "unrolled")


def resolve_layer_loop(layer_loop: str = "auto") -> str:
    """``"auto"``: "unrolled" on CPU, where a scan copies each layer's weights at every step
    (docs/performance.md measures the cost), "scan" on GPU and TPU (compile time independent of depth)."""
    if layer_loop not in LAYER_LOOPS:
        raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, got {layer_loop!r}")
    if layer_loop == "auto":
        return "unrolled" if jax.default_backend() == "cpu" else "scan"
    return layer_loop


def merge_target(graphdef, state, layer_loop: str = "auto", slices: list | None = None) -> TargetModel:
    """``nnx.merge`` for the decode programs; an unrolled layer loop slices the layers once up front
    (or uses ``slices`` from :meth:`TargetModel.layer_slices`)."""
    model = nnx.merge(graphdef, state)
    return model.unroll_layers(slices) if resolve_layer_loop(layer_loop) == "unrolled" else model


_PER_LAYER = weakref.WeakKeyDictionary()  # target -> (its stacked layer arrays, per-layer copies of them)


def per_layer_weights(target: TargetModel, layer_loop: str = "auto") -> list | None:
    """The target's layers as separate per-layer arrays for an unrolled program (``None`` for a scan),
    made once and kept beside the stacked ones while ``target`` lives: a second copy of the layer
    weights, which an unrolled program would otherwise slice out at every call (one copy of the weights
    per call, and one compiled slice per layer and weight, which adds much compile time to a deep model;
    docs/performance.md measures it). The copies are remade when the target's layer arrays change (JAX
    arrays are immutable, so new weights are new arrays)."""
    if resolve_layer_loop(layer_loop) != "unrolled":
        return None
    leaves = jax.tree.leaves(nnx.split(target.layers)[1])
    kept = _PER_LAYER.get(target)
    if kept is not None and len(kept[0]) == len(leaves) and all(a is b for a, b in zip(kept[0], leaves)):
        return kept[1]
    slices = target.layer_slices()
    _PER_LAYER[target] = (tuple(leaves), slices)
    return slices
