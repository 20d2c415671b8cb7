"""retrace-jax: lossless speculative decoding (DFlash + ReTrace) as one compiled XLA program."""

from retrace_jax.config import ConfigError, ModelConfig
from retrace_jax.hf_io import CheckpointError, load_target
from retrace_jax.target import TargetModel

__all__ = ["CheckpointError", "ConfigError", "ModelConfig", "TargetModel", "load_target"]
from retrace_jax.generate import GenerateOutput, generate

__all__ += ["GenerateOutput", "generate"]
