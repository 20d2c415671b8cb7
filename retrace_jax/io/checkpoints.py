"""Loading and saving targets and drafters as Hugging Face / official DFlash checkpoint directories."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from retrace_jax.errors import CheckpointError, ConfigError
from retrace_jax.io.atomic import default_dir_mode, read_directory, replace_directory, write_error
from retrace_jax.io.files import regular_file
from retrace_jax.io.safetensors import SINGLE_FILE, TensorReader, strip_prefix
from retrace_jax.io.weights import (
    WeightSpec,
    all_drafter_specs,
    check_layers,
    drafter_specs,
    export_tensors,
    load_into,
    retrace_specs,
    target_specs,
)
from retrace_jax.models import draft_vocab
from retrace_jax.models.config import ModelConfig, read_config
from retrace_jax.models.drafter import DFlashDrafter, DrafterConfig, check_drafter_matches
from retrace_jax.models.retrace import ReTraceConfig, ReTraceFusion
from retrace_jax.models.target import TargetModel, abstract_target
from retrace_jax.parallel.sharding import check_divisible
from retrace_jax.validation import load_drafter_arguments


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


def load_target(path: str, dtype=None, *, mesh: Mesh | None = None) -> TargetModel:
    """Loads a Qwen3 / Qwen2 / Llama checkpoint from a Hugging Face directory (sharded over ``mesh``
    by the logical-axis rules when one is given). ``dtype``: "float32", "bfloat16" or None (bfloat16 on
    GPU and TPU, float32 on CPU). Every file comes from one save, even while another one replaces it
    (:func:`~retrace_jax.io.atomic.read_directory`)."""
    dtype = resolve_dtype(dtype)
    return read_directory(path, lambda directory: _load_target(directory, dtype, mesh))


def _load_target(path: str, dtype, mesh: Mesh | None) -> TargetModel:
    cfg = read_config(ModelConfig, path)
    check_divisible("target", cfg.num_heads, cfg.num_kv_heads, mesh)
    reader = TensorReader(path)
    # The names first: a config that does not fit its checkpoint is refused before anything is built
    check_layers(reader.names(), "model.layers.", cfg.num_layers, path)
    ignore = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    return load_into(abstract_target(cfg, dtype), target_specs(cfg), reader, dtype, ignore=ignore, mesh=mesh)


def load_drafter(path: str, target: TargetModel, dtype=None, *, retrace: bool | ReTraceConfig | None = None,
                 seed: int = 0, mesh: Mesh | None = None) -> DFlashDrafter:
    """Loads a drafter in the official DFlash layout (a ``model.`` prefix is accepted) for ``target``.

    A checkpoint whose config has ``retrace_config`` loads as a ReTrace drafter. ``retrace=True`` turns
    a plain DFlash checkpoint into a ReTrace drafter whose new module starts at zero (``W_v = 0``, so it
    drafts exactly as before; a ``ReTraceConfig`` chooses its options); ``retrace=False`` loads only the
    DFlash part of a ReTrace checkpoint; ``retrace`` is as strict as ``generate``'s ``use_retrace``
    (``"no"`` and ``0`` are refused, not taken as True or False). ``dtype`` defaults to the target's. Every
    file comes from one save, even while another one replaces it
    (:func:`~retrace_jax.io.atomic.read_directory`).
    """
    if not isinstance(target, TargetModel):
        raise TypeError(f"load_drafter: target must be a TargetModel (rj.load_target, rj.tiny.tiny_target), got "
                        f"{type(target).__name__}")
    if not isinstance(retrace, ReTraceConfig):
        retrace = load_drafter_arguments(retrace=retrace).retrace
    dtype = resolve_dtype(target.dtype if dtype is None else dtype)
    return read_directory(path, lambda directory: _load_drafter(directory, target, dtype, retrace, seed, mesh))


def _load_drafter(path: str, target: TargetModel, dtype, retrace: bool | ReTraceConfig | None, seed: int,
                  mesh: Mesh | None) -> DFlashDrafter:
    stored = read_config(DrafterConfig, path)
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
    aliases = strip_prefix(reader.names(), "model.", path)
    # The names first: a config that does not fit its checkpoint is refused before anything is built
    check_layers(aliases, "layers.", cfg.num_layers, path)
    specs = drafter_specs(cfg)
    ignore: list[str] = []
    fresh = None
    if stored.retrace is not None and cfg.retrace is None:
        ignore = [s.hf_name for s in retrace_specs(stored.retrace)]
    elif cfg.retrace is not None and stored.retrace is None and cfg.retrace.fusion == "embedding":
        init = ReTraceFusion(cfg.retrace, cfg.hidden_size, cfg.hidden_size, dtype=dtype, rngs=nnx.Rngs(seed))
        fresh = {("retrace",) + p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(init))}
    elif cfg.retrace is not None:
        specs = all_drafter_specs(cfg)
    vocab = read_draft_vocab(path, cfg)
    if vocab is not None:
        fresh = {**(fresh or {}), ("draft_vocab",): jnp.asarray(vocab)}
    module = abstract_module(lambda: DFlashDrafter(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    return load_into(module, specs, reader, dtype, aliases=aliases, ignore=ignore, fresh=fresh, mesh=mesh)


def read_draft_vocab(path: str, cfg: DrafterConfig) -> np.ndarray | None:
    """The draft vocabulary stored beside a drafter checkpoint (``retrace_jax/models/draft_vocab.py``), checked
    against its ``config.json``; None for a drafter over the whole vocabulary."""
    file = os.path.join(path, draft_vocab.FILE)
    if cfg.draft_vocab_size is None:
        if os.path.exists(file):
            raise CheckpointError(f"{file} is there but {os.path.join(path, 'config.json')} has no draft_vocab_size; "
                                  f"remove the file or add the field")
        return None
    # there but no regular file (a directory, a FIFO) is said to be what it is, and never opened
    regular_file(file, f"{os.path.join(path, 'config.json')} has draft_vocab_size {cfg.draft_vocab_size} "
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


def save_drafter(drafter: DFlashDrafter, path: str, dtype=None) -> None:
    """Writes ``config.json`` and ``model.safetensors`` in the official DFlash layout; ``dtype``
    ("float32" or "bfloat16") stores the weights in that type (default: the drafter's own).

    The checkpoint is written as a new version that ``path`` then links to
    (:func:`~retrace_jax.io.atomic.replace_directory`): a failure leaves an existing checkpoint as it was;
    other files there (a tokenizer, a README) are kept, old weight files of any layout are not. A failed
    write (a full disk) is an ``OSError`` naming ``path`` and the cause."""
    extra = None
    if drafter.cfg.draft_vocab_size is not None:  # beside the official layout (retrace_jax/models/draft_vocab.py)
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

    def write(tmp: str) -> None:
        tensors = {k: v.astype(dtype) for k, v in export_tensors(module, specs).items()}
        try:
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(dict(hf, torch_dtype=dtype.name), f, indent=2)
            save_file(tensors, os.path.join(tmp, SINGLE_FILE), metadata={"format": "pt"})
            for file, file_tensors in {SINGLE_FILE: None, **(extra or {})}.items():
                if file_tensors is not None:
                    save_file(file_tensors, os.path.join(tmp, file))
                os.chmod(os.path.join(tmp, file), default_dir_mode() & 0o666)  # safetensors writes it private
        except (OSError, SafetensorError) as err:
            raise write_error(err, f"{caller} could not write {path}") from err

    replace_directory(path, write, caller)

