"""Helpers shared by the tests: tiny random Hugging Face reference models saved as checkpoint directories,
checkpoint edits, random parameters, and a compile counter."""

from __future__ import annotations

import contextlib
import json
import os
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from retrace_jax.decoding.programs import BACKEND_COMPILE_EVENT

# ---------------------------------------------------------------------------------- reference models

VOCAB = 128

FAMILIES = {
    # GQA, head_dim (32) != hidden / heads (16), untied head.
    "qwen3": dict(cls="Qwen3", tie_word_embeddings=False, head_dim=32),
    # Biases on q/k/v, tied embeddings.
    "qwen2": dict(cls="Qwen2", tie_word_embeddings=True),
    # Neither; untied.
    "llama": dict(cls="Llama", tie_word_embeddings=False),
}


def hf_config(family: str, **overrides):
    spec = dict(FAMILIES[family])
    cls = spec.pop("cls")
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kwargs.update(spec)
    kwargs.update(overrides)
    return getattr(transformers, f"{cls}Config")(**kwargs)


def make_hf_model(family: str, seed: int = 0, **overrides):
    """A random float32 causal LM with larger-than-default weights, so its greedy outputs vary."""
    torch.manual_seed(seed)
    config = hf_config(family, **overrides)
    model = getattr(transformers, f"{FAMILIES[family]['cls']}ForCausalLM")(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.05)
    return model.eval()


def save_hf_model(model, directory: str, **kwargs) -> str:
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return directory


def save_word_tokenizer(directory: str, vocab_size: int = VOCAB) -> None:
    """A whitespace word-level tokenizer over ``w0 .. w{vocab-1}`` (no download needed)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w2", pad_token="w0").save_pretrained(directory)


def hf_greedy(model, prompt, n):
    """transformers' greedy continuation of ``n`` tokens (no stop token)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# ---------------------------------------------------------------------------------- checkpoint edits

def copy_model_dir(directory, dst) -> str:
    """A copy of a checkpoint directory that a test may damage."""
    shutil.copytree(directory, dst)
    return str(dst)


def edit_tensors(directory: str, fn) -> None:
    """Applies ``fn`` to the dict of ``directory/model.safetensors`` (name -> numpy array) and saves it."""
    path = os.path.join(directory, "model.safetensors")
    tensors = {k: np.array(v) for k, v in load_file(path).items()}
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def edit_config(directory: str, fn) -> None:
    """Applies ``fn`` to the dict of ``directory/config.json`` and saves it."""
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    fn(cfg)
    with open(path, "w") as f:
        json.dump(cfg, f)


# ---------------------------------------------------------------------------------- random parameters

def randomize(module, seed=0, scale=0.15):
    """Replaces every parameter with N(0, scale) noise (norm scales around 1), so tests exercise them."""
    graphdef, state = nnx.split(module)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    new = [
        (1.0 + 0.1 * jax.random.normal(k, x.shape) if x.ndim == 1 else scale * jax.random.normal(k, x.shape)).astype(x.dtype)
        for k, x in zip(keys, leaves)
    ]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, new))


def with_random_retrace(drafter, seed=0, scale=0.3):
    """The drafter with its ReTrace module's parameters (``W_v`` included) drawn at random."""
    graphdef, state = nnx.split(drafter)
    flat = dict(nnx.to_flat_state(state))
    key = jax.random.PRNGKey(seed)
    for path, var in flat.items():
        if path[0] == "retrace":
            key, sub = jax.random.split(key)
            var.set_value(scale * jax.random.normal(sub, var.get_value().shape))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# ---------------------------------------------------------------------------------- compilations


@contextlib.contextmanager
def count_compiles():
    """Yields a list that receives the name of every function compiled inside the block (through
    jax.monitoring, a public API)."""
    names: list[str] = []

    def listener(event, duration_secs, **kwargs):
        if event == BACKEND_COMPILE_EVENT:
            names.append(kwargs.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def built_once(tmp_path_factory, name: str, build) -> "os.PathLike":
    """A directory that ``build(path)`` fills once per test run, shared by pytest-xdist's worker
    processes: the first to ask builds it under a file lock, the others wait for it and read it."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above each worker's own
    path = root / name
    with FileLock(str(path) + ".lock"):
        if not (path / ".complete").exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
            build(path)
            (path / ".complete").touch()
    return path


def cli_error(capsys, main, argv) -> str:
    """Runs a command line's ``main`` on input it must refuse: it exits with status 1 and its last line on
    stderr is one ``error: ...`` line (no traceback), which is returned."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 1, exit_.value.code
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.endswith("\n"), err
    line = err.splitlines()[-1]
    assert line.startswith("error: "), err
    return line
