"""The training configuration of ``train.py``: one pydantic model per YAML section holds the defaults, the
documentation and the checks of every key.

    cfg = load_config("configs/tiny_dflash.yaml", ["train.steps=200"])
    cfg.train.steps, cfg.data.prompts, cfg.drafter.block_size

Loading checks everything that would otherwise fail deep inside a run (often inside traced code): an
unknown key, a value of the wrong type (strictly: ``'8'`` and ``8.7`` are no integer, ``'false'`` and ``1``
no bool; ``retrace_jax/validation.py``), a learning rate that is not positive, a clip of 0, a bad ``gamma``
or ``correction_source``. All problems are reported at once, each named by its key and by where it came
from: the file, or ``--set``. What needs the target or the devices is checked before any work by
``retrace_jax/training/preflight.py``. Sections also read like plain dicts (``cfg["train"]["steps"]``), so
code written for the dict form keeps working.
"""

from __future__ import annotations

import difflib
import os
import re
import warnings
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    Field,
    PlainValidator,
    ValidationError,
    model_validator,
)

from retrace_jax.errors import ConfigError
from retrace_jax.models.drafter import INIT_FC, BlockSize, DrafterConfig, drafter_config
from retrace_jax.models.retrace import Fusion, Hints, Mixture, ReTraceConfig, Signals, Slots, ZeroStart
from retrace_jax.parallel.sharding import parse_mesh_spec
from retrace_jax.training.retrace_loss import CORRECTION_SOURCES
from retrace_jax.training.dflash_loss import SLOT_WEIGHTS
from retrace_jax.training.step import OBJECTIVES, SCHEDULES
from retrace_jax.validation import (
    STRICT,
    Bool,
    Int,
    NonNegativeInt,
    Number,
    PositiveInt,
    config_error,
    join,
    problems,
    short_repr,
)

COMPUTE_DTYPES = ("float32", "bfloat16")
TARGET_DTYPES = ("float32", "bfloat16", "float16")
PRECISIONS = ("float32", "bfloat16")  # target_precision, train.precision: the products of float32 weights
MEMORY_DTYPES = ("float32", "bfloat16", "float16")  # or null: the compute dtype
NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _yaml_number(value):
    """PyYAML reads ``1e-3`` (no dot) as a string: where a number is due, it is the number it spells."""
    return float(value) if isinstance(value, str) and NUMBER.match(value) else value


def _true_false_auto(value):
    if value is True or value is False or value == "auto":
        return value
    raise ValueError(f"expected true, false or auto, got {short_repr(value)}")


def _mesh(spec: str) -> str:
    parse_mesh_spec(spec)  # its ValueError names the entry at fault
    return spec


Float = Annotated[Number, BeforeValidator(_yaml_number)]
PositiveFloat = Annotated[Float, Field(gt=0)]
NonNegativeFloat = Annotated[Float, Field(ge=0)]
Path = Annotated[str, AfterValidator(os.path.expanduser)]  # ~ expanded
AutoBool = Annotated[bool | str, PlainValidator(_true_false_auto)]
MeshSpec = Annotated[str, AfterValidator(_mesh)]
LayerList = Annotated[list[NonNegativeInt], Field(min_length=1)]


def doc(text: str, default: Any = None, **kwargs):
    """A field with its default and its documentation (shown by ``describe()``)."""
    return Field(default, description=text, **kwargs)


