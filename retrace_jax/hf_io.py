"""Hugging Face checkpoints in and out: one table per model maps tensor names to parameter paths.

The same table drives loading and saving, so the two directions cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from retrace_jax import draft_vocab
from retrace_jax.config import ConfigError, ModelConfig, read_config_json
from retrace_jax.drafter import DFlashDrafter, DrafterConfig
from retrace_jax.retrace import ReTraceConfig, ReTraceFusion
from retrace_jax.sharding import check_divisible, named_sharding
from retrace_jax.target import TargetModel

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensors that some checkpoints carry but no model here uses.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not fit the model its config describes."""


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """One tensor: its Hugging Face name, its NNX state path, whether it is stored ``[out, in]``, and the
    logical axes of its dimensions (for sharding; see ``sharding.LOGICAL_RULES``). ``layer`` is set for
    one layer's slice of a parameter stacked over layers (the target's decoder blocks)."""

    hf_name: str
    path: tuple
    transpose: bool = False
    axes: tuple = (None,)
    layer: int | None = None

    @property
    def param_axes(self) -> tuple:
        """The logical axes of the whole parameter (a stacked one has a leading, unsharded layer axis)."""
        return self.axes if self.layer is None else (None,) + tuple(self.axes)

    def convert(self, array: np.ndarray) -> np.ndarray:
        """Checkpoint layout <-> parameter layout (the same operation both ways)."""
        return array.T if self.transpose else array


def linear_specs(hf_prefix: str, path: tuple, bias: bool, axes=(None, None), layer=None) -> list[WeightSpec]:
    """A dense layer; ``axes`` are the logical axes of its ``[in, out]`` kernel."""
    specs = [WeightSpec(f"{hf_prefix}.weight", path + ("kernel",), transpose=True, axes=tuple(axes), layer=layer)]
    if bias:
        specs.append(WeightSpec(f"{hf_prefix}.bias", path + ("bias",), axes=(axes[1],), layer=layer))
    return specs


QKVO_AXES = {"q_proj": ("embed", "heads"), "k_proj": ("embed", "kv_heads"), "v_proj": ("embed", "kv_heads"),
             "o_proj": ("heads", "embed")}
MLP_AXES = {"gate_proj": ("embed", "mlp"), "up_proj": ("embed", "mlp"), "down_proj": ("mlp", "embed")}


def norm_spec(hf_prefix: str, path: tuple, layer=None) -> WeightSpec:
    return WeightSpec(f"{hf_prefix}.weight", path + ("weight",), layer=layer)


def mlp_specs(hf_prefix: str, path: tuple, bias: bool, layer=None) -> list[WeightSpec]:
    return [s for name, axes in MLP_AXES.items()
            for s in linear_specs(f"{hf_prefix}.{name}", path + (name,), bias, axes, layer)]


def block_specs(hf: str, path: tuple, qkv_bias: bool, o_bias: bool, mlp_bias: bool, qk_norm: bool,
                layer=None) -> list[WeightSpec]:
    """One decoder block (``layers.DecoderBlock``), target and drafter alike."""
    specs = [norm_spec(f"{hf}.input_layernorm", path + ("input_layernorm",), layer),
             norm_spec(f"{hf}.post_attention_layernorm", path + ("post_attention_layernorm",), layer)]
    for name, axes in QKVO_AXES.items():
        bias = o_bias if name == "o_proj" else qkv_bias
        specs += linear_specs(f"{hf}.self_attn.{name}", path + ("self_attn", name), bias, axes, layer)
    if qk_norm:
        specs.append(norm_spec(f"{hf}.self_attn.q_norm", path + ("self_attn", "q_norm"), layer))
        specs.append(norm_spec(f"{hf}.self_attn.k_norm", path + ("self_attn", "k_norm"), layer))
    return specs + mlp_specs(f"{hf}.mlp", path + ("mlp",), mlp_bias, layer)


def target_specs(cfg: ModelConfig) -> list[WeightSpec]:
    """The target's tensors; layer ``i``'s tensors are slice ``i`` of the stacked block parameters."""
    specs = [WeightSpec("model.embed_tokens.weight", ("embed_tokens", "embedding"), axes=("vocab", "embed"))]
    for i in range(cfg.num_layers):
        specs += block_specs(f"model.layers.{i}", ("layers",), cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias, cfg.qk_norm,
                             layer=i)
    specs.append(norm_spec("model.norm", ("norm",)))
    if not cfg.tie_word_embeddings:
        specs += linear_specs("lm_head", ("lm_head",), False, ("embed", "vocab"))
    return specs


