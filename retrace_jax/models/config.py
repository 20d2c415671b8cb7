"""Model configuration read from a Hugging Face ``config.json``.

One frozen dataclass describes every supported decoder (Qwen3, Qwen2/Qwen2.5, Llama); the families differ
only by the flags below.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from retrace_jax.errors import ConfigError
from retrace_jax.models.layers import BlockSpec

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderShape:
    """The shape of a stack of decoder blocks: what the target's and the drafter's configs share, read
    from ``config.json`` by one parser (:meth:`shape_from_hf`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int

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

    @staticmethod
    def shape_from_hf(hf: dict[str, Any], max_position_embeddings: int) -> dict[str, Any]:
        """The shape fields of a ``config.json`` dict, checked (``max_position_embeddings``: the default
        when the file has none)."""
        _check_rope(hf)
        heads = _required(hf, "num_attention_heads")
        hidden = _required(hf, "hidden_size")
        return dict(
            vocab_size=_required(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required(hf, "intermediate_size"),
            num_layers=_required(hf, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=_positive_int(hf, "num_key_value_heads") or heads,
            head_dim=_positive_int(hf, "head_dim") or hidden // heads,
            rope_theta=float(rope_theta(hf)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", max_position_embeddings)),
        )

    def shape_to_hf(self) -> dict[str, Any]:
        """The ``config.json`` fields of the shape (``shape_from_hf`` reads them back)."""
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig(DecoderShape):
    """A target decoder: its shape and the flags of its family (hashable: a static jit argument)."""

    model_type: str
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: always; Qwen3/Llama: attention_bias
    o_bias: bool  # Qwen3/Llama: attention_bias; Qwen2: never
    mlp_bias: bool  # Llama's mlp_bias
    qk_norm: bool  # Qwen3 only

    @property
    def block_spec(self) -> BlockSpec:
        return self.block_spec_with(qkv_bias=self.qkv_bias, o_bias=self.o_bias, mlp_bias=self.mlp_bias,
                                    qk_norm=self.qk_norm)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Builds a config from the dict of a Hugging Face ``config.json``."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            **cls.shape_from_hf(hf, max_position_embeddings=32768),
            model_type=model_type,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)) if model_type == "llama" else False,
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
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {directory}")
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not UTF-8 text: {err}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path} must hold a JSON object, not {type(hf).__name__}")
    return hf


def rope_theta(hf: dict[str, Any]) -> float:
    """``rope_theta`` at the top level (older files) or under ``rope_parameters`` (transformers 5)."""
    params = hf.get("rope_parameters") or {}
    if "rope_theta" in params:
        return params["rope_theta"]
    if "rope_theta" in hf:
        return hf["rope_theta"]
    return 10000.0


def _check_rope(hf: dict[str, Any]) -> None:
    for key in ("rope_parameters", "rope_scaling"):
        params = hf.get(key) or {}
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise ConfigError(f"unsupported RoPE scaling {kind!r} in {key}; only default RoPE is implemented")


def short_repr(value, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + " ..."


def _required(hf: dict[str, Any], key: str):
    if key not in hf:
        raise ConfigError(f"config.json lacks {key!r}")
    return _positive_int(hf, key)


def _positive_int(hf: dict[str, Any], key: str):
    """``hf[key]`` when it is a positive integer (None when absent)."""
    value = hf.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{key} must be a positive integer, got {short_repr(value)}")
    return value
