"""Builds the laboratory target: a small Qwen3-architecture model trained from scratch on the Python
standard library's source code, with its own byte-level BPE tokenizer (see lab/README.md).

Stages, each resumable and skipped when its output exists (run them all with no arguments):

    data       the stdlib's .py files (training) and the held-out packages' .py files, in path order
    tokenizer  a byte-level BPE trained on the training files, then both corpora tokenized
    train      the target in float32 (AdamW, warm-up + cosine), Orbax checkpoints that resume exactly
    export     the last checkpoint as a bf16 Hugging Face directory with the tokenizer

    python lab/build_target.py                          # everything, into lab/work and lab/target
    python lab/build_target.py --stages train --stop-after 20   # 20 more steps, then a checkpoint

The run is a function of its settings and the Python version's standard library: batch ``step`` is
drawn from the token stream by ``(seed, step)``, so a resumed run repeats an uninterrupted one exactly.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import importlib.util
import json
import math
import os
import shutil
import signal
import sys
import sysconfig
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's retrace_jax

STAGES = ("data", "tokenizer", "train", "export")
# Held-out text: these packages' own .py files (dependencies of the project, so present wherever it
# runs). Never used for training or for the tokenizer.
HELD_OUT_PACKAGES = ("optax", "flax")
# Training files: the standard library without its test suites and without installed packages.
EXCLUDED_DIRS = ("site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__")
EOS, PAD, MASK = "<|endoftext|>", "<|pad|>", "<|mask|>"
SPECIAL_TOKENS = (EOS, PAD, MASK)  # ids 0, 1, 2; EOS also separates files and serves as BOS


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    work: str = "lab/work"
    out: str = "lab/target"
    seed: int = 0
    # data (None: all files)
    max_train_files: int | None = None
    max_heldout_files: int | None = None
    # tokenizer
    vocab_size: int = 4096
    # model (Qwen3)
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    # training
    seq_len: int = 512
    batch_size: int = 8
    steps: int = 800
    lr: float = 2e-3
    warmup_frac: float = 0.04
    weight_decay: float = 0.1
    clip: float = 1.0
    log_every: int = 10
    eval_every: int = 100
    eval_windows: int = 32
    checkpoint_every: int = 50
    keep_checkpoints: int = 3
    stop_after: int | None = None  # steps to run in this call (then save and stop)

    @property
    def data_dir(self) -> str:
        return os.path.join(self.work, "data")

    @property
    def tokenizer_dir(self) -> str:
        return os.path.join(self.work, "tokenizer")

    @property
    def train_dir(self) -> str:
        return os.path.join(self.work, "train")


# ------------------------------------------------------------------------------------------------ data

def training_files(max_files: int | None = None) -> tuple[str, list[str]]:
    """The standard library's root and its .py files (relative, sorted) outside ``EXCLUDED_DIRS``."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        files += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames if f.endswith(".py")]
    return root, sorted(files)[:max_files]


def held_out_files(max_files: int | None = None) -> list[tuple[str, str]]:
    """``(package root, relative path)`` of every .py file of ``HELD_OUT_PACKAGES``, in order."""
    out = []
    for name in HELD_OUT_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"held-out package {name!r} is not installed (pip install {name})")
        pkg = list(spec.submodule_search_locations)[0]
        root = os.path.dirname(pkg)
        found = []
        for dirpath, dirnames, filenames in os.walk(pkg):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            found += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames if f.endswith(".py")]
        out += [(root, f) for f in sorted(found)]
    return out[:max_files]