def drafter_specs(cfg: DrafterConfig) -> list[WeightSpec]:
    """The official DFlash tensor names (no ``model.`` prefix)."""
    specs = [WeightSpec("fc.weight", ("fc", "kernel"), transpose=True, axes=(None, "embed")),
             norm_spec("hidden_norm", ("hidden_norm",)), norm_spec("norm", ("norm",))]
    for i in range(cfg.num_layers):
        specs += block_specs(f"layers.{i}", ("layers", i), cfg.attention_bias, cfg.attention_bias, False, True)
    return specs


def retrace_specs(cfg: ReTraceConfig) -> list[WeightSpec]:
    """``retrace.{correct,value,gate}.weight``, or ``.down.weight`` / ``.up.weight`` pairs with a rank."""
    names = ("correct", "value", "gate") if cfg.gate else ("correct", "value")
    if cfg.rank is None:
        return [WeightSpec(f"retrace.{n}.weight", ("retrace", n, "full", "kernel"), True) for n in names]
    return [WeightSpec(f"retrace.{n}.{f}.weight", ("retrace", n, f, "kernel"), True)
            for n in names for f in ("down", "up")]


def all_drafter_specs(cfg: DrafterConfig) -> list[WeightSpec]:
    return drafter_specs(cfg) + (retrace_specs(cfg.retrace) if cfg.retrace is not None else [])


class TensorReader:
    """Reads tensors by name from ``model.safetensors`` or from shards listed in the index file.

    Every file is opened once here, so a truncated or corrupt one is reported by name before any weight
    is read; a directory holding both layouts is refused (one of them would silently win)."""

    def __init__(self, directory: str):
        index_path = os.path.join(directory, INDEX_FILE)
        single_path = os.path.join(directory, SINGLE_FILE)
        if os.path.isfile(index_path) and os.path.isfile(single_path):
            raise CheckpointError(f"{directory} holds both {SINGLE_FILE} and {INDEX_FILE}; one of them is stale "
                                  f"(remove it)")
        if os.path.isfile(index_path):
            weight_map = _read_weight_map(index_path)
            for file in sorted(set(weight_map.values())):
                path = os.path.join(directory, file)
                if not os.path.isfile(path):
                    raise FileNotFoundError(f"{INDEX_FILE} lists {file}, which is missing from {directory}")
                stored = set(_tensor_names(path))
                absent = sorted(n for n, f in weight_map.items() if f == file and n not in stored)
                if absent:
                    raise CheckpointError(f"{path} lacks tensors that {INDEX_FILE} places there: {_short(absent)}")
        elif os.path.isfile(single_path):
            weight_map = {name: SINGLE_FILE for name in _tensor_names(single_path)}
        else:
            raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {directory}")
        self.directory = directory
        self.weight_map = weight_map

    def names(self) -> set[str]:
        return set(self.weight_map)

    def file(self, name: str) -> str:
        return os.path.join(self.directory, self.weight_map[name])

    def get(self, name: str, index: tuple | None = None) -> np.ndarray:
        """The tensor, or only ``tensor[index]`` (a tuple of slices) read from disk; non-finite values
        (NaN, inf) are an error naming the tensor."""
        try:
            with safe_open(self.file(name), framework="numpy") as f:
                array = f.get_tensor(name) if index is None else f.get_slice(name)[index]
        except SafetensorError as err:
            raise CheckpointError(f"cannot read tensor {name} from {self.file(name)}: {err}") from None
        bad = int(array.size - np.count_nonzero(np.isfinite(array.astype(np.float32, copy=False))))
        if bad:
            where = "" if index is None else f" (in the slice {index})"
            raise CheckpointError(f"tensor {name} in {self.file(name)} has {bad} non-finite values (NaN or inf)"
                                  f"{where}")
        return array

    def shape(self, name: str) -> tuple[int, ...]:
        with safe_open(self.file(name), framework="numpy") as f:
            return tuple(f.get_slice(name).get_shape())


