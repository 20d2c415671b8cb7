"""retrace-jax: lossless speculative decoding (DFlash + ReTrace) as one compiled XLA program.

The public API is what this module exports; module paths inside the package may move between releases.
Layout: ``models`` (target, drafter, ReTrace), ``attention``, ``decoding`` (``generate`` and its
compiled loops), ``io`` (Hugging Face checkpoints), ``parallel`` (meshes, multi-host), ``training``,
``assets`` (real models, prompt sets, shipped drafters) and ``cli`` (``decode.py``, ``train.py``).
"""

__version__ = "0.2.0"

from retrace_jax import assets
from retrace_jax.decoding.buffers import clear_decode_buffers
from retrace_jax.decoding.generation import GenerateOutput, generate
from retrace_jax.decoding.programs import enable_compilation_cache
from retrace_jax.errors import CheckpointError, ConfigError, DataError
from retrace_jax.io.checkpoints import load_drafter, load_target, save_drafter, save_target
from retrace_jax.models import tiny
from retrace_jax.models.config import ModelConfig
from retrace_jax.models.drafter import DFlashDrafter, DrafterConfig, init_drafter
from retrace_jax.models.retrace import ReTraceConfig
from retrace_jax.models.target import TargetModel
from retrace_jax.parallel.placement import shard_model
from retrace_jax.parallel.sharding import make_mesh

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DFlashDrafter",
    "DataError",
    "DrafterConfig",
    "GenerateOutput",
    "ModelConfig",
    "ReTraceConfig",
    "TargetModel",
    "__version__",
    "assets",
    "clear_decode_buffers",
    "enable_compilation_cache",
    "generate",
    "init_drafter",
    "load_drafter",
    "load_target",
    "make_mesh",
    "save_drafter",
    "save_target",
    "shard_model",
    "tiny",
]
