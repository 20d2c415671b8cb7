"""Training steps sized ahead of time, without weights: the Qwen3-4B ReTrace recipe builds its step on
abstract arrays, and the per-device memory that docs/training.md quotes comes from XLA's analysis of
the compiled step, checked here on small shapes against the sizes of its arguments."""

import os

import jax
import jax.numpy as jnp
import pytest

from retrace_jax.models.tiny import TINY_QWEN3
from retrace_jax.training.config import from_dict, load_config
from retrace_jax.training.memory import QWEN3_4B, abstract_step, per_device_bytes, step_memory

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_qwen3_4b_retrace_config_is_the_published_recipe_and_its_step_builds():
    cfg = load_config(os.path.join(ROOT, "configs", "qwen3_4b_retrace.yaml"))
    d, t = cfg.data, cfg.train
    assert (d.num_prompts, d.max_new_tokens, d.drop_long_prompts) == (40000, 1024, True)
    assert t.steps * t.batch_size == 8 * d.num_prompts  # 8 epochs
    assert t.batch_size * t.grad_accum == 32 and t.steps // t.grad_accum == 10000  # global batch 32 per update
    assert (t.lr, t.weight_decay, t.warmup_frac, t.beta_warmup_steps) == (5e-5, 0.01, 0.05, 50)
    assert t.objective == "retrace" and t.memory_dtype == "float16" and cfg.drafter.init
    assert (cfg.drafter.block_size, cfg.drafter.num_layers) == (16, 5)
    step, args = abstract_step(cfg, QWEN3_4B)
    target_state, drafter_state, opt_state = args[:3]
    new_drafter, new_opt, metrics = jax.eval_shape(step, *args)
    same = lambda a, b: jax.tree.map(lambda x, y: (x.shape, x.dtype) == (y.shape, y.dtype), a, b)  # noqa: E731
    assert all(jax.tree.leaves(same(new_drafter, drafter_state))) and all(jax.tree.leaves(same(new_opt, opt_state)))
    assert {"loss", "loss_round1", "loss_round2", "beta", "grad_norm"} <= set(metrics)
    assert metrics["loss"].shape == () and metrics["slot_accuracy"].shape == (16,)
    # Sizes: a 4.0B-parameter bf16 target, a float32 drafter with its ReTrace module, AdamW's two moments
    # and the gradient accumulator of the 4 micro-steps.
    assert 7.4 < per_device_bytes(target_state) / 2**30 < 7.6
    drafter_params = per_device_bytes(drafter_state) // 4
    assert 0.5e9 < drafter_params < 0.6e9
    assert per_device_bytes(opt_state) == pytest.approx(3 * per_device_bytes(drafter_state), rel=1e-4)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(drafter_state))


@pytest.mark.parametrize("objective", ["dflash", pytest.param("retrace", marks=pytest.mark.slow)])
def test_memory_analysis_accounts_for_the_arguments(objective):
    def sized(batch):
        cfg = from_dict({"drafter": {"num_layers": 1, "block_size": 4},
                         "train": {"objective": objective, "batch_size": batch, "seq_len": 32, "num_anchors": 4}})
        step, args = abstract_step(cfg, TINY_QWEN3)
        return step_memory(step, args), args

    mem, args = sized(4)
    donated = per_device_bytes(args[1]) + per_device_bytes(args[2])
    assert mem["alias"] == donated  # the new drafter and optimizer state reuse the donated buffers
    if objective == "retrace":  # every target weight is read (the verify pass ends in the LM head)
        assert mem["argument"] == per_device_bytes(args)
    else:  # DFlash reads the target only up to its last feature layer: XLA drops the rest
        assert per_device_bytes(args[1:]) < mem["argument"] < per_device_bytes(args)
    assert mem["temp"] > 0 and mem["peak"] == mem["argument"] + mem["output"] + mem["temp"] - mem["alias"]
    if objective == "dflash":
        bigger, _ = sized(16)
        assert bigger["temp"] > 2 * mem["temp"]  # activations grow with the batch