class Section(BaseModel):
    """Common behaviour of the sections: strict fields, unknown keys refused, checked assignments,
    dict-style reads."""

    model_config = {**STRICT, "validate_assignment": True}
    RENAMED: ClassVar[dict[str, str]] = {}  # old key -> new key (the old one warns)

    @classmethod
    def key(cls) -> str:
        """The section's key in the file ("" for the whole file)."""
        return next((k for k, c in SECTIONS.items() if c is cls), "")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        for old, new in cls.RENAMED.items():
            if isinstance(data, dict) and old in data:
                where = f"{cls.key()}." if cls.key() else ""
                warnings.warn(f"config key {where + old!r} is now {where + new!r}", DeprecationWarning, stacklevel=2)
                data = {(new if k == old else k): v for k, v in data.items()}
        return data

    def __setattr__(self, key: str, value) -> None:
        try:
            super().__setattr__(key, value)
        except ValidationError as err:
            raise config_error(err, parent=self.key()) from None

    def __getitem__(self, key: str):
        if key not in type(self).model_fields:
            raise KeyError(key)
        return getattr(self, key)

    def __setitem__(self, key: str, value) -> None:
        setattr(self, key, value)

    def to_dict(self) -> dict:
        return self.model_dump()


class DataConfig(Section):
    """``data:``: the prompts and their regeneration by the target."""

    prompts: Path = doc("a JSONL file (ShareGPT, OpenAI messages, {\"prompt\"}, {\"turns\"}), or 'random' "
                        "token prompts", "random")
    num_prompts: PositiveInt | None = doc("how many prompts to use (random prompts: how many to draw); null: all",
                                          1024)
    prompt_len: PositiveInt = doc("random prompts only: their length in tokens", 8)
    eval_prompts: NonNegativeInt = doc("held out from training for the periodic τ evaluation", 16)
    max_prompt_len: PositiveInt = doc("prompts are never cut: longer ones are dropped (below) or refused", 1024)
    drop_long_prompts: Bool = doc("true: longer prompts are left out (and counted); false: they are an error", True)
    max_new_tokens: PositiveInt = doc("response length of the regeneration", 64)
    gen_batch_size: PositiveInt = doc("rows decoded at a time during regeneration (generate's slots: a row whose "
                                      "response ends takes the next prompt)", 64)
    shard_size: PositiveInt = doc("prompts per data shard (the unit of resuming and of multi-process preparation)",
                                  512)
    temperature: NonNegativeFloat = doc("regeneration temperature (0: greedy)", 0.0)
    thinking: Bool = doc("Qwen3 chat template: thinking off unless asked", False)
    drafter: Path | None = doc("a drafter directory to regenerate faster (same output at temperature 0)")
    keep_features: Bool = doc(
        "regeneration keeps the target's features of the drafter's target layers at every position, as it computes "
        "them (one shard_NNNNN.features.npy beside each shard), so that train.feature_cache fills its store from "
        "them instead of a second forward pass over the data; plain regeneration only (no data.drafter)", False)
    dir: Path | None = doc("the prepared data; null: {out}/data")
    reuse_from: Path | None = doc(
        "another prepared data directory whose finished shards hold exactly these prompts, shard for shard (the "
        "first prompts of a source that grew, say), regenerated by the same target with the same shard_size, "
        "max_new_tokens and temperature: preparation copies them (hard links where it can, with their kept "
        "features) instead of regenerating them; the rest are regenerated. Recorded nowhere: the data is what "
        "regeneration would write")


