"""How the decode programs run the target's layers: one ``lax.scan`` over the stacked blocks, or an
unrolled Python loop over per-layer copies of their weights that are made once and kept beside the
target (with the LM head laid out for the CPU's matrix products)."""

from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp
from flax import nnx, struct

from retrace_jax.models.target import TargetModel

LAYER_LOOPS = ("auto", "scan", "unrolled")


@struct.dataclass
class DecodeWeights:
    """Copies of the target's weights that an unrolled decode program reads instead of the stacked ones.

    ``layers``: one parameter pytree per layer (:meth:`TargetModel.layer_slices`). ``head_dv``: a tied
    LM head as ``[d, V]`` (None for an untied head, whose kernel is ``[d, V]`` already). XLA's CPU
    backend multiplies several rows by a ``[V, d]`` matrix contracted on ``d`` several times more slowly
    than by the same matrix laid out ``[d, V]`` (``benchmarks/lm_head.py``), and a verify pass or a drafted
    block multiplies 8-16 rows by the head at every round."""

    layers: list
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
    return model.unroll_layers(kept.layers).with_head_dv(kept.head_dv)


_KEPT = weakref.WeakKeyDictionary()  # target -> (the arrays the copies were made from, DecodeWeights)


def decode_weights(target: TargetModel, layer_loop: str = "auto", state: nnx.State | None = None) -> DecodeWeights | None:
    """The weights an unrolled program reads (``None`` for a scan), made once and kept beside the target
    while it lives: a second copy of the layer weights, which an unrolled program would otherwise slice
    out at every call (one copy of the weights per call, and one compiled slice per layer and weight,
    which adds much compile time to a deep model; docs/performance.md measures it), and a tied head's
    ``[d, V]`` copy. The copies are remade when the target's arrays change (JAX arrays are immutable, so
    new weights are new arrays). ``state``: the target's ``nnx.state``, when the caller has it already
    (it saves walking the target's graph once more)."""
    if resolve_layer_loop(layer_loop) != "unrolled":
        return None
    state = nnx.state(target) if state is None else state
    leaves = jax.tree.leaves(state["layers"])
    tied = target.cfg.tie_word_embeddings
    if tied:
        leaves.append(state["embed_tokens"]["embedding"].get_value())
    kept = _KEPT.get(target)
    if kept is not None and len(kept[0]) == len(leaves) and all(a is b for a, b in zip(kept[0], leaves)):
        return kept[1]
    weights = DecodeWeights(target.layer_slices(), _transposed(leaves[-1]) if tied else None)
    _KEPT[target] = (tuple(leaves), weights)
    return weights


@jax.jit
def _transposed(matrix):
    return jnp.transpose(matrix)