def read_docs(pairs) -> list[dict]:
    docs = []
    for root, rel in pairs:
        with open(os.path.join(root, rel), "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a few files in other encodings; skipped (listed nowhere, counted in the manifest)
        if text.strip():
            docs.append({"path": rel, "sha256": hashlib.sha256(raw).hexdigest(), "text": text})
    return docs


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _read_json(path: str):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def stage_data(cfg: BuildConfig, log) -> None:
    done = os.path.join(cfg.data_dir, "manifest.json")
    if os.path.exists(done):
        log({"event": "skip", "stage": "data", "reason": f"{done} exists"})
        return
    os.makedirs(cfg.data_dir, exist_ok=True)
    root, train = training_files(cfg.max_train_files)
    train_docs = read_docs((root, f) for f in train)
    held_docs = read_docs(held_out_files(cfg.max_heldout_files))
    _write_json(os.path.join(cfg.data_dir, "train_docs.json"), train_docs)
    _write_json(os.path.join(cfg.data_dir, "heldout_docs.json"), held_docs)
    manifest = {"python": sys.version.split()[0], "stdlib": root, "excluded_dirs": list(EXCLUDED_DIRS),
                "held_out_packages": {n: _version(n) for n in HELD_OUT_PACKAGES}}
    for name, docs in (("train", train_docs), ("heldout", held_docs)):
        manifest[name] = {"files": len(docs), "bytes": sum(len(d["text"].encode()) for d in docs),
                          "sha256": hashlib.sha256("".join(d["path"] + d["sha256"] for d in docs).encode()).hexdigest()}
    manifest["train"]["skipped_not_utf8"] = len(train) - len(train_docs)
    _write_json(done, manifest)
    log({"event": "data", **{k: v for k, v in manifest.items()}})


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


# ------------------------------------------------------------------------------------------- tokenizer

def train_tokenizer(texts, vocab_size: int):
    """A byte-level BPE (``tokenizers``) with the special tokens first; returns a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() != vocab_size:
        raise SystemExit(f"the tokenizer has {tok.get_vocab_size()} tokens, not vocab_size={vocab_size} (too little "
                         f"training text for that many merges: lower --vocab-size)")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=PAD,
                                   mask_token=MASK, clean_up_tokenization_spaces=False)


def save_tokenizer(tokenizer, directory: str) -> None:
    """``save_pretrained``, naming the class ``PreTrainedTokenizerFast`` (which every transformers version
    from 4.x on loads) rather than a version-specific backend name."""
    tokenizer.save_pretrained(directory)
    path = os.path.join(directory, "tokenizer_config.json")
    config = _read_json(path)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def token_stream(tokenizer, docs) -> np.ndarray:
    """Every document's tokens followed by EOS, concatenated (uint16)."""
    eos = tokenizer.convert_tokens_to_ids(EOS)
    encoded = tokenizer.backend_tokenizer.encode_batch([d["text"] for d in docs], add_special_tokens=False)
    ids = [np.asarray(e.ids + [eos], np.uint16) for e in encoded]
    return np.concatenate(ids) if ids else np.zeros(0, np.uint16)


def stage_tokenizer(cfg: BuildConfig, log) -> None:
    done = os.path.join(cfg.data_dir, "heldout_tokens.npy")
    if os.path.exists(done):
        log({"event": "skip", "stage": "tokenizer", "reason": f"{done} exists"})
        return
    start = time.perf_counter()
    train_docs = _read_json(os.path.join(cfg.data_dir, "train_docs.json"))
    held_docs = _read_json(os.path.join(cfg.data_dir, "heldout_docs.json"))
    tokenizer = train_tokenizer((d["text"] for d in train_docs), cfg.vocab_size)
    tmp = cfg.tokenizer_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_tokenizer(tokenizer, tmp)
    shutil.rmtree(cfg.tokenizer_dir, ignore_errors=True)
    os.replace(tmp, cfg.tokenizer_dir)
    record = {"event": "tokenizer", "vocab_size": len(tokenizer)}
    for name, docs in (("train", train_docs), ("heldout", held_docs)):
        tokens = token_stream(tokenizer, docs)
        np.save(os.path.join(cfg.data_dir, f"{name}_tokens.tmp.npy"), tokens)
        os.replace(os.path.join(cfg.data_dir, f"{name}_tokens.tmp.npy"), os.path.join(cfg.data_dir, f"{name}_tokens.npy"))
        record[f"{name}_tokens"] = int(tokens.size)
        record[f"{name}_bytes_per_token"] = round(sum(len(d["text"].encode()) for d in docs) / max(1, tokens.size), 3)
    record["seconds"] = round(time.perf_counter() - start, 1)
    log(record)


# ----------------------------------------------------------------------------------------------- model

def model_config(cfg: BuildConfig):
    from retrace_jax.models.config import ModelConfig

    return ModelConfig(model_type="qwen3", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                       intermediate_size=cfg.intermediate_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                       num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
                       rms_norm_eps=1e-6, max_position_embeddings=cfg.max_position_embeddings,
                       tie_word_embeddings=True, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True)


def init_model(cfg: BuildConfig):
    import jax.numpy as jnp
    from flax import nnx

    from retrace_jax.models.target import TargetModel

    return TargetModel(model_config(cfg), dtype=jnp.float32, rngs=nnx.Rngs(cfg.seed))


def batch_tokens(tokens: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int) -> np.ndarray:
    """Batch ``step``: ``batch_size`` windows of ``seq_len + 1`` tokens at offsets drawn by ``(seed, step)``."""
    starts = np.random.default_rng([seed, step]).integers(0, tokens.size - seq_len, size=batch_size)
    return np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int32)


