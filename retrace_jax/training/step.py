"""One jitted optimisation step of the drafter (DFlash or ReTrace objective); the target is frozen.

The step is a pure function of ``(states, batch, step, seed)``: anchors come from
``fold_in(PRNGKey(seed), step)`` and ReTrace's ``beta`` from ``step``, so a resumed run repeats an
uninterrupted one exactly.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from retrace_jax.models.layers import product_precision
from retrace_jax.parallel.sharding import batch_sharding
from retrace_jax.training.dflash_loss import (
    SLOT_WEIGHTS,
    TRAIN_MESH,
    TeacherTopK,
    dflash_loss,
    sample_anchors,
)
from retrace_jax.training.retrace_loss import (
    CORRECTION_SOURCES,
    DEFAULT_ROUNDS,
    MemoryTraining,
    loss_weights,
    retrace_loss,
)

OBJECTIVES = ("dflash", "retrace")
SCHEDULES = ("cosine", "constant")  # after the warm-up: cosine decay to 0, or constant then a linear decay
_norm = optax.tree.norm if hasattr(getattr(optax, "tree", None), "norm") else optax.global_norm


@dataclasses.dataclass(frozen=True)
class StepOptions:
    objective: str = "dflash"  # "dflash" or "retrace"
    num_anchors: int = 8
    gamma: float | None = None  # loss decay; None: the published value for the block size
    round1_weight: float | None = None  # ReTrace: weight of round 1 (later rounds 1.0); None: 1.0
    correction_source: str = "verify"  # ReTrace: "verify" or "teacher"
    beta_warmup_steps: int = 50  # ReTrace: beta ramps 0 -> 1 over these steps
    compute_dtype: str = "float32"  # "bfloat16": compute with bf16 copies of the float32 master weights
    precision: str = "float32"  # "bfloat16": the drafter's products take bfloat16 operands (layers.products)
    remat: bool = False  # recompute drafter layer activations in the backward pass
    grad_accum: int = 1  # micro-steps per optimizer update
    memory_dtype: str | None = None  # ReTrace: dtype the retained (detached) states are stored in; None: compute
    rounds: int = DEFAULT_ROUNDS  # ReTrace: rounds of the on-policy rollout (>= 2)
    round_weights: tuple[float, ...] | None = None  # ReTrace: loss weight per round; None: from round1_weight
    memory_dropout: float = 0.0  # ReTrace: probability that a block's memory is dropped in a later round
    miss_weight: float = 0.0  # ReTrace: extra loss weight of slots the memory-off draft gets wrong
    slot_weights: str = "gamma"  # DFlash: how the drafted slots weigh (dflash_loss.SLOT_WEIGHTS)
    distill_topk: int = 0  # DFlash: > 0 trains the slots on the target's top-k too (dflash_loss.teacher_top_k)
    distill_weight: float = 1.0  # DFlash, with distill_topk: the soft loss's share, the hard labels' the rest

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"compute_dtype must be float32 or bfloat16, got {self.compute_dtype!r}")
        if self.precision not in ("float32", "bfloat16"):
            raise ValueError(f"precision must be float32 or bfloat16, got {self.precision!r}")
        if self.slot_weights not in SLOT_WEIGHTS:
            raise ValueError(f"slot_weights must be one of {SLOT_WEIGHTS}, got {self.slot_weights!r}")
        if self.slot_weights != "gamma" and self.objective != "dflash":
            raise ValueError(f"slot_weights {self.slot_weights!r} serves the dflash objective only")
        if not isinstance(self.distill_topk, int) or isinstance(self.distill_topk, bool) or self.distill_topk < 0:
            raise ValueError(f"distill_topk must be a non-negative integer, got {self.distill_topk!r}")
        if self.distill_topk and self.objective != "dflash":
            raise ValueError("distill_topk serves the dflash objective only")
        if not (isinstance(self.distill_weight, (int, float)) and 0 <= self.distill_weight <= 1):
            raise ValueError(f"distill_weight must be a number in [0, 1], got {self.distill_weight!r}")
        if self.correction_source not in CORRECTION_SOURCES:
            raise ValueError(f"correction_source must be one of {CORRECTION_SOURCES}, got {self.correction_source!r}")
        if self.gamma is not None and not (isinstance(self.gamma, (int, float)) and 0 < self.gamma < float("inf")):
            raise ValueError(f"gamma must be a positive number or None, got {self.gamma!r}")
        if self.memory_dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"memory_dtype must be float32, bfloat16, float16 or None, got {self.memory_dtype!r}")
        if not isinstance(self.remat, bool):
            raise ValueError(f"remat must be True or False, got {self.remat!r}")
        loss_weights(self.rounds, self.round_weights, self.round1_weight)  # raises ValueError
        MemoryTraining(self.memory_dropout, self.miss_weight).check()
        if self.round_weights is not None:
            object.__setattr__(self, "round_weights", tuple(self.round_weights))  # hashable (a static argument)
        for name in ("num_anchors", "grad_accum"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def lr_schedule(lr: float, updates: int, warmup_frac: float, schedule: str = "cosine", decay_frac: float = 0.2):
    """The learning rate of each optimizer update: a linear warm-up over ``warmup_frac`` of the updates,
    then a cosine decay to zero at the last (the DFlash recipe), or (``"constant"``) the peak held until
    the last ``decay_frac`` of the updates and a linear decay to zero over them."""
    warmup = max(1, int(warmup_frac * updates))
    if schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, updates)
    if schedule != "constant":
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if not 0 < decay_frac <= 1:
        raise ValueError(f"decay_frac must be in (0, 1], got {decay_frac!r}")
    decay = max(1, int(round(decay_frac * updates)))
    hold = max(0, updates - warmup - decay)
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr),
                                 optax.linear_schedule(lr, 0.0, decay)], [warmup, warmup + hold])


def adamw(lr: float, steps: int, warmup_frac: float = 0.04, weight_decay: float = 0.0, clip: float = 1.0,
          grad_accum: int = 1, retrace_lr_multiplier: float = 1.0, schedule: str = "cosine", decay_frac: float = 0.2):
    """AdamW with linear warm-up, cosine decay (or ``schedule="constant"``: :func:`lr_schedule`) and
    global-norm clipping (the DFlash recipe); with
    ``grad_accum > 1`` gradients of that many consecutive steps are averaged into one update. The
    ReTrace module's updates (parameters under ``retrace``) are scaled by ``retrace_lr_multiplier``: its
    learning rate is that multiple of the rest's (its weight decay with it, as AdamW scales decay by the
    rate)."""
    if not (isinstance(lr, (int, float)) and 0 < lr < float("inf")):
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    if not (isinstance(clip, (int, float)) and 0 < clip < float("inf")):
        raise ValueError(f"clip must be a positive number (the global gradient-norm limit), got {clip!r}")
    updates = max(2, steps // max(1, grad_accum))
    rates = lr_schedule(lr, updates, warmup_frac, schedule, decay_frac)
    opt = optax.chain(optax.clip_by_global_norm(clip), optax.adamw(rates, weight_decay=weight_decay))
    if not (isinstance(retrace_lr_multiplier, (int, float)) and 0 < retrace_lr_multiplier < float("inf")):
        raise ValueError(f"retrace_lr_multiplier must be a positive number, got {retrace_lr_multiplier!r}")
    if retrace_lr_multiplier != 1.0:  # (1.0 keeps the optimizer state of runs before the option existed)
        scale = optax.multi_transform({"retrace": optax.scale(retrace_lr_multiplier), "rest": optax.identity()},
                                      retrace_labels)
        opt = optax.chain(opt, scale)
    return optax.MultiSteps(opt, grad_accum) if grad_accum > 1 else opt


def retrace_labels(params):
    """``"retrace"`` for the ReTrace module's parameters, ``"rest"`` for every other one."""
    def label(path, _):
        return "retrace" if any(getattr(key, "key", None) == "retrace" for key in path) else "rest"

    return jax.tree_util.tree_map_with_path(label, params)