def _tensor_names(path: str) -> list[str]:
    """The tensor names in a safetensors file's header; a ``CheckpointError`` naming a truncated or
    corrupt file."""
    try:
        with safe_open(path, framework="numpy") as f:
            return list(f.keys())
    except SafetensorError as err:
        raise CheckpointError(f"{path} is not a readable safetensors file (truncated or corrupt?): {err}") from None


def _read_weight_map(index_path: str) -> dict[str, str]:
    """``weight_map`` of a ``model.safetensors.index.json``, checked."""
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{index_path} is not valid JSON: {err}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path} has no 'weight_map' object (tensor name -> file)")
    bad = [n for n, f in weight_map.items() if not isinstance(f, str) or os.path.basename(f) != f]
    if bad:
        raise CheckpointError(f"{index_path}: weight_map entries must be file names in the same directory: "
                              f"{_short(sorted(bad))}")
    return weight_map


def strip_prefix(names: Iterable[str], prefix: str) -> dict[str, str]:
    """Maps names without ``prefix`` to the stored names (for checkpoints saved with a ``model.`` prefix)."""
    return {n[len(prefix) :] if n.startswith(prefix) else n: n for n in names}


def load_into(module: nnx.Module, specs: list[WeightSpec], reader: TensorReader, dtype, *,
              aliases: dict[str, str] | None = None, ignore: Iterable[str] = (),
              fresh: dict[tuple, jax.Array] | None = None, mesh: Mesh | None = None) -> nnx.Module:
    """Fills an (abstract) module's parameters from a checkpoint, checking names and shapes.

    With a ``mesh`` each device reads only its own shard of each tensor from the safetensors files.
    ``fresh`` supplies parameters that the checkpoint does not hold (by state path)."""
    aliases = aliases or {n: n for n in reader.names()}
    wanted = {s.hf_name for s in specs}
    ignore = set(ignore)
    missing = sorted(wanted - set(aliases))
    extra = sorted(
        n for n in set(aliases) - wanted if n not in ignore and not n.endswith(IGNORED_SUFFIXES)
    )
    if missing or extra:
        raise CheckpointError(
            f"checkpoint in {reader.directory} does not match the model: "
            f"missing tensors {_short(missing)}; unexpected tensors {_short(extra)}"
        )
    graphdef, state = nnx.split(module)
    flat = dict(nnx.to_flat_state(state))
    groups: dict[tuple, list[WeightSpec]] = {}
    for spec in specs:
        groups.setdefault(spec.path, []).append(spec)
    for path, group in groups.items():
        expected = tuple(flat[path].get_value().shape)
        stacked = group[0].layer is not None
        if stacked:
            group = sorted(group, key=lambda s: s.layer)
            if [s.layer for s in group] != list(range(expected[0])):
                raise AssertionError(f"stacked parameter {path} has {expected[0]} layers, specs {len(group)}")
        for spec in group:
            one = expected[1:] if stacked else expected
            hf_expected = one[::-1] if spec.transpose else one
            if reader.shape(aliases[spec.hf_name]) != hf_expected:
                raise CheckpointError(f"tensor {spec.hf_name} has shape {reader.shape(aliases[spec.hf_name])}, "
                                      f"the config implies {hf_expected}")

        def read(spec, index=None):
            hf_index = None if index is None else (tuple(index[::-1]) if spec.transpose else tuple(index))
            return np.asarray(spec.convert(reader.get(aliases[spec.hf_name], hf_index)), dtype=dtype)

        def read_shard(index, group=group, stacked=stacked):
            if not stacked:
                return read(group[0], index)
            return np.stack([read(group[i], index[1:]) for i in range(len(group))[index[0]]])

        if mesh is None:
            value = jnp.asarray(read_shard((slice(None),) * len(expected)))
        else:
            value = jax.make_array_from_callback(expected, named_sharding(group[0].param_axes, expected, mesh),
                                                 read_shard)
        flat[path].set_value(value)
    for path, value in (fresh or {}).items():
        flat[path].set_value(value if mesh is None else jax.device_put(value, NamedSharding(mesh, PartitionSpec())))
    covered = set(groups) | set(fresh or {})
    left = [p for p in flat if p not in covered]
    if left:
        raise AssertionError(f"parameters with no checkpoint tensor: {left}")
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def export_tensors(module: nnx.Module, specs: list[WeightSpec]) -> dict[str, np.ndarray]:
    """The module's parameters as Hugging Face named ``[out, in]`` arrays."""
    flat = dict(nnx.to_flat_state(nnx.state(module, nnx.Param)))
    out = {}
    for s in specs:
        value = np.asarray(jax.device_get(flat[s.path].get_value()))
        out[s.hf_name] = np.ascontiguousarray(s.convert(value if s.layer is None else value[s.layer]))
    return out


