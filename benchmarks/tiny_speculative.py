"""τ and wall time of DFlash speculative decoding against plain decoding on a tiny random target.

The drafter is trained on the spot on the target's own greedy outputs (or loaded with --load), then
both decoders run the same held-out prompts one at a time (batch 1), alternating, after compilation.
Speed has two conventions (``benchmarks/speed.py``): end to end (prefill included) and decode only
(after prefill, the official benchmark's convention), each time the median of ``--repeats`` runs.
τ is also measured at T = 1 for the three draft rules. Prints a table; writes JSON.

    python benchmarks/tiny_speculative.py --steps 1500 --train-prompts 4096 --save runs/tiny_bench_drafter
    python benchmarks/tiny_speculative.py --load runs/tiny_bench_drafter
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import retrace_jax as rj  # noqa: E402
from benchmarks.report import report  # noqa: E402
from benchmarks.speed import rates, time_methods  # noqa: E402
from retrace_jax.models.tiny import tiny_target  # noqa: E402
from retrace_jax.training.self_distill import regenerate, train_dflash  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--train-prompts", type=int, default=512)
    p.add_argument("--eval-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--drafter-layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per prompt and method (median; >= 3)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--save", default=None, help="save the trained drafter here")
    p.add_argument("--load", default=None, help="load a drafter instead of training one")
    args = p.parse_args()
    if args.repeats < 3:
        p.error(f"--repeats must be at least 3 (times are medians), got {args.repeats}")

    target = tiny_target()
    vocab = target.cfg.vocab_size
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, vocab - 1, (8,)).tolist() for _ in range(args.train_prompts + args.eval_prompts)]
    train, held_out = prompts[: args.train_prompts], prompts[args.train_prompts :]

    t0 = time.perf_counter()
    if args.load:
        drafter = rj.load_drafter(args.load, target)
    else:
        tokens, mask = regenerate(target, train, args.max_new_tokens)
        drafter = rj.init_drafter(target.cfg, mask_token_id=vocab - 1, num_layers=args.drafter_layers,
                                  block_size=args.block_size)
        drafter = train_dflash(target, drafter, tokens, mask, steps=args.steps, batch_size=32,
                               log=lambda m: print("  train", m), log_every=max(1, args.steps // 5))
        if args.save:
            rj.save_drafter(drafter, args.save)
    train_s = time.perf_counter() - t0
    sampled = {rule: rj.generate(target, held_out, args.max_new_tokens, drafter=drafter, temperature=1.0,
                                 draft_rule=rule, seed=1) for rule in ("argmax", "target_sample", "sample")}

    spec = rj.generate(target, held_out, args.max_new_tokens, drafter=drafter)
    plain = rj.generate(target, held_out, args.max_new_tokens)
    assert spec.tokens == plain.tokens, "speculative output differs from plain greedy"

    runs = {"plain": [], "dflash": []}
    for prompt in held_out:
        for name, t in time_methods(target, prompt, args.max_new_tokens, {"plain": {}, "dflash": {"drafter": drafter}},
                                    args.repeats).items():
            runs[name].append(t)
    speed = {name: rates(v) for name, v in runs.items()}
    result = {
        "target": "tiny random Qwen3 (4 layers, d=128, vocab 512)",
        "drafter": args.load or f"{args.drafter_layers} layers, {args.steps} steps on {args.train_prompts} prompts",
        "block_size": drafter.cfg.block_size,
        "train_and_regenerate_seconds": None if args.load else round(train_s, 1),
        "eval_prompts": len(held_out),
        "tau_T0 (mean of prompt means)": round(spec.tau(), 3),
        "tau_T0_pooled": round(spec.tau_pooled(), 3),
        "tau_T1_argmax_rule": round(sampled["argmax"].tau(), 3),
        "tau_T1_argmax_rule_pooled": round(sampled["argmax"].tau_pooled(), 3),
        "tau_T1_target_sample_rule (official)": round(sampled["target_sample"].tau(), 3),
        "tau_T1_target_sample_rule_pooled": round(sampled["target_sample"].tau_pooled(), 3),
        "tau_T1_sample_rule": round(sampled["sample"].tau(), 3),
        "tau_T1_sample_rule_pooled": round(sampled["sample"].tau_pooled(), 3),
        "timing": f"batch 1, median of {args.repeats} runs per prompt",
        "plain_tokens_per_s (end to end)": round(speed["plain"]["end_to_end"], 1),
        "dflash_tokens_per_s (end to end)": round(speed["dflash"]["end_to_end"], 1),
        "speedup_end_to_end": round(speed["dflash"]["end_to_end"] / speed["plain"]["end_to_end"], 3),
        "plain_tokens_per_s (decode only)": round(speed["plain"]["decode"], 1),
        "dflash_tokens_per_s (decode only)": round(speed["dflash"]["decode"], 1),
        "speedup_decode_only": round(speed["dflash"]["decode"] / speed["plain"]["decode"], 3),
    }
    print()
    report(result, args.out)


if __name__ == "__main__":
    main()
