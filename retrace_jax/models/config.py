"""Model configuration read from a Hugging Face ``config.json``.

One frozen dataclass describes every supported decoder (Qwen3, Qwen2/Qwen2.5, Llama); the families differ
only by the flags below. Its fields are checked strictly whenever it is built (``retrace_jax/validation.py``),
and a ``config.json`` is checked key by key before anything is computed from it, so a bad value is
refused with its key named instead of surfacing as a NaN or a ``TypeError`` deep inside.
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, model_validator

from retrace_jax.errors import ConfigError
from retrace_jax.io.files import regular_file
from retrace_jax.models.layers import BlockSpec
from retrace_jax.validation import (
    Bool,
    Int,
    NonNegativeInt,
    PositiveInt,
    PositiveNumber,
    config_dataclass,
    short_repr,
    validated,
)

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama")
ModelType = Literal[SUPPORTED_MODEL_TYPES]


@config_dataclass(kw_only=True)
class DecoderShape:
    """The shape of a stack of decoder blocks: what the target's and the drafter's configs share, read
    from ``config.json`` by one schema (:class:`ShapeKeys`)."""

    vocab_size: PositiveInt
    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    num_layers: PositiveInt
    num_heads: PositiveInt
    num_kv_heads: PositiveInt
    head_dim: PositiveInt
    rope_theta: PositiveNumber
    rms_norm_eps: PositiveNumber
    max_position_embeddings: PositiveInt

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )

    def block_spec_with(self, *, qkv_bias: bool, o_bias: bool, mlp_bias: bool, qk_norm: bool) -> BlockSpec:
        """The :class:`~retrace_jax.models.layers.BlockSpec` of this shape with the family's flags."""
        return BlockSpec(self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim,
                         self.rope_theta, self.rms_norm_eps, qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias,
                         qk_norm=qk_norm)

    def shape_to_hf(self) -> dict[str, Any]:
        """The ``config.json`` fields of the shape (:class:`ShapeKeys` reads them back)."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_dropout": 0.0,
        }


ACTIVATIONS = ("silu", "swish")  # the MLP's activation: SiLU, by either of transformers' names for it


def _silu(value: str) -> str:
    if value not in ACTIVATIONS:
        raise ValueError(f"{short_repr(value)} is not implemented; retrace-jax implements 'silu' (the SiLU-gated MLP)")
    return value


def _whole_rotary(value: float) -> float:
    if value != 1:
        raise ValueError(f"{value!r} is not implemented; retrace-jax rotates the whole head (1.0)")
    return value


def _listed(items: list, limit: int = 6) -> str:
    text = ", ".join(map(str, items[:limit]))
    return text + (f" and {len(items) - limit} more" if len(items) > limit else "")


Activation = Annotated[str, AfterValidator(_silu)]
RotaryFraction = Annotated[PositiveNumber, AfterValidator(_whole_rotary)]


class HFKeys(BaseModel):
    """Keys of a Hugging Face ``config.json`` that this library reads, checked strictly. Other keys are
    ignored (real configs carry many); an absent or null key takes its default."""

    model_config = ConfigDict(strict=True, extra="ignore")


class RopeKeys(HFKeys):
    """``rope_parameters`` (transformers 5) or ``rope_scaling``: only default RoPE is implemented."""

    rope_type: str | None = None
    type: str | None = None
    rope_theta: PositiveNumber | None = None
    partial_rotary_factor: RotaryFraction | None = None  # transformers 5 may keep it here

    @model_validator(mode="after")
    def _default_only(self):
        kind = self.rope_type or self.type or "default"
        if kind != "default":
            raise ValueError(f"unsupported RoPE scaling {kind!r}; only default RoPE is implemented")
        return self


class ShapeKeys(HFKeys):
    """The shape keys of a target's or a drafter's ``config.json``."""

    vocab_size: PositiveInt
    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    num_hidden_layers: PositiveInt
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt | None = None  # default: num_attention_heads
    head_dim: PositiveInt | None = None  # default: hidden_size // num_attention_heads
    rope_theta: PositiveNumber | None = None  # older files; transformers 5 writes rope_parameters.rope_theta
    rope_parameters: RopeKeys | None = None
    rope_scaling: RopeKeys | None = None
    rms_norm_eps: PositiveNumber | None = None  # default 1e-6
    max_position_embeddings: PositiveInt | None = None  # default: the caller's
    # Read only to refuse what is not implemented (the maths would differ): another MLP activation, RoPE
    # over part of each head. Absent, or at the value that changes nothing, they load.
    hidden_act: Activation | None = None
    partial_rotary_factor: RotaryFraction | None = None

    def shape(self, max_position_embeddings: int) -> dict[str, Any]:
        """The :class:`DecoderShape` fields, defaults filled in."""
        theta = self.rope_parameters.rope_theta if self.rope_parameters else None
        theta = theta if theta is not None else self.rope_theta
        return dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_hidden_layers,
            num_heads=self.num_attention_heads,
            num_kv_heads=self.num_key_value_heads or self.num_attention_heads,
            head_dim=self.head_dim or self.hidden_size // self.num_attention_heads,
            rope_theta=10000.0 if theta is None else float(theta),
            rms_norm_eps=1e-6 if self.rms_norm_eps is None else self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings or max_position_embeddings,
        )


DEFAULT_MAX_WINDOW_LAYERS = 28  # transformers' Qwen2Config and Qwen3Config, when a config.json has none


class TargetKeys(ShapeKeys):
    """A target's ``config.json``."""

    model_type: ModelType
    tie_word_embeddings: Bool | None = None
    attention_bias: Bool | None = None
    mlp_bias: Bool | None = None
    # Sliding-window attention is not implemented for a target: these keys are read to refuse a config
    # whose layers would slide as transformers reads it, and load at values where none does (Qwen2 configs
    # ship use_sliding_window false beside sliding_window 32768; transformers then drops the window).
    layer_types: list[str] | None = None
    use_sliding_window: Bool | None = None
    sliding_window: Int | None = None
    max_window_layers: NonNegativeInt | None = None

    @model_validator(mode="after")
    def _full_attention_only(self):
        layers, problems = self.num_hidden_layers, []
        if self.layer_types is not None:  # as transformers, these decide over max_window_layers
            if len(self.layer_types) != layers:
                problems.append(f"layer_types has {len(self.layer_types)} entries for num_hidden_layers {layers} "
                                f"(one per layer)")
            other = [i for i, kind in enumerate(self.layer_types) if kind != "full_attention"]
            if other:
                more = f" (nor are layers {_listed(other[1:])})" if len(other) > 1 else ""
                problems.append(f"layer_types[{other[0]}]: {short_repr(self.layer_types[other[0]])} is not "
                                f"implemented for a target; retrace-jax implements 'full_attention'{more}")
        elif self.use_sliding_window and self.sliding_window is not None:
            # transformers' Qwen2/Qwen3: layers from max_window_layers on slide (absent: their default, 28)
            first = DEFAULT_MAX_WINDOW_LAYERS if self.max_window_layers is None else self.max_window_layers
            if first < layers:
                given = (f"from max_window_layers {first}" if self.max_window_layers is not None
                         else f"max_window_layers not given: transformers' default {DEFAULT_MAX_WINDOW_LAYERS}")
                problems.append(f"use_sliding_window: true with sliding_window {self.sliding_window} makes layers "
                                f"{first}..{layers - 1} ({given}) sliding-window layers, which are not implemented "
                                f"for a target (set use_sliding_window to false for full attention)")
        if problems:
            raise ValueError("; ".join(problems))
        return self