def default_dtype() -> jnp.dtype:
    """bfloat16 on accelerators (GPU, TPU), float32 on CPU (the parity dtype)."""
    return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)


def resolve_dtype(dtype) -> jnp.dtype:
    """``"float32"`` or ``"bfloat16"``; ``None`` or ``"auto"`` is :func:`default_dtype`."""
    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        return default_dtype()
    name = jnp.dtype(dtype).name
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    return jnp.dtype(dtype)


def abstract_module(factory):
    """Builds a module's structure without allocating or initialising its parameters."""
    return nnx.eval_shape(factory)


def _from_config_json(kind, path: str):
    """``kind.from_hf`` of ``path/config.json``; its errors name the file."""
    hf = read_config_json(path)
    try:
        return kind.from_hf(hf)
    except (KeyError, TypeError, ValueError) as err:
        message = err.args[0] if isinstance(err, ConfigError) and err.args else f"{type(err).__name__}: {err}"
        raise ConfigError(f"{os.path.join(path, 'config.json')}: {message}") from None


def load_target(path: str, dtype=None, *, mesh: Mesh | None = None) -> TargetModel:
    """Loads a Qwen3 / Qwen2 / Llama checkpoint from a Hugging Face directory (sharded over ``mesh``
    by the logical-axis rules when one is given). ``dtype``: "float32", "bfloat16" or None (bfloat16 on
    GPU and TPU, float32 on CPU)."""
    dtype = resolve_dtype(dtype)
    cfg = _from_config_json(ModelConfig, path)
    check_divisible("target", cfg.num_heads, cfg.num_kv_heads, mesh)
    reader = TensorReader(path)
    module = abstract_module(lambda: TargetModel(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    ignore = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    return load_into(module, target_specs(cfg), reader, dtype, ignore=ignore, mesh=mesh)


def check_drafter_matches(cfg: DrafterConfig, target_cfg: ModelConfig) -> None:
    """Raises ``ConfigError`` listing every way a drafter does not fit a target."""
    problems = []
    if cfg.hidden_size != target_cfg.hidden_size:
        problems.append(f"hidden_size {cfg.hidden_size} != target hidden_size {target_cfg.hidden_size}")
    if cfg.num_target_layers != target_cfg.num_layers:
        problems.append(f"num_target_layers {cfg.num_target_layers} != target num_hidden_layers "
                        f"{target_cfg.num_layers}")
    if cfg.vocab_size != target_cfg.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} != target vocab_size {target_cfg.vocab_size}")
    if not 0 <= cfg.mask_token_id < target_cfg.vocab_size:
        problems.append(f"mask_token_id {cfg.mask_token_id} outside the target vocabulary [0, {target_cfg.vocab_size})")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target_cfg.num_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} outside the target's layers 0..{target_cfg.num_layers - 1}")
    if cfg.block_size < 2:
        problems.append(f"block_size {cfg.block_size} < 2")
    if cfg.num_layers < 1:
        problems.append(f"num_hidden_layers {cfg.num_layers} < 1")
    if problems:
        raise ConfigError("drafter does not match the target: " + "; ".join(problems))