class DrafterSection(Section):
    """``drafter:``: the drafter to train (a new one, or a checkpoint to start from)."""

    init: Path | None = doc("a DFlash (or ReTrace) checkpoint directory to start from; the keys below then come "
                            "from its config.json")
    num_layers: PositiveInt = doc("decoder layers of a new drafter", 1)
    block_size: BlockSize = doc("tokens per drafted block (slot 0 holds the last committed token)", 8)
    mask_token_id: NonNegativeInt | None = doc("the mask token; null: the last vocabulary id")
    target_layer_ids: LayerList | None = doc("target layers whose features the drafter reads; null: the official "
                                             "default")
    intermediate_size: PositiveInt | None = doc("MLP width of a new drafter; null: the target's")
    attention_bias: Bool | None = doc("biases on a new drafter's attention projections (q, k, v, o), e.g. to keep "
                                      "those of a Qwen2 target's layers that init_layers copies; null: none")
    init_layers: LayerList | None = doc("target layers whose weights start a new drafter's layers, one per layer "
                                        "(e.g. the last ones); null: random")
    init_mlp_neurons: Literal["first", "active"] = doc(
        "with init_layers and a narrower MLP (intermediate_size): which of the target layer's neurons the drafter "
        "keeps: first, or active (the highest mean |activation| over 32 training sequences)", "first")
    init_qk_norm: Literal["ones", "target"] = doc(
        "with init_layers from a target without q/k norms (Qwen2, Llama): the drafter's q/k norms start at ones, or "
        "target (the mean RMS of the copied layer's query and key heads over 32 training sequences, so that the "
        "normed queries and keys keep the scale of the target's and attention is as sharp)", "ones")
    init_final_norm: Bool = doc("a new drafter's final norm starts as the target's (its output feeds the target's "
                                "LM head); false: ones", False)
    init_fc: Literal[INIT_FC] = doc("a new drafter's feature projection: random, or mean (the mean of the target "
                                    "layers' features: one identity block per layer over their number)", "random")
    draft_vocab: PositiveInt | None = doc(
        "a new drafter proposes only the N most frequent response tokens of the training data (a draft vocabulary: "
        "its LM head is N rows of the target's, cheaper to train and to run; retrace_jax/models/draft_vocab.py); "
        "null: the whole vocabulary. With init: the checkpoint's, which must have this size")


class RetraceSection(Section):
    """``retrace:``: the ReTrace module added to the drafter when the objective is retrace."""

    signals: Signals = doc("which rejected states enter the correction: drafter, target or both", "both")
    rank: PositiveInt | None = doc("low-rank factorisation of the ReTrace projections; null: full rank")
    gate: Bool = doc("sigmoid gate on the residual", True)
    slots: Slots = doc("which rejected slots the memory keeps: all (the paper's design), or agreed: only where the "
                       "drafter's rejected token equals the target's own token from the same verify pass "
                       "(docs/retrace.md, \"Slots\")", "all")
    fusion: Fusion = doc("where the memory enters the next block: embedding (the paper's gated residual into the "
                         "block's input embeddings) or keys (an ablation: the target's features at the kept slots "
                         "become extra keys and values of the block; no parameters of its own)", "embedding")
    hints: Hints = doc("what else the memory carries: none (the paper's design) or tokens: at each kept slot the "
                       "target's own token from the verify pass and the drafter's rejected proposal, embedded, "
                       "projected and gated into the next block's input (docs/retrace.md, \"Token hints\")", "none")
    mixture: Mixture = doc("whether the proposals mix in the target's stale distribution: none (the paper's design) "
                           "or target: at each kept slot q = (1 - g) p + g p_target, p_target the target's top-8 "
                           "tokens from the verify pass, under a learned gate that starts closed (docs/retrace.md, "
                           "\"Output mixture\")", "none")
    zero_start: ZeroStart = doc("which parameter starts at zero so that a new module drafts as DFlash: value (W_v, "
                                "the paper's) or scale (a learned scalar on the fused residual; W_v starts small "
                                "and random)", "value")


