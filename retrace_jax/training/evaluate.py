"""Evaluation, export and metric logging for the training loop: τ with real speculative generation on
held-out prompts, the drafter export (gathered to process 0), the DFlash feature cache, and the metric
records written to ``metrics.jsonl`` and (optionally) TensorBoard event files."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from typing import Callable

import jax
import numpy as np
from flax import nnx

from retrace_jax.decoding.generation import generate
from retrace_jax.errors import ConfigError
from retrace_jax.io.atomic import write_error
from retrace_jax.io.checkpoints import save_drafter
from retrace_jax.models.draft_vocab import vocab_digest
from retrace_jax.models.layers import bfloat16_kernels, product_precision
from retrace_jax.parallel.distributed import barrier
from retrace_jax.training.data import SequenceData
from retrace_jax.training.dflash_loss import features_fn
from retrace_jax.training.feature_store import (
    FeatureStore,
    build_stores,
    fill_from_kept,
    kept_features_meta,
    store_key,
    top_k_key,
)


def evaluate(target, drafter, eval_ids, max_new_tokens: int, mesh, step: int) -> dict:
    """Real speculative generation on the held-out prompts: τ of the current drafter (every process
    calls this when the mesh spans processes). A ReTrace drafter is also run with its memory off
    (``eval_tau_memory_off``: its own DFlash path), so that the τ curve shows what the memory adds."""
    # The deprecated signature: the training config in place of max_new_tokens.
    if isinstance(max_new_tokens, dict) or hasattr(max_new_tokens, "eval_max_new_tokens"):
        max_new_tokens = max_new_tokens["eval_max_new_tokens"]
    out = generate(target, eval_ids, max_new_tokens, drafter=drafter, mesh=mesh)
    record = {"event": "eval", "step": step, "eval_tau": round(out.tau(), 4), "eval_tau_pooled": round(out.tau_pooled(), 4)}
    if drafter.cfg.retrace is not None:
        off = generate(target, eval_ids, max_new_tokens, drafter=drafter, mesh=mesh, use_retrace=False)
        record |= {"eval_tau_memory_off": round(off.tau(), 4), "eval_tau_memory_off_pooled": round(off.tau_pooled(), 4)}
    return record


def gathered(module):
    """The module with every parameter as a host array holding the whole value (all processes call it)."""
    if jax.process_count() == 1:
        return module
    from jax.experimental import multihost_utils

    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, multihost_utils.process_allgather(state, tiled=True))


def export_drafter(drafter, path: str) -> str:
    """Writes the drafter in the official layout from process 0, after checking every weight is finite."""
    host = gathered(drafter)
    if jax.process_index() == 0:
        bad = [".".join(map(str, p)) for p, v in nnx.to_flat_state(nnx.state(host))
               if not np.all(np.isfinite(np.asarray(jax.device_get(v.get_value()), np.float32)))]
        if bad:
            raise FloatingPointError(f"not exporting {path}: non-finite weights in {', '.join(bad[:5])}")
        save_drafter(host, path)
    barrier("retrace_jax.export")
    return path


FEATURE_CACHE_LIMIT = 16 << 30  # unused, still importable: the feature cache is on disk (feature_store.py)


def cached_features(target, layer_ids, data: SequenceData, batch_size: int, log, store_root: str,
                    target_id: str = "", precision: str = "float32", top_k: int = 0,
                    head_ids=None) -> list[FeatureStore]:
    """The frozen target's features of every sequence, computed once into a :class:`FeatureStore` under
    ``store_root`` (the prepared data's directory; one process) and reused by later runs. ``target_id``
    (the target's path) and ``precision`` (the products': ``"bfloat16"`` runs the pass with bfloat16
    operands, as ``train.target_precision`` asks) are part of the store's key. With ``top_k``
    (``train.distill_topk``) a second store holds the target's top-k of every position over the head
    vocabulary of the token ids ``head_ids`` (None: the whole vocabulary), ``ids`` and ``probs``
    (:func:`~retrace_jax.training.dflash_loss.teacher_top_k`), keyed by that vocabulary and ``top_k`` too;
    one target pass fills whichever of the two is unfinished. The feature store is copied from the
    regeneration's kept features instead (``data.keep_features``: :func:`fill_from_kept`) when they are
    those it needs. Returns the stores: the features, then the top-k."""
    lengths = [len(t) for t in data.tokens]
    key = store_key(target_id, layer_ids, data.seq_len, target.dtype, len(data), precision)
    stores = [FeatureStore(store_root, key, lengths, len(layer_ids) * target.cfg.hidden_size)]
    if top_k:
        vocab = None if head_ids is None else vocab_digest(head_ids)
        key = top_k_key(target_id, data.seq_len, target.dtype, len(data), precision, vocab, top_k)
        stores.append(FeatureStore(store_root, key, lengths, arrays={"ids": (top_k, np.int32),
                                                                     "probs": (top_k, np.float32)}, kind="topk"))
    free = shutil.disk_usage(store_root).free
    need = sum(store.nbytes for store in stores if store.done < len(data) and not os.path.exists(store.dir))
    if need > free:
        raise ConfigError(f"train.feature_cache needs {need / 2**30:.1f} GiB in {store_root}, which has "
                          f"{free / 2**30:.1f} GiB free; compute features online instead")
    width = len(layer_ids) * target.cfg.hidden_size
    kept = kept_features_meta(target_id, layer_ids, target.dtype, precision, width)
    if fill_from_kept(stores[0], data, kept, log) and all(store.done >= len(data) for store in stores):
        return stores
    fn = features_fn(bfloat16_kernels(target) if precision == "bfloat16" else target, layer_ids, top_k, head_ids)

    def values_of(tokens):
        with product_precision(precision):
            out = jax.device_get(fn(tokens))
        return (out[0], tuple(out[1:])) if top_k else (out,)

    build_stores(stores, values_of, lambda idx: data.rows(idx)[0], batch_size, log)
    return stores


class MetricsLog:
    """The ``log`` callable of a run: prints each record as a JSON line and, on process 0, appends it to
    ``{out}/metrics.jsonl`` and writes its numbers as TensorBoard scalars to ``{out}/tensorboard``
    (``tensorboard``: true, false, or auto = when tensorboardX is installed). Other processes print
    only (prefixed with their index) so that one file holds the run. ``out=None`` prints only, leaving a
    run's files alone (``train.py --stage export``). A record ``{"event": "warning", "message": ...}`` is
    printed as one ``warning: ...`` line on stderr instead. ``before_record`` is called before each record
    (``train.py`` raises a swallowed Ctrl-C there)."""

    def __init__(self, out: str | None, tensorboard: bool | str = "auto", echo: bool = True,
                 before_record: Callable[[], None] | None = None):
        self.echo, self.metrics, self.writer, self._open_writer = echo, None, None, None
        self.before_record = before_record
        self.process = jax.process_index()
        if self.process != 0 or out is None:
            return
        os.makedirs(out, exist_ok=True)
        self.metrics = open(os.path.join(out, "metrics.jsonl"), "a")
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                if tensorboard is True:
                    self.close()
                    raise ConfigError("train.tensorboard is true but tensorboardX is not installed: "
                                             "pip install 'retrace-jax[tensorboard]'") from None
                return
            # opened with the first record, so that a run refused at start leaves no empty event file
            self._open_writer = lambda: SummaryWriter(logdir=os.path.join(out, "tensorboard"))

    def __call__(self, record: dict) -> None:
        if self.before_record is not None:
            self.before_record()
        line = json.dumps(record)
        if record.get("event") == "warning":  # for people: one line on stderr (and the record in the file)
            if self.process == 0:
                print(f"warning: {record['message']}", file=sys.stderr, flush=True)
        elif self.echo:
            print(line if self.process == 0 else f"[process {self.process}] {line}", flush=True)
        if self.metrics is None:
            return
        try:
            self.metrics.write(line + "\n")
            self.metrics.flush()
        except OSError as err:  # a full disk: the error names the file
            raise write_error(err, f"could not write {self.metrics.name}") from err
        if self._open_writer is not None and "step" in record and record.get("event", "eval") == "eval":
            if self.writer is None:
                self.writer = self._open_writer()
            group = "eval" if record.get("event") == "eval" else "train"
            for key, value in record.items():
                if key not in ("step", "event") and isinstance(value, (int, float)) and not isinstance(value, bool) \
                        and math.isfinite(value):
                    self.writer.add_scalar(f"{group}/{key}", value, record["step"])
            self.writer.flush()

    def close(self) -> None:
        writer, self.writer, self._open_writer = self.writer, None, None
        metrics, self.metrics = self.metrics, None
        try:
            if writer is not None:
                writer.close()
        finally:
            if metrics is not None:
                try:
                    metrics.close()
                except OSError as err:
                    raise write_error(err, f"could not write {metrics.name}") from err