def load_drafter(path: str, target: TargetModel, dtype=None, *, retrace: bool | ReTraceConfig | None = None,
                 seed: int = 0, mesh: Mesh | None = None) -> DFlashDrafter:
    """Loads a drafter in the official DFlash layout (a ``model.`` prefix is accepted) for ``target``.

    A checkpoint whose config has ``retrace_config`` loads as a ReTrace drafter. ``retrace=True`` turns
    a plain DFlash checkpoint into a ReTrace drafter whose new module starts at zero (``W_v = 0``, so it
    drafts exactly as before; a ``ReTraceConfig`` chooses its options); ``retrace=False`` loads only the
    DFlash part of a ReTrace checkpoint. ``dtype`` defaults to the target's.
    """
    dtype = resolve_dtype(target.dtype if dtype is None else dtype)
    stored = _from_config_json(DrafterConfig, path)
    cfg = stored
    if isinstance(retrace, ReTraceConfig) and stored.retrace not in (None, retrace):
        raise ConfigError(f"{path} holds a ReTrace drafter with {stored.retrace}, not the requested {retrace}")
    if retrace not in (None, False) and stored.retrace is None:
        cfg = dataclasses.replace(stored, retrace=retrace if isinstance(retrace, ReTraceConfig) else ReTraceConfig())
    elif retrace is False:
        cfg = dataclasses.replace(stored, retrace=None)
    check_drafter_matches(cfg, target.cfg)
    check_divisible("drafter", cfg.num_heads, cfg.num_kv_heads, mesh)
    reader = TensorReader(path)
    module = abstract_module(lambda: DFlashDrafter(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    specs = drafter_specs(cfg)
    ignore: list[str] = []
    fresh = None
    if stored.retrace is not None and cfg.retrace is None:
        ignore = [s.hf_name for s in retrace_specs(stored.retrace)]
    elif cfg.retrace is not None and stored.retrace is None:
        init = ReTraceFusion(cfg.retrace, cfg.hidden_size, cfg.hidden_size, dtype=dtype, rngs=nnx.Rngs(seed))
        fresh = {("retrace",) + p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(init))}
    elif cfg.retrace is not None:
        specs = all_drafter_specs(cfg)
    vocab = read_draft_vocab(path, cfg)
    if vocab is not None:
        fresh = {**(fresh or {}), ("draft_vocab",): jnp.asarray(vocab)}
    return load_into(module, specs, reader, dtype, aliases=strip_prefix(reader.names(), "model."),
                     ignore=ignore, fresh=fresh, mesh=mesh)


def read_draft_vocab(path: str, cfg: DrafterConfig) -> np.ndarray | None:
    """The draft vocabulary stored beside a drafter checkpoint (``retrace_jax/draft_vocab.py``), checked
    against its ``config.json``; None for a drafter over the whole vocabulary."""
    file = os.path.join(path, draft_vocab.FILE)
    if cfg.draft_vocab_size is None:
        if os.path.exists(file):
            raise CheckpointError(f"{file} is there but {os.path.join(path, 'config.json')} has no draft_vocab_size; "
                                  f"remove the file or add the field")
        return None
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{os.path.join(path, 'config.json')} has draft_vocab_size {cfg.draft_vocab_size} "
                                f"but {file} is missing")
    try:
        with safe_open(file, framework="numpy") as f:
            if draft_vocab.TENSOR not in f.keys():
                raise CheckpointError(f"{file} lacks the tensor {draft_vocab.TENSOR!r}")
            ids = f.get_tensor(draft_vocab.TENSOR)
    except (OSError, SafetensorError) as err:
        raise CheckpointError(f"{file} cannot be read: {err}") from None
    try:
        ids = draft_vocab.check_ids(ids, cfg.vocab_size, file)
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    if len(ids) != cfg.draft_vocab_size:
        raise CheckpointError(f"{file} holds {len(ids)} token ids, config.json says draft_vocab_size "
                              f"{cfg.draft_vocab_size}")
    return ids


def model_specs(module) -> list[WeightSpec]:
    """The mapping table of a target or drafter."""
    return target_specs(module.cfg) if isinstance(module, TargetModel) else all_drafter_specs(module.cfg)


def shard_model(module, mesh: Mesh):
    """Places an in-memory target or drafter on ``mesh`` by the logical-axis rules."""
    cfg = module.cfg
    check_divisible(type(module).__name__, cfg.num_heads, cfg.num_kv_heads, mesh)
    axes = {s.path: s.param_axes for s in model_specs(module)}
    graphdef, state = nnx.split(module)
    flat = dict(nnx.to_flat_state(state))
    for path, var in flat.items():
        value = var.get_value()
        var.set_value(jax.device_put(value, named_sharding(axes.get(path, (None,) * value.ndim), value.shape, mesh)))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# Weight files of any layout: a saved checkpoint keeps none of the old ones, so none can shadow the new weights.
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")


