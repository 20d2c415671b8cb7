"""A training step sized ahead of time, without weights: the step of a configuration built on abstract
arrays (``jax.eval_shape``) for a target of given shapes, and its per-device memory from XLA
(``jit(...).lower(...).compile().memory_analysis()``).

    step, args = abstract_step(load_config("configs/qwen3_4b_retrace.yaml"), QWEN3_4B, mesh)
    jax.eval_shape(step, *args)      # shapes and dtypes of the outputs: the step traces
    step_memory(step, args)          # bytes per device, from the compiled program
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from retrace_jax.io.weights import model_specs
from retrace_jax.models.config import ModelConfig
from retrace_jax.models.drafter import init_drafter
from retrace_jax.models.target import abstract_target
from retrace_jax.parallel.sharding import batch_sharding, named_sharding
from retrace_jax.training.config import TrainConfig, new_drafter_args
from retrace_jax.training.loop import optimizer_for, step_options
from retrace_jax.training.step import make_train_step, opt_state_shardings

# The shapes of the published Qwen3 targets (their config.json), for sizing runs without the weights.
QWEN3_4B = ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_layers=36,
                       num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       max_position_embeddings=40960, tie_word_embeddings=True, qkv_bias=False, o_bias=False,
                       mlp_bias=False, qk_norm=True)
QWEN3_8B = dataclasses.replace(QWEN3_4B, hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False)


def _abstract(module, mesh):
    """``(graphdef, state)`` of an abstract module, each leaf a ShapeDtypeStruct placed by the rules."""
    graphdef, state = nnx.split(module)
    if mesh is None:
        return graphdef, state
    axes = {s.path: s.param_axes for s in model_specs(module)}  # as shard_model places them
    flat = dict(nnx.to_flat_state(state))
    for path, var in flat.items():
        v = var.get_value()
        sharding = named_sharding(axes.get(path, (None,) * len(v.shape)), v.shape, mesh)
        var.set_value(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding))
    return graphdef, nnx.from_flat_state(flat)


def abstract_step(cfg: TrainConfig, target_cfg: ModelConfig, mesh=None):
    """The jitted train step of ``cfg`` and abstract arguments for it (target of shapes ``target_cfg``,
    the drafter of the ``drafter`` section, the optimizer state, a global batch). Nothing is allocated."""
    t = cfg.train
    target = abstract_target(target_cfg, dtype=jnp.dtype(cfg.target_dtype))
    args = new_drafter_args(cfg, target_cfg.vocab_size)
    drafter = nnx.eval_shape(lambda: init_drafter(target_cfg, **args))
    target_def, target_state = _abstract(target, mesh)
    drafter_def, drafter_state = _abstract(drafter, mesh)
    optimizer = optimizer_for(cfg)
    if mesh is None:
        opt_state = jax.eval_shape(optimizer.init, drafter_state)
        shardings = {}
    else:  # the optimizer state follows the parameters (as init_opt_state places it)
        opt_sh = opt_state_shardings(optimizer, drafter_state, mesh)
        opt_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                 jax.eval_shape(optimizer.init, drafter_state), opt_sh)
        shardings = dict(drafter_shardings=jax.tree.map(lambda x: x.sharding, drafter_state), opt_shardings=opt_sh)
    step = make_train_step(target_def, drafter_def, optimizer, step_options(cfg), mesh=mesh, **shardings)
    batch = dict(sharding=batch_sharding(mesh, 2)) if mesh is not None else {}
    tokens = jax.ShapeDtypeStruct((t.batch_size, t.seq_len), jnp.int32, **batch)
    scalar = dict(sharding=NamedSharding(mesh, PartitionSpec())) if mesh is not None else {}
    args = (target_state, drafter_state, opt_state, tokens, tokens, jax.ShapeDtypeStruct((), jnp.int32, **scalar),
            jax.ShapeDtypeStruct((), jnp.uint32, **scalar))
    return step, args


def step_memory(step, args) -> dict[str, int]:
    """Bytes per device of the compiled step, as XLA reports them: arguments (weights, optimizer state,
    batch), outputs, temporaries, outputs aliased onto donated arguments, and their sum less the aliases
    (the peak the program needs, within XLA's estimate)."""
    return memory_report(step.lower(*args).compile())


def memory_report(compiled) -> dict[str, int]:
    """:func:`step_memory` of an already compiled step."""
    m = compiled.memory_analysis()
    out = {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes, "temp": m.temp_size_in_bytes,
           "alias": m.alias_size_in_bytes, "generated_code": m.generated_code_size_in_bytes}
    out["peak"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    return out


def step_flops(compiled) -> float:
    """Floating-point operations of one step per device, from XLA's cost analysis."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", float("nan")))


def per_device_bytes(tree) -> int:
    """Bytes of an abstract (or concrete) tree on one device, from each leaf's sharding."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += jnp.dtype(x.dtype).itemsize * math.prod(shape)
    return total
