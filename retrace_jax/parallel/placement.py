"""Placing an in-memory target or drafter on a mesh by its weight table's logical axes."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh

from retrace_jax.io.weights import model_specs
from retrace_jax.parallel.sharding import check_divisible, named_sharding


def shard_model(module, mesh: Mesh):
    """Places an in-memory target or drafter on ``mesh`` by the logical-axis rules."""
    cfg = module.cfg
    check_divisible(type(module).__name__, cfg.num_heads, cfg.num_kv_heads, mesh)
    axes = {s.path: s.param_axes for s in model_specs(module)}
    graphdef, state = nnx.split(module)
    flat = dict(nnx.to_flat_state(state))
    for path, var in flat.items():
        value = var.get_value()
        var.set_value(jax.device_put(value, named_sharding(axes.get(path, (None,) * value.ndim), value.shape, mesh)))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