def save_drafter(drafter: DFlashDrafter, path: str, dtype=None) -> None:
    """Writes ``config.json`` and ``model.safetensors`` in the official DFlash layout; ``dtype``
    ("float32" or "bfloat16") stores the weights in that type (default: the drafter's own).

    The checkpoint is written to a temporary directory beside ``path`` and renamed into place, so a
    failure (or a killed process) leaves an existing checkpoint at ``path`` as it was. Other files there
    (a tokenizer, a README) are kept; old weight files of any layout (an index and its shards,
    ``pytorch_model.bin``) are not, so they cannot shadow the new weights. Replacing an existing directory
    takes two renames (old out, new in); a process killed between them leaves the old checkpoint as
    ``.NAME.old-*`` beside ``path``."""
    extra = None
    if drafter.cfg.draft_vocab_size is not None:  # beside the official layout (retrace_jax/draft_vocab.py)
        ids = np.asarray(jax.device_get(drafter.draft_vocab.get_value()), np.int32)
        extra = {draft_vocab.FILE: {draft_vocab.TENSOR: ids}}
    _save_checkpoint(drafter, drafter.cfg.to_hf(), all_drafter_specs(drafter.cfg), path, dtype, "save_drafter",
                     extra)


def save_target(target: TargetModel, path: str, dtype=None, extra_config: dict | None = None) -> None:
    """Writes a target as a Hugging Face directory (``config.json`` + ``model.safetensors``) that
    :func:`load_target` and transformers' ``AutoModelForCausalLM`` load; ``extra_config`` adds fields
    to ``config.json`` (token ids: ``bos_token_id``, ``eos_token_id``, ``pad_token_id``). Atomic and
    keeping other files (a tokenizer) as :func:`save_drafter` does; ``dtype`` defaults to the target's."""
    hf = dict(target.cfg.to_hf(), **(extra_config or {}))
    _save_checkpoint(target, hf, target_specs(target.cfg), path, dtype, "save_target")


def _save_checkpoint(module, hf: dict, specs: list[WeightSpec], path: str, dtype, caller: str,
                     extra: dict | None = None) -> None:
    """The atomic save behind :func:`save_drafter` and :func:`save_target`; ``extra`` maps more
    safetensors file names to their tensors (written as they are)."""
    dtype = resolve_dtype(dtype if dtype is not None else module.dtype)
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise FileExistsError(f"{caller}: {path} exists and is not a directory")
    kept = _kept_files(path, caller) if os.path.isdir(path) else []
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.saving-", dir=parent)
    try:
        os.chmod(tmp, _default_dir_mode())  # mkdtemp makes it private; a checkpoint gets the usual mode
        hf = dict(hf, torch_dtype=dtype.name)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf, f, indent=2)
        tensors = {k: v.astype(dtype) for k, v in export_tensors(module, specs).items()}
        save_file(tensors, os.path.join(tmp, SINGLE_FILE), metadata={"format": "pt"})
        for file, file_tensors in {SINGLE_FILE: None, **(extra or {})}.items():
            if file_tensors is not None:
                save_file(file_tensors, os.path.join(tmp, file))
            os.chmod(os.path.join(tmp, file), _default_dir_mode() & 0o666)  # safetensors writes it private
        for file in kept:
            shutil.copy2(os.path.join(path, file), os.path.join(tmp, file))
        _swap_in(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _default_dir_mode() -> int:
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o777 & ~umask


def _kept_files(path: str, caller: str = "save_drafter") -> list[str]:
    """The files of an existing checkpoint directory that a new save keeps (all but config and weights)."""
    names = sorted(os.listdir(path))
    subdirs = [n for n in names if not os.path.isfile(os.path.join(path, n))]
    if subdirs:
        raise ValueError(f"{caller} replaces the checkpoint directory {path}, but it holds other things "
                         f"({', '.join(subdirs[:5])}); choose an empty or new directory")
    return [n for n in names if n != "config.json" and not n.endswith(WEIGHT_SUFFIXES)]


def _swap_in(tmp: str, path: str) -> None:
    """Renames the finished directory ``tmp`` to ``path``, replacing what is there."""
    if not os.path.exists(path):
        os.rename(tmp, path)
        return
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-", dir=os.path.dirname(path))
    os.rmdir(old)  # only the unique name is wanted
    os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        os.rename(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _short(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
