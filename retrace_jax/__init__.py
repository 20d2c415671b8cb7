"""retrace-jax: lossless speculative decoding (DFlash + ReTrace) as one compiled XLA program.

The public API is what this module exports; module paths inside the package may move between releases.
Layout: ``models`` (target, drafter, ReTrace), ``attention``, ``decoding`` (``generate`` and its
compiled loops), ``io`` (Hugging Face checkpoints), ``parallel`` (meshes, multi-host), ``training``,
``assets`` (real models, prompt sets, shipped drafters) and ``cli`` (``decode.py``, ``train.py``).

The exports are imported on first use (PEP 562), so that importing a part of the package that does not
need JAX, such as the command lines' argument parsing (``decode.py --help``), does not import JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.2.0"

# Each export and the module that defines it.
_EXPORTS = {
    "clear_decode_buffers": "retrace_jax.decoding.buffers",
    "GenerateOutput": "retrace_jax.decoding.generation",
    "generate": "retrace_jax.decoding.generation",
    "enable_compilation_cache": "retrace_jax.decoding.programs",
    "CheckpointError": "retrace_jax.errors",
    "ConfigError": "retrace_jax.errors",
    "DataError": "retrace_jax.errors",
    "load_drafter": "retrace_jax.io.checkpoints",
    "load_target": "retrace_jax.io.checkpoints",
    "save_drafter": "retrace_jax.io.checkpoints",
    "save_target": "retrace_jax.io.checkpoints",
    "ModelConfig": "retrace_jax.models.config",
    "DFlashDrafter": "retrace_jax.models.drafter",
    "DrafterConfig": "retrace_jax.models.drafter",
    "init_drafter": "retrace_jax.models.drafter",
    "ReTraceConfig": "retrace_jax.models.retrace",
    "TargetModel": "retrace_jax.models.target",
    "shard_model": "retrace_jax.parallel.placement",
    "make_mesh": "retrace_jax.parallel.sharding",
}
# The two namespaces re-exported as modules.
_MODULES = {"assets": "retrace_jax.assets", "tiny": "retrace_jax.models.tiny"}

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


def __getattr__(name: str):
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        # A subpackage (rj.models, rj.decoding, ...), as it is reachable once something imported it.
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and editors see
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
