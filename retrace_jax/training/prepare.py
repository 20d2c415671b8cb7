"""Data preparation for ``train.py``: prompts -> the target's own responses, in resumable shards.

With several processes each one regenerates only its share of the shards (shard ``i`` goes to process
``i % processes``) on its own devices; process 0 writes the manifest before and after. The shards are
the same whatever the number of processes, and an interrupted preparation resumes where it stopped.

The manifest records what the data is made of (:func:`data_settings`) and from which target
(:func:`target_identity`); :func:`check_prepared` refuses data made otherwise, at every stage.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np

from retrace_jax.decoding.generation import bucket, generate
from retrace_jax.io.checkpoints import load_drafter, load_target
from retrace_jax.io.digest import file_sha256
from retrace_jax.models.config import read_config_json
from retrace_jax.models.drafter import DrafterConfig
from retrace_jax.models.layers import bfloat16_kernels, product_precision
from retrace_jax.models.tiny import TINY_QWEN3, tiny_target
from retrace_jax.parallel.distributed import barrier
from retrace_jax.parallel.placement import shard_model
from retrace_jax.training.config import TrainConfig, as_config, new_drafter_config
from retrace_jax.training.data import (
    MANIFEST,
    UNRECORDED,
    DataError,
    PrepareSettings,
    begin_manifest,
    byte_encoder,
    chat_encoder,
    check_manifest,
    check_prompt_lengths,
    describe_differences,
    drop_long,
    finish_manifest,
    finished_shards,
    iter_prompt_ids,
    kept_features_path,
    load_tokenizer,
    prepare_shards,
    read_prompts,
    recorded_target,
    settings_differences,
    unrecorded,
    write_file,
)
from retrace_jax.training.feature_store import KEPT, kept_features_meta, read_kept_meta
from retrace_jax.training.lock import run_lock


def data_dir(cfg) -> str:
    return as_config(cfg).data_dir


def build_target(cfg, mesh=None):
    """The frozen target (placed on ``mesh`` when given) and its tokenizer (None for the tiny target)."""
    cfg = as_config(cfg)
    if cfg.target == "tiny":
        target = tiny_target(dtype=jnp.dtype(cfg.target_dtype))
        return (shard_model(target, mesh) if mesh is not None else target), None
    return load_target(cfg.target, dtype=cfg.target_dtype, mesh=mesh), load_tokenizer(cfg.target)


def prompt_ids(cfg: TrainConfig, vocab: int, tokenizer, log) -> list[list[int]]:
    """Training prompts followed by the held-out evaluation prompts, as token ids."""
    d = cfg.data
    n_eval = d.eval_prompts
    if d.prompts == "random":
        rng = np.random.RandomState(cfg.train.seed)
        return [rng.randint(0, vocab, (d.prompt_len,)).tolist() for _ in range(d.num_prompts + n_eval)]
    limit = None if d.num_prompts is None else d.num_prompts + n_eval
    encode = chat_encoder(tokenizer, d.thinking) if tokenizer is not None else byte_encoder(vocab)
    ids = iter_prompt_ids(read_prompts(d.prompts, None if d.drop_long_prompts else limit), encode)
    if d.drop_long_prompts:
        ids, dropped = drop_long(ids, d.max_prompt_len, limit)
        log({"event": "dropped_long_prompts", "kept": len(ids), "dropped": dropped, "max_prompt_len": d.max_prompt_len})
    else:
        check_prompt_lengths(ids, d.max_prompt_len)  # never cut (evaluation prompts included)
    return ids


def prepare(cfg, log=print) -> str:
    """Regenerates the training responses with the target; returns the data directory. Every process
    of a multi-process run calls this (each prepares its share). Holds the lock on ``cfg.out``
    (:mod:`retrace_jax.training.lock`)."""
    cfg = as_config(cfg)
    with run_lock(cfg.out):
        return _prepare(cfg, log)


def data_settings(cfg: TrainConfig, num_prompts: int | None = None) -> PrepareSettings:
    """What the configuration's prepared data is made of (``num_prompts``: the training prompts kept,
    known once the prompts are encoded). A prompt file that is not there is not fingerprinted: training
    from prepared data does not need it, and preparing says that it is missing."""
    d = cfg.data
    random = d.prompts == "random"
    digest = None if random else file_sha256(d.prompts)[:16] if os.path.isfile(d.prompts) else UNRECORDED
    return PrepareSettings(num_prompts=num_prompts, shard_size=d.shard_size, max_prompt_len=d.max_prompt_len,
                           max_new_tokens=d.max_new_tokens, temperature=d.temperature, source=str(d.prompts),
                           source_sha256=digest, requested_prompts=d.num_prompts, eval_prompts=d.eval_prompts,
                           drop_long_prompts=d.drop_long_prompts, prompt_len=d.prompt_len if random else None,
                           thinking=d.thinking, seed=cfg.train.seed if random else None)


def target_identity(cfg: TrainConfig) -> dict:
    """The target that prepared data comes from, as its manifest records it: the directory ("tiny" for
    the tiny random target), a digest of its ``config.json`` (another size or family) and
    ``target_dtype`` and ``target_precision`` (bfloat16 responses and products differ from float32's; a
    manifest written before ``precision`` was recorded had float32 products). Another directory is another target
    too: a model fine-tuned from the same base has the same ``config.json``."""
    hf = TINY_QWEN3.to_hf() if cfg.target == "tiny" else read_config_json(cfg.target)
    digest = hashlib.sha256(json.dumps(hf, sort_keys=True).encode()).hexdigest()[:16]
    return {"path": "tiny" if cfg.target == "tiny" else os.path.abspath(cfg.target), "config_sha256": digest,
            "dtype": cfg.target_dtype, "precision": cfg.target_precision}


def check_prepared(cfg, log=print, settings: PrepareSettings | None = None) -> PrepareSettings:
    """Refuses (``DataError``) prepared data in ``cfg.data_dir`` that was made with other settings than
    ``cfg`` asks for or from another target, before anything loads; warns (a ``log`` record) about what
    an earlier release's manifest does not record. Returns the settings (``settings``, or those of
    ``cfg``; their ``num_prompts`` is compared only when known)."""
    cfg = as_config(cfg)
    settings = settings or data_settings(cfg)
    if os.path.exists(os.path.join(cfg.data_dir, MANIFEST)):
        ignore = ("num_prompts",) if settings.num_prompts is None else ()
        target = target_identity(cfg)
        manifest = check_manifest(cfg.data_dir, settings, target, ignore)
        missing = unrecorded(manifest, settings, target, ignore)
        if missing:
            log({"event": "warning", "message": f"{os.path.join(cfg.data_dir, MANIFEST)} does not record "
                                                f"{', '.join(missing)} (an earlier release wrote it): they are not "
                                                f"checked; delete {cfg.data_dir} to prepare it again if they may "
                                                f"differ"})
    return settings



def kept_layer_ids(cfg: TrainConfig, target_cfg) -> tuple[int, ...]:
    """The target layers whose features the configuration's drafter reads: ``drafter.init``'s, or those of
    the new drafter training will build for ``target_cfg`` (``drafter.target_layer_ids``, the official
    default when null)."""
    if cfg.drafter.init:
        return tuple(DrafterConfig.from_hf(read_config_json(cfg.drafter.init)).target_layer_ids)
    return tuple(new_drafter_config(cfg, target_cfg).target_layer_ids)


def _check_kept_meta(out: str, meta: dict, finished: list[int], num_shards: int, log) -> None:
    """Refuses (``DataError``) to keep other features than the finished shards of ``out`` kept, while
    shards remain to regenerate (with none left there is nothing to keep: a warning); warns about finished
    shards that kept no features, for which training fills the feature store by a target pass."""
    without = [i for i in finished if not os.path.isfile(kept_features_path(out, i))]
    if without:
        log({"event": "warning", "message": f"{len(without)} finished shard(s) of {out} (the first: {without[0]}) kept "
                                            f"no features (prepared without data.keep_features): training fills "
                                            f"the feature store by a pass of the target, not from the kept features"})
    saved = read_kept_meta(out)
    if saved is not None and saved != meta:
        differ = describe_differences(settings_differences(saved, meta))
        if len(finished) < num_shards:
            raise DataError(f"{os.path.join(out, KEPT)}: the shards keep other features ({differ}); use a new data "
                            f"directory, or delete its shard_*.features.npy files and {KEPT} to keep these")
        log({"event": "warning", "message": f"{out} is fully prepared and its shards keep other features than "
                                            f"data.keep_features asks for ({differ}): training fills the feature "
                                            f"store by a pass of the target"})


REUSE_SAME = ("shard_size", "max_new_tokens", "temperature", "thinking", "seed")  # what makes a shard's responses


def check_reuse_source(source: str, out: str, settings: PrepareSettings, target: dict) -> dict:
    """The manifest of ``data.reuse_from``'s preparation ``source``, refused (``DataError``) where it is none,
    is ``out`` itself, or was made by another ``target`` or with other settings of :data:`REUSE_SAME`."""
    if os.path.realpath(source) == os.path.realpath(out):
        raise DataError(f"data.reuse_from: {source} is this preparation's own directory (data.dir)")
    manifest_path = os.path.join(source, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise DataError(f"data.reuse_from: {source} holds no prepared data (no {MANIFEST})")
    with open(manifest_path) as f:
        theirs = json.load(f)
    ours = settings.record()
    diff = settings_differences({k: theirs["settings"][k] for k in REUSE_SAME if k in theirs["settings"]},
                                {k: ours.get(k) for k in REUSE_SAME})
    saved = recorded_target(theirs)
    if saved is not None:
        diff.update(settings_differences(saved, target))
    else:
        diff["target"] = ("not recorded", target["path"])
    if diff:
        raise DataError(f"data.reuse_from: {source} was prepared otherwise ({describe_differences(diff)}); its "
                        f"responses are not what this preparation would regenerate")
    return theirs


def reuse_shards(source: str, theirs: dict, out: str, train_ids, shard_size: int, kept: dict | None, log) -> list[int]:
    """``data.reuse_from``: copies into ``out`` the finished shards of the preparation ``source`` (its
    manifest ``theirs``, from :func:`check_reuse_source`) that regeneration would write again: each holding
    exactly ``train_ids``' prompts of its shard in their order (compared token for token), with their kept
    features where ``kept`` (this preparation's ``data.keep_features``) asks for them, of the same layers. A
    file is a hard link where the file system allows (no disk taken), a copy otherwise, a shard's features
    before the shard (whose file marks it done). Shards that ``out`` has already, or that differ, are left
    to regeneration. Returns the shards copied."""
    features_there = kept is not None and read_kept_meta(source) == kept
    num_shards = -(-len(train_ids) // shard_size)
    have = set(finished_shards(out, {"done": []}, num_shards))
    copied, differ = [], []
    for i in finished_shards(source, theirs, num_shards):  # those on disk too (a preparation still going)
        if i in have:
            continue
        shard = os.path.join(source, f"shard_{i:05d}.npz")
        if not _holds_prompts(shard, train_ids[i * shard_size:(i + 1) * shard_size]) or (
                kept is not None and not (features_there and os.path.isfile(kept_features_path(source, i)))):
            differ.append(i)
            continue
        if kept is not None:
            _link_or_copy(kept_features_path(source, i), kept_features_path(out, i))
        _link_or_copy(shard, os.path.join(out, f"shard_{i:05d}.npz"))
        copied.append(i)
    log({"event": "reused_shards", "from": source, "shards": len(copied), "differ": len(differ),
         **({"first_differing": differ[0]} if differ else {})})
    if not copied and len(have) < num_shards:
        log({"event": "warning", "message": f"data.reuse_from: no shard of {source} holds this preparation's prompts"
                                            f"{' with the features it keeps' if kept is not None else ''}: they are "
                                            f"all regenerated"})
    return copied


def _holds_prompts(path: str, prompts) -> bool:
    """Whether the shard at ``path`` holds exactly ``prompts``, in order, each followed by its response."""
    if not os.path.isfile(path):
        return False
    with np.load(path) as z:
        tokens, mask, offsets = z["tokens"], z["loss_mask"], z["offsets"]
    if len(offsets) - 1 != len(prompts):
        return False
    for j, p in enumerate(prompts):
        seq, m = tokens[offsets[j]:offsets[j + 1]], mask[offsets[j]:offsets[j + 1]]
        n = len(p)
        if len(seq) < n or m[:n].any() or not np.array_equal(seq[:n], np.asarray(p, seq.dtype)) or (
                len(seq) > n and not m[n:].all()):
            return False
    return True


def _link_or_copy(src: str, dst: str) -> None:
    """``src`` at ``dst``, in one rename: a hard link, or a copy where the file system has none (another
    device); a failed copy (a full disk) is an ``OSError`` naming ``dst``."""
    def write(tmp):
        if os.path.lexists(tmp):
            os.remove(tmp)
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)

    write_file(dst, ".reuse.tmp", write)


def _prepare(cfg: TrainConfig, log) -> str:
    d = cfg.data
    nproc, pid = jax.process_count(), jax.process_index()
    settings = check_prepared(cfg, log)  # data made otherwise is refused before the target loads
    target, tokenizer = build_target(cfg)  # each process regenerates on its own devices
    if cfg.target_precision == "bfloat16":
        target = bfloat16_kernels(target)
    ids = prompt_ids(cfg, target.cfg.vocab_size, tokenizer, log)
    n_eval = d.eval_prompts
    if len(ids) <= n_eval:
        raise DataError(f"{len(ids)} prompts leave none for training after holding out {n_eval} for evaluation")
    train_ids, eval_ids = ids[: len(ids) - n_eval], ids[len(ids) - n_eval :]
    out = cfg.data_dir
    settings = dataclasses.replace(settings, num_prompts=len(train_ids))
    target_id = target_identity(cfg)
    eval_path = os.path.join(out, "eval_prompts.json")
    manifest = check_manifest(out, settings, target_id)  # every process checks (and fails alike) before any writes
    reused = check_reuse_source(d.reuse_from, out, settings, target_id) if d.reuse_from is not None else None
    _check_eval_prompts(eval_path, eval_ids)
    layers, kept = None, None
    if d.keep_features:
        layers = kept_layer_ids(cfg, target.cfg)
        kept = kept_features_meta(cfg.target, layers, target.dtype, cfg.target_precision,
                                  len(layers) * target.cfg.hidden_size)
        num_shards = -(-len(train_ids) // d.shard_size)
        finished = finished_shards(out, manifest or {"done": []}, num_shards) if os.path.isdir(out) else []
        _check_kept_meta(out, kept, finished, num_shards, log)
    if pid == 0:
        os.makedirs(out, exist_ok=True)
        _write_eval_prompts(eval_path, eval_ids)
        if kept is not None and read_kept_meta(out) is None:
            with open(os.path.join(out, KEPT + ".tmp"), "w") as f:
                json.dump(kept, f)
            os.replace(os.path.join(out, KEPT + ".tmp"), os.path.join(out, KEPT))
        if reused is not None:
            reuse_shards(d.reuse_from, reused, out, train_ids, d.shard_size, kept, log)
        if nproc > 1:
            begin_manifest(out, settings, target=target_id)
    barrier("retrace_jax.prepare.begin")
    drafter = load_drafter(d.drafter, target) if d.drafter else None
    stops = [t for t in ([tokenizer.eos_token_id] if tokenizer is not None else []) if t is not None]

    def generate_fn(chunk, first_index):
        # The shard as one stream through gen_batch_size rows (generate's slots): a row whose response
        # ends takes the next prompt at once, so no row waits for the longest response of a batch, and a
        # refilled row's prefill costs what its own prompt costs. Prompt j of the shard samples with the
        # stream fold_in(PRNGKey(first_index), j): distinct in every shard, whatever gen_batch_size is.
        # data.keep_features: the target's features of every position too, as the stream computes them.
        with product_precision(cfg.target_precision):
            out = generate(target, chunk, d.max_new_tokens, drafter=drafter, temperature=d.temperature,
                           stop_token_ids=stops, seed=first_index, slots=min(d.gen_batch_size, bucket(len(chunk), 1)),
                           feature_layers=layers)
        return out.tokens if layers is None else (out.tokens, out.features)

    start = time.perf_counter()
    manifest = prepare_shards(out, train_ids, settings, generate_fn, progress=pid == 0, process_index=pid,
                              process_count=nproc, target=target_id)
    barrier("retrace_jax.prepare.end")
    if nproc > 1:
        if pid == 0:
            manifest = finish_manifest(out, -(-len(train_ids) // d.shard_size))
        barrier("retrace_jax.prepare.manifest")
        with open(os.path.join(out, "manifest.json")) as f:
            manifest = json.load(f)
    log({"event": "prepared", "dir": out, "shards": len(manifest["done"]), "prompts": len(train_ids),
         "eval_prompts": len(eval_ids), "processes": nproc, "seconds": round(time.perf_counter() - start, 1)})
    return out


def _check_eval_prompts(path: str, eval_ids) -> None:
    if os.path.exists(path):
        with open(path) as f:
            if json.load(f) != eval_ids:
                raise DataError(f"{path} holds other evaluation prompts; use a new data directory")


def _write_eval_prompts(path: str, eval_ids) -> None:
    if os.path.exists(path):
        return
    with open(path + ".tmp", "w") as f:
        json.dump(eval_ids, f)
    os.replace(path + ".tmp", path)
