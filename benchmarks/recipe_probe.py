"""The recipe probe: train a drafter from a configuration for its short, fixed budget, then measure how
well it fits, lever by lever.

    # the data first (resumable): train.py --config configs/qwen25coder05_probe.yaml --stage prepare
    python benchmarks/recipe_probe.py run base --config configs/qwen25coder05_probe.yaml
    python benchmarks/recipe_probe.py run b8 --config configs/qwen25coder05_probe.yaml --set drafter.block_size=8
    python benchmarks/recipe_probe.py table runs/probes/base/probe.json runs/probes/b8/probe.json --baseline base
    # probes while the data is still being prepared: all on one fixed snapshot of its first shards
    python benchmarks/recipe_probe.py snapshot runs/qwen25coder05_code_data_bf16 runs/probe_data_8 --shards 8
    # minutes: how fast a recipe memorises the same 4 sequences (a screen before a probe)
    python benchmarks/recipe_probe.py memorize qk --config configs/qwen25coder05_probe.yaml \
        --set data.dir=runs/probe_data_8 --set drafter.init_qk_norm=target

``run NAME`` trains into ``ROOT/NAME`` (``train.py --stage train``: the prepared data of the configuration,
resumed exactly when rerun), then measures its drafter on two sets of sequences, each a prompt and the
target's greedy response in float32 (made once and kept in ``ROOT/_sets``):

- **dev**: prompts that no training prompt comes from (``--dev``, default the held-out package pieces
  ``code_heldout.jsonl``, lines ``--dev-lines``; the first 64 lines are the final evaluation's, so the
  default takes lines 128-191): the set every lever is chosen on; HumanEval is kept for the final drafters.
- **fit**: ``--fit`` prompts spread evenly over the configuration's training prompts (the fit gap: a drafter
  short of data fits these better than dev; one short of recipe fits neither).

On each, at every block size of ``--blocks``, blocks are drafted at up to ``--anchors`` anchors spread over
each response from the target's float32 features (:mod:`retrace_jax.training.probe`: for a greedy target
this is exactly what a speculative round starting there accepts), giving each sequence's τ and the
per-slot acceptance (slot k: the share of blocks that reach slot k whose slot k is accepted), and the share
of the responses' tokens that the draft vocabulary holds. The result,
``ROOT/NAME/probe.json`` (``--out`` copies it), also holds the training time and last logged metrics.

``curve NAME --every K`` is the long run: it trains the configuration to ``train.steps`` in segments of K
steps, each resumed from the last one's checkpoint, and measures the drafter after each as ``run`` does,
into ``ROOT/NAME/curve.json`` with the tokens seen so far; rerun, it goes on where it stopped. ``plot``
draws dev and fit τ of curves against steps and tokens seen. ``points CURVE [--against OTHER]`` prints a
curve's points as a table, with paired 95% intervals of dev and fit τ against the previous point and of
dev τ against another curve's point of the same step, or with ``--against-step STEP`` its point at STEP (a
checkpoint that ships, say; only where both record the same dev sequences: each measured set carries a
digest of its tokens). ``publish CURVE DEST`` copies a run's curve to its committed
place, refusing where that would drop a point DEST holds (a run started again on a new machine).

``table`` prints one row per probe: dev τ at each block, its ratio to the baseline's at every block with a
95% bootstrap interval over dev sequences (paired: every probe sees the same sequences), dev slot
acceptance 1-4 at the largest block, fit τ, and the fit gap.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from benchmarks.report import write_json  # noqa: E402
from benchmarks.retrace_positions import paired_ratio  # noqa: E402

DEV = os.path.expanduser("~/.cache/retrace_jax/data/code_heldout.jsonl")


def _lines(spec: str) -> slice:
    start, sep, stop = spec.partition(":")
    if not sep or not start.isdigit() or not stop.isdigit() or int(stop) <= int(start):
        raise SystemExit(f"--dev-lines expects START:STOP (0-based, STOP > START), got {spec!r}")
    return slice(int(start), int(stop))


def sequences_of(target, prompts: list[list[int]], max_new_tokens: int, stops: list[int], batch_size: int = 32):
    """``tokens [N, S]`` and ``loss_mask [N, S]`` of each prompt and the target's greedy float32
    response (prompts whose response is shorter than a block are kept: they simply hold no anchors)."""
    import retrace_jax as rj

    rows = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        out = rj.generate(target, chunk, max_new_tokens, stop_token_ids=stops)
        rows += [(list(p), list(r)) for p, r in zip(chunk, out.tokens)]
    length = max(len(p) + len(r) for p, r in rows)
    tokens = np.zeros((len(rows), length), np.int32)
    mask = np.zeros_like(tokens)
    for n, (p, r) in enumerate(rows):
        tokens[n, : len(p) + len(r)] = p + r
        mask[n, len(p) : len(p) + len(r)] = 1
    return tokens, mask


def cached(path: str, build):
    """The arrays of ``path`` (an ``.npz``), built and written atomically by ``build()`` when absent."""
    if os.path.exists(path):
        with np.load(path) as z:
            return {k: z[k] for k in z.files}
    arrays = build()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp.npz"  # one per process: two probes may build the same set at once
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
    return arrays


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def evaluation_sets(cfg, target, tokenizer, args) -> dict[str, dict]:
    """``{"dev": {...}, "fit": {...}}``: tokens and loss masks of both sets, kept in ``ROOT/_sets``."""
    from retrace_jax.training.data import SequenceData, chat_encoder, iter_prompt_ids, read_prompts, spread_indices

    stops = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    lines = _lines(args.dev_lines)
    new = cfg.data.max_new_tokens
    dev_key = {"target": os.path.abspath(cfg.target), "prompts": os.path.abspath(args.dev), "lines": args.dev_lines,
               "new": new}

    def dev():
        prompts = read_prompts(args.dev, lines.stop)[lines]
        if len(prompts) < lines.stop - lines.start:
            raise SystemExit(f"{args.dev} has {lines.start + len(prompts)} prompts, fewer than --dev-lines asks")
        tokens, mask = sequences_of(target, iter_prompt_ids(prompts, chat_encoder(tokenizer)), new, stops)
        return {"tokens": tokens, "loss_mask": mask}

    data = SequenceData(cfg.data_dir, 1 << 30)
    picked = spread_indices(len(data), args.fit)
    fit_key = {"target": os.path.abspath(cfg.target), "data": os.path.abspath(cfg.data_dir), "picked": picked.tolist(),
               "new": new}

    def fit():
        prompts = [data.tokens[i][: int(np.argmax(data.mask[i]))].tolist() for i in picked]
        tokens, mask = sequences_of(target, prompts, new, stops)
        return {"tokens": tokens, "loss_mask": mask, "index": picked}

    sets = os.path.join(args.root, "_sets")
    return {"dev": cached(os.path.join(sets, f"dev-{_digest(dev_key)}.npz"), dev),
            "fit": cached(os.path.join(sets, f"fit-{_digest(fit_key)}.npz"), fit)}


def features_of(target, tokens, layer_ids, root: str, key: dict, batch_size: int = 8):
    """The target's float32 features ``[N, S, F]`` at ``layer_ids`` for ``tokens``, kept in ``root``."""
    from retrace_jax.training.dflash_loss import features_fn
    from retrace_jax.training.probe import in_padded_batches

    def build():
        return {"features": in_padded_batches(features_fn(target, layer_ids), (tokens,), batch_size)}

    return cached(os.path.join(root, f"features-{_digest(key)}.npz"), build)["features"]


