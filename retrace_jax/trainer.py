"""The training driver behind ``train.py``, kept as one import for earlier code. It now lives in:

* :mod:`retrace_jax.train_config` -- the typed configuration (defaults, docs, validation);
* :mod:`retrace_jax.train_prepare` -- data preparation (the target's own responses, resumable shards);
* :mod:`retrace_jax.train_loop` -- the training loop (mesh, sharded steps, checkpoints, resume);
* :mod:`retrace_jax.train_eval` -- evaluation, export and metric logging;
* :mod:`retrace_jax.distributed` -- multi-process start-up.
"""

from retrace_jax.distributed import initialize as initialize_distributed
from retrace_jax.train_config import (DEFAULTS, ConfigurationError, TrainConfig, as_config, describe, from_dict,
                                      load_config)
from retrace_jax.train_eval import FEATURE_CACHE_LIMIT, MetricsLog, cached_features, evaluate, export_drafter
from retrace_jax.train_loop import (TrainingDiverged, build_drafter, export_checkpoint, maybe_initialize_distributed,
                                    train)
from retrace_jax.train_prepare import build_target, data_dir, prepare

__all__ = [
    "DEFAULTS", "FEATURE_CACHE_LIMIT", "ConfigurationError", "MetricsLog", "TrainConfig", "TrainingDiverged",
    "as_config", "build_drafter", "build_target", "cached_features", "data_dir", "describe", "evaluate",
    "export_checkpoint", "export_drafter", "from_dict", "initialize_distributed", "load_config",
    "maybe_initialize_distributed", "prepare", "train",
]
