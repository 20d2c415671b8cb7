"""The training loop behind ``train.py``: a mesh over every device of every process, sharded jitted
steps on global batches, Orbax checkpoints with exact resume, periodic τ evaluation and the export.

The run is a pure function of its settings and the prepared data: batch ``step`` is drawn from the
whole data set by ``(seed, step)`` and each process builds only the rows its devices hold, so one
process with 8 devices and two with 4 each train on the same batches and give the same result. Every
process runs this same loop (one command on every host).
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from retrace_jax.errors import CheckpointError, ConfigError
from retrace_jax.io.checkpoints import load_drafter
from retrace_jax.models.draft_vocab import (
    coverage,
    draft_vocab_ids,
    frequent_tokens,
    token_counts,
    vocab_digest,
)
from retrace_jax.models.drafter import (
    check_drafter_matches,
    init_around_layers,
    init_drafter,
    init_layers_from_target,
    with_draft_vocab,
)
from retrace_jax.parallel.distributed import agree_any, initialize
from retrace_jax.parallel.placement import shard_model
from retrace_jax.parallel.sharding import batch_sharding, make_mesh
from retrace_jax.training.checkpoints import Checkpoints
from retrace_jax.training.config import TrainConfig, anchor_room, as_config, head_room, new_drafter_args
from retrace_jax.training.data import SequenceData, describe_differences, settings_differences, spread_indices
from retrace_jax.training.evaluate import cached_features, evaluate, export_drafter
from retrace_jax.training.lock import run_lock
from retrace_jax.training.prepare import build_target, check_prepared
from retrace_jax.training.retrace_loss import loss_weights
from retrace_jax.training.step import StepOptions, adamw, init_opt_state, lr_schedule, make_train_step


class TrainingDiverged(FloatingPointError):
    """A non-finite loss or gradient: training stopped, the last good checkpoint is kept."""


def maybe_initialize_distributed(setting) -> None:
    """An alias, still importable from here: see :func:`retrace_jax.parallel.distributed.initialize`."""
    initialize(setting)


def build_drafter(cfg, target, mesh, data: SequenceData | None = None, log=None):
    """The drafter to train: a new one, or ``drafter.init`` loaded. A new drafter with ``drafter.draft_vocab``
    gets the most frequent response tokens of ``data`` (over the shards of every process)."""
    cfg = as_config(cfg)
    t, dc = cfg.train, cfg.drafter
    args = new_drafter_args(cfg, target.cfg.vocab_size)
    if dc.init:
        drafter = load_drafter(dc.init, target, retrace=args["retrace"], mesh=mesh)
    else:
        drafter = init_drafter(target.cfg, **args, seed=t.seed)
        check_drafter_matches(drafter.cfg, target.cfg)
        if dc.init_layers is not None:
            neurons = qk_scales = None
            if dc.init_mlp_neurons == "active" or dc.init_qk_norm == "target":
                if data is None:
                    raise ConfigError("drafter.init_mlp_neurons: active and drafter.init_qk_norm: target need the "
                                      "prepared data to measure on")
                stats = layer_statistics(target, data, dc.init_layers, log)
                if dc.init_mlp_neurons == "active":
                    neurons = [np.asarray(s["mlp"]) for s in stats]
                if dc.init_qk_norm == "target":
                    qk_scales = [(float(s["q_rms"]), float(s["k_rms"])) for s in stats]
            try:
                drafter = init_layers_from_target(drafter, target, dc.init_layers, neurons, qk_scales)
            except ValueError as err:
                raise ConfigError(f"drafter.init_layers: {err}") from None
        if dc.init_final_norm or dc.init_fc != "random":
            drafter = init_around_layers(drafter, target, dc.init_final_norm, dc.init_fc)
        if mesh is not None:
            drafter = shard_model(drafter, mesh)
        if dc.draft_vocab is not None:
            if data is None:
                raise ConfigError("drafter.draft_vocab needs the prepared data to count tokens in")
            counts = token_counts(data.tokens, data.mask, target.cfg.vocab_size)
            if jax.process_count() > 1:  # every process chooses from the counts of all shards
                from jax.experimental import multihost_utils

                counts = np.asarray(multihost_utils.process_allgather(counts)).sum(0)
            if dc.draft_vocab > target.cfg.vocab_size:
                raise ConfigError(f"drafter.draft_vocab {dc.draft_vocab} exceeds the target's vocabulary "
                                         f"({target.cfg.vocab_size})")
            drafter = with_draft_vocab(drafter, frequent_tokens(counts, dc.draft_vocab))
            if log is not None:
                log({"event": "draft_vocab", "size": drafter.cfg.draft_vocab_size,
                     "coverage": round(coverage(counts, drafter.draft_vocab.get_value()), 6)})
    if dc.init and dc.draft_vocab is not None and drafter.cfg.draft_vocab_size != dc.draft_vocab:
        raise ConfigError(f"drafter.draft_vocab is {dc.draft_vocab}, but {dc.init} drafts over "
                                 f"{drafter.cfg.draft_vocab_size or 'the whole vocabulary'}; a drafter keeps its "
                                 f"draft vocabulary (set drafter.draft_vocab to null or to its size)")
    if t.objective == "retrace" and drafter.cfg.retrace is None:
        raise ConfigError("objective retrace needs a ReTrace drafter")
    if t.objective == "dflash" and drafter.cfg.retrace is not None:
        raise ConfigError(f"{dc.init} is a ReTrace drafter: train it with objective retrace (objective "
                                 f"dflash would leave its ReTrace module untrained)")
    # load_config and preflight refuse this before any work; kept for a drafter built here otherwise
    room = anchor_room(t.num_anchors, t.seq_len, drafter.cfg.block_size,
                       f"drafter.init {dc.init}" if dc.init else "drafter.block_size")
    room += head_room(t.distill_topk, drafter.cfg.draft_vocab_size, target.cfg.vocab_size,
                      f"drafter.init {dc.init}" if dc.init else "drafter.draft_vocab")
    if room:
        raise ConfigError(room[0])
    return drafter


def layer_statistics(target, data: SequenceData, layers, log=None, sequences: int = 32) -> list[dict]:
    """:meth:`TargetModel.layer_statistics` of each layer over ``sequences`` training sequences spread over
    the data (every position of the sequences counts), as host values."""
    idx = spread_indices(len(data), sequences)
    width = data.width(idx)
    tokens, _, lengths = data.rows(idx, width)
    valid = np.arange(width)[None, :] < lengths[:, None]
    stats = [jax.device_get(target.layer_statistics(jnp.asarray(tokens), jnp.asarray(valid), int(layer)))
             for layer in layers]
    if log is not None:
        log({"event": "layer_statistics", "layers": [int(x) for x in layers], "sequences": len(idx),
             "q_rms": [round(float(s["q_rms"]), 4) for s in stats],
             "k_rms": [round(float(s["k_rms"]), 4) for s in stats]})
    return stats


def step_options(cfg: TrainConfig) -> StepOptions:
    t = cfg.train
    return StepOptions(objective=t.objective, num_anchors=t.num_anchors, gamma=t.gamma, round1_weight=t.round1_weight,
                       correction_source=t.correction_source, beta_warmup_steps=t.beta_warmup_steps,
                       compute_dtype=t.compute_dtype, precision=t.precision, remat=t.remat, grad_accum=t.grad_accum,
                       memory_dtype=t.memory_dtype, rounds=t.rounds,
                       round_weights=None if t.round_weights is None else tuple(t.round_weights),
                       memory_dropout=t.memory_dropout, miss_weight=t.miss_weight, slot_weights=t.slot_weights,
                       distill_topk=t.distill_topk, distill_weight=t.distill_weight)


def optimizer_for(cfg: TrainConfig):
    t = cfg.train
    return adamw(t.lr, t.steps, t.warmup_frac, t.weight_decay, t.clip, t.grad_accum,
                 t.retrace_lr_multiplier if t.objective == "retrace" else 1.0, t.schedule, t.decay_frac)


def run_settings(cfg: TrainConfig, drafter, num_sequences: int) -> dict:
    """What an exact resume must share with the run that wrote the checkpoint. (The mesh, the process
    count, remat, logging and checkpoint intervals may change.) ``drafter``: the drafter, or its
    config."""
    t = cfg.train
    drafter_cfg = getattr(drafter, "cfg", drafter)
    vocab = draft_vocab_ids(drafter)
    weights, retrace = loss_weights(t.rounds, t.round_weights, t.round1_weight), t.objective == "retrace"
    return {
        "seed": t.seed, "objective": t.objective, "batch_size": t.batch_size, "seq_len": t.seq_len, "steps": t.steps,
        "grad_accum": t.grad_accum, "num_anchors": t.num_anchors, "lr": t.lr, "warmup_frac": t.warmup_frac,
        "weight_decay": t.weight_decay, "clip": t.clip, "gamma": t.gamma, "round1_weight": weights[0],
        "retrace_lr_multiplier": t.retrace_lr_multiplier if retrace else None,
        "rounds": t.rounds if retrace else None, "round_weights": list(weights) if retrace else None,
        "memory_dropout": t.memory_dropout if retrace else None, "miss_weight": t.miss_weight if retrace else None,
        "correction_source": t.correction_source, "beta_warmup_steps": t.beta_warmup_steps,
        "compute_dtype": t.compute_dtype, "precision": t.precision, "memory_dtype": t.memory_dtype,
        "block_size": drafter_cfg.block_size,
        "slot_weights": t.slot_weights, "schedule": t.schedule, "length_buckets": t.length_buckets,
        "distill_topk": t.distill_topk, "distill_weight": t.distill_weight if t.distill_topk else None,
        "loss_positions": t.loss_positions,
        # the features' products: the store's follow target_precision, the step's are JAX's default
        "feature_precision": cfg.target_precision if t.feature_cache else "float32",
        "decay_frac": t.decay_frac if t.schedule == "constant" else None,
        "num_layers": drafter_cfg.num_layers, "intermediate_size": drafter_cfg.intermediate_size,
        "attention_bias": drafter_cfg.attention_bias,
        "target_layer_ids": list(drafter_cfg.target_layer_ids),
        "mask_token_id": drafter_cfg.mask_token_id,
        "retrace": drafter_cfg.retrace.to_hf() if drafter_cfg.retrace is not None else None,
        "num_sequences": num_sequences,
        # A draft vocabulary by its digest (None: the whole vocabulary). A checkpoint whose settings lack
        # a key is not compared on it (settings_differences).
        "draft_vocab": None if vocab is None else vocab_digest(vocab),
        "branch_from": None if t.branch_from is None else os.path.normpath(t.branch_from),
        "branch_step": t.branch_step,
    }


# what a branch (train.branch_from) may set otherwise than the run it starts from: the schedule
BRANCH_MAY_CHANGE = ("steps", "schedule", "warmup_frac", "decay_frac", "lr", "branch_from", "branch_step")


def _lr_at(settings: dict, step: int) -> float:
    """The learning rate of the update after ``step`` micro-steps under a run's saved settings."""
    ga = settings.get("grad_accum", 1)
    schedule = lr_schedule(settings["lr"], settings["steps"] // ga, settings["warmup_frac"],
                           settings.get("schedule", "cosine"), settings.get("decay_frac") or 0.2)
    return float(schedule(step // ga))


def open_branch(cfg: TrainConfig, settings: dict, log) -> Checkpoints:
    """The checkpoints of the run that ``train.branch_from`` names, read only, once checkpoint
    ``train.branch_step`` is known to be there, to match its files' checksums and to have been written with
    this run's settings but for :data:`BRANCH_MAY_CHANGE`. Logs the learning rate there under both
    schedules (a warning where the branch makes it jump)."""
    t = cfg.train
    directory = os.path.join(t.branch_from, "checkpoints")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"train.branch_from: {t.branch_from} holds no checkpoints ({directory})")
    ckpts = Checkpoints(directory, keep=t.keep_checkpoints, read_only=True)
    try:
        steps = ckpts.all_steps()
        if t.branch_step not in steps:
            raise FileNotFoundError(f"train.branch_step: no checkpoint of step {t.branch_step} in {directory}; "
                                    f"there are: {', '.join(map(str, sorted(steps))) or 'none'}")
        ckpts.verify(t.branch_step)  # a changed file: a CheckpointError naming it
        saved = ckpts.read_meta(t.branch_step)
        diff = settings_differences({k: v for k, v in saved.items() if k not in BRANCH_MAY_CHANGE}, settings)
        if diff:
            raise ConfigError(f"train.branch_from: checkpoint {t.branch_step} in {directory} was written with other "
                              f"settings ({describe_differences(diff)}); a branch may change only the schedule "
                              f"({', '.join(BRANCH_MAY_CHANGE[:5])})")
    except BaseException:
        ckpts.close()
        raise
    then = _lr_at(saved, t.branch_step) if all(k in saved for k in ("lr", "steps", "warmup_frac")) else None
    now = _lr_at(settings, t.branch_step)
    log({"event": "branched", "from": directory, "step": t.branch_step, "lr_then": then, "lr_now": now})
    if then is not None and not math.isclose(then, now, rel_tol=1e-6, abs_tol=1e-12):
        log({"event": "warning", "message": f"the learning rate jumps at the branch step {t.branch_step}: {then:.3g} "
                                            f"under the schedule of {t.branch_from}, {now:.3g} under this run's"})
    return ckpts


def check_resume(ckpts: Checkpoints, step: int, settings: dict, out: str) -> None:
    """Refuses, before anything is restored, to resume a checkpoint written with other settings. A
    checkpoint whose files differ from their checksums is not compared (its settings may be the changed
    bytes): restoring it fails, and :func:`restore_newest_readable` sets it aside."""
    try:
        ckpts.verify(step)
    except CheckpointError:
        return
    saved = ckpts.read_meta(step)
    if saved.get("objective") == "retrace" and "rounds" not in saved:  # saved without rounds: two rounds
        saved = {**saved, "rounds": 2}
    diff = settings_differences(saved, settings)
    if diff:
        raise ConfigError(f"{out}/checkpoints/{step} was written with other settings ({describe_differences(diff)}); "
                          f"an exact resume needs the same ones: restore them, or train into a new out directory")


def restore_newest_readable(ckpts: Checkpoints, drafter_state, opt_state, settings: dict, out: str, log):
    """``(step, drafter_state, opt_state)`` of the newest checkpoint that restores. Newer ones that do not
    (a truncated, lost or changed file) are set aside as ``STEP.unreadable`` with a warning, once an older
    one has restored: a failure that every checkpoint shares (too little memory, say) moves nothing. None
    readable is a ``CheckpointError`` naming the directory. Every process calls this; a checkpoint that
    fails on any process counts as unreadable on all."""
    failures: list[tuple[int, str]] = []
    for step in ckpts.all_steps():
        check_resume(ckpts, step, settings, out)
        error = None
        try:
            new_drafter, new_opt, _ = ckpts.restore(step, drafter_state, opt_state, warn=_warning(log))
        except CheckpointError as err:
            error = str(err)
        if agree_any(error is not None):
            failures.append((step, error or f"checkpoint {step} in {ckpts.directory} cannot be read on another "
                                            f"process"))
            continue
        for bad, message in failures:
            moved = ckpts.set_aside(bad)
            log({"event": "warning", "message": f"{message}; resuming from step {step}, the newest readable one; "
                                                f"it is moved to {moved}"})
        return step, new_drafter, new_opt
    if failures:
        listed = "; ".join(message.replace(f" in {ckpts.directory}", "") for _, message in failures)
        raise CheckpointError(f"no checkpoint in {ckpts.directory} can be read ({listed}); move them away to "
                              f"train from the start")
    return 0, drafter_state, opt_state


def _warning(log):
    return lambda message: log({"event": "warning", "message": message})


def global_batch(data: SequenceData, step: int, batch_size: int, seed: int, mesh, features=(),
                 bucketed: tuple[int, int] | None = None, loss_positions: str = "response"):
    """The arrays of batch ``step``, sharded over the data axes; each process fills only its own rows:
    the tokens, the loss mask and every array of the stores ``features`` (``train.feature_cache``:
    :func:`~retrace_jax.training.evaluate.cached_features`). ``bucketed`` (``train.length_buckets``:
    ``(block_size, num_anchors)``): batches of similar lengths, each as wide as it needs
    (:meth:`SequenceData.width`). ``loss_positions`` (``train.loss_positions``): "all" hands the step a loss
    mask of every real position after each sequence's first instead of the response positions. Also
    ``(tokens, response_tokens)``: the batch's real tokens and its response positions (every process builds
    the whole batch's host rows, so these are global)."""
    idx = data.indices(step, batch_size, seed, bucketed is not None)
    width = data.width(idx, *bucketed) if bucketed else None
    tokens, mask, lengths = data.rows(idx, width)
    loss_mask = mask
    if loss_positions == "all":
        pos = np.arange(tokens.shape[1])[None, :]
        loss_mask = ((pos >= 1) & (pos < lengths[:, None])).astype(mask.dtype)
    elif loss_positions != "response":
        raise ValueError(f"loss_positions is 'response' or 'all', got {loss_positions!r}")
    host = [tokens, loss_mask] + [x for store in features for x in store.get_all(idx, width)]
    arrays = [jax.make_array_from_callback(x.shape, batch_sharding(mesh, x.ndim), lambda i, x=x: x[i]) for x in host]
    return arrays, (int(lengths.sum()), int(np.count_nonzero(mask)))


def host_value(x) -> np.ndarray:
    """A replicated value (a metric) as a host array, on any process."""
    if not getattr(x, "is_fully_addressable", True):
        x = x.addressable_data(0)
    return np.asarray(jax.device_get(x))


class _Stop:
    """Set by SIGTERM: the loop saves a checkpoint and returns."""

    requested = False

    def __call__(self, signum, frame):
        self.requested = True


class _Setup(NamedTuple):
    """What training and exporting both build from a configuration."""
    mesh: jax.sharding.Mesh
    target: object
    data: SequenceData
    drafter: object
    settings: dict  # run_settings: what a checkpoint of this run must have been written with


def _setup(cfg: TrainConfig, log) -> _Setup:
    t = cfg.train
    initialize(t.distributed)
    mesh = make_mesh(t.mesh)
    data_parallel = mesh.shape["data"] * mesh.shape["fsdp"]
    if t.batch_size % data_parallel:
        raise ConfigError(f"train.batch_size {t.batch_size} must divide over the data axes of mesh "
                                 f"{dict(mesh.shape)} ({data_parallel})")
    if t.length_buckets and jax.process_count() > 1:
        raise ConfigError("train.length_buckets serves single-process runs (each process holds other sequences, "
                          "so their batch widths would differ)")
    if t.feature_cache and jax.process_count() > 1:
        raise ConfigError("train.feature_cache serves single-process runs; with several processes the "
                                 "features are computed in the step")
    check_prepared(cfg, log)  # data made otherwise is refused before the target loads
    target, _ = build_target(cfg, mesh)
    data = SequenceData(cfg.data_dir, t.seq_len)
    drafter = build_drafter(cfg, target, mesh, data, log)
    return _Setup(mesh, target, data, drafter, run_settings(cfg, drafter, len(data)))


def _trainable(cfg: TrainConfig, drafter, mesh):
    """The drafter split into its graph, its trained parameters and its fixed state (a draft vocabulary),
    with the optimizer and a fresh optimizer state (the structure a checkpoint restores into)."""
    optimizer = optimizer_for(cfg)
    drafter_def, drafter_state, fixed = nnx.split(drafter, nnx.Param, ...)
    return optimizer, drafter_def, drafter_state, fixed, init_opt_state(optimizer, drafter_state, mesh)


def train(cfg, log=print) -> dict:
    """Runs (or resumes) training; returns a summary. Exports the drafter when the run completes; a run
    that stops before (SIGTERM, ``train.stop_after``) saves a checkpoint and says why in
    ``summary["stopped"]`` ("SIGTERM" or "stop_after"). With several processes every process calls this
    with the same configuration. Holds the lock on ``cfg.out`` (:mod:`retrace_jax.training.lock`):
    another run there is refused."""
    cfg = as_config(cfg)
    initialize(cfg.train.distributed)  # before the lock, which process 0 takes
    with run_lock(cfg.out):
        s = _setup(cfg, log)
        with open(os.path.join(cfg.data_dir, "eval_prompts.json")) as f:
            eval_ids = json.load(f)
        ckpts = Checkpoints(os.path.join(cfg.out, "checkpoints"), keep=cfg.train.keep_checkpoints)
        branch = None
        try:
            start = ckpts.latest_step() or 0
            if start:
                check_resume(ckpts, start, s.settings, cfg.out)
            elif cfg.train.branch_from is not None:
                branch = open_branch(cfg, s.settings, log)
                start = cfg.train.branch_step
            return _run(cfg, s, eval_ids, ckpts, start, log, branch)
        finally:
            if branch is not None:
                branch.close()
            ckpts.close()


def export_checkpoint(cfg, step: int | None = None, log=print) -> str:
    """Exports the drafter of checkpoint ``step`` of ``cfg.out`` (default: the latest) to
    ``OUT/drafter_step{N}`` in the official layout, without training: to evaluate a run that is still going
    (its checkpoints are only read) or one that stopped early. The configuration must be the run's own."""
    cfg = as_config(cfg)
    initialize(cfg.train.distributed)  # before the checkpoints touch JAX (_setup's call then does nothing)
    ckpts = Checkpoints(os.path.join(cfg.out, "checkpoints"), keep=cfg.train.keep_checkpoints, read_only=True)
    try:
        steps = list(ckpts.manager.all_steps())
        if not steps:
            raise FileNotFoundError(f"no finished checkpoint in {ckpts.directory}")
        if step is None:
            step = max(steps)
        elif step not in steps:
            raise FileNotFoundError(f"no checkpoint of step {step} in {ckpts.directory}; there are: "
                                    f"{', '.join(map(str, sorted(steps)))}")
        s = _setup(cfg, log)  # the target and the data load only once the step is known to exist
        check_resume(ckpts, step, s.settings, cfg.out)
        _, drafter_def, drafter_state, fixed, opt_state = _trainable(cfg, s.drafter, s.mesh)
        drafter_state, _, _ = ckpts.restore(step, drafter_state, opt_state, warn=_warning(log))
    finally:
        ckpts.close()
    path = export_drafter(nnx.merge(drafter_def, drafter_state, fixed), os.path.join(cfg.out, f"drafter_step{step}"))
    log({"event": "exported", "step": step, "drafter": path})
    return path


def _run(cfg: TrainConfig, setup: _Setup, eval_ids, ckpts, start, log, branch: Checkpoints | None = None) -> dict:
    t = cfg.train
    target, drafter, data, mesh, settings = setup.target, setup.drafter, setup.data, setup.mesh, setup.settings
    target_def, target_state = nnx.split(target)
    optimizer, drafter_def, drafter_state, fixed, opt_state = _trainable(cfg, drafter, mesh)
    drafter_sh = jax.tree.map(lambda x: x.sharding, drafter_state)
    opt_sh = jax.tree.map(lambda x: x.sharding, opt_state)
    step_fn = make_train_step(target_def, drafter_def, optimizer, step_options(cfg), mesh=mesh,
                              drafter_shardings=drafter_sh, opt_shardings=opt_sh, precomputed_features=t.feature_cache,
                              drafter_fixed=fixed)
    features = ()
    if t.feature_cache:
        features = cached_features(target, drafter.cfg.target_layer_ids, data, t.batch_size, log, cfg.data_dir,
                                   cfg.target, precision=cfg.target_precision, top_k=t.distill_topk,
                                   head_ids=draft_vocab_ids(drafter))
    if branch is not None:  # train.branch_from: another run's checkpoint, checked by open_branch
        drafter_state, opt_state, _ = branch.restore(start, drafter_state, opt_state, warn=_warning(log))
    elif start:
        start, drafter_state, opt_state = restore_newest_readable(ckpts, drafter_state, opt_state, settings, cfg.out,
                                                                  log)
    if start and branch is None:
        log({"event": "resumed", "step": start, "processes": jax.process_count()})
    stop = _Stop()
    previous = signal.signal(signal.SIGTERM, stop) if threading.current_thread() is threading.main_thread() else None
    summary = {"steps_run": 0, "first_loss": None, "last_loss": None}
    pending: list[tuple[int, dict]] = []  # metrics of the steps not yet checked for finiteness
    last_saved = (start or None) if branch is None else None  # a branch's start is the other run's checkpoint
    bucketed = (drafter.cfg.block_size, t.num_anchors) if t.length_buckets else None
    # the tokens of every batch trained so far, from step 0 (a resumed run counts the earlier ones from the
    # data order): the x axis of a curve against tokens seen, exact across resumes
    tokens_seen, response_seen = data.seen(start, t.batch_size, t.seed, bucketed is not None) if start else (0, 0)
    tick, tick_tokens = time.perf_counter(), tokens_seen
    step = start

    def check_finite():
        """Raises on the first non-finite loss or gradient norm since the last check (nothing saved)."""
        values = [(host_value(m["loss"]), host_value(m["grad_norm"])) for _, m in pending]
        for (s, _), (loss, norm) in zip(pending, values):
            if not (math.isfinite(float(loss)) and math.isfinite(float(norm))):
                kept = f"the last good checkpoint is step {last_saved}" if last_saved else "no checkpoint was written"
                raise TrainingDiverged(f"training diverged at step {s}: loss {float(loss)}, gradient norm "
                                       f"{float(norm)}; stopped without saving it ({kept} in {cfg.out}/checkpoints; "
                                       f"nothing exported). Lower train.lr (now {t.lr}) or check the data")
        pending.clear()

    try:
        while step < t.steps:
            batch, (tokens, response) = global_batch(data, step, t.batch_size, t.seed, mesh, features, bucketed,
                                                      t.loss_positions)
            drafter_state, opt_state, metrics = step_fn(target_state, drafter_state, opt_state, batch[0], batch[1],
                                                        jnp.int32(step), jnp.uint32(t.seed), *batch[2:])
            step += 1
            ckpts.poll()  # the checksums of a checkpoint whose asynchronous save has finished meanwhile
            summary["steps_run"] += 1
            tokens_seen += tokens
            response_seen += response
            pending.append((step, metrics))
            logging = step % t.log_every == 0 or step == t.steps or step == start + 1
            if logging:
                m = {k: host_value(v) for k, v in metrics.items()}
                check_finite()
                now = time.perf_counter()
                record = {"step": step, **{k: (v if k == "loss" else np.round(v, 4)).tolist() for k, v in m.items()},
                          "tokens_per_s": round((tokens_seen - tick_tokens) / (now - tick), 1),
                          "tokens_seen": tokens_seen, "response_tokens_seen": response_seen}
                tick, tick_tokens = now, tokens_seen
                summary["first_loss"] = summary["first_loss"] if summary["first_loss"] is not None else record["loss"]
                summary["last_loss"] = record["loss"]
                log(record)
            if eval_ids and t.eval_every and step % t.eval_every == 0 and step < t.steps:
                check_finite()
                log({**evaluate(target, nnx.merge(drafter_def, drafter_state, fixed), eval_ids, t.eval_max_new_tokens,
                                mesh, step), "tokens_seen": tokens_seen, "response_tokens_seen": response_seen})
            stop_now = stop.requested
            if jax.process_count() > 1 and (logging or step % t.checkpoint_every == 0):
                stop_now = agree_any(stop_now)  # every process stops at the same step
            stopping = stop_now or (t.stop_after is not None and summary["steps_run"] >= t.stop_after)
            if step % t.checkpoint_every == 0 or step == t.steps or stopping:
                check_finite()
                ckpts.save(step, drafter_state, opt_state, settings)
                last_saved = step
            if stopping:
                reason = "SIGTERM" if stop_now else "stop_after"
                log({"event": "stopped", "step": step, "reason": reason})
                if step < t.steps:
                    summary["stopped"] = reason
                break
        check_finite()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    summary["step"] = step
    if step >= t.steps:
        drafter = nnx.merge(drafter_def, drafter_state, fixed)
        if eval_ids:
            record = {**evaluate(target, drafter, eval_ids, t.eval_max_new_tokens, mesh, step),
                      "tokens_seen": tokens_seen, "response_tokens_seen": response_seen}
            log(record)
            summary.update({k: v for k, v in record.items() if k not in ("event", "step")})
        summary["drafter"] = export_drafter(drafter, os.path.join(cfg.out, "drafter"))
        log({"event": "done", **summary})
    return summary