def measure(drafter, target, sets: dict, blocks: list[int], anchors: int, root: str, target_path: str) -> dict:
    from retrace_jax.training.probe import teacher_forced_acceptance

    out = {}
    layers = list(drafter.cfg.target_layer_ids)
    for name, s in sets.items():
        feats = features_of(target, s["tokens"], layers, os.path.join(root, "_sets"),
                            {"target": target_path, "set": _digest(s["tokens"].tolist()), "layers": layers})
        per_block = {}
        for w in blocks:
            a = teacher_forced_acceptance(drafter, target, s["tokens"], s["loss_mask"], feats, w, anchors)
            per_block[str(w)] = {"tau": float(np.nanmean(a.tau)), "tau_per_sequence": a.tau.tolist(),
                                 "blocks": int(a.blocks.sum()), "slot_acceptance": a.slot_acceptance.tolist(),
                                 "slot_reached": a.slot_reached.tolist()}
        out[name] = {"sequences": len(s["tokens"]), "digest": _digest(s["tokens"].tolist()), "blocks": per_block,
                     "draft_vocab_coverage": vocab_coverage(drafter, s["tokens"], s["loss_mask"])}
    return out


def vocab_coverage(drafter, tokens, loss_mask) -> float | None:
    """The share of the set's response tokens that the drafter's draft vocabulary holds (None: it drafts
    over the whole vocabulary)."""
    import jax

    from retrace_jax.models.draft_vocab import coverage, token_counts

    vocab = getattr(drafter, "draft_vocab", None)
    if vocab is None:
        return None
    counts = token_counts(list(tokens), list(loss_mask), drafter.cfg.vocab_size)
    return coverage(counts, np.asarray(jax.device_get(vocab.get_value())))