class TrainSection(Section):
    """``train:``: the objective, the optimiser, the mesh, checkpoints and logging."""

    objective: Literal[OBJECTIVES] = doc("dflash, or retrace (the on-policy rollout of `rounds` rounds)", "dflash")
    steps: PositiveInt = doc("training steps, counted in micro-steps (as checkpoints and resume number them): "
                             "with grad_accum > 1, steps / grad_accum optimizer updates, so steps must be a "
                             "multiple of grad_accum", 100)
    batch_size: PositiveInt = doc("global batch, in sequences (over all processes and devices)", 8)
    seq_len: PositiveInt = doc("sequences are cut or padded to this many tokens", 128)
    num_anchors: PositiveInt = doc("anchored blocks per sequence", 8)
    length_buckets: Bool = doc("batches of sequences of similar length (sorted within groups of 16 batches of an "
                               "epoch's permutation), each padded to its longest rounded up to a multiple of 128 "
                               "positions instead of to seq_len: less padding, a few compiled step shapes; one "
                               "process", False)
    lr: PositiveFloat = doc("peak learning rate of AdamW", 3.0e-3)
    warmup_frac: NonNegativeFloat = doc("linear warm-up, as a fraction of the optimizer updates; then cosine decay",
                                        0.04, lt=1)
    schedule: Literal[SCHEDULES] = doc("after the warm-up: cosine (decay to zero at the last update, the DFlash "
                                       "recipe) or constant (the peak until the last decay_frac of the updates, "
                                       "then a linear decay to zero)", "cosine")
    decay_frac: PositiveFloat = doc("schedule constant: the share of the optimizer updates the final linear decay "
                                    "takes", 0.2, le=1)
    weight_decay: NonNegativeFloat = doc("AdamW weight decay", 0.0)
    retrace_lr_multiplier: PositiveFloat = doc("retrace objective: the ReTrace module's learning rate as a multiple "
                                               "of lr (it starts at zero inside a trained drafter)", 1.0)
    clip: PositiveFloat = doc("global gradient-norm clip (> 0)", 1.0)
    grad_accum: PositiveInt = doc("micro-steps averaged into one optimizer update", 1)
    compute_dtype: Literal[COMPUTE_DTYPES] = doc("float32, or bfloat16 (bf16 copies of the float32 master weights)",
                                                 "float32")
    precision: Literal[PRECISIONS] = doc(
        "the drafter's matrix products in a training step: float32, or bfloat16 (bfloat16 operands and float32 "
        "accumulation in the forward and the backward pass, float32 master weights and optimizer: "
        "jax.default_matmul_precision('bfloat16'), on a CPU the dense layers' and the LM head's products, "
        "faster on CPUs with AVX-512 BF16; on a GPU or TPU every product)", "float32")
    remat: Bool = doc("recompute drafter layer activations in the backward pass", False)
    feature_cache: Bool = doc("DFlash, one process: compute the target features of all sequences once, into a "
                              "memory-mapped store beside the prepared data that later runs reuse (resumable; "
                              "retrace_jax/training/feature_store.py)", False)
    gamma: PositiveFloat | None = doc("loss decay over block slots; null: the published value for the block size")
    slot_weights: Literal[SLOT_WEIGHTS] = doc(
        "DFlash: how the drafted slots of a block weigh in the loss: gamma (exp(-(k-1)/gamma), the published "
        "rule), uniform, reach (the drafter's probability of getting slots 1..k-1 all right: the first error gets "
        "the weight) or expected_length (the gradient of the log expected accepted length, D-PACE's direction); "
        "the last two from the drafter's own label probabilities, without gradient", "gamma")
    loss_positions: Literal["response", "all"] = doc(
        "DFlash: where blocks are anchored and labelled: response (the target's regenerated tokens) or all (every "
        "position after a sequence's first, the prompt's too, whose labels are the prompt's own tokens, not the "
        "target's: more labels from the same data and the same features)", "response")
    distill_topk: NonNegativeInt = doc(
        "DFlash: > 0 trains each drafted slot on the target's next-token distribution as well (soft labels): its "
        "top distill_topk tokens over the drafter's head vocabulary (the draft vocabulary, or the whole), "
        "renormalised, from the target pass that gives the features (with feature_cache: computed once into a "
        "store of its own beside the features); 0: the hard labels alone", 0)
    distill_weight: NonNegativeFloat = doc("with distill_topk: a slot's loss is (1 - distill_weight) * hard + "
                                           "distill_weight * soft cross-entropy", 1.0, le=1)
    rounds: Int = doc("ReTrace: rounds of the on-policy rollout per anchor (>= 2): round 1 drafts without memory, "
                      "each later round re-anchors where the previous one's acceptance leaves it, with that round's "
                      "rejected suffix as its memory, as at inference", 4, ge=2)
    round_weights: list[NonNegativeFloat] | None = doc("ReTrace: the loss weight of each round, one per round; null: "
                                                       "round1_weight for round 1 and 1.0 for every later round")
    round1_weight: NonNegativeFloat | None = doc("ReTrace: weight of the round-1 (DFlash) loss, every later round "
                                                 "weighing 1.0 (the short form of round_weights; not with it); "
                                                 "null: 1.0")
    correction_source: Literal[CORRECTION_SOURCES] = doc("ReTrace: verify (the target run on the drafted block, as "
                                                         "at inference) or teacher (the teacher-forced states)",
                                                         "verify")
    beta_warmup_steps: NonNegativeInt = doc("ReTrace: beta ramps 0 -> 1 over these optimizer updates", 50)
    memory_dtype: Literal[MEMORY_DTYPES] | None = doc("ReTrace: store the retained (detached) rejected-suffix "
                                                      "states in this dtype, e.g. float16; null: the compute dtype")
    memory_dropout: NonNegativeFloat = doc("ReTrace: probability that a block's memory is dropped in a round after the "
                                           "first (it then drafts as DFlash), so what the memory adds is its own",
                                           0.0, le=1)
    miss_weight: NonNegativeFloat = doc("ReTrace: slots that the same round drafted without its memory gets wrong "
                                        "weigh 1 + miss_weight in the loss (one more gradient-free draft per later "
                                        "round)", 0.0)
    seed: NonNegativeInt = doc("drafter init, anchors and the data order", 0)
    mesh: MeshSpec | None = doc("e.g. 'data=2,fsdp=2,tensor=2' over all devices of all processes; null: every "
                                "device on the data axis")
    distributed: AutoBool = doc("jax.distributed.initialize(): true, false, or auto (when a coordinator or a "
                                "cluster scheduler is detected)", "auto")
    log_every: PositiveInt = doc("steps between metric lines", 10)
    eval_every: NonNegativeInt = doc("steps between τ evaluations (0: only at the end)", 0)
    eval_max_new_tokens: PositiveInt = doc("tokens generated per held-out prompt in evaluation", 64)
    checkpoint_every: PositiveInt = doc("steps between Orbax checkpoints", 100)
    keep_checkpoints: PositiveInt = doc("checkpoints kept", 3)
    stop_after: PositiveInt | None = doc("stop (with a checkpoint) after this many steps in this run")
    branch_from: Path | None = doc("start from a checkpoint of another run (its out directory): its drafter, "
                                   "optimizer state and step count at train.branch_step, then train on to "
                                   "train.steps with this run's schedule. A cooldown tried on a run that goes on "
                                   "(schedule constant, with steps and decay_frac that put the decay right after "
                                   "the branch step), the other run untouched. Only the schedule may differ "
                                   "(steps, schedule, warmup_frac, decay_frac, lr); read only while this run has "
                                   "no checkpoint of its own")
    branch_step: PositiveInt | None = doc("train.branch_from: the step of its checkpoint to start from")
    tensorboard: AutoBool = doc("TensorBoard event files in {out}/tensorboard: true, false, or auto (when "
                                "tensorboardX is installed: pip install 'retrace-jax[tensorboard]')", "auto")


