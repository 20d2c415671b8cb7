"""What a training run is refused for before it does any work: its configuration against the target's
and the starting drafter's ``config.json`` and against the devices.

``load_config`` checks every key on its own; some values are wrong only for a given target or machine
(a layer the target lacks, more positions than it has, a mesh of more devices than there are). Found
where they are used, they would stop a run after its data preparation, or after its training.
``train.py`` runs :func:`preflight` once JAX has started (the mesh spans every process's devices) and
before anything else (before ``out``, its lock or its log exist); it reads a few small JSON files and
allocates nothing.
"""

from __future__ import annotations

import json
import os

import jax

from retrace_jax.errors import ConfigError
from retrace_jax.models.config import ModelConfig, read_config
from retrace_jax.models.drafter import DrafterConfig, check_drafter_matches
from retrace_jax.models.tiny import TINY_QWEN3
from retrace_jax.parallel.sharding import check_divisible, make_mesh
from retrace_jax.training.config import TrainConfig, anchor_room, as_config, head_room, new_drafter_config
from retrace_jax.training.data import MANIFEST

# drafter keys that describe a new drafter -> DrafterConfig fields; with drafter.init, those given must
# be the checkpoint's (rather than be silently ignored)
NEW_DRAFTER_KEYS = {"num_layers": "num_layers", "block_size": "block_size", "mask_token_id": "mask_token_id",
                    "target_layer_ids": "target_layer_ids", "intermediate_size": "intermediate_size",
                    "draft_vocab": "draft_vocab_size", "attention_bias": "attention_bias"}


def target_config(cfg: TrainConfig) -> ModelConfig:
    """The target's configuration, read without its weights."""
    return TINY_QWEN3 if cfg.target == "tiny" else _read(ModelConfig, cfg.target, "target")


def _read(kind, path: str, key: str):
    try:
        return read_config(kind, path)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{key}: {err}") from None


def preflight(cfg, stage: str = "all", devices=None) -> None:
    """Raises :class:`ConfigError` listing what in ``cfg`` cannot run on its target or on ``devices``
    (default: every device of every process). ``stage`` is ``train.py``'s: data preparation alone
    needs neither the starting drafter nor the mesh."""
    cfg = as_config(cfg)
    target = target_config(cfg)
    problems = _prompts(cfg, stage) + _lengths(cfg, target, stage)
    if stage != "prepare":
        problems += _drafter(cfg, target) + _mesh(cfg, target, devices)
    if problems:
        raise ConfigError("; ".join(problems))


def needs_preparing(cfg, stage: str = "all") -> bool:
    """Whether ``train.py --stage STAGE`` prepares data: always with ``prepare``; with ``all`` unless
    ``cfg.data_dir`` holds finished data (a manifest that lists every shard). Data whose manifest cannot
    be read counts as unfinished."""
    if stage == "prepare":
        return True
    if stage != "all":
        return False
    try:
        with open(os.path.join(as_config(cfg).data_dir, MANIFEST)) as f:
            manifest = json.load(f)
        settings = manifest["settings"]
        return len(manifest["done"]) < -(-settings["num_prompts"] // settings["shard_size"])
    except (OSError, ValueError, KeyError, TypeError, ArithmeticError):
        return True


def _prompts(cfg: TrainConfig, stage: str) -> list[str]:
    """A prompt file that is not there, when the data still has to be prepared from it (training from
    prepared data does not read it)."""
    path = cfg.data.prompts
    if path == "random" or os.path.isfile(path) or not needs_preparing(cfg, stage):
        return []
    return [f"data.prompts: prompt file not found: {path} (the data in {cfg.data_dir} is still to be prepared "
            f"from it)"]


def _lengths(cfg: TrainConfig, target: ModelConfig, stage: str) -> list[str]:
    """Prompts are never cut, so prompt and new tokens must fit the target's positions (``generate``
    would refuse them during preparation, or in the evaluation at the end of training)."""
    d, limit = cfg.data, target.max_position_embeddings
    prompt, key = (d.prompt_len, "data.prompt_len") if d.prompts == "random" else (d.max_prompt_len, "data.max_prompt_len")
    uses = [("data.max_new_tokens", d.max_new_tokens)] if stage in ("all", "prepare") else []
    uses += [("train.eval_max_new_tokens", cfg.train.eval_max_new_tokens)] if stage in ("all", "train") else []
    return [f"{name}: {new} new tokens after a prompt of up to {prompt} tokens ({key}) need {prompt + new} positions, "
            f"more than the target's max_position_embeddings {limit}" for name, new in uses if prompt + new > limit]


def _drafter(cfg: TrainConfig, target: ModelConfig) -> list[str]:
    dc, out = cfg.drafter, []
    if dc.init:
        stored = _read(DrafterConfig, dc.init, "drafter.init")
        for key, field in NEW_DRAFTER_KEYS.items():
            given, theirs = dc[key], getattr(stored, field)
            theirs = list(theirs) if isinstance(theirs, tuple) else theirs
            if key in dc.model_fields_set and given is not None and given != theirs:
                out.append(f"drafter.{key}: {given}, but drafter.init {dc.init} has {theirs} (a drafter started "
                           f"from a checkpoint keeps its own; leave the key out or give that value)")
        try:
            check_drafter_matches(stored, target)
        except ConfigError as err:
            out.append(f"drafter.init {dc.init}: {err}")
        out += anchor_room(cfg.train.num_anchors, cfg.train.seq_len, stored.block_size, f"drafter.init {dc.init}")
        return out + head_room(cfg.train.distill_topk, stored.draft_vocab_size, target.vocab_size,
                               f"drafter.init {dc.init}")
    try:
        new_drafter_config(cfg, target)
    except ConfigError as err:
        out.append(f"drafter: {err}")
    bad = [i for i in dc.init_layers or () if i >= target.num_layers]
    if bad:
        out.append(f"drafter.init_layers: {bad} are not layers of the target (0..{target.num_layers - 1})")
    if dc.draft_vocab is not None and dc.draft_vocab > target.vocab_size:
        out.append(f"drafter.draft_vocab: {dc.draft_vocab} exceeds the target's vocabulary ({target.vocab_size})")
    return out + head_room(cfg.train.distill_topk, dc.draft_vocab, target.vocab_size, "drafter.draft_vocab")


def _mesh(cfg: TrainConfig, target: ModelConfig, devices) -> list[str]:
    t = cfg.train
    try:
        mesh = make_mesh(t.mesh, devices)
        check_divisible("target", target.num_heads, target.num_kv_heads, mesh)
    except ValueError as err:
        return [f"train.mesh: {err}"]
    data_parallel = mesh.shape["data"] * mesh.shape["fsdp"]
    out = []
    if t.batch_size % data_parallel:
        out.append(f"train.batch_size: {t.batch_size} does not divide over the data axes of mesh "
                   f"{dict(mesh.shape)} ({data_parallel})")
    if t.feature_cache and jax.process_count() > 1:
        out.append("train.feature_cache: serves single-process runs; with several processes the features are "
                   "computed in the step")
    return out