def loss_fn(drafter_state, drafter_def, target, tokens_bs, loss_mask_bs, step, seed, opts: StepOptions,
            features_bsf=None, drafter_fixed=None, teacher_bsz=None):
    """``drafter_fixed``: the drafter's variables that are not trained (a draft vocabulary), when
    ``drafter_def`` comes from ``nnx.split(drafter, nnx.Param, ...)``. ``teacher_bsz``: the target's top-k
    of every position (``dflash_loss.TeacherTopK``) that comes with precomputed features."""
    if opts.compute_dtype == "bfloat16":
        drafter_state = jax.tree.map(lambda x: x.astype(jnp.bfloat16), drafter_state)
    drafter = nnx.merge(drafter_def, drafter_state, *(() if drafter_fixed is None else (drafter_fixed,)))
    key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
    anchors, valid = sample_anchors(key, loss_mask_bs, opts.num_anchors, drafter.cfg.block_size)
    if opts.objective == "dflash":
        m = dflash_loss(drafter, target, tokens_bs, loss_mask_bs, anchors, valid, opts.gamma, remat=opts.remat,
                        features_bsf=features_bsf, slot_weights=opts.slot_weights, distill_topk=opts.distill_topk,
                        distill_weight=opts.distill_weight, teacher_bsz=teacher_bsz)
        return m.loss, {"loss": m.loss, "tau": m.tau, "slot_accuracy": m.slot_accuracy}
    updates = step // opts.grad_accum  # beta ramps over optimizer updates, not micro-steps
    beta = jnp.clip(updates / max(1, opts.beta_warmup_steps), 0.0, 1.0)
    loss, r = retrace_loss(drafter, target, tokens_bs, loss_mask_bs, anchors, valid, beta,
                           round1_weight=opts.round1_weight, correction_source=opts.correction_source,
                           gamma=opts.gamma, remat=opts.remat, memory_dtype=opts.memory_dtype, rounds=opts.rounds,
                           round_weights=opts.round_weights,
                           memory_training=MemoryTraining(opts.memory_dropout, opts.miss_weight,
                                                          jax.random.fold_in(key, 1)))
    # Round 1 keeps the DFlash names (tau, slot_accuracy); every round n has loss_roundN, accepted_roundN
    # (mean a over its valid blocks) and, from round 2 on, tau_roundN and slot_accuracy_roundN.
    metrics = {"loss": loss, "tau": r.round1.tau, "slot_accuracy": r.round1.slot_accuracy, "beta": beta}
    for n, (m, a, v) in enumerate(zip(r.rounds, r.accepted, r.valid), start=1):
        metrics[f"loss_round{n}"] = m.loss
        metrics[f"accepted_round{n}"] = jnp.sum(a * v) / jnp.maximum(jnp.sum(v), 1)
        if n > 1:
            metrics[f"tau_round{n}"], metrics[f"slot_accuracy_round{n}"] = m.tau, m.slot_accuracy
    return loss, metrics