@config_dataclass(kw_only=True)
class ModelConfig(DecoderShape):
    """A target decoder: its shape and the flags of its family (hashable: a static jit argument)."""

    model_type: ModelType
    tie_word_embeddings: Bool
    qkv_bias: Bool  # Qwen2: always; Qwen3/Llama: attention_bias
    o_bias: Bool  # Qwen3/Llama: attention_bias; Qwen2: never
    mlp_bias: Bool  # Llama's mlp_bias
    qk_norm: Bool  # Qwen3 only

    @property
    def block_spec(self) -> BlockSpec:
        return self.block_spec_with(qkv_bias=self.qkv_bias, o_bias=self.o_bias, mlp_bias=self.mlp_bias,
                                    qk_norm=self.qk_norm)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Builds a config from the dict of a Hugging Face ``config.json``."""
        keys = validated(TargetKeys, hf)
        model_type, attention_bias = keys.model_type, bool(keys.attention_bias)
        return cls(
            **keys.shape(max_position_embeddings=32768),
            model_type=model_type,
            tie_word_embeddings=bool(keys.tie_word_embeddings),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(keys.mlp_bias) if model_type == "llama" else False,
            qk_norm=model_type == "qwen3",
        )

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` fields of this model (``from_hf(cfg.to_hf()) == cfg``); the
        flags must be ones that the family can express (Qwen3's QK-norm, Qwen2's q/k/v biases)."""
        family = HF_ARCHITECTURES[self.model_type]
        if self.qk_norm != (self.model_type == "qwen3"):
            raise ConfigError(f"qk_norm={self.qk_norm} cannot be expressed by model_type {self.model_type!r}")
        if self.model_type == "qwen2":
            if not self.qkv_bias or self.o_bias:
                raise ConfigError("model_type 'qwen2' always has q/k/v biases and no o_proj bias")
        elif self.qkv_bias != self.o_bias:
            raise ConfigError(f"model_type {self.model_type!r} has one attention_bias flag for q/k/v and o_proj")
        if self.mlp_bias and self.model_type != "llama":
            raise ConfigError(f"mlp_bias cannot be expressed by model_type {self.model_type!r}")
        hf = {
            "architectures": [family],
            "model_type": self.model_type,
            **self.shape_to_hf(),
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        if self.model_type != "qwen2":
            hf["attention_bias"] = self.o_bias
        if self.model_type == "llama":
            hf["mlp_bias"] = self.mlp_bias
        return hf


HF_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


def read_config_json(directory: str) -> dict[str, Any]:
    """Reads ``directory/config.json`` with a clear error when it is missing or not a JSON object."""
    path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"model directory not found: {directory}")
    regular_file(path, f"no config.json in {directory}", ConfigError)  # a directory, a FIFO: said so, not opened
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not UTF-8 text: {err}") from None
    except RecursionError:  # the decoder recurses once per nesting level; no config nests that deep
        raise ConfigError(f"{path} is nested too deeply to be a model config") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path} must hold a JSON object, not {type(hf).__name__}")
    return hf


def read_config(kind, directory: str):
    """``kind.from_hf`` (:class:`ModelConfig` or ``DrafterConfig``) of ``directory/config.json``; its
    errors name the file."""
    hf = read_config_json(directory)
    try:
        return kind.from_hf(hf)
    except ValueError as err:
        raise ConfigError(f"{os.path.join(directory, 'config.json')}: {err}") from None
