"""The training configuration of ``train.py``: one dataclass per YAML section holds the defaults, the
documentation and the validation of every key.

    cfg = load_config("configs/tiny_dflash.yaml", ["train.steps=200"])
    cfg.train.steps, cfg.data.prompts, cfg.drafter.block_size

Loading checks everything that would otherwise fail deep inside a run (often inside traced code): an
unknown key, a value of the wrong type, a learning rate that is not positive, a clip of 0, a bad
``gamma`` or ``correction_source``. All problems are reported at once, each named by its key. Sections
also read like plain dicts (``cfg["train"]["steps"]``), so code written for the dict form keeps working.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import typing
import warnings
from typing import Any, ClassVar

import yaml

from retrace_jax.errors import ConfigError
from retrace_jax.models.retrace import SIGNALS
from retrace_jax.parallel.sharding import parse_mesh_spec

OBJECTIVES = ("dflash", "retrace")
CORRECTION_SOURCES = ("verify", "teacher")
COMPUTE_DTYPES = ("float32", "bfloat16")
TARGET_DTYPES = ("float32", "bfloat16", "float16")
MEMORY_DTYPES = (None, "float32", "bfloat16", "float16")
NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def doc(text: str, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING):
    """A dataclass field with its documentation (shown by ``describe()``)."""
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata={"doc": text})
    return dataclasses.field(default=default, metadata={"doc": text})


class Section:
    """Common behaviour of the sections: dict-style reads, validation, conversion to plain dicts."""

    RENAMED: ClassVar[dict[str, str]] = {}  # old key -> new key (the old one warns)

    def __getitem__(self, key: str):
        if key not in {f.name for f in dataclasses.fields(self)}:
            raise KeyError(key)
        return getattr(self, key)

    def __setitem__(self, key: str, value) -> None:
        setattr(self, key, value)

    def to_dict(self) -> dict:
        return {f.name: (getattr(self, f.name).to_dict() if isinstance(getattr(self, f.name), Section)
                         else getattr(self, f.name)) for f in dataclasses.fields(self)}

    def problems(self, where: str) -> list[str]:  # overridden per section
        return []


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass
class DataConfig(Section):
    """``data:``: the prompts and their regeneration by the target."""

    prompts: str = doc("a JSONL file (ShareGPT, OpenAI messages, {\"prompt\"}, {\"turns\"}), or 'random' "
                       "token prompts", "random")
    num_prompts: int | None = doc("how many prompts to use (random prompts: how many to draw); null: all", 1024)
    prompt_len: int = doc("random prompts only: their length in tokens", 8)
    eval_prompts: int = doc("held out from training for the periodic τ evaluation", 16)
    max_prompt_len: int = doc("prompts are never cut: longer ones are dropped (below) or refused", 1024)
    drop_long_prompts: bool = doc("true: longer prompts are left out (and counted); false: they are an error", True)
    max_new_tokens: int = doc("response length of the regeneration", 64)
    gen_batch_size: int = doc("prompts per generate() call during regeneration", 64)
    shard_size: int = doc("prompts per data shard (the unit of resuming and of multi-process preparation)", 512)
    temperature: float = doc("regeneration temperature (0: greedy)", 0.0)
    thinking: bool = doc("Qwen3 chat template: thinking off unless asked", False)
    drafter: str | None = doc("a drafter directory to regenerate faster (same output at temperature 0)", None)
    dir: str | None = doc("the prepared data; null: {out}/data", None)

    def problems(self, where):
        out = []
        for key in ("prompt_len", "max_prompt_len", "max_new_tokens", "gen_batch_size", "shard_size"):
            if not _positive_int(self[key]):
                out.append(f"{where}{key} must be a positive integer, got {self[key]!r}")
        if self.num_prompts is not None and not _positive_int(self.num_prompts):
            out.append(f"{where}num_prompts must be a positive integer or null, got {self.num_prompts!r}")
        if self.prompts == "random" and self.num_prompts is None:
            out.append(f"{where}num_prompts must be set for random prompts")
        if not isinstance(self.eval_prompts, int) or isinstance(self.eval_prompts, bool) or self.eval_prompts < 0:
            out.append(f"{where}eval_prompts must be >= 0, got {self.eval_prompts!r}")
        if not _number(self.temperature) or self.temperature < 0:
            out.append(f"{where}temperature must be >= 0, got {self.temperature!r}")
        return out


@dataclasses.dataclass
class DrafterSection(Section):
    """``drafter:``: the drafter to train (a new one, or a checkpoint to start from)."""

    init: str | None = doc("a DFlash (or ReTrace) checkpoint directory to start from; the keys below "
                           "then come from its config.json", None)
    num_layers: int = doc("decoder layers of a new drafter", 1)
    block_size: int = doc("tokens per drafted block (slot 0 holds the last committed token)", 8)
    mask_token_id: int | None = doc("the mask token; null: the last vocabulary id", None)
    target_layer_ids: list[int] | None = doc("target layers whose features the drafter reads; null: the "
                                             "official default", None)
    intermediate_size: int | None = doc("MLP width of a new drafter; null: the target's", None)
    init_layers: list[int] | None = doc("target layers whose weights start a new drafter's layers, one per "
                                        "layer (e.g. the last ones); null: random", None)
    draft_vocab: int | None = doc("a new drafter proposes only the N most frequent response tokens of the "
                                  "training data (a draft vocabulary: its LM head is N rows of the target's, "
                                  "cheaper to train and to run; retrace_jax/models/draft_vocab.py); null: the whole "
                                  "vocabulary. With init: the checkpoint's, which must have this size", None)

    def problems(self, where):
        out = []
        layers = self.init_layers
        if layers is not None and (not isinstance(layers, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)):
            out.append(f"{where}init_layers must be a list of target layer indices or null, got {layers!r}")
        elif layers is not None and self.init:
            out.append(f"{where}init_layers starts a new drafter; with init the weights come from {self.init}")
        elif layers is not None and _positive_int(self.num_layers) and len(layers) != self.num_layers:
            out.append(f"{where}init_layers needs one target layer per drafter layer ({self.num_layers}), got {layers!r}")
        if self.draft_vocab is not None and not _positive_int(self.draft_vocab):
            out.append(f"{where}draft_vocab must be a positive integer or null, got {self.draft_vocab!r}")
        if not _positive_int(self.num_layers):
            out.append(f"{where}num_layers must be a positive integer, got {self.num_layers!r}")
        if not _positive_int(self.block_size) or self.block_size < 2:
            out.append(f"{where}block_size must be an integer >= 2, got {self.block_size!r}")
        for key in ("mask_token_id", "intermediate_size"):
            value = self[key]
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                out.append(f"{where}{key} must be a non-negative integer or null, got {value!r}")
        ids = self.target_layer_ids
        if ids is not None and (not isinstance(ids, list) or not ids or
                                not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
            out.append(f"{where}target_layer_ids must be a non-empty list of layer indices or null, got {ids!r}")
        return out


@dataclasses.dataclass
class RetraceSection(Section):
    """``retrace:``: the ReTrace module added to the drafter when the objective is retrace."""

    signals: str = doc(f"which rejected states enter the correction: {', '.join(SIGNALS)}", "both")
    rank: int | None = doc("low-rank factorisation of the ReTrace projections; null: full rank", None)
    gate: bool = doc("sigmoid gate on the residual", True)

    def problems(self, where):
        out = []
        if self.signals not in SIGNALS:
            out.append(f"{where}signals must be one of {', '.join(SIGNALS)}, got {self.signals!r}")
        if self.rank is not None and not _positive_int(self.rank):
            out.append(f"{where}rank must be a positive integer or null, got {self.rank!r}")
        return out


@dataclasses.dataclass
class TrainSection(Section):
    """``train:``: the objective, the optimiser, the mesh, checkpoints and logging."""

    objective: str = doc("dflash, or retrace (the on-policy rollout of `rounds` rounds)", "dflash")
    steps: int = doc("training steps (micro-steps when grad_accum > 1)", 100)
    batch_size: int = doc("global batch, in sequences (over all processes and devices)", 8)
    seq_len: int = doc("sequences are cut or padded to this many tokens", 128)
    num_anchors: int = doc("anchored blocks per sequence", 8)
    lr: float = doc("peak learning rate of AdamW", 3.0e-3)
    warmup_frac: float = doc("linear warm-up, as a fraction of the optimizer updates; then cosine decay", 0.04)
    weight_decay: float = doc("AdamW weight decay", 0.0)
    clip: float = doc("global gradient-norm clip (> 0)", 1.0)
    grad_accum: int = doc("micro-steps averaged into one optimizer update", 1)
    compute_dtype: str = doc("float32, or bfloat16 (bf16 copies of the float32 master weights)", "float32")
    remat: bool = doc("recompute drafter layer activations in the backward pass", False)
    feature_cache: bool = doc("DFlash, one process: compute the target features of all sequences once, into "
                              "a memory-mapped store beside the prepared data that later runs reuse "
                              "(resumable; retrace_jax/training/feature_store.py)", False)
    gamma: float | None = doc("loss decay over block slots; null: the published value for the block size", None)
    rounds: int = doc("ReTrace: rounds of the on-policy rollout per anchor (>= 2): round 1 drafts without "
                      "memory, each later round re-anchors where the previous one's acceptance leaves it, with "
                      "that round's rejected suffix as its memory, as at inference", 4)
    round_weights: list[float] | None = doc("ReTrace: the loss weight of each round, one per round; null: "
                                            "round1_weight for round 1 and 1.0 for every later round", None)
    round1_weight: float | None = doc("ReTrace: weight of the round-1 (DFlash) loss, every later round "
                                      "weighing 1.0 (the short form of round_weights; not with it); null: 1.0",
                                      None)
    correction_source: str = doc("ReTrace: verify (the target run on the drafted block, as at inference) "
                                 "or teacher (the teacher-forced states)", "verify")
    beta_warmup_steps: int = doc("ReTrace: beta ramps 0 -> 1 over these optimizer updates", 50)
    memory_dtype: str | None = doc("ReTrace: store the retained (detached) rejected-suffix states in this "
                                   "dtype, e.g. float16; null: the compute dtype", None)
    seed: int = doc("drafter init, anchors and the data order", 0)
    mesh: str | None = doc("e.g. 'data=2,fsdp=2,tensor=2' over all devices of all processes; null: every "
                           "device on the data axis", None)
    distributed: bool | str = doc("jax.distributed.initialize(): true, false, or auto (when a coordinator "
                                  "or a cluster scheduler is detected)", "auto")
    log_every: int = doc("steps between metric lines", 10)
    eval_every: int = doc("steps between τ evaluations (0: only at the end)", 0)
    eval_max_new_tokens: int = doc("tokens generated per held-out prompt in evaluation", 64)
    checkpoint_every: int = doc("steps between Orbax checkpoints", 100)
    keep_checkpoints: int = doc("checkpoints kept", 3)
    stop_after: int | None = doc("stop (with a checkpoint) after this many steps in this run", None)
    tensorboard: bool | str = doc("TensorBoard event files in {out}/tensorboard: true, false, or auto (when "
                                  "tensorboardX is installed: pip install 'retrace-jax[tensorboard]')", "auto")

    def problems(self, where):
        out = []
        for key in ("steps", "batch_size", "seq_len", "num_anchors", "log_every", "checkpoint_every", "grad_accum",
                    "keep_checkpoints", "eval_max_new_tokens"):
            if not _positive_int(self[key]):
                out.append(f"{where}{key} must be a positive integer, got {self[key]!r}")
        for key in ("eval_every", "beta_warmup_steps", "seed"):
            if not isinstance(self[key], int) or isinstance(self[key], bool) or self[key] < 0:
                out.append(f"{where}{key} must be an integer >= 0, got {self[key]!r}")
        if self.stop_after is not None and not _positive_int(self.stop_after):
            out.append(f"{where}stop_after must be a positive integer or null, got {self.stop_after!r}")
        if self.objective not in OBJECTIVES:
            out.append(f"{where}objective must be dflash or retrace, got {self.objective!r}")
        if not _number(self.lr) or self.lr <= 0:
            out.append(f"{where}lr must be a positive number, got {self.lr!r}")
        if not _number(self.clip) or self.clip <= 0:
            out.append(f"{where}clip must be a positive number (the global gradient-norm limit), got {self.clip!r}")
        if not _number(self.warmup_frac) or not 0 <= self.warmup_frac < 1:
            out.append(f"{where}warmup_frac must lie in [0, 1), got {self.warmup_frac!r}")
        if not _number(self.weight_decay) or self.weight_decay < 0:
            out.append(f"{where}weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.gamma is not None and (not _number(self.gamma) or self.gamma <= 0):
            out.append(f"{where}gamma must be a positive number or null, got {self.gamma!r}")
        if not isinstance(self.rounds, int) or isinstance(self.rounds, bool) or self.rounds < 2:
            out.append(f"{where}rounds must be an integer >= 2, got {self.rounds!r}")
        if self.round1_weight is not None and (not _number(self.round1_weight) or self.round1_weight < 0):
            out.append(f"{where}round1_weight must be a number >= 0 or null, got {self.round1_weight!r}")
        weights = self.round_weights
        if weights is not None:
            if not isinstance(weights, list) or not all(_number(w) and w >= 0 for w in weights):
                out.append(f"{where}round_weights must be a list of numbers >= 0 (one per round) or null, "
                           f"got {weights!r}")
            elif isinstance(self.rounds, int) and len(weights) != self.rounds:
                out.append(f"{where}round_weights has {len(weights)} weights for {self.rounds} rounds: give one "
                           f"per round, got {weights!r}")
            if self.round1_weight is not None:
                out.append(f"{where}round_weights and {where}round1_weight are both given: round1_weight is the "
                           f"short form of round_weights [round1_weight, 1.0, ...]; keep one of them")
        if self.correction_source not in CORRECTION_SOURCES:
            out.append(f"{where}correction_source must be verify or teacher, got {self.correction_source!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            out.append(f"{where}compute_dtype must be float32 or bfloat16, got {self.compute_dtype!r}")
        if self.memory_dtype not in MEMORY_DTYPES:
            out.append(f"{where}memory_dtype must be float32, bfloat16, float16 or null, got {self.memory_dtype!r}")
        for key in ("remat", "feature_cache"):
            if not isinstance(self[key], bool):
                out.append(f"{where}{key} must be true or false, got {self[key]!r}")
        for key in ("distributed", "tensorboard"):
            if self[key] not in (True, False, "auto"):
                out.append(f"{where}{key} must be true, false or auto, got {self[key]!r}")
        if self.feature_cache is True and self.objective == "retrace":
            out.append(f"{where}feature_cache serves the dflash objective only (ReTrace runs the target on drafts)")
        if self.mesh is not None:
            try:
                parse_mesh_spec(str(self.mesh))
            except ValueError as err:
                out.append(f"{where}mesh: {err}")
        return out


@dataclasses.dataclass
class TrainConfig(Section):
    """The whole file: the target, the output directory and the sections."""

    target: str = doc("a Hugging Face directory, or 'tiny' (a random Qwen3 made on the spot)", "tiny")
    target_dtype: str = doc("float32, bfloat16 or float16", "float32")
    out: str = doc("metrics.jsonl, tensorboard/, checkpoints/, drafter/ (the exported drafter), data/",
                   "runs/default")
    data: DataConfig = doc("", factory=DataConfig)
    drafter: DrafterSection = doc("", factory=DrafterSection)
    retrace: RetraceSection = doc("", factory=RetraceSection)
    train: TrainSection = doc("", factory=TrainSection)

    def problems(self, where=""):
        out = []
        if self.target_dtype not in TARGET_DTYPES:
            out.append(f"target_dtype must be one of {', '.join(TARGET_DTYPES)}, got {self.target_dtype!r}")
        for name in ("data", "drafter", "retrace", "train"):
            out += self[name].problems(f"{name}.")
        t, dr = self.train, self.drafter
        if (not dr.init and _positive_int(t.seq_len) and _positive_int(dr.block_size)
                and t.seq_len < dr.block_size + 1):
            out.append(f"train.seq_len {t.seq_len} leaves no room for a block of {dr.block_size}")
        return out

    def validate(self) -> "TrainConfig":
        problems = self.problems()
        if problems:
            raise ConfigError("; ".join(problems))
        return self

    @property
    def data_dir(self) -> str:
        return self.data.dir or os.path.join(self.out, "data")


SECTIONS = {"data": DataConfig, "drafter": DrafterSection, "retrace": RetraceSection, "train": TrainSection}
PATH_KEYS = (("target",), ("out",), ("data", "prompts"), ("data", "dir"), ("data", "drafter"), ("drafter", "init"))


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(kind, value, key: str):
    """YAML reads ``1e-3`` as a string: numbers are parsed where the key holds a number; ints are taken
    where a float is expected. Anything else is left for validation, which names the key."""
    args = typing.get_args(kind) or (kind,)
    if isinstance(value, str) and NUMBER.match(value) and (int in args or float in args):
        if int in args and value.lstrip("+-").isdigit():
            return int(value)
        return float(value)
    if float in args and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _apply(section: Section, update: dict, where: str) -> None:
    if not isinstance(update, dict):
        raise ConfigError(f"config key {where.rstrip('.') or 'the file'!r} must be a mapping, got {update!r}")
    hints = _hints(type(section))
    for key, value in update.items():
        if key in section.RENAMED:
            new = section.RENAMED[key]
            warnings.warn(f"config key {where + key!r} is now {where + new!r}", DeprecationWarning, stacklevel=3)
            key = new
        if key not in hints or key == "RENAMED":
            raise ConfigError(f"unknown config key {where + str(key)!r}")
        current = getattr(section, key)
        if isinstance(current, Section):
            _apply(current, value or {}, f"{where}{key}.")
        else:
            setattr(section, key, _coerce(hints[key], value, where + key))


def load_config(path: str | None, overrides: list[str] = (), validate: bool = True) -> TrainConfig:
    """Defaults, then the YAML file (``None``: defaults only), then ``key.sub=value`` overrides (values
    parsed as YAML), then ``~`` in paths expanded and everything validated."""
    cfg = TrainConfig()
    if path is not None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config file not found: {path}")
        with open(path) as f:
            try:
                raw = yaml.safe_load(f)
            except yaml.YAMLError as err:
                raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
        _apply(cfg, raw or {}, "")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        *parents, leaf = key.split(".")
        patch: dict = {leaf: yaml.safe_load(value)}
        for p in reversed(parents):
            patch = {p: patch}
        _apply(cfg, patch, "")
    for keys in PATH_KEYS:
        holder = cfg if len(keys) == 1 else cfg[keys[0]]
        if isinstance(holder[keys[-1]], str):
            holder[keys[-1]] = os.path.expanduser(holder[keys[-1]])
    return cfg.validate() if validate else cfg


def from_dict(raw: dict) -> TrainConfig:
    """A validated configuration from a plain (possibly partial) dict."""
    cfg = TrainConfig()
    _apply(cfg, raw, "")
    return cfg.validate()


def describe() -> str:
    """Every key with its default and documentation, as YAML comments (``train.py --describe``)."""
    lines = []
    for f in dataclasses.fields(TrainConfig):
        if f.name in SECTIONS:
            lines.append(f"{f.name}:")
            for g in dataclasses.fields(SECTIONS[f.name]):
                default = g.default if g.default is not dataclasses.MISSING else None
                lines.append(f"  {g.name}: {yaml.safe_dump(default, default_flow_style=True).strip().removesuffix('...').strip()}"
                             f"  # {g.metadata['doc']}")
        else:
            lines.append(f"{f.name}: {yaml.safe_dump(f.default).strip().removesuffix('...').strip()}  # {f.metadata['doc']}")
    return "\n".join(lines)


DEFAULTS = TrainConfig().to_dict()


def as_config(cfg) -> TrainConfig:
    """A :class:`TrainConfig` from itself or from a plain dict (the dict form is still accepted)."""
    return cfg if isinstance(cfg, TrainConfig) else from_dict(cfg)


def __getattr__(name: str):
    if name == "ConfigurationError":  # the deprecated name of ConfigError
        warnings.warn("ConfigurationError is now retrace_jax.ConfigError (one error type for every "
                      "configuration); the old name will be removed", DeprecationWarning, stacklevel=2)
        return ConfigError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