class TrainConfig(Section):
    """The whole file: the target, the output directory and the sections."""

    target: Path = doc("a Hugging Face directory, or 'tiny' (a random Qwen3 made on the spot)", "tiny")
    target_dtype: Literal[TARGET_DTYPES] = doc("float32, bfloat16 or float16", "float32")
    target_precision: Literal[PRECISIONS] = doc(
        "the float32 target's matrix products when it regenerates the data and fills the feature store: float32, "
        "or bfloat16 (bfloat16 operands, float32 accumulation: jax.default_matmul_precision('bfloat16'), which on "
        "a CPU rounds the dense layers' products, faster batched on CPUs with AVX-512 BF16, and on a GPU or TPU "
        "every product; greedy responses can differ from float32's at near-ties: benchmarks/regen_throughput.py "
        "counts them). Inside a training step the target computes at JAX's default",
        "float32")
    out: Path = doc("metrics.jsonl, tensorboard/, checkpoints/, drafter/ (the exported drafter), data/",
                    "runs/default")
    data: DataConfig = Field(default_factory=DataConfig)
    drafter: DrafterSection = Field(default_factory=DrafterSection)
    retrace: RetraceSection = Field(default_factory=RetraceSection)
    train: TrainSection = Field(default_factory=TrainSection)

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data):
        """``train:`` with nothing under it is an empty section."""
        if isinstance(data, dict):
            return {k: {} if v is None and k in SECTIONS else v for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _together(self):
        """What no single key can say wrong."""
        d, dr, t, out = self.data, self.drafter, self.train, []
        if d.prompts == "random" and d.num_prompts is None:
            out.append("data.num_prompts: must be set for random prompts")
        if d.keep_features and d.drafter is not None:
            out.append("data.keep_features: the features are kept by plain regeneration; set data.drafter to null")
        if dr.init_mlp_neurons != "first" and dr.init_layers is None:
            out.append("drafter.init_mlp_neurons: chooses the neurons that drafter.init_layers copies; set init_layers")
        if dr.init_qk_norm != "ones" and dr.init_layers is None:
            out.append("drafter.init_qk_norm: scales the q/k norms of the layers that drafter.init_layers copies; set "
                       "init_layers")
        if dr.init and (dr.init_final_norm or dr.init_fc != "random"):
            out.append(f"drafter.init_final_norm, drafter.init_fc: start a new drafter; with drafter.init the weights "
                       f"come from {dr.init}")
        if dr.init_layers is not None and dr.init:
            out.append(f"drafter.init_layers: starts a new drafter; with drafter.init the weights come from {dr.init}")
        elif dr.init_layers is not None and len(dr.init_layers) != dr.num_layers:
            out.append(f"drafter.init_layers: needs one target layer per drafter layer ({dr.num_layers}), got "
                       f"{dr.init_layers}")
        if t.round_weights is not None and len(t.round_weights) != t.rounds:
            out.append(f"train.round_weights: {len(t.round_weights)} weights for {t.rounds} rounds: give one per "
                       f"round, got {t.round_weights}")
        if t.round_weights is not None and t.round1_weight is not None:
            out.append("train.round_weights: given with train.round1_weight, its short form [round1_weight, 1.0, "
                       "...]; keep one of them")
        if self.target_precision != "float32" and self.target_dtype != "float32":
            out.append(f"target_precision: {self.target_precision} products are for a float32 target; a "
                       f"{self.target_dtype} target computes in {self.target_dtype} (target_dtype)")
        if t.slot_weights != "gamma" and t.objective != "dflash":
            out.append(f"train.slot_weights: {t.slot_weights} serves the dflash objective only")
        if t.loss_positions != "response" and t.objective != "dflash":
            out.append(f"train.loss_positions: {t.loss_positions} serves the dflash objective only")
        if t.distill_topk and t.objective != "dflash":
            out.append("train.distill_topk: serves the dflash objective only")
        if not dr.init:  # the target's vocabulary, and a checkpoint's draft vocabulary: preflight checks them
            out += head_room(t.distill_topk, dr.draft_vocab, None, "drafter.draft_vocab")
        if t.distill_weight != 1.0 and not t.distill_topk:
            out.append("train.distill_weight: mixes in the soft loss of train.distill_topk; set distill_topk")
        if t.feature_cache and t.objective == "retrace":
            out.append("train.feature_cache: serves the dflash objective only (ReTrace runs the target on drafts)")
        if not dr.init and t.seq_len < dr.block_size + 1:
            out.append(f"train.seq_len: {t.seq_len} leaves no room for a block of {dr.block_size} "
                       f"(drafter.block_size)")
        elif not dr.init:  # with drafter.init the block size is the checkpoint's: preflight checks it
            out += anchor_room(t.num_anchors, t.seq_len, dr.block_size, "drafter.block_size")
        if t.steps < t.grad_accum:
            out.append(f"train.steps: {t.steps} is smaller than train.grad_accum {t.grad_accum}: steps count "
                       f"micro-steps, {t.grad_accum} of them make one optimizer update, so the run would make no "
                       f"optimizer update (give a multiple of {t.grad_accum})")
        elif t.steps % t.grad_accum:
            out.append(f"train.steps: {t.steps} is not a multiple of train.grad_accum {t.grad_accum}: steps count "
                       f"micro-steps, {t.grad_accum} of them make one optimizer update, so the last "
                       f"{t.steps % t.grad_accum} would never be applied (give "
                       f"{t.steps - t.steps % t.grad_accum} or {t.steps - t.steps % t.grad_accum + t.grad_accum})")
        if (t.branch_from is None) != (t.branch_step is None):
            out.append("train.branch_from, train.branch_step: a branch needs both, the run and its step")
        elif t.branch_step is not None:
            if t.branch_step >= t.steps:
                out.append(f"train.branch_step: {t.branch_step} leaves nothing to train (train.steps {t.steps})")
            if t.branch_step % t.grad_accum:
                out.append(f"train.branch_step: {t.branch_step} is not a multiple of train.grad_accum {t.grad_accum}")
            if os.path.abspath(t.branch_from) == os.path.abspath(self.out):
                out.append(f"train.branch_from: {t.branch_from} is this run's own out directory; a run resumes "
                           f"from its own checkpoints without it")
        if out:
            raise ValueError("; ".join(out))
        return self

    @property
    def data_dir(self) -> str:
        return self.data.dir or os.path.join(self.out, "data")


def new_drafter_args(cfg: TrainConfig, target_vocab_size: int) -> dict:
    """The keyword arguments of :func:`~retrace_jax.models.drafter.init_drafter` and
    :func:`~retrace_jax.models.drafter.drafter_config` for the new drafter that ``cfg``'s ``drafter`` and
    ``retrace`` sections describe (the mask token defaults to the target's last id): the one reading of those
    keys that preflight, preparation (which features to keep), the memory estimate and training share."""
    dc = cfg.drafter
    retrace = ReTraceConfig(**cfg.retrace.to_dict()) if cfg.train.objective == "retrace" else None
    return dict(mask_token_id=dc.mask_token_id if dc.mask_token_id is not None else target_vocab_size - 1,
                num_layers=dc.num_layers, block_size=dc.block_size, target_layer_ids=dc.target_layer_ids,
                intermediate_size=dc.intermediate_size, retrace=retrace, attention_bias=bool(dc.attention_bias))


def new_drafter_config(cfg: TrainConfig, target_cfg) -> DrafterConfig:
    """The :class:`~retrace_jax.models.drafter.DrafterConfig` of the new drafter of ``cfg`` for the target of
    config ``target_cfg``, for checks made before it is built: without the repeated-layer-ids warning, which
    building it gives once (raises ``ConfigError`` for settings it cannot have)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return drafter_config(target_cfg, **new_drafter_args(cfg, target_cfg.vocab_size))


def anchor_room(num_anchors: int, seq_len: int, block_size: int, block_key: str) -> list[str]:
    """The problem (a list of at most one) when ``train.num_anchors`` exceeds the anchor positions of a
    ``seq_len``-token sequence, ``seq_len - block_size + 1`` (a block must fit after its anchor);
    ``block_key`` says where the block size comes from."""
    room = seq_len - block_size + 1
    if num_anchors <= room:
        return []
    return [f"train.num_anchors: {num_anchors} exceeds the {max(room, 0)} anchor positions of a {seq_len}-token "
            f"sequence (train.seq_len) with block size {block_size} ({block_key})"]


def head_room(distill_topk: int, draft_vocab: int | None, vocab_size: int | None, vocab_key: str) -> list[str]:
    """The problem (a list of at most one) when ``train.distill_topk`` exceeds the drafter's head vocabulary:
    its draft vocabulary of ``draft_vocab`` tokens, or without one the target's ``vocab_size`` (None: not
    known yet); ``vocab_key`` says where the draft vocabulary comes from."""
    size = vocab_size if draft_vocab is None else draft_vocab
    if size is None or distill_topk <= size:
        return []
    where = (f"the target's vocabulary ({size} tokens)" if draft_vocab is None else
             f"the draft vocabulary ({size} tokens, {vocab_key})")
    return [f"train.distill_topk: {distill_topk} exceeds {where}, the drafter's head vocabulary"]


SECTIONS = {"data": DataConfig, "drafter": DrafterSection, "retrace": RetraceSection, "train": TrainSection}


def _validated(raw, source=lambda path: "") -> TrainConfig:
    """``raw`` as a :class:`TrainConfig`, or one :class:`ConfigError` naming every key at fault, each
    preceded by ``source(path)``: where its value came from (``"c.yaml: "``, ``"--set "``)."""
    try:
        return TrainConfig.model_validate(raw)
    except ValidationError as err:
        found = []
        for path, text in problems(err):
            if text == "unknown key":  # a misspelt key: the closest known one
                parent, _, key = path.rpartition(".")
                close = difflib.get_close_matches(key, SECTIONS.get(parent, TrainConfig).model_fields, 1)
                text += f"; did you mean {close[0]!r}?" if close else ""
            found.append((path, text))
        raise ConfigError(join(found, source)) from None


def load_config(path: str | None, overrides: list[str] = ()) -> TrainConfig:
    """Defaults, then the YAML file (``None``: defaults only), then ``key.sub=value`` overrides (values
    parsed as YAML), checked together; ``~`` in paths is expanded."""
    raw: Any = {}
    if path is not None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config file not found: {path}")
        with open(path, "rb") as f:
            data = f.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            line = data.count(b"\n", 0, err.start) + 1
            raise ConfigError(f"{path}: line {line}: not UTF-8 (byte {data[err.start]:#04x})") from None
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
        raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        _validated(raw, lambda _: f"{path}: ")  # raises: not a mapping
    overridden = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        *parents, leaf = key.split(".")
        node = raw
        for p in parents:
            node.setdefault(p, {})
            if node[p] is None:
                node[p] = {}
            if not isinstance(node[p], dict):
                raise ConfigError(f"--set {key}: {p} is not a mapping but {short_repr(node[p])}")
            node = node[p]
        node[leaf] = yaml.safe_load(value)
        overridden.append(key)

    def source(field: str) -> str:
        if any(field == k or field.startswith((k + ".", k + "[")) for k in overridden):
            return "--set "
        return f"{path}: " if path else ""

    return _validated(raw, source)


def from_dict(raw: dict) -> TrainConfig:
    """A checked configuration from a plain (possibly partial) dict."""
    return _validated(raw)


def describe() -> str:
    """Every key with its default and documentation, as YAML comments (``train.py --describe``)."""

    def line(indent: str, key: str, field) -> str:
        default = yaml.safe_dump(field.default, default_flow_style=True).strip().removesuffix("...").strip()
        return f"{indent}{key}: {default}  # {field.description}"

    lines = []
    for name, field in TrainConfig.model_fields.items():
        if name in SECTIONS:
            lines += [f"{name}:"] + [line("  ", k, f) for k, f in SECTIONS[name].model_fields.items()]
        else:
            lines.append(line("", name, field))
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