def last_metrics(out_dir: str) -> dict:
    """The last logged training metrics of a run (loss, slot accuracies) from its ``metrics.jsonl``."""
    last = {}
    path = os.path.join(out_dir, "metrics.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                if "loss" in record and "step" in record:
                    last = record
    return last


def run(args) -> dict:
    import train as train_cli

    import retrace_jax as rj
    from retrace_jax.training.config import load_config
    from retrace_jax.training.data import load_tokenizer

    out_dir = os.path.join(args.root, args.name)
    sets_args = list(args.set) + [f"out={out_dir}"]
    cfg = load_config(args.config, sets_args)
    result_path = os.path.join(out_dir, "probe.json")
    settings_path = os.path.join(out_dir, "probe_settings.json")
    settings = {"config": os.path.relpath(os.path.abspath(args.config), ROOT), "set": list(args.set)}
    if os.path.exists(settings_path):
        with open(settings_path) as f:
            saved = json.load(f)
        if args.again:  # train and measure anew: what the earlier probe left goes
            import shutil

            for name in ("drafter", "drafter.versions", "checkpoints", "tensorboard"):
                shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
            for name in ("metrics.jsonl", "probe.json", "probe_settings.json"):
                if os.path.exists(os.path.join(out_dir, name)):
                    os.remove(os.path.join(out_dir, name))
        elif saved != settings:
            raise SystemExit(f"{out_dir} holds the probe of {saved['config']} with {saved['set']}; use another NAME, "
                             f"or --again to train and measure anew")
        elif os.path.exists(result_path):  # measured already: the table of that result
            with open(result_path) as f:
                result = json.load(f)
            write_json(result, args.out)
            print_table([result], args.name)
            return result
    write_json(settings, settings_path)
    start = time.perf_counter()
    if not os.path.exists(os.path.join(out_dir, "drafter")):
        train_cli.main(["--config", args.config, "--stage", "train"] + [x for s in sets_args for x in ("--set", s)])
    train_s = time.perf_counter() - start
    target = rj.load_target(cfg.target, dtype="float32")
    tokenizer = load_tokenizer(cfg.target)
    drafter = rj.load_drafter(os.path.join(out_dir, "drafter"), target, dtype="float32")
    sets = evaluation_sets(cfg, target, tokenizer, args)
    blocks = [int(b) for b in args.blocks.split(",")]
    metrics = last_metrics(out_dir)
    times = [r.get("seconds") for r in _records(out_dir) if r.get("event") == "done"]
    result = {"name": args.name, "config": os.path.relpath(os.path.abspath(args.config), ROOT), "set": list(args.set),
              "steps": cfg.train.steps, "batch_size": cfg.train.batch_size, "block_size": drafter.cfg.block_size,
              "train_seconds_this_call": round(train_s, 1), "train_done": times[-1] if times else None,
              "last_metrics": metrics, "anchors": args.anchors, "dev": args.dev, "dev_lines": args.dev_lines,
              **measure(drafter, target, sets, blocks, args.anchors, args.root, os.path.abspath(cfg.target))}
    write_json(result, result_path)
    write_json(result, args.out)
    print_table([result], args.name)
    return result


def curve_points(steps: int, every: int) -> list[int]:
    """The steps a curve measures at: every ``every`` steps and the last."""
    return sorted(set(range(every, steps + 1, every)) | {steps})


def curve(args) -> dict:
    """``curve NAME``: trains ``ROOT/NAME`` from the configuration to ``train.steps`` in segments of
    ``--every`` steps (``train.stop_after``: each segment resumes from the last one's checkpoint) and after
    each measures the checkpoint's drafter as ``run`` measures a probe, on the same dev and fit sets. Each
    point (its step, the tokens and response tokens seen since step 0, dev and fit τ per block with their
    per-sequence values, the slot acceptances) goes to ``ROOT/NAME/curve.json`` as soon as it is measured,
    so rerunning the same command goes on where it stopped, in another session too. ``--until STEP`` stops
    after the points up to STEP: a lever compared with another curve at its first points. A branch
    (``train.branch_from``, ``train.branch_step``) measures only the points after its branch step."""
    import shutil

    import train as train_cli

    import retrace_jax as rj
    from retrace_jax.training.checkpoints import Checkpoints
    from retrace_jax.training.config import load_config
    from retrace_jax.training.data import SequenceData, load_tokenizer

    out_dir = os.path.join(args.root, args.name)
    sets_args = list(args.set) + [f"out={out_dir}"]
    cfg = load_config(args.config, sets_args)
    t = cfg.train
    settings = {"config": os.path.relpath(os.path.abspath(args.config), ROOT), "set": list(args.set),
                "every": args.every, "dev": args.dev, "dev_lines": args.dev_lines, "fit": args.fit,
                "blocks": args.blocks, "anchors": args.anchors}
    settings_path, path = os.path.join(out_dir, "curve_settings.json"), os.path.join(out_dir, "curve.json")
    if os.path.exists(settings_path):
        with open(settings_path) as f:
            saved = json.load(f)
        if saved != settings:
            diff = {k: (saved.get(k), v) for k, v in settings.items() if saved.get(k) != v}
            raise SystemExit(f"{out_dir} holds a curve of other settings ({diff}: then, now); use another NAME")
    elif os.path.exists(os.path.join(out_dir, "checkpoints")):
        raise SystemExit(f"{out_dir} holds a run that is not a curve's; use another NAME")
    write_json(settings, settings_path)
    points = []
    if os.path.exists(path):
        with open(path) as f:
            points = json.load(f)["points"]
    done = {p["step"] for p in points}
    first = t.branch_step or 0  # a branch (train.branch_from) trains, and so measures, only past its start
    todo = [s for s in curve_points(t.steps, args.every)
            if s > first and s not in done and (args.until is None or s <= args.until)]
    train_args = ["--config", args.config] + [x for s in sets_args for x in ("--set", s)]
    data = SequenceData(cfg.data_dir, t.seq_len)
    blocks = [int(b) for b in args.blocks.split(",")]
    target = sets = None

    def saved_steps() -> list[int]:
        if not os.path.isdir(os.path.join(out_dir, "checkpoints")):
            return []
        ckpts = Checkpoints(os.path.join(out_dir, "checkpoints"), keep=t.keep_checkpoints, read_only=True)
        try:
            return ckpts.all_steps()
        finally:
            ckpts.close()

    for step in todo:
        latest = max(saved_steps(), default=first)
        if latest < step:
            train_cli.main(train_args + ["--stage", "train", "--set", f"train.stop_after={step - latest}"])
        if step not in saved_steps():  # stopped between training past it and measuring it, and its checkpoint is gone since
            print(f"step {step}: no checkpoint left to measure; the curve goes on without it", file=sys.stderr)
            continue
        drafter_dir = train_cli.main(train_args + ["--stage", "export", "--step", str(step)])
        if target is None:
            target = rj.load_target(cfg.target, dtype="float32")
            sets = evaluation_sets(cfg, target, load_tokenizer(cfg.target), args)
        drafter = rj.load_drafter(drafter_dir, target, dtype="float32")
        tokens, response = data.seen(step, t.batch_size, t.seed, t.length_buckets)
        point = {"step": step, "tokens_seen": tokens, "response_tokens_seen": response,
                 **measure(drafter, target, sets, blocks, args.anchors, args.root, os.path.abspath(cfg.target))}
        points = sorted(points + [point], key=lambda p: p["step"])
        write_json({"name": args.name, **settings, "steps": t.steps, "batch_size": t.batch_size, "points": points},
                   path)
        if not args.keep_drafters:  # an exported drafter: a link to the newest of its versions
            versions = f"{drafter_dir}.versions"
            if os.path.islink(drafter_dir):
                os.remove(drafter_dir)
            else:
                shutil.rmtree(drafter_dir)
            shutil.rmtree(versions, ignore_errors=True)
        b = str(blocks[-1])
        print(json.dumps({"event": "curve", "step": step, "tokens_seen": tokens,
                          f"dev_tau@{b}": round(point["dev"]["blocks"][b]["tau"], 4),
                          f"fit_tau@{b}": round(point["fit"]["blocks"][b]["tau"], 4)}), flush=True)
    with open(path) as f:
        return json.load(f)


def _branch_of(curve: dict) -> tuple[str, int] | None:
    """``(parent run name, branch step)`` of a branch's curve (``train.branch_from`` and ``train.branch_step``
    among its ``--set`` values), or None."""
    given = dict(s.split("=", 1) for s in curve.get("set", []) if "=" in s)
    if "train.branch_from" not in given or "train.branch_step" not in given:
        return None
    return os.path.basename(os.path.normpath(given["train.branch_from"])), int(given["train.branch_step"])


def plot(paths: list[str], out: str, block: int | None = None) -> None:
    """Dev τ (solid) and fit τ (dashed) of each curve against steps and against tokens seen. A branch's curve
    (a cooldown, ``train.branch_from``) starts at its parent's point of the branch step where the parent is
    plotted with a point there."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = []
    for path in paths:
        with open(path) as f:
            curves.append(json.load(f))
    by_name = {c["name"]: c for c in curves}
    fig, axes = plt.subplots(1, 2, figsize=(12.5, 4.2), sharey=True)
    for c in curves:
        pts = c["points"]
        if not pts:
            continue
        b = str(block if block is not None else max(int(k) for k in pts[0]["dev"]["blocks"]))
        branch = _branch_of(c)
        if branch and branch[0] in by_name:
            start = [p for p in by_name[branch[0]]["points"] if p["step"] == branch[1] and b in p["dev"]["blocks"]]
            pts = start + pts
        for ax, key in zip(axes, ("step", "tokens_seen")):
            x = [p[key] for p in pts]
            line, = ax.plot(x, [p["dev"]["blocks"][b]["tau"] for p in pts], marker="o", label=f"{c['name']} dev")
            ax.plot(x, [p["fit"]["blocks"][b]["tau"] for p in pts], ls="--", color=line.get_color(),
                    label=f"{c['name']} fit")
        axes[0].set_ylabel(f"τ at block {b} (teacher-forced, greedy)")
    axes[0].set_xlabel("training steps")
    axes[1].set_xlabel("tokens seen")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=120, bbox_inches="tight")
    print(out)


def sets_only(args) -> None:
    """Builds the dev and fit sets and their float32 features at the configuration's drafter layers (what
    ``run`` would build first), e.g. while the data for the first probe is still being prepared."""
    import retrace_jax as rj
    from retrace_jax.training.config import load_config
    from retrace_jax.training.data import load_tokenizer

    cfg = load_config(args.config, list(args.set))
    target = rj.load_target(cfg.target, dtype="float32")
    sets = evaluation_sets(cfg, target, load_tokenizer(cfg.target), args)
    layers = cfg.drafter.target_layer_ids
    if layers is None:  # the official default, as init_drafter chooses it
        from retrace_jax.models.drafter import default_target_layer_ids

        layers = default_target_layer_ids(target.cfg.num_layers, cfg.drafter.num_layers)
    layers = [int(x) for x in layers]
    for s in sets.values():
        features_of(target, s["tokens"], layers, os.path.join(args.root, "_sets"),
                    {"target": os.path.abspath(cfg.target), "set": _digest(s["tokens"].tolist()), "layers": layers})
    print(f"sets in {os.path.join(args.root, '_sets')}: " + ", ".join(f"{k} {len(v['tokens'])} sequences"
                                                                     for k, v in sets.items()))


def memorize(args) -> dict:
    """Trains a new drafter of the configuration on the same ``--sequences`` training sequences at every step
    for ``--steps`` steps (the configuration's optimizer and schedule over that many steps, anchors drawn
    anew each step) and logs the loss, the slot accuracies and the τ they imply on that batch every
    ``--every`` steps: how fast a recipe can fit data it sees again and again, a screen of minutes for
    what keeps a drafter from fitting (a recipe that cannot memorise a few sequences will not fit
    thousands). Writes ``ROOT/_memorize/NAME.json``; nothing is exported or checkpointed."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from retrace_jax.models.draft_vocab import draft_vocab_ids
    from retrace_jax.training import loop
    from retrace_jax.training.config import load_config
    from retrace_jax.training.evaluate import cached_features
    from retrace_jax.training.step import make_train_step

    cfg = load_config(args.config, list(args.set) + [f"train.steps={args.steps}",
                                                     f"train.batch_size={args.sequences}",
                                                     f"out={os.path.join(args.root, '_memorize', args.name)}"])
    events = []
    setup = loop._setup(cfg, events.append)
    t = cfg.train
    data = setup.data
    idx = np.asarray(data.indices(0, args.sequences, t.seed))  # one batch of the first epoch's order
    tokens, mask, _ = data.rows(idx, None)
    batch = [jnp.asarray(tokens), jnp.asarray(mask)]
    if t.feature_cache:
        stores = cached_features(setup.target, setup.drafter.cfg.target_layer_ids, data, t.batch_size,
                                 events.append, cfg.data_dir, cfg.target, precision=cfg.target_precision,
                                 top_k=t.distill_topk, head_ids=draft_vocab_ids(setup.drafter))
        batch += [jnp.asarray(x) for store in stores for x in store.get_all(idx, None)]
    optimizer, drafter_def, drafter_state, fixed, opt_state = loop._trainable(cfg, setup.drafter, None)
    target_def, target_state = nnx.split(setup.target)
    step_fn = make_train_step(target_def, drafter_def, optimizer, loop.step_options(cfg),
                              precomputed_features=t.feature_cache, drafter_fixed=fixed)
    curve, start = [], time.perf_counter()
    for step in range(args.steps):
        drafter_state, opt_state, m = step_fn(target_state, drafter_state, opt_state, *batch[:2], jnp.int32(step),
                                              jnp.uint32(t.seed), *batch[2:])
        if (step + 1) % args.every == 0 or step + 1 == args.steps:
            m = jax.device_get(m)
            row = {"step": step + 1, "loss": round(float(m["loss"]), 4), "tau": round(float(m["tau"]), 4),
                   "slot_accuracy": [round(float(x), 4) for x in m["slot_accuracy"][1:5]],
                   "seconds": round(time.perf_counter() - start, 1)}
            curve.append(row)
            print(json.dumps(row), flush=True)
    result = {"name": args.name, "config": os.path.relpath(os.path.abspath(args.config), ROOT), "set": list(args.set),
              "sequences": args.sequences, "steps": args.steps, "indices": idx.tolist(), "curve": curve,
              "events": [e for e in events if e.get("event") == "layer_statistics"]}
    write_json(result, os.path.join(args.root, "_memorize", f"{args.name}.json"))
    return result


