"""How the decode programs run the target's layers: one ``lax.scan`` over the stacked blocks, or an
unrolled Python loop over per-layer weights: on one CPU device, views of the stacked arrays' memory that
are made once and kept beside the target; elsewhere the stacked arrays themselves, indexed statically
where each layer runs (one copy of the weights in either case). The LM head is laid out for the CPU's
matrix products."""

from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from retrace_jax.models.target import TargetModel

LAYER_LOOPS = ("auto", "scan", "unrolled")


@struct.dataclass
class DecodeWeights:
    """The target's weights as an unrolled decode program reads them instead of the stacked ones.

    ``layers``: one parameter pytree per layer: views of the stacked arrays' memory on one CPU device;
    None elsewhere (the program indexes the stacked arrays: :meth:`TargetModel.unroll_in_place`), or
    copies (:meth:`TargetModel.layer_slices`) when asked for (``per_layer_copies``, to measure them
    against the other two). ``head_dv``: a tied
    LM head as ``[d, V]`` (None for an untied head, whose kernel is ``[d, V]`` already). XLA's CPU
    backend multiplies several rows by a ``[V, d]`` matrix contracted on ``d`` several times more slowly
    than by the same matrix laid out ``[d, V]`` (``benchmarks/lm_head.py``), and a verify pass or a drafted
    block multiplies 8-16 rows by the head at every round."""

    layers: list | None
    head_dv: jax.Array | None


def resolve_layer_loop(layer_loop: str = "auto") -> str:
    """``"auto"``: "unrolled" on CPU, where a scan copies each layer's weights at every step
    (docs/performance.md measures the cost), "scan" on GPU and TPU (compile time independent of depth)."""
    if layer_loop not in LAYER_LOOPS:
        raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, got {layer_loop!r}")
    if layer_loop == "auto":
        return "unrolled" if jax.default_backend() == "cpu" else "scan"
    return layer_loop


def merge_target(graphdef, state, layer_loop: str = "auto", kept: DecodeWeights | None = None) -> TargetModel:
    """``nnx.merge`` for the decode programs; an unrolled layer loop uses the weights of ``kept`` (from
    :func:`decode_weights`), or slices the layers once up front when it is None."""
    model = nnx.merge(graphdef, state)
    if resolve_layer_loop(layer_loop) != "unrolled":
        return model
    if kept is None:
        return model.unroll_layers()
    model = model.unroll_in_place() if kept.layers is None else model.unroll_layers(kept.layers)
    return model.with_head_dv(kept.head_dv)


_KEPT = weakref.WeakKeyDictionary()  # target -> (the arrays they were made from, DecodeWeights, per_layer_copies)


def decode_weights(target: TargetModel, layer_loop: str = "auto", state: nnx.State | None = None,
                   per_layer_copies: bool = False) -> DecodeWeights | None:
    """The weights an unrolled program reads (``None`` for a scan), made once and kept beside the target
    while it lives. On one CPU device, the layer weights one array per layer, views of the stacked
    arrays' memory (:func:`_layer_views`): XLA's CPU backend copies a layer's weights out of a stacked
    array at every step (docs/performance.md measures it), and slicing them inside each program would
    also add one compiled slice per layer and weight. Elsewhere no layer arrays (``layers`` None): the
    program indexes the stacked arrays where each layer runs (:meth:`TargetModel.unroll_in_place`),
    so the weights stay one copy; ``per_layer_copies`` makes a second copy of them instead, one array
    per layer (what this function kept before; ``benchmarks/device_check.py`` compares the two). A tied
    head gets its ``[d, V]`` copy. They are remade when the target's arrays change (JAX arrays are
    immutable, so new weights are new arrays). ``state``: the target's ``nnx.state``, when the caller has
    it already (it saves walking the target's graph once more)."""
    if resolve_layer_loop(layer_loop) != "unrolled":
        return None
    state = nnx.state(target) if state is None else state
    leaves = jax.tree.leaves(state["layers"])
    tied = target.cfg.tie_word_embeddings
    if tied:
        leaves.append(state["embed_tokens"]["embedding"].get_value())
    kept = _KEPT.get(target)
    if (kept is not None and kept[2] == per_layer_copies and len(kept[0]) == len(leaves)
            and all(a is b for a, b in zip(kept[0], leaves))):
        return kept[1]
    layers = target.layer_slices() if per_layer_copies else _layer_views(target)
    weights = DecodeWeights(layers, _transposed(leaves[-1]) if tied else None)
    _KEPT[target] = (tuple(leaves), weights, per_layer_copies)
    return weights


def _layer_views(target: TargetModel) -> list | None:
    """The stacked blocks' parameters as one pytree per layer whose arrays share the stacked arrays' memory
    (no second copy of the layer weights: 1.41 GB for Qwen2.5-Coder-0.5B in float32), where every stacked
    array lies whole in one CPU device's memory; else None (sharded or accelerator arrays: the program
    indexes the stacked arrays, :meth:`TargetModel.unroll_in_place`). A program reads such a view as it reads a copy, so decoding is as
    fast. JAX keeps the stacked arrays' memory while a view of it lives, and never writes into it (a
    program given a view to donate copies it instead)."""
    _, params = nnx.split(target.layers)
    leaves = jax.tree.leaves(params)
    if not leaves or not all(_on_one_cpu(a) for a in leaves):
        return None
    hosts = [np.asarray(a) for a in leaves]  # the arrays' own memory, read-only (no copy on a CPU)
    if not all(h.flags.c_contiguous for h in hosts):
        return None
    # committed to a device where the stacked arrays are (a program's outputs follow its inputs, and a
    # committed cache in the next call would compile the program again), else on the default device
    devices = [next(iter(a.devices())) if a.committed else None for a in leaves]
    treedef = jax.tree.structure(params)
    return [jax.tree.unflatten(treedef, [jax.device_put(h[i], d, may_alias=True) for h, d in zip(hosts, devices)])
            for i in range(target.cfg.num_layers)]


def _on_one_cpu(array) -> bool:
    if not isinstance(array, jax.Array) or isinstance(array, jax.core.Tracer) or array.is_deleted():
        return False
    devices = array.devices()
    return len(devices) == 1 and next(iter(devices)).platform == "cpu" and array.is_fully_addressable


@jax.jit
def _transposed(matrix):
    return jnp.transpose(matrix)
