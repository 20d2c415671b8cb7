"""The training driver behind ``train.py``: configuration, data preparation, and the training loop
(mesh, sharded jitted steps, Orbax checkpoints with exact resume, periodic τ evaluation, export)."""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx

from retrace_jax.checkpointing import Checkpoints
from retrace_jax.data import (DataError, PrepareSettings, SequenceData, byte_encoder, chat_encoder, drop_long,
                              iter_prompt_ids, load_tokenizer, prepare_shards, read_prompts)
from retrace_jax.dflash_loss import target_features
from retrace_jax.drafter import init_drafter
from retrace_jax.generation import generate
from retrace_jax.hf_io import check_drafter_matches, load_drafter, load_target, save_drafter, shard_model
from retrace_jax.retrace import ReTraceConfig
from retrace_jax.sharding import batch_sharding, make_mesh
from retrace_jax.tiny import tiny_target
from retrace_jax.train_step import StepOptions, adamw, init_opt_state, make_train_step

DEFAULTS: dict[str, Any] = {
    "target": "tiny",  # a Hugging Face directory, or "tiny" (a random Qwen3 made on the spot)
    "target_dtype": "float32",
    "out": "runs/default",  # metrics.jsonl, checkpoints/, drafter/ (the exported drafter), data/
    "data": {
        "prompts": "random",  # a JSONL file (ShareGPT, OpenAI messages, {"prompt"}), or random token prompts
        "num_prompts": 1024,  # how many prompts to use (random prompts: how many to draw); null: all
        "prompt_len": 8,  # random prompts only
        "eval_prompts": 16,  # held out from training for the periodic τ evaluation
        "max_prompt_len": 1024,  # prompts are never cut: longer ones are dropped (below) or refused
        "drop_long_prompts": True,  # true: longer prompts are left out (and counted); false: they are an error
        "max_new_tokens": 64,  # response length of the regeneration
        "gen_batch_size": 64,
        "shard_size": 512,
        "temperature": 0.0,  # regeneration: greedy by default
        "thinking": False,  # Qwen3 chat template: thinking off unless asked
        "drafter": None,  # a drafter directory to regenerate faster (same output at temperature 0)
        "dir": None,  # default: {out}/data
    },
    "drafter": {
        "init": None,  # a DFlash (or ReTrace) checkpoint directory to start from
        "num_layers": 1,
        "block_size": 8,
        "mask_token_id": None,  # null: the last vocabulary id
        "target_layer_ids": None,  # null: the official default
        "intermediate_size": None,
    },
    "retrace": {"signals": "both", "rank": None, "gate": True},
    "train": {
        "objective": "dflash",  # "dflash" or "retrace"
        "steps": 100,
        "batch_size": 8,  # global, in sequences
        "seq_len": 128,
        "num_anchors": 8,
        "lr": 3.0e-3,
        "warmup_frac": 0.04,
        "weight_decay": 0.0,
        "clip": 1.0,
        "grad_accum": 1,
        "compute_dtype": "float32",
        "remat": False,
        "feature_cache": False,  # DFlash: compute the target features of all sequences once, keep them in memory
        "gamma": None,
        "round1_weight": 1.0,
        "correction_source": "verify",
        "beta_warmup_steps": 50,
        "seed": 0,
        "mesh": None,  # e.g. "data=2,fsdp=2,tensor=2"; null: every device on the data axis
        "distributed": "auto",  # jax.distributed.initialize(): true, false, or auto (when a coordinator is set)
        "log_every": 10,
        "eval_every": 0,  # 0: only at the end
        "eval_max_new_tokens": 64,
        "checkpoint_every": 100,
        "keep_checkpoints": 3,
        "stop_after": None,  # stop (with a checkpoint) after this many steps in this run
    },
}


class ConfigurationError(ValueError):
    """A training configuration that cannot run."""


def _merge(base: dict, update: dict, where: str = "") -> dict:
    out = copy.deepcopy(base)
    for key, value in (update or {}).items():
        if key not in base:
            raise ConfigurationError(f"unknown config key {where + key!r}")
        if isinstance(base[key], dict):
            if not isinstance(value, dict):
                raise ConfigurationError(f"config key {where + key!r} must be a mapping")
            out[key] = _merge(base[key], value, f"{where}{key}.")
        else:
            out[key] = _coerce(base[key], value)
    return out


NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _coerce(default, value):
    """YAML reads ``1e-3`` as a string: numbers are parsed where the default is a number (or unset)."""
    if not isinstance(value, str) or isinstance(default, bool) or not isinstance(default, (int, float, type(None))):
        return value
    if NUMBER.match(value):
        return int(value) if isinstance(default, int) and value.lstrip("+-").isdigit() else float(value)
    if default is not None:
        raise ConfigurationError(f"expected a number, got {value!r}")
    return value


def validate(cfg) -> None:
    """Checks the settings that would otherwise fail deep inside a run."""
    t, d, dr = cfg["train"], cfg["data"], cfg["drafter"]
    problems = []
    for key in ("steps", "batch_size", "seq_len", "num_anchors", "log_every", "checkpoint_every", "grad_accum",
                "keep_checkpoints", "eval_max_new_tokens"):
        if not isinstance(t[key], int) or t[key] < 1:
            problems.append(f"train.{key} must be a positive integer, got {t[key]!r}")
    if not isinstance(t["eval_every"], int) or t["eval_every"] < 0:
        problems.append(f"train.eval_every must be >= 0 (0: only at the end), got {t['eval_every']!r}")
    if t["objective"] not in ("dflash", "retrace"):
        problems.append(f"train.objective must be dflash or retrace, got {t['objective']!r}")
    if not dr["init"] and isinstance(t["seq_len"], int) and t["seq_len"] < dr["block_size"] + 1:
        problems.append(f"train.seq_len {t['seq_len']} leaves no room for a block of {dr['block_size']}")
    if d["prompts"] == "random" and not isinstance(d["num_prompts"], int):
        problems.append("data.num_prompts must be set for random prompts")
    if not isinstance(d["eval_prompts"], int) or d["eval_prompts"] < 0:
        problems.append(f"data.eval_prompts must be >= 0, got {d['eval_prompts']!r}")
    if t["feature_cache"] and t["objective"] != "dflash":
        problems.append("train.feature_cache serves the dflash objective only (ReTrace runs the target on drafts)")
    if problems:
        raise ConfigurationError("; ".join(problems))


