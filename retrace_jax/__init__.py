"""retrace-jax: lossless speculative decoding (DFlash + ReTrace) as one compiled XLA program."""

from retrace_jax.compile_cache import enable_compilation_cache
from retrace_jax.config import ConfigError, ModelConfig
from retrace_jax.drafter import DFlashDrafter, DrafterConfig, init_drafter
from retrace_jax.retrace import ReTraceConfig
from retrace_jax.hf_io import (CheckpointError, load_drafter, load_target, save_drafter, save_target,
                               shard_model)
from retrace_jax.sharding import make_mesh
from retrace_jax.target import TargetModel

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DFlashDrafter",
    "DrafterConfig",
    "ModelConfig",
    "ReTraceConfig",
    "TargetModel",
    "enable_compilation_cache",
    "init_drafter",
    "load_drafter",
    "make_mesh",
    "load_target",
    "save_drafter",
    "save_target",
    "shard_model",
]
import retrace_jax.assets as assets
import retrace_jax.tiny as tiny
from retrace_jax.generation import GenerateOutput, generate

__all__ += ["GenerateOutput", "assets", "generate", "tiny"]
