"""Time of one drafter training step (after compilation) for each of several drafter settings, measured side
by side in one process: the settings alternate, and each is the median of ``--repeats`` timed steps.

    python benchmarks/train_step.py --target ~/.cache/retrace_jax/models/smollm2-135m-instruct \\
        --draft-vocab 0,16384,8192 --feature-cache        # the LM head's share of a DFlash step
    python benchmarks/train_step.py --target ~/.cache/retrace_jax/models/qwen2.5-coder-0.5b-instruct \
        --layers 2 --intermediate-size 1536 --block-size 16 --draft-vocab 8192 --seq-len 256 --feature-cache \
        --precision float32,bfloat16                         # train.precision's products

Random tokens and, with ``--feature-cache``, random target features stand in for the data (the work does
not depend on the values). ``--draft-vocab 0`` is the whole vocabulary. Without ``--feature-cache`` the
step runs the frozen target on the batch as well (``train.feature_cache: false``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import retrace_jax as rj  # noqa: E402
from benchmarks.report import report  # noqa: E402
from retrace_jax.models.drafter import with_draft_vocab  # noqa: E402
from retrace_jax.models.tiny import tiny_target  # noqa: E402
from retrace_jax.training.step import StepOptions, adamw, init_opt_state, make_train_step  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="a Hugging Face directory (default: the tiny random target)")
    p.add_argument("--draft-vocab", default="0", help="comma-separated draft vocabulary sizes (0: the whole one)")
    p.add_argument("--layers", type=int, default=1, help="drafter layers")
    p.add_argument("--intermediate-size", type=int, default=None, help="the drafter's MLP width (default: the target's)")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=224)
    p.add_argument("--anchors", type=int, default=16)
    p.add_argument("--feature-cache", action="store_true", help="features come with the batch (train.feature_cache)")
    p.add_argument("--objective", default="dflash", choices=["dflash", "retrace"],
                   help="retrace: the rollout of --rounds rounds with the verify signal (no feature cache)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--precision", default="float32",
                   help="comma-separated train.precision values (the drafter's products: float32, bfloat16)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    target = rj.load_target(os.path.expanduser(args.target)) if args.target else tiny_target()
    cfg = target.cfg
    sizes = [int(v) for v in args.draft_vocab.split(",")]
    precisions = args.precision.split(",")
    if not set(precisions) <= {"float32", "bfloat16"}:
        p.error(f"--precision takes float32 and bfloat16, got {args.precision!r}")
    settings = [(size, precision) for size in sizes for precision in precisions]
    rng = np.random.RandomState(0)
    tokens = jnp.asarray(rng.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len)), jnp.int32)
    mask = jnp.asarray(np.arange(args.seq_len)[None].repeat(args.batch_size, 0) >= args.seq_len // 4, jnp.int32)
    if args.objective == "retrace" and args.feature_cache:
        p.error("--objective retrace runs the target on the batch: leave out --feature-cache")
    retrace = rj.ReTraceConfig(slots="agreed") if args.objective == "retrace" else None
    base = rj.init_drafter(cfg, mask_token_id=cfg.vocab_size - 1, num_layers=args.layers, block_size=args.block_size,
                           intermediate_size=args.intermediate_size, retrace=retrace)
    feats = ()
    if args.feature_cache:
        width = len(base.cfg.target_layer_ids) * cfg.hidden_size
        feats = (jnp.asarray(rng.randn(args.batch_size, args.seq_len, width), target.dtype),)
    optimizer = adamw(1e-4, 1000)
    target_def, target_state = nnx.split(target)
    runs = {}
    for size, precision in settings:
        opts = StepOptions(objective=args.objective, num_anchors=args.anchors, rounds=args.rounds, precision=precision)
        drafter = with_draft_vocab(base, np.arange(size)) if size else base
        drafter_def, state, fixed = nnx.split(drafter, nnx.Param, ...)
        state = jax.tree.map(jnp.copy, state)  # each setting its own (donated) parameters
        step = make_train_step(target_def, drafter_def, optimizer, opts, precomputed_features=args.feature_cache,
                               drafter_fixed=fixed)
        opt_state = init_opt_state(optimizer, state)
        start = time.perf_counter()
        state, opt_state, metrics = step(target_state, state, opt_state, tokens, mask, jnp.int32(0), jnp.uint32(0),
                                         *feats)
        jax.block_until_ready(metrics)
        runs[size, precision] = {"step": step, "state": state, "opt": opt_state,
                                 "compile_s": time.perf_counter() - start,
                                 "times": []}
    for i in range(args.repeats):  # the settings alternate, so load changes hit them alike
        for r in runs.values():
            start = time.perf_counter()
            r["state"], r["opt"], metrics = r["step"](target_state, r["state"], r["opt"], tokens, mask,
                                                      jnp.int32(i + 1), jnp.uint32(0), *feats)
            jax.block_until_ready(metrics)
            r["times"].append(time.perf_counter() - start)
    whole = float(np.median(runs[settings[0]]["times"]))
    result = {"target": args.target or "tiny", "vocab": cfg.vocab_size, "layers": args.layers,
              "intermediate_size": base.cfg.intermediate_size,
              "block_size": args.block_size, "batch_size": args.batch_size, "seq_len": args.seq_len,
              "anchors": args.anchors, "feature_cache": args.feature_cache, "repeats": args.repeats,
              "objective": args.objective, "rounds": args.rounds if args.objective == "retrace" else None,
              "device": jax.devices()[0].platform}
    for (size, precision), r in runs.items():
        ms = 1e3 * float(np.median(r["times"]))
        label = f"draft vocabulary {size or cfg.vocab_size}"
        if len(precisions) > 1:
            label += f", {precision} products"
        result[f"step ms, {label} (x first)"] = f"{ms:.1f} ({ms / (1e3 * whole):.3f})"
    report(result, args.out)


if __name__ == "__main__":
    main()
