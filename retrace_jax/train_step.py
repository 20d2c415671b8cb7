"""One jitted optimisation step of the drafter; the target is frozen and passed as state."""

from __future__ import annotations

import functools

import jax
import optax
from flax import nnx

from retrace_jax.dflash_loss import dflash_loss, sample_anchors


def adamw(lr: float, steps: int, warmup_frac: float = 0.04, weight_decay: float = 0.0, clip: float = 1.0):
    """AdamW with linear warm-up, cosine decay and global-norm clipping (the DFlash recipe)."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, int(warmup_frac * steps)), max(2, steps))
    return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(schedule, weight_decay=weight_decay))


@functools.partial(jax.jit, static_argnames=("target_def", "drafter_def", "optimizer", "num_anchors"),
                   donate_argnames=("drafter_state", "opt_state"))
def dflash_train_step(target_def, target_state, drafter_def, drafter_state, opt_state, tokens_bs, loss_mask_bs,
                      key, *, optimizer, num_anchors: int):
    """Samples anchors, computes the DFlash loss and applies one optimizer update to the drafter."""
    target = nnx.merge(target_def, target_state)
    block_size = nnx.merge(drafter_def, drafter_state).cfg.block_size
    anchors, valid = sample_anchors(key, loss_mask_bs, num_anchors, block_size)

    def loss_fn(state):
        metrics = dflash_loss(nnx.merge(drafter_def, state), target, tokens_bs, loss_mask_bs, anchors, valid)
        return metrics.loss, metrics

    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(drafter_state)
    updates, opt_state = optimizer.update(grads, opt_state, drafter_state)
    return optax.apply_updates(drafter_state, updates), opt_state, metrics