def _step(target_state, drafter_state, opt_state, tokens_bs, loss_mask_bs, step, seed, features_bsf=None,
          top_ids_bsz=None, top_probs_bsz=None, *, target_def, drafter_def, optimizer, opts, drafter_fixed=None):
    target = nnx.merge(target_def, target_state)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    teacher = None if top_ids_bsz is None else TeacherTopK(top_ids_bsz, top_probs_bsz)
    with product_precision(opts.precision):  # read as the step is traced
        (_, metrics), grads = grad_fn(drafter_state, drafter_def, target, tokens_bs, loss_mask_bs, step, seed, opts,
                                      features_bsf, drafter_fixed, teacher)
    updates, opt_state = optimizer.update(grads, opt_state, drafter_state)
    metrics["grad_norm"] = _norm(grads)
    return optax.apply_updates(drafter_state, updates), opt_state, metrics


def opt_state_shardings(optimizer, drafter_state, mesh):
    """Shardings of the optimizer state: each moment like its parameter (so FSDP shards AdamW's state
    too), counters and other scalars replicated. ``drafter_state`` may be abstract."""
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract = jax.eval_shape(optimizer.init, drafter_state)
    param_shardings = jax.tree.map(lambda x: x.sharding, drafter_state)
    return optax.tree_map_params(optimizer, lambda _, s: s, abstract, param_shardings,
                                 transform_non_params=lambda _: replicated,
                                 is_leaf=lambda x: isinstance(x, NamedSharding))


def init_opt_state(optimizer, drafter_state, mesh=None):
    """The optimizer state, laid out like the parameters (scalars replicated over the mesh)."""
    if mesh is None:
        return jax.jit(optimizer.init)(drafter_state)
    return jax.jit(optimizer.init, out_shardings=opt_state_shardings(optimizer, drafter_state, mesh))(drafter_state)


def _under_mesh(fn, mesh):
    """``fn`` traced with ``mesh`` in ``TRAIN_MESH``, so that the losses pin activations to the batch
    axes (see ``dflash_loss.batch_sharded``)."""

    @functools.wraps(fn)
    def wrapped(*args):
        token = TRAIN_MESH.set(mesh)
        try:
            return fn(*args)
        finally:
            TRAIN_MESH.reset(token)

    return wrapped


def make_train_step(target_def, drafter_def, optimizer, opts: StepOptions, *, mesh=None, drafter_shardings=None,
                    opt_shardings=None, precomputed_features=False, drafter_fixed=None):
    """The jitted step ``(target_state, drafter_state, opt_state, tokens, loss_mask, step, seed[, features[,
    top_ids, top_probs]]) -> (drafter_state, opt_state, metrics)``; drafter and optimizer states are donated.
    With ``precomputed_features`` (DFlash only) the target features come in with the batch instead of being
    computed in the step, and with ``opts.distill_topk`` the target's top-k of every position as well
    (``dflash_loss.features_fn``). With a mesh the batch is sharded over the data axes and the updated states keep
    the given shardings. ``drafter_fixed``: the untrained variables of a drafter split as
    ``nnx.split(drafter, nnx.Param, ...)`` (its draft vocabulary), constants of the step."""
    if precomputed_features and opts.objective != "dflash":
        raise ValueError("precomputed target features serve the DFlash objective only")
    fn = functools.partial(_step, target_def=target_def, drafter_def=drafter_def, optimizer=optimizer, opts=opts,
                           drafter_fixed=drafter_fixed)
    if mesh is None:
        return jax.jit(fn, donate_argnums=(1, 2))
    fn = _under_mesh(fn, mesh)
    batch, replicated = batch_sharding(mesh, 2), NamedSharding(mesh, PartitionSpec())
    in_shardings = (None, drafter_shardings, opt_shardings, batch, batch, replicated, replicated)
    if precomputed_features:
        in_shardings += (batch_sharding(mesh, 3),) * (3 if opts.distill_topk else 1)
    return jax.jit(fn, donate_argnums=(1, 2), in_shardings=in_shardings,
                   out_shardings=(drafter_shardings, opt_shardings, replicated))
