"""Training a drafter on its target's own greedy outputs: regenerate responses, then fit DFlash.

A small in-memory loop (one jitted step per batch) for tiny models, tests and quick experiments.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from retrace_jax.decoding.generation import generate
from retrace_jax.models.drafter import DFlashDrafter
from retrace_jax.models.target import TargetModel
from retrace_jax.training.step import StepOptions, adamw, init_opt_state, make_train_step


def regenerate(target: TargetModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
               batch_size: int = 64, pad_id: int = 0):
    """Prompt + the target's greedy response per prompt, right-padded to one length.

    Returns ``tokens [N, S]`` and ``loss_mask [N, S]`` (1 on response tokens).
    """
    rows = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        out = generate(target, chunk, max_new_tokens=max_new_tokens)
        rows += [(list(p), r) for p, r in zip(chunk, out.tokens)]
    length = max(len(p) + len(r) for p, r in rows)
    tokens = np.full((len(rows), length), pad_id, np.int32)
    mask = np.zeros((len(rows), length), np.int32)
    for n, (p, r) in enumerate(rows):
        tokens[n, : len(p) + len(r)] = p + r
        mask[n, len(p) : len(p) + len(r)] = 1
    return tokens, mask


def train_dflash(target: TargetModel, drafter: DFlashDrafter, tokens_ns, loss_mask_ns, *, steps: int,
                 batch_size: int = 16, lr: float = 3e-3, num_anchors: int = 8, seed: int = 0,
                 log: Callable[[dict], None] | None = None, log_every: int = 50) -> DFlashDrafter:
    """Fits ``drafter`` with the DFlash loss on random batches; returns the trained drafter."""
    target_def, target_state = nnx.split(target)
    drafter_def, drafter_state = nnx.split(drafter)
    drafter_state = jax.tree.map(jnp.copy, drafter_state)  # the step donates its input
    optimizer = adamw(lr, steps)
    opt_state = init_opt_state(optimizer, drafter_state)
    step_fn = make_train_step(target_def, drafter_def, optimizer, StepOptions(num_anchors=num_anchors))
    tokens, mask = jnp.asarray(tokens_ns), jnp.asarray(loss_mask_ns)
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    for step in range(steps):
        idx = rng.choice(len(tokens_ns), size=min(batch_size, len(tokens_ns)), replace=False)
        drafter_state, opt_state, m = step_fn(target_state, drafter_state, opt_state, tokens[idx], mask[idx],
                                              jnp.int32(step), jnp.uint32(seed))
        if log and (step % log_every == 0 or step == steps - 1):
            log({"step": step, "loss": float(m["loss"]), "tau": float(m["tau"]),
                 "slot_accuracy": np.round(np.asarray(m["slot_accuracy"]), 3).tolist(),
                 "seconds": round(time.perf_counter() - start, 2)})
    return nnx.merge(drafter_def, drafter_state)