def _records(out_dir: str) -> list[dict]:
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def print_table(results: list[dict], baseline: str) -> list[dict]:
    """One row per probe (see the module's docstring); returns the rows."""
    base = next((r for r in results if r["name"] == baseline), None)
    if base is None:
        raise SystemExit(f"--baseline {baseline!r} is none of the probes ({', '.join(r['name'] for r in results)})")
    blocks = sorted({int(b) for r in results for b in r["dev"]["blocks"]})
    head = ["probe", "steps"] + [f"dev τ@{b}" for b in blocks] + [f"/ {baseline} @{b}" for b in blocks]
    head += [f"dev slot acc 1-4 @{blocks[-1]}", f"fit τ@{blocks[-1]}", "fit / dev"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    rows = []
    for r in results:
        row = {"name": r["name"], "set": r["set"]}
        cells = [r["name"], str(r["steps"])]
        for b in blocks:
            d = r["dev"]["blocks"].get(str(b))
            cells.append(f"{d['tau']:.3f}" if d else "")
        for b in blocks:
            d, bd = r["dev"]["blocks"].get(str(b)), base["dev"]["blocks"].get(str(b))
            if not d or not bd:
                cells.append("")
                continue
            ratio = paired_ratio(np.asarray(d["tau_per_sequence"]), np.asarray(bd["tau_per_sequence"]))
            row[f"ratio@{b}"] = ratio
            cells.append(f"{ratio['ratio']:.3f} [{ratio['low']:.3f}, {ratio['high']:.3f}]" if ratio["prompts"] else
                         "no sequence with a block")
        d, f = r["dev"]["blocks"].get(str(blocks[-1])), r["fit"]["blocks"].get(str(blocks[-1]))
        cells.append(" / ".join(f"{x:.2f}" for x in d["slot_acceptance"][:4]) if d else "")
        cells.append(f"{f['tau']:.3f}" if f else "")
        cells.append(f"{f['tau'] / d['tau']:.3f}" if f and d else "")
        print("| " + " | ".join(cells) + " |")
        rows.append(row)
    return rows


def _paired(a: dict, b: dict, name: str, block: str, same_run: bool = False) -> dict | None:
    """The paired ratio of two measurements' per-sequence τ on set ``name`` at ``block``, or None when they
    are not known to be of the same sequences: both must record the set's digest, and the same one, except
    for two points of one curve (``same_run``: its sets are fixed), which older curves did not record."""
    x, y = a[name]["blocks"].get(block), b[name]["blocks"].get(block)
    da, db = a[name].get("digest"), b[name].get("digest")
    same = da == db if da and db else same_run and not da and not db
    if not x or not y or not same or a[name]["sequences"] != b[name]["sequences"]:
        return None
    return paired_ratio(np.asarray(x["tau_per_sequence"]), np.asarray(y["tau_per_sequence"]))


def _ratio_cell(r: dict | None) -> str:
    if r is None:
        return ""
    return f"{r['ratio']:.3f} [{r['low']:.3f}, {r['high']:.3f}]" if r["prompts"] else "no sequence with a block"


def print_points(curve: dict, block: int | None = None, against: dict | None = None,
                 against_step: int | None = None) -> list[dict]:
    """One row per point of a curve (``curve.json``): the tokens seen, dev τ per block, dev slot acceptance
    and fit τ at ``block`` (default: the smallest measured), the fit gap, and paired 95% intervals over the
    sequences of dev and fit τ at ``block`` against the previous point and, with ``against`` (another
    curve), of dev τ against its point of the same step where both record the same dev sequences (their
    digest); with ``against_step`` too, against that one point of ``against`` (a checkpoint that ships, say)
    at every step. Returns the rows."""
    points = curve["points"]
    if not points:
        raise SystemExit(f"curve {curve.get('name')!r} has no points yet")
    blocks = sorted({int(b) for p in points for b in p["dev"]["blocks"]})
    b = str(blocks[0] if block is None else block)
    if int(b) not in blocks:
        raise SystemExit(f"--block {b} was not measured (blocks {blocks})")
    other = {p["step"]: p for p in (against or {}).get("points", [])}
    if against_step is not None:
        if against is None:
            raise SystemExit("--against-step needs --against")
        if against_step not in other:
            raise SystemExit(f"curve {against.get('name')!r} has no point at step {against_step} "
                             f"(its steps: {sorted(other)})")
        other = {p["step"]: other[against_step] for p in points}
    head = ["step", "tokens / response tokens seen"] + [f"dev τ@{w}" for w in blocks]
    head += [f"dev slot acc 1-3 @{b}", f"fit τ@{b}", f"fit / dev @{b}", f"dev / previous @{b}",
             f"fit / previous @{b}"]
    if against is not None:
        head.append(f"dev / {against.get('name')}" + ("" if against_step is None else f" step {against_step}")
                    + f" @{b}")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    rows, previous = [], None
    for p in points:
        dev, fit = p["dev"]["blocks"].get(b), p["fit"]["blocks"].get(b)
        row = {"step": p["step"], "tokens_seen": p["tokens_seen"], "response_tokens_seen": p["response_tokens_seen"],
               "dev_tau": {str(w): p["dev"]["blocks"][str(w)]["tau"] for w in blocks if str(w) in p["dev"]["blocks"]},
               "fit_tau": None if fit is None else fit["tau"],
               "dev_vs_previous": None if previous is None else _paired(p, previous, "dev", b, same_run=True),
               "fit_vs_previous": None if previous is None else _paired(p, previous, "fit", b, same_run=True),
               "dev_vs_against": _paired(p, other[p["step"]], "dev", b) if p["step"] in other else None}
        cells = [str(p["step"]), f"{p['tokens_seen']:,} / {p['response_tokens_seen']:,}"]
        cells += [f"{row['dev_tau'][str(w)]:.3f}" if str(w) in row["dev_tau"] else "" for w in blocks]
        cells.append(" / ".join(f"{x:.2f}" for x in dev["slot_acceptance"][:3]) if dev else "")
        cells.append(f"{fit['tau']:.3f}" if fit else "")
        cells.append(f"{fit['tau'] / dev['tau']:.3f}" if fit and dev else "")
        cells += [_ratio_cell(row["dev_vs_previous"]), _ratio_cell(row["fit_vs_previous"])]
        if against is not None:
            cells.append("no point" if p["step"] not in other else _ratio_cell(row["dev_vs_against"]) or
                         "not known to be the same sequences")
        print("| " + " | ".join(cells) + " |")
        rows.append(row)
        previous = p
    return rows


def publish(source: str, dest: str) -> dict:
    """``publish CURVE DEST``: copies a run's curve to its committed place, unless that would lose points:
    where DEST already holds a curve with a step that CURVE lacks, or another dev set at a step both hold
    (the run was started again, its checkpoints lost with the machine it ran on), it refuses and DEST stays
    as it is. Returns the curve written."""
    with open(source) as f:
        new = json.load(f)
    if os.path.exists(dest):
        with open(dest) as f:
            old = json.load(f)
        new_points = {p["step"]: p for p in new["points"]}
        lost = sorted(p["step"] for p in old["points"] if p["step"] not in new_points)
        if lost:
            raise SystemExit(f"{dest} holds the points of steps {lost}, which {source} lacks (a run started "
                             "again?); it is left as it is: publish the new run under another name")
        changed = sorted(p["step"] for p in old["points"]
                         if _dev_digest(p) != _dev_digest(new_points[p["step"]]))
        if changed:
            raise SystemExit(f"{dest} was measured on other dev sequences at steps {changed} than {source}; "
                             "it is left as it is")
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    write_json(new, dest)
    return new


def missing_points(path: str, until: int, every: int) -> list[int]:
    """``holds CURVE --until STEP --every N``: the steps of ``curve_points(STEP, N)`` that the curve at
    ``path`` does not hold (all of them where there is no file): empty when a run to STEP need not train
    again, e.g. a committed baseline whose checkpoints are not on this machine."""
    held = set()
    if os.path.exists(path):
        with open(path) as f:
            held = {p["step"] for p in json.load(f)["points"]}
    return [s for s in curve_points(until, every) if s not in held]


def _dev_digest(point: dict):
    return point.get("dev", {}).get("digest")


def snapshot(source: str, shards: int, dest: str) -> dict:
    """A fixed copy of the first ``shards`` finished shards of prepared data and of their kept features
    where there are any (hard links where the file system allows, copies otherwise) with a manifest that
    lists just them, so that probes started while the preparation goes on all train on the same sequences.
    Refuses fewer finished shards than asked and a destination that holds other data."""
    import shutil

    with open(os.path.join(source, "manifest.json")) as f:
        manifest = json.load(f)
    wanted = list(range(shards))
    missing = [i for i in wanted if i not in manifest["done"]]
    if missing:
        raise SystemExit(f"{source}: shards {missing[:5]} of the first {shards} are not finished yet "
                         f"({len(manifest['done'])} are)")
    target_manifest = {**manifest, "done": wanted}
    path = os.path.join(dest, "manifest.json")
    if os.path.exists(path):
        with open(path) as f:
            if json.load(f) != target_manifest:
                raise SystemExit(f"{dest} holds another snapshot; choose a new directory")
        return target_manifest
    os.makedirs(dest, exist_ok=True)
    names = [f"shard_{i:05d}.npz" for i in wanted] + ["eval_prompts.json"]
    kept = [f"shard_{i:05d}.features.npy" for i in wanted] + ["features.json"]  # data.keep_features
    names += [name for name in kept if os.path.exists(os.path.join(source, name))]
    for name in names:
        src, dst = os.path.join(source, name), os.path.join(dest, name)
        if not os.path.exists(dst):
            try:
                os.link(src, dst)
            except OSError:
                shutil.copyfile(src, dst)
    write_json(target_manifest, path)
    return target_manifest


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    trains = argparse.ArgumentParser(add_help=False)  # what run and memorize train from
    trains.add_argument("--config", required=True)
    trains.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override (repeatable)")
    trains.add_argument("--root", default=os.path.join(ROOT, "runs", "probes"))
    measures = argparse.ArgumentParser(add_help=False)  # what run and curve measure on
    measures.add_argument("--dev", default=DEV, help="the dev prompt file (JSONL)")
    measures.add_argument("--dev-lines", default="128:192", help="START:STOP: the dev prompts' lines (0-based)")
    measures.add_argument("--fit", type=int, default=64, help="training prompts spread over the data (the fit set)")
    measures.add_argument("--blocks", default="4,8,16", help="block sizes to measure at")
    measures.add_argument("--anchors", type=int, default=32, help="anchors per sequence")
    r = sub.add_parser("run", parents=[trains, measures], help="train a probe (resumable) and measure it")
    r.add_argument("name", help="the probe's name: its directory under --root")
    r.add_argument("--out", help="also write the result here")
    r.add_argument("--again", action="store_true", help="train and measure even if NAME has a result")
    r.add_argument("--sets-only", action="store_true", help="only build the dev and fit sets and their features")
    m = sub.add_parser("memorize", parents=[trains],
                       help="how fast a configuration fits the same few sequences (minutes)")
    m.add_argument("name", help="the result's name: ROOT/_memorize/NAME.json")
    m.add_argument("--sequences", type=int, default=4, help="training sequences, the same at every step")
    m.add_argument("--steps", type=int, default=100)
    m.add_argument("--every", type=int, default=10, help="log every this many steps")
    c = sub.add_parser("curve", parents=[trains, measures],
                       help="a long run, measured every --every steps: tau against steps and tokens seen (resumable)")
    c.add_argument("name", help="the run's name: its directory under --root")
    c.add_argument("--every", type=int, required=True, help="measure after every this many steps (and the last)")
    c.add_argument("--keep-drafters", action="store_true", help="keep each measured drafter (OUT/drafter_stepN)")
    c.add_argument("--until", type=int, default=None, metavar="STEP",
                   help="stop after the points up to STEP (a rerun without it, or with a later one, goes on)")
    pl = sub.add_parser("plot", help="plot curves (curve.json files): dev and fit tau against steps and tokens seen")
    pl.add_argument("curves", nargs="+", help="curve.json files")
    pl.add_argument("--out", required=True, help="the image to write (.png, .svg)")
    pl.add_argument("--block", type=int, default=None, help="the block size to plot (default: the largest measured)")
    pt = sub.add_parser("points", help="a curve's points as a table, with paired intervals against the previous "
                                       "point and another curve's")
    pt.add_argument("curve", help="a curve.json file")
    pt.add_argument("--block", type=int, default=None, help="the block of the slot, fit and interval columns "
                                                            "(default: the smallest measured)")
    pt.add_argument("--against", help="another curve.json, measured on the same dev sequences")
    pt.add_argument("--against-step", type=int, metavar="STEP",
                    help="compare every point with --against's point at STEP (default: its point of the same step)")
    pt.add_argument("--out", help="write the rows (with intervals) as JSON")
    t = sub.add_parser("table", help="compare probes' results")
    t.add_argument("results", nargs="+", help="probe.json files")
    t.add_argument("--baseline", default="base")
    t.add_argument("--out", help="write the rows (with intervals) as JSON")
    pb = sub.add_parser("publish", help="copy a run's curve.json to its committed place, never losing points")
    pb.add_argument("curve", help="the run's curve.json")
    pb.add_argument("dest", help="the committed curve (results/...)")
    h = sub.add_parser("holds", help="exit 0 if a curve holds every point up to --until, 1 (listing the "
                                     "missing steps) otherwise")
    h.add_argument("curve", help="a curve.json file (need not exist)")
    h.add_argument("--until", type=int, required=True, metavar="STEP")
    h.add_argument("--every", type=int, required=True, help="the curve's measuring interval")
    n = sub.add_parser("snapshot", help="a fixed copy of the first shards of prepared data")
    n.add_argument("source", help="a prepared data directory (train.py --stage prepare)")
    n.add_argument("dest")
    n.add_argument("--shards", type=int, required=True)
    args = p.parse_args(argv)
    if args.command == "snapshot":
        if args.shards < 1:
            p.error("--shards must be positive")
        return snapshot(args.source, args.shards, args.dest)
    if args.command == "memorize":
        if min(args.sequences, args.steps, args.every) < 1:
            p.error("--sequences, --steps and --every must be positive")
        return memorize(args)
    if args.command in ("run", "curve") and (args.fit < 1 or args.anchors < 1):
        p.error("--fit and --anchors must be positive")
    if args.command == "run":
        return sets_only(args) if args.sets_only else run(args)
    if args.command == "curve":
        if args.every < 1:
            p.error("--every must be positive")
        return curve(args)
    if args.command == "publish":
        return publish(args.curve, args.dest)
    if args.command == "holds":
        if min(args.until, args.every) < 1:
            p.error("--until and --every must be positive")
        missing = missing_points(args.curve, args.until, args.every)
        if missing:
            print(f"{args.curve} lacks the points of steps {missing}")
            raise SystemExit(1)
        return []
    if args.command == "plot":
        return plot(args.curves, args.out, args.block)
    if args.command == "points":
        curves = []
        for path in [args.curve] + ([args.against] if args.against else []):
            with open(path) as f:
                curves.append(json.load(f))
        rows = print_points(curves[0], args.block, curves[1] if args.against else None, args.against_step)
        write_json({"curve": args.curve, "against": args.against, "against_step": args.against_step, "rows": rows},
                   args.out)
        return rows
    results = []
    for path in args.results:
        with open(path) as f:
            results.append(json.load(f))
    rows = print_table(results, args.baseline)
    write_json({"baseline": args.baseline, "rows": rows, "results": results}, args.out)
    return rows


if __name__ == "__main__":
    main()
