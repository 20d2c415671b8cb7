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
    logical axes of its parameter's dimensions (for sharding; see
    ``retrace_jax.parallel.sharding.LOGICAL_RULES``). ``layer`` is set for one layer's slice of a parameter
    stacked over layers (the target's decoder blocks). ``part`` is set for one of the tensors that a fused
    parameter joins (q/k/v, gate/up): ``(axis, start, stop, squeeze)``, the range ``start:stop`` of the
    (one layer's) parameter's ``axis`` that holds it, that axis dropped when ``squeeze``. The part's other
    axes, after the first (a kernel's input axis) or from the first (a bias), merge into the tensor's
    output axis in order (row-major)."""

    hf_name: str
    path: tuple
    transpose: bool = False
    axes: tuple = (None,)
    layer: int | None = None
    part: tuple[int, int, int, bool] | None = None

    @property
    def param_axes(self) -> tuple:
        """The logical axes of the whole parameter (a stacked one has a leading, unsharded layer axis)."""
        return self.axes if self.layer is None else (None,) + tuple(self.axes)

    def part_index(self, ndim: int) -> tuple:
        """The index of this tensor in one layer's parameter of ``ndim`` dimensions (all of it: ``()``)."""
        if self.part is None:
            return ()
        axis, start, stop, squeeze = self.part
        return (slice(None),) * axis + (start if squeeze else slice(start, stop),) + (slice(None),) * (ndim - axis - 1)

    def part_shape(self, shape: tuple) -> tuple:
        """The shape of this tensor's part of one layer's parameter of ``shape``."""
        if self.part is None:
            return tuple(shape)
        axis, start, stop, squeeze = self.part
        return tuple(shape[:axis]) + (() if squeeze else (stop - start,)) + tuple(shape[axis + 1:])

    def _merged(self, part_shape: tuple) -> tuple:
        """The part's shape with its output axes merged: the tensor's shape in the parameter's layout."""
        if self.part is None:
            return tuple(part_shape)
        lead = 1 if self.transpose else 0
        return tuple(part_shape[:lead]) + (int(np.prod(part_shape[lead:], dtype=np.int64)),)

    def hf_shape(self, shape: tuple) -> tuple:
        """The checkpoint tensor's shape for one layer's parameter of ``shape``."""
        merged = self._merged(self.part_shape(shape))
        return merged[::-1] if self.transpose else merged

    def convert(self, array: np.ndarray) -> np.ndarray:
        """Checkpoint layout <-> parameter layout, for a tensor that is a whole parameter (the same
        operation both ways)."""
        return array.T if self.transpose else array

    def to_hf(self, value: np.ndarray) -> np.ndarray:
        """The checkpoint tensor from one layer's parameter ``value``."""
        part = value[self.part_index(value.ndim)]
        return self.convert(part.reshape(self._merged(part.shape)))

    def unit(self, shape: tuple) -> int:
        """Checkpoint rows (output features) per index of the part's first output axis: reads of whole
        such indices (heads, neurons) fill a part block by block."""
        part = self.part_shape(shape)
        return int(np.prod(part[(1 if self.transpose else 0) + 1:], dtype=np.int64))


def linear_specs(hf_prefix: str, path: tuple, bias: bool, axes=(None, None), layer=None) -> list[WeightSpec]:
    """A dense layer; ``axes`` are the logical axes of its ``[in, out]`` kernel."""
    specs = [WeightSpec(f"{hf_prefix}.weight", path + ("kernel",), transpose=True, axes=tuple(axes), layer=layer)]
    if bias:
        specs.append(WeightSpec(f"{hf_prefix}.bias", path + ("bias",), axes=(axes[1],), layer=layer))
    return specs


def fused_specs(hf_prefix: str, names: tuple[str, ...], path: tuple, bias: bool, axes: tuple, axis: int,
                sizes: tuple[int, ...], layer=None) -> list[WeightSpec]:
    """The separate checkpoint tensors ``{hf_prefix}.{name}`` of one fused dense layer (``layers.Projection``,
    kernel ``[in, *out]`` with logical ``axes``): ``name`` fills ``sizes[i]`` entries of the kernel's
    ``axis`` (size 1: that axis dropped), one after the other."""
    specs, start = [], 0
    for name, size in zip(names, sizes):
        part = (axis, start, start + size, size == 1)
        specs.append(WeightSpec(f"{hf_prefix}.{name}.weight", path + ("kernel",), True, tuple(axes), layer, part))
        if bias:
            specs.append(WeightSpec(f"{hf_prefix}.{name}.bias", path + ("bias",), False, tuple(axes[1:]), layer,
                                    (axis - 1, start, start + size, size == 1)))
        start += size
    return specs


# logical axes of the fused kernels: qkv_proj [d, K, H/K + 2, D] (split over KV heads: each shard holds its
# KV heads' query heads), gate_up_proj [d, 2, I] (split over neurons: each shard its neurons' gate and up)
QKV_AXES = ("embed", "kv_heads", None, None)
GATE_UP_AXES = ("embed", None, "mlp")
O_AXES = ("heads", "embed")
DOWN_AXES = ("mlp", "embed")


def norm_spec(hf_prefix: str, path: tuple, layer=None) -> WeightSpec:
    return WeightSpec(f"{hf_prefix}.weight", path + ("weight",), layer=layer)


def mlp_specs(hf_prefix: str, path: tuple, bias: bool, layer=None) -> list[WeightSpec]:
    return (fused_specs(hf_prefix, ("gate_proj", "up_proj"), path + ("gate_up_proj",), bias, GATE_UP_AXES, 1,
                        (1, 1), layer)
            + linear_specs(f"{hf_prefix}.down_proj", path + ("down_proj",), bias, DOWN_AXES, layer))


def block_specs(hf: str, path: tuple, qkv_bias: bool, o_bias: bool, mlp_bias: bool, qk_norm: bool,
                queries_per_kv: int, layer=None) -> list[WeightSpec]:
    """One decoder block (``layers.DecoderBlock``), target and drafter alike; ``queries_per_kv``: query
    heads per KV head (``H / K``)."""
    specs = [norm_spec(f"{hf}.input_layernorm", path + ("input_layernorm",), layer),
             norm_spec(f"{hf}.post_attention_layernorm", path + ("post_attention_layernorm",), layer)]
    specs += fused_specs(f"{hf}.self_attn", ("q_proj", "k_proj", "v_proj"), path + ("self_attn", "qkv_proj"),
                         qkv_bias, QKV_AXES, 2, (queries_per_kv, 1, 1), layer)
    specs += linear_specs(f"{hf}.self_attn.o_proj", path + ("self_attn", "o_proj"), o_bias, O_AXES, layer)
    if qk_norm:
        specs.append(norm_spec(f"{hf}.self_attn.q_norm", path + ("self_attn", "q_norm"), layer))
        specs.append(norm_spec(f"{hf}.self_attn.k_norm", path + ("self_attn", "k_norm"), layer))
    return specs + mlp_specs(f"{hf}.mlp", path + ("mlp",), mlp_bias, layer)


def target_specs(cfg: ModelConfig) -> list[WeightSpec]:
    """The target's tensors; layer ``i``'s tensors are slice ``i`` of the stacked block parameters."""
    specs = [WeightSpec("model.embed_tokens.weight", ("embed_tokens", "embedding"), axes=("vocab", "embed"))]
    for i in range(cfg.num_layers):
        specs += block_specs(f"model.layers.{i}", ("layers",), cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias, cfg.qk_norm,
                             cfg.num_heads // cfg.num_kv_heads, layer=i)
    specs.append(norm_spec("model.norm", ("norm",)))
    if not cfg.tie_word_embeddings:
        specs += linear_specs("lm_head", ("lm_head",), False, ("embed", "vocab"))
    return specs


def drafter_specs(cfg: DrafterConfig) -> list[WeightSpec]:
    """The official DFlash tensor names (no ``model.`` prefix)."""
    specs = [WeightSpec("fc.weight", ("fc", "kernel"), transpose=True, axes=(None, "embed")),
             norm_spec("hidden_norm", ("hidden_norm",)), norm_spec("norm", ("norm",))]
    for i in range(cfg.num_layers):
        specs += block_specs(f"layers.{i}", ("layers", i), cfg.attention_bias, cfg.attention_bias, False, True,
                             cfg.num_heads // cfg.num_kv_heads)
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
        one = expected[1:] if stacked else expected
        layers = {}  # layer (None: not stacked) -> its specs
        for spec in group:
            layers.setdefault(spec.layer, []).append(spec)
        if stacked and sorted(layers) != list(range(expected[0])):
            raise AssertionError(f"stacked parameter {path} has {expected[0]} layers, specs {len(layers)}")
        for spec in group:
            hf_expected = spec.hf_shape(one)
            reader.check_floating(aliases[spec.hf_name])
            if reader.shape(aliases[spec.hf_name]) != hf_expected:
                raise CheckpointError(f"tensor {spec.hf_name} has shape {reader.shape(aliases[spec.hf_name])}, "
                                      f"the config implies {hf_expected}")

        def read(spec, index=None):
            hf_index = None if index is None else (tuple(index[::-1]) if spec.transpose else tuple(index))
            return np.asarray(spec.convert(reader.get(aliases[spec.hf_name], hf_index)), dtype=dtype)

        def read_part(spec, index, one=one):
            """The region ``index`` (slices, one per axis) of the part of one layer's parameter that
            ``spec`` fills: the checkpoint rows of the part's first output axis in ``index``, read whole."""
            part = spec.part_shape(one)
            lead = 1 if spec.transpose else 0
            first, stop, _ = index[lead].indices(part[lead])
            unit = spec.unit(one)
            rows = (slice(first * unit, stop * unit),)
            block = reader.get(aliases[spec.hf_name], rows + ((index[0],) if spec.transpose else ()))
            block = np.asarray(spec.convert(block), dtype=dtype)
            block = block.reshape(block.shape[:lead] + (stop - first,) + part[lead + 1:])
            return block[(slice(None),) * (lead + 1) + tuple(index[lead + 1:])]

        def read_layer(specs, index, one=one, path=path):
            """One layer's parameter (or its region ``index``) from its checkpoint tensors."""
            if specs[0].part is None:
                return read(specs[0], index)
            index = tuple(slice(None) for _ in one) if index is None else tuple(index)
            out = np.empty([len(range(*i.indices(n))) for i, n in zip(index, one)], dtype)
            for spec in specs:
                axis, _, _, squeeze = spec.part
                if index[axis].indices(one[axis]) != (0, one[axis], 1):
                    raise AssertionError(f"{path}: a shard splits the axis {axis} that joins {spec.hf_name}")
                sub = tuple(slice(None) if i == axis else x for i, x in enumerate(index) if not (i == axis and squeeze))
                out[spec.part_index(len(one))] = read_part(spec, sub)
            return out

        def fill(dest, spec, one=one):
            """Reads one tensor into ``dest`` (its place in the parameter) a block of rows at a time: no
            temporary copy of a whole large tensor (the untied LM head of Qwen2.5-Coder-0.5B is 545 MB).
            A part of a fused parameter is read a block of whole heads or neurons at a time."""
            name = aliases[spec.hf_name]
            shape = reader.shape(name)
            if spec.part is not None:
                dest = dest[spec.part_index(dest.ndim)]
                lead = 1 if spec.transpose else 0
                per = spec.unit(one) * max(1, int(np.prod(shape[1:], dtype=np.int64)))  # bytes/itemsize per index
                step = max(1, LOAD_BLOCK_BYTES // max(1, per * np.dtype(dtype).itemsize))
                for start in range(0, dest.shape[lead], step):
                    stop = min(start + step, dest.shape[lead])
                    index = (slice(None),) * lead + (slice(start, stop),)
                    dest[index] = read_part(spec, index + (slice(None),) * (dest.ndim - lead - 1))
                return
            into = spec.convert(dest)  # a view in the checkpoint's layout
            if not shape:
                into[...] = reader.get(name)
                return
            step = max(1, LOAD_BLOCK_BYTES // max(1, into[0].nbytes))
            for start in range(0, shape[0], step):
                into[start:start + step] = reader.get(name, (slice(start, start + step),))

        def read_shard(index, layers=layers, stacked=stacked, expected=expected):
            if not stacked:
                return read_layer(layers[None], index)
            return np.stack([read_layer(layers[i], index[1:]) for i in range(expected[0])[index[0]]])

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
    groups: dict[tuple, list[WeightSpec]] = {}
    for s in specs:
        groups.setdefault(s.path, []).append(s)
    tensors = {}
    for path, group in groups.items():  # each parameter fetched once (a stacked or joined one holds several)
        value = np.asarray(jax.device_get(flat[path].get_value()))
        for s in group:
            tensors[s.hf_name] = np.ascontiguousarray(s.to_hf(value if s.layer is None else value[s.layer]))
    out = {s.hf_name: tensors[s.hf_name] for s in specs}  # in the table's order
    return out


def model_specs(module) -> list[WeightSpec]:
    """The mapping table of a target or drafter."""
    return target_specs(module.cfg) if isinstance(module, TargetModel) else all_drafter_specs(module.cfg)
