"""The weight tables: each parameter's Hugging Face tensor name, state path, layout and logical axes.

One table per model drives loading, saving and sharding, so the directions cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from retrace_jax.errors import CheckpointError
from retrace_jax.io.safetensors import IGNORED_SUFFIXES, TensorReader, host_empty, short_names
from retrace_jax.models.config import ModelConfig
from retrace_jax.models.drafter import DrafterConfig
from retrace_jax.models.retrace import ReTraceConfig
from retrace_jax.models.target import TargetModel
from retrace_jax.parallel.sharding import named_sharding


# load_into reads a tensor this many bytes at a time (of the loaded type)
LOAD_BLOCK_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """One tensor: its Hugging Face name, its NNX state path, whether it is stored ``[out, in]``, and the
    logical axes of its dimensions (for sharding; see ``retrace_jax.parallel.sharding.LOGICAL_RULES``).
    ``layer`` is set for one layer's slice of a parameter stacked over layers (the target's decoder
    blocks)."""

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
    """``retrace.{correct,value,gate}.weight`` (and ``hint``, ``hint_gate`` with ``hints="tokens"``), or
    ``.down.weight`` / ``.up.weight`` pairs with a rank, ``retrace.scale`` with ``zero_start="scale"`` and
    ``retrace.mix_gate.{weight,bias}``, ``retrace.mix_scale`` with ``mixture="target"`` (none for the "keys"
    fusion, which has no parameters of its own)."""
    if cfg.fusion == "keys":
        return []
    names = ("correct", "value", "gate") if cfg.gate else ("correct", "value")
    if cfg.hints == "tokens":
        names += ("hint", "hint_gate")
    scale = [WeightSpec("retrace.scale", ("retrace", "scale"))] if cfg.zero_start == "scale" else []
    if cfg.mixture == "target":
        scale += [WeightSpec("retrace.mix_gate.weight", ("retrace", "mix_gate", "kernel"), True),
                  WeightSpec("retrace.mix_gate.bias", ("retrace", "mix_gate", "bias")),
                  WeightSpec("retrace.mix_scale", ("retrace", "mix_scale"))]
    if cfg.rank is None:
        return [WeightSpec(f"retrace.{n}.weight", ("retrace", n, "full", "kernel"), True) for n in names] + scale
    return [WeightSpec(f"retrace.{n}.{f}.weight", ("retrace", n, f, "kernel"), True)
            for n in names for f in ("down", "up")] + scale


def all_drafter_specs(cfg: DrafterConfig) -> list[WeightSpec]:
    return drafter_specs(cfg) + (retrace_specs(cfg.retrace) if cfg.retrace is not None else [])


def check_layers(names: Iterable[str], prefix: str, num_layers: int, directory: str) -> None:
    """A ``CheckpointError`` unless the layer indices in the tensor names ``{prefix}N.*`` are exactly
    ``0..num_layers-1``, naming the missing and the unexpected layers. It runs before anything is built
    from the config, and its cost grows with the checkpoint's names, not with the number of layers that
    ``config.json`` claims (``num_hidden_layers: 100000`` is refused at once)."""
    present = set()
    for name in names:
        if name.startswith(prefix):
            index = name[len(prefix):].split(".", 1)[0]
            if index.isascii() and index.isdigit():
                present.add(int(index))
    inside = sorted(i for i in present if i < num_layers)
    missing, last = [], -1
    for i in inside + [num_layers]:
        if i > last + 1:
            missing.append((last + 1, i - 1))
        last = i
    extra = sorted(i for i in present if i >= num_layers)
    if missing or extra:
        problems = [f"missing layers {_spans(missing)}"] if missing else []
        if extra:
            problems.append(f"unexpected layers {_spans([(i, i) for i in extra])}")
        raise CheckpointError(f"checkpoint in {directory} does not match num_hidden_layers {num_layers} of its "
                              f"config.json: {'; '.join(problems)} (tensors {prefix}N.*)")


def _spans(spans: list[tuple[int, int]], limit: int = 6) -> str:
    text = ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in spans[:limit])
    return text + (f" and {len(spans) - limit} more" if len(spans) > limit else "")


def check_names(specs: list[WeightSpec], aliases: Iterable[str], directory: str, ignore: Iterable[str] = ()) -> None:
    """A ``CheckpointError`` listing the tensors that ``specs`` want and the checkpoint lacks, and those it
    holds that nothing wants (``ignore`` and :data:`IGNORED_SUFFIXES` aside)."""
    wanted = {s.hf_name for s in specs}
    ignore = set(ignore)
    names = set(aliases)
    missing = sorted(wanted - names)
    extra = sorted(n for n in names - wanted if n not in ignore and not n.endswith(IGNORED_SUFFIXES))
    if missing or extra:
        raise CheckpointError(
            f"checkpoint in {directory} does not match the model: "
            f"missing tensors {short_names(missing)}; unexpected tensors {short_names(extra)}"
        )


def load_into(module: nnx.Module, specs: list[WeightSpec], reader: TensorReader, dtype, *,
              aliases: dict[str, str] | None = None, ignore: Iterable[str] = (),
              fresh: dict[tuple, jax.Array] | None = None, mesh: Mesh | None = None) -> nnx.Module:
    """Fills an (abstract) module's parameters from a checkpoint, checking names and shapes.

    With a ``mesh`` each device reads only its own shard of each tensor from the safetensors files.
    ``fresh`` supplies parameters that the checkpoint does not hold (by state path)."""
    aliases = aliases or {n: n for n in reader.names()}
    check_names(specs, aliases, reader.directory, ignore)
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
            reader.check_floating(aliases[spec.hf_name])
            if reader.shape(aliases[spec.hf_name]) != hf_expected:
                raise CheckpointError(f"tensor {spec.hf_name} has shape {reader.shape(aliases[spec.hf_name])}, "
                                      f"the config implies {hf_expected}")

        def read(spec, index=None):
            hf_index = None if index is None else (tuple(index[::-1]) if spec.transpose else tuple(index))
            return np.asarray(spec.convert(reader.get(aliases[spec.hf_name], hf_index)), dtype=dtype)

        def fill(dest, spec):
            """Reads one tensor into ``dest`` (its place in the parameter) a block of rows at a time: no
            temporary copy of a whole large tensor (the untied LM head of Qwen2.5-Coder-0.5B is 545 MB)."""
            name = aliases[spec.hf_name]
            shape = reader.shape(name)
            into = spec.convert(dest)  # a view in the checkpoint's layout
            if not shape:
                into[...] = reader.get(name)
                return
            step = max(1, LOAD_BLOCK_BYTES // max(1, into[0].nbytes))
            for start in range(0, shape[0], step):
                into[start:start + step] = reader.get(name, (slice(start, start + step),))

        def read_shard(index, group=group, stacked=stacked):
            if not stacked:
                return read(group[0], index)
            return np.stack([read(group[i], index[1:]) for i in range(len(group))[index[0]]])

        if mesh is None:  # filled in place and handed to JAX, which takes it without a copy on a CPU
            value = host_empty(expected, dtype)
            for spec in group:
                fill(value[spec.layer] if stacked else value, spec)
            value = jax.device_put(value, may_alias=True)
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


def model_specs(module) -> list[WeightSpec]:
    """The mapping table of a target or drafter."""
    return target_specs(module.cfg) if isinstance(module, TargetModel) else all_drafter_specs(module.cfg)