def eval_windows(tokens: np.ndarray, n: int, seq_len: int) -> np.ndarray:
    """``n`` evenly spaced held-out windows of ``seq_len + 1`` tokens (the same at every evaluation)."""
    starts = np.linspace(0, tokens.size - seq_len - 1, n).astype(np.int64)
    return np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int32)


@functools.lru_cache(maxsize=4)
def compiled(graphdef, lr: float, steps: int, warmup_frac: float, weight_decay: float, clip: float):
    """The jitted optimizer init, loss (mean next-token cross-entropy) and training step of a model
    structure and schedule; cached, so repeated builds in one process (the tests) compile them once."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from retrace_jax.training.step import adamw

    optimizer = adamw(lr, steps, warmup_frac, weight_decay, clip)

    def loss_fn(state, tokens_bt):
        model = nnx.merge(graphdef, state)
        x, y = tokens_bt[:, :-1], tokens_bt[:, 1:]
        cache = model.init_cache(x.shape[0], x.shape[1], jnp.float32)
        out = model(x, cache, attention="dense")  # the chunked path's fori_loop has no reverse derivative
        logits = model.logits(out.hidden).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step_fn(state, opt_state, tokens_bt):
        loss, grads = jax.value_and_grad(loss_fn)(state, tokens_bt)
        updates, opt_state = optimizer.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss, optax.global_norm(grads)

    return jax.jit(optimizer.init), jax.jit(loss_fn), jax.jit(step_fn, donate_argnums=(0, 1))


def compiled_for(cfg: BuildConfig, graphdef):
    return compiled(graphdef, cfg.lr, cfg.steps, cfg.warmup_frac, cfg.weight_decay, cfg.clip)


def mean_loss(loss_fn, state, windows: np.ndarray, batch_size: int) -> float:
    """The mean next-token loss over ``windows``, ``batch_size`` at a time (the last batch may be short)."""
    import jax.numpy as jnp

    total = sum(float(loss_fn(state, jnp.asarray(windows[i : i + batch_size]))) * len(windows[i : i + batch_size])
                for i in range(0, len(windows), batch_size))
    return total / len(windows)


def run_settings(cfg: BuildConfig, num_tokens: int) -> dict:
    """What an exact resume must share with the run that wrote the checkpoint."""
    keep = ("seed", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
            "intermediate_size", "rope_theta", "seq_len", "batch_size", "steps", "lr", "warmup_frac",
            "weight_decay", "clip")
    return {**{k: getattr(cfg, k) for k in keep}, "train_tokens": num_tokens}


def unigram_loss(train: np.ndarray, heldout: np.ndarray, vocab: int) -> float:
    """Cross-entropy (nats/token) of the held-out tokens under the training unigram (add-one)."""
    counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[heldout].mean())


class _Stop:
    requested = False

    def __call__(self, signum, frame):
        self.requested = True


def stage_train(cfg: BuildConfig, log) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from retrace_jax.training.checkpoints import Checkpoints, settings_differences

    train = np.load(os.path.join(cfg.data_dir, "train_tokens.npy"))
    heldout = np.load(os.path.join(cfg.data_dir, "heldout_tokens.npy"))
    settings = run_settings(cfg, int(train.size))
    ckpts = Checkpoints(os.path.join(cfg.train_dir, "checkpoints"), keep=cfg.keep_checkpoints)
    try:
        start = ckpts.latest_step() or 0
        if start >= cfg.steps:
            log({"event": "skip", "stage": "train", "reason": f"checkpoint {start} is the last step"})
            return {"step": start}
        graphdef, state = nnx.split(init_model(cfg))
        init_fn, loss_fn, step_fn = compiled_for(cfg, graphdef)
        opt_state = init_fn(state)
        train_seconds = 0.0
        if start:
            saved = ckpts.read_meta(start)
            diff = settings_differences(saved, settings)
            if diff:
                raise SystemExit(f"{ckpts.directory}/{start} was written with other settings "
                                 f"({'; '.join(f'{k}: {a!r} then, {b!r} now' for k, (a, b) in diff.items())}); "
                                 f"restore them or build into another --work directory")
            state, opt_state, meta = ckpts.restore(start, state, opt_state)
            train_seconds = float(meta.get("train_seconds", 0.0))
            log({"event": "resumed", "step": start})
        else:
            log({"event": "start", "parameters": int(sum(x.size for x in jax.tree.leaves(state))),
                 "unigram_heldout_loss": round(unigram_loss(train, heldout, cfg.vocab_size), 4), **settings})
        windows = eval_windows(heldout, cfg.eval_windows, cfg.seq_len)

        stop = _Stop()
        previous = signal.signal(signal.SIGTERM, stop)
        step, run, window, tick = start, 0, [], time.perf_counter()
        try:
            while step < cfg.steps:
                tokens = jnp.asarray(batch_tokens(train, step, cfg.batch_size, cfg.seq_len, cfg.seed))
                state, opt_state, loss, grad_norm = step_fn(state, opt_state, tokens)
                loss, grad_norm = float(loss), float(grad_norm)
                if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                    raise FloatingPointError(f"training diverged at step {step + 1}: loss {loss}, gradient norm "
                                             f"{grad_norm}; the last checkpoint is kept (lower --lr)")
                step, run = step + 1, run + 1
                window.append(loss)
                stopping = stop.requested or (cfg.stop_after is not None and run >= cfg.stop_after)
                if step % cfg.log_every == 0 or step == cfg.steps or stopping:
                    now = time.perf_counter()
                    train_seconds += now - tick
                    log({"step": step, "loss": round(sum(window) / len(window), 5), "last_loss": loss,
                         "grad_norm": round(grad_norm, 4),
                         "s_per_step": round((now - tick) / len(window), 3), "train_seconds": round(train_seconds, 1)})
                    window, tick = [], now
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    value = mean_loss(loss_fn, state, windows, cfg.batch_size)
                    log({"event": "eval", "step": step, "heldout_loss": round(value, 5),
                         "heldout_ppl": round(math.exp(value), 3)})
                    tick = time.perf_counter()  # evaluation time is not training time
                if step % cfg.checkpoint_every == 0 or step == cfg.steps or stopping:
                    ckpts.save(step, state, opt_state, dict(settings, train_seconds=round(train_seconds, 1)))
                if stopping:
                    log({"event": "stopped", "step": step, "reason": "SIGTERM" if stop.requested else "stop_after"})
                    break
        finally:
            signal.signal(signal.SIGTERM, previous)
        return {"step": step, "train_seconds": train_seconds}
    finally:
        ckpts.close()


# ---------------------------------------------------------------------------------------------- export

def restore_model(cfg: BuildConfig, step: int | None = None):
    """The target at checkpoint ``step`` (default: the last) in float32, and that step."""
    from flax import nnx

    from retrace_jax.training.checkpoints import Checkpoints

    ckpts = Checkpoints(os.path.join(cfg.train_dir, "checkpoints"), keep=cfg.keep_checkpoints)
    try:
        step = ckpts.latest_step() if step is None else step
        if step is None:
            raise SystemExit(f"no checkpoint in {ckpts.directory}: run the train stage first")
        graphdef, state = nnx.split(init_model(cfg))
        opt_state = compiled_for(cfg, graphdef)[0](state)
        state, _, meta = ckpts.restore(step, state, opt_state)
        return nnx.merge(graphdef, state), step, meta
    finally:
        ckpts.close()


def stage_export(cfg: BuildConfig, log, allow_partial: bool = False) -> None:
    """Writes the last checkpoint as a bf16 Hugging Face directory with the tokenizer and a
    ``build_info.json`` (settings, data manifest, held-out loss before and after the bf16 rounding)."""
    from flax import nnx
    from transformers import AutoTokenizer

    from retrace_jax.io.atomic import to_plain_directory
    from retrace_jax.io.checkpoints import load_target, save_target

    model, step, meta = restore_model(cfg)
    if step < cfg.steps and not allow_partial:
        raise SystemExit(f"the last checkpoint is step {step} of {cfg.steps}: finish the train stage first "
                         f"(or pass --allow-partial)")
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_dir)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    os.makedirs(cfg.out, exist_ok=True)
    for name in os.listdir(cfg.out):  # stale tokenizer files of an earlier build go; save_target keeps the rest
        if name.startswith(("tokenizer", "special_tokens")):
            os.remove(os.path.join(cfg.out, name))
    save_tokenizer(tokenizer, cfg.out)
    save_target(model, cfg.out, dtype="bfloat16", extra_config=ids)
    to_plain_directory(cfg.out)  # the repository keeps the files, not a link to a version
    windows = eval_windows(np.load(os.path.join(cfg.data_dir, "heldout_tokens.npy")), cfg.eval_windows, cfg.seq_len)
    losses = {}
    for name, module in (("heldout_loss", model), ("heldout_loss_bf16_weights", load_target(cfg.out, "float32"))):
        graphdef, state = nnx.split(module)
        losses[name] = round(mean_loss(compiled_for(cfg, graphdef)[1], state, windows, cfg.batch_size), 5)
    data = {k: v for k, v in _read_json(os.path.join(cfg.data_dir, "manifest.json")).items() if k != "stdlib"}
    info = {"step": step, "mask_token_id": tokenizer.mask_token_id, "train_seconds": meta.get("train_seconds"),
            **losses, "eval_windows": cfg.eval_windows, "settings": run_settings(cfg, int(meta.get("train_tokens", 0))),
            "data": data}
    with open(os.path.join(cfg.out, "build_info.json"), "w") as f:
        json.dump(info, f, indent=2)
    log({"event": "export", "step": step, "out": cfg.out, **losses,
         "bytes": sum(os.path.getsize(os.path.join(cfg.out, n)) for n in os.listdir(cfg.out))})


# ------------------------------------------------------------------------------------------------ main

def build(cfg: BuildConfig, stages=STAGES, log=None, allow_partial: bool = False) -> None:
    from retrace_jax.training.evaluate import MetricsLog

    os.makedirs(cfg.work, exist_ok=True)
    metrics = MetricsLog(cfg.work, tensorboard=False) if log is None else None
    log = log or metrics
    try:
        for stage in stages:
            if stage == "data":
                stage_data(cfg, log)
            elif stage == "tokenizer":
                stage_tokenizer(cfg, log)
            elif stage == "train":
                stage_train(cfg, log)
            elif stage == "export":
                stage_export(cfg, log, allow_partial)
            else:
                raise SystemExit(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")
    finally:
        if metrics is not None:
            metrics.close()


def parse_args(argv=None) -> tuple[BuildConfig, list[str], bool]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset of " + ",".join(STAGES))
    parser.add_argument("--allow-partial", action="store_true", help="export an unfinished run's last checkpoint")
    for field in dataclasses.fields(BuildConfig):
        kind = {"int | None": int, "int": int, "float": float, "str": str}[str(field.type)]
        parser.add_argument("--" + field.name.replace("_", "-"), type=kind, default=field.default)
    args = vars(parser.parse_args(argv))
    stages = [s for s in args.pop("stages").split(",") if s]
    allow_partial = args.pop("allow_partial")
    return BuildConfig(**args), stages, allow_partial


def main(argv=None) -> None:
    cfg, stages, allow_partial = parse_args(argv)
    build(cfg, stages, allow_partial=allow_partial)


if __name__ == "__main__":
    main()