def load_config(path: str, overrides: list[str] = ()) -> dict:
    """Defaults, then the YAML file, then ``key.sub=value`` overrides (values parsed as YAML)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file not found: {path}")
    with open(path) as f:
        cfg = _merge(DEFAULTS, yaml.safe_load(f) or {})
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigurationError(f"--set expects key=value, got {item!r}")
        *parents, leaf = key.split(".")
        patch: dict = {leaf: yaml.safe_load(value)}
        for p in reversed(parents):
            patch = {p: patch}
        cfg = _merge(cfg, patch)
    for section, key in PATH_KEYS:
        holder = cfg[section] if section else cfg
        if isinstance(holder[key], str):
            holder[key] = os.path.expanduser(holder[key])
    validate(cfg)
    return cfg


PATH_KEYS = ((None, "target"), (None, "out"), ("data", "prompts"), ("data", "dir"), ("data", "drafter"),
             ("drafter", "init"))


def data_dir(cfg) -> str:
    return cfg["data"]["dir"] or os.path.join(cfg["out"], "data")


def build_target(cfg, mesh=None):
    if cfg["target"] == "tiny":
        target = tiny_target()
        return (shard_model(target, mesh) if mesh is not None else target), None
    return load_target(cfg["target"], dtype=cfg["target_dtype"], mesh=mesh), load_tokenizer(cfg["target"])


# ---------------------------------------------------------------------------------------------- prepare

def prepare(cfg, log=print) -> str:
    """Regenerates the training responses with the target; returns the data directory."""
    d = cfg["data"]
    target, tokenizer = build_target(cfg)
    vocab = target.cfg.vocab_size
    n_eval = d["eval_prompts"]
    if d["prompts"] == "random":
        rng = np.random.RandomState(cfg["train"]["seed"])
        ids = [rng.randint(0, vocab, (d["prompt_len"],)).tolist() for _ in range(d["num_prompts"] + n_eval)]
    else:
        limit = None if d["num_prompts"] is None else d["num_prompts"] + n_eval
        encode = chat_encoder(tokenizer, d["thinking"]) if tokenizer is not None else byte_encoder(vocab)
        ids = iter_prompt_ids(read_prompts(d["prompts"], None if d["drop_long_prompts"] else limit), encode)
        if d["drop_long_prompts"]:
            ids, dropped = drop_long(ids, d["max_prompt_len"], limit)
            log({"event": "dropped_long_prompts", "kept": len(ids), "dropped": dropped,
                 "max_prompt_len": d["max_prompt_len"]})
    if len(ids) <= n_eval:
        raise DataError(f"{len(ids)} prompts leave none for training after holding out {n_eval} for evaluation")
    train_ids, eval_ids = ids[: len(ids) - n_eval], ids[len(ids) - n_eval :]
    out = data_dir(cfg)
    os.makedirs(out, exist_ok=True)
    eval_path = os.path.join(out, "eval_prompts.json")
    eval_ids = [p[: d["max_prompt_len"]] for p in eval_ids]
    if os.path.exists(eval_path):
        with open(eval_path) as f:
            if json.load(f) != eval_ids:
                raise DataError(f"{eval_path} holds other evaluation prompts; use a new data directory")
    else:
        with open(eval_path, "w") as f:
            json.dump(eval_ids, f)
    drafter = load_drafter(d["drafter"], target) if d["drafter"] else None
    stops = [t for t in ([tokenizer.eos_token_id] if tokenizer is not None else []) if t is not None]

    def generate_fn(chunk, first_index):
        tokens = []
        for i in range(0, len(chunk), d["gen_batch_size"]):
            out = generate(target, chunk[i : i + d["gen_batch_size"]], d["max_new_tokens"], drafter=drafter,
                           temperature=d["temperature"], stop_token_ids=stops, seed=first_index + i)
            tokens += out.tokens
        return tokens

    settings = PrepareSettings(num_prompts=len(train_ids), shard_size=d["shard_size"],
                               max_prompt_len=d["max_prompt_len"], max_new_tokens=d["max_new_tokens"],
                               temperature=d["temperature"], source=str(d["prompts"]))
    start = time.perf_counter()
    manifest = prepare_shards(out, train_ids, settings, generate_fn)
    log({"event": "prepared", "dir": out, "shards": len(manifest["done"]), "prompts": len(train_ids),
         "eval_prompts": len(eval_ids), "seconds": round(time.perf_counter() - start, 1)})
    return out


# ------------------------------------------------------------------------------------------------ train

def maybe_initialize_distributed(setting) -> None:
    auto = setting == "auto" and ("JAX_COORDINATOR_ADDRESS" in os.environ or "COORDINATOR_ADDRESS" in os.environ)
    if setting is True or auto:
        jax.distributed.initialize()


def build_drafter(cfg, target, mesh):
    t, dc = cfg["train"], cfg["drafter"]
    retrace = ReTraceConfig(**cfg["retrace"]) if t["objective"] == "retrace" else None
    if dc["init"]:
        drafter = load_drafter(dc["init"], target, retrace=retrace, mesh=mesh)
    else:
        vocab = target.cfg.vocab_size
        mask_id = dc["mask_token_id"] if dc["mask_token_id"] is not None else vocab - 1
        drafter = init_drafter(target.cfg, mask_token_id=mask_id, num_layers=dc["num_layers"],
                               block_size=dc["block_size"], target_layer_ids=dc["target_layer_ids"],
                               intermediate_size=dc["intermediate_size"], retrace=retrace, seed=t["seed"])
        check_drafter_matches(drafter.cfg, target.cfg)
        if mesh is not None:
            drafter = shard_model(drafter, mesh)
    if t["objective"] == "retrace" and drafter.cfg.retrace is None:
        raise ConfigurationError("objective retrace needs a ReTrace drafter")
    if t["objective"] == "dflash" and drafter.cfg.retrace is not None:
        raise ConfigurationError(f"{dc['init']} is a ReTrace drafter: train it with objective retrace (objective "
                                 f"dflash would leave its ReTrace module untrained)")
    seq_room = t["seq_len"] - drafter.cfg.block_size + 1
    if t["num_anchors"] > seq_room:
        raise ConfigurationError(f"train.num_anchors {t['num_anchors']} exceeds the {max(seq_room, 0)} anchor "
                                 f"positions of a {t['seq_len']}-token sequence with block size {drafter.cfg.block_size}")
    return drafter


class _Stop:
    """Set by SIGTERM: the loop saves a checkpoint and returns."""

    requested = False

    def __call__(self, signum, frame):
        self.requested = True


def train(cfg, log=print) -> dict:
    """Runs (or resumes) training; returns a summary. Exports the drafter when the run completes."""
    t = cfg["train"]
    maybe_initialize_distributed(t["distributed"])
    mesh = make_mesh(t["mesh"])
    target, _ = build_target(cfg, mesh)
    nproc, pid = jax.process_count(), jax.process_index()
    if t["batch_size"] % nproc or t["batch_size"] % (mesh.shape["data"] * mesh.shape["fsdp"]):
        raise ConfigurationError(f"batch_size {t['batch_size']} must divide over {nproc} processes and the "
                                 f"data axes of mesh {dict(mesh.shape)}")
    data = SequenceData(data_dir(cfg), t["seq_len"], pid, nproc)
    with open(os.path.join(data_dir(cfg), "eval_prompts.json")) as f:
        eval_ids = json.load(f)
    drafter = build_drafter(cfg, target, mesh)
    opts = StepOptions(objective=t["objective"], num_anchors=t["num_anchors"], gamma=t["gamma"],
                       round1_weight=t["round1_weight"], correction_source=t["correction_source"],
                       beta_warmup_steps=t["beta_warmup_steps"], compute_dtype=t["compute_dtype"], remat=t["remat"],
                       grad_accum=t["grad_accum"])
    optimizer = adamw(t["lr"], t["steps"], t["warmup_frac"], t["weight_decay"], t["clip"], t["grad_accum"])
    target_def, target_state = nnx.split(target)
    drafter_def, drafter_state = nnx.split(drafter)
    opt_state = init_opt_state(optimizer, drafter_state, mesh)
    drafter_sh = jax.tree.map(lambda x: x.sharding, drafter_state)
    opt_sh = jax.tree.map(lambda x: x.sharding, opt_state)
    step_fn = make_train_step(target_def, drafter_def, optimizer, opts, mesh=mesh, drafter_shardings=drafter_sh,
                              opt_shardings=opt_sh, precomputed_features=t["feature_cache"])
    local_batch = t["batch_size"] // nproc
    features = cached_features(target, drafter.cfg.target_layer_ids, data, local_batch, log) if t["feature_cache"] else None
    ckpts = Checkpoints(os.path.join(cfg["out"], "checkpoints"), keep=t["keep_checkpoints"])
    start = ckpts.latest_step() or 0
    run_meta = {"seed": t["seed"], "objective": t["objective"], "batch_size": t["batch_size"], "seq_len": t["seq_len"],
                "steps": t["steps"], "grad_accum": t["grad_accum"]}
    if start:
        drafter_state, opt_state, meta = ckpts.restore(start, drafter_state, opt_state)
        changed = {k: (meta.get(k), v) for k, v in run_meta.items() if k in meta and meta[k] != v}
        if changed:
            ckpts.close()
            raise ConfigurationError(f"{cfg['out']}/checkpoints was written with other settings {changed} "
                                     f"(saved, now); an exact resume needs the same ones, or use a new out")
        log({"event": "resumed", "step": start, "from": meta})
    stop = _Stop()
    previous = signal.signal(signal.SIGTERM, stop) if _main_thread() else None
    sharding = batch_sharding(mesh, 2)
    summary = {"steps_run": 0, "first_loss": None, "last_loss": None}
    tick, tokens_seen = time.perf_counter(), 0
    step = start
    try:
        while step < t["steps"]:
            idx = data.indices(step, local_batch, t["seed"])
            tokens, mask, lengths = data.rows(idx)
            batch = [jax.make_array_from_process_local_data(sharding, x) for x in (tokens, mask)]
            if features is not None:
                batch.append(jax.make_array_from_process_local_data(batch_sharding(mesh, 3), features[idx]))
            drafter_state, opt_state, metrics = step_fn(target_state, drafter_state, opt_state, batch[0], batch[1],
                                                        jnp.int32(step), jnp.uint32(t["seed"]), *batch[2:])
            step += 1
            summary["steps_run"] += 1
            tokens_seen += int(lengths.sum()) * nproc
            if step % t["log_every"] == 0 or step == t["steps"] or step == start + 1:
                m = jax.device_get(metrics)
                now = time.perf_counter()
                record = {"step": step, **{k: np.round(np.asarray(v), 4).tolist() for k, v in m.items()},
                          "tokens_per_s": round(tokens_seen / (now - tick), 1)}
                tick, tokens_seen = now, 0
                summary["first_loss"] = summary["first_loss"] or record["loss"]
                summary["last_loss"] = record["loss"]
                log(record)
            if eval_ids and t["eval_every"] and step % t["eval_every"] == 0 and step < t["steps"]:
                log(evaluate(target, nnx.merge(drafter_def, drafter_state), eval_ids, t, mesh, step))
            stopping = stop.requested or (t["stop_after"] is not None and summary["steps_run"] >= t["stop_after"])
            if step % t["checkpoint_every"] == 0 or step == t["steps"] or stopping:
                ckpts.save(step, drafter_state, opt_state, run_meta)
            if stopping:
                log({"event": "stopped", "step": step, "reason": "SIGTERM" if stop.requested else "stop_after"})
                break
    finally:
        ckpts.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    summary["step"] = step
    if step >= t["steps"]:
        drafter = nnx.merge(drafter_def, drafter_state)
        if eval_ids:
            summary.update({k: v for k, v in evaluate(target, drafter, eval_ids, t, mesh, step).items() if k != "event"})
        export = os.path.join(cfg["out"], "drafter")
        if pid == 0:
            save_drafter(_gathered(drafter), export)
        summary["drafter"] = export
        log({"event": "done", **summary})
    return summary


FEATURE_CACHE_LIMIT = 16 << 30  # bytes of host memory the feature cache may take


def cached_features(target, layer_ids, data: SequenceData, batch_size: int, log) -> np.ndarray:
    """The frozen target's features of every local sequence ``[N, seq_len, n*d]``, computed once."""
    width = len(layer_ids) * target.cfg.hidden_size
    itemsize = jnp.dtype(target.dtype).itemsize
    size = len(data) * data.seq_len * width * itemsize
    if size > FEATURE_CACHE_LIMIT:
        raise ConfigurationError(f"train.feature_cache would take {size / 2**30:.1f} GiB of host memory "
                                 f"(limit {FEATURE_CACHE_LIMIT / 2**30:.0f} GiB); compute features online instead")
    graphdef, state = nnx.split(target)
    fn = jax.jit(lambda st, tokens: target_features(nnx.merge(graphdef, st), tokens, tuple(layer_ids)))
    out = np.zeros((len(data), data.seq_len, width), jnp.dtype(target.dtype))
    start = time.perf_counter()
    for i in range(0, len(data), batch_size):
        idx = np.arange(i, min(i + batch_size, len(data)))
        tokens = np.zeros((batch_size, data.seq_len), np.int32)
        tokens[: len(idx)] = data.rows(idx)[0]
        out[idx] = np.asarray(jax.device_get(fn(state, tokens)))[: len(idx)]
    log({"event": "feature_cache", "sequences": len(data), "gib": round(size / 2**30, 3),
         "seconds": round(time.perf_counter() - start, 1)})
    return out


def evaluate(target, drafter, eval_ids, t, mesh, step) -> dict:
    """Real speculative generation on the held-out prompts: τ of the current drafter."""
    out = generate(target, eval_ids, t["eval_max_new_tokens"], drafter=drafter, mesh=mesh)
    return {"event": "eval", "step": step, "eval_tau": round(out.tau(), 4), "eval_tau_pooled": round(out.tau_pooled(), 4)}


def _gathered(module):
    if jax.process_count() == 1:
        return module
    from jax.experimental import multihost_utils

    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, multihost_utils.process_allgather(state, tiled=True))


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
