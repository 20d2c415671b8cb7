"""Speculative decoding on CPU with the several-row products compiled each way (``rj.generate``'s
``cpu_products``: "ynnpack", XLA's default, against "eigen"), beside plain decoding, in one process:
batch 1, the first ``--prompts`` prompts of each file, ``--max-new-tokens`` greedy tokens, each pass
timing every prompt end to end (prefill included) with plain decoding and each choice in turn, after one
pass that compiles; the table gives the medians over ``--repeats`` passes and checks that every output
equals plain decoding's.

    python benchmarks/cpu_products.py --target ~/.cache/retrace_jax/models/qwen2.5-coder-0.5b-instruct \\
        --drafter retrace_jax/assets/drafters/qwen2.5-coder-0.5b-instruct-dflash \\
        --prompts-file humaneval=~/.cache/retrace_jax/data/humaneval_raw.jsonl \\
        --prompts-file heldout=~/.cache/retrace_jax/data/code_heldout.jsonl

"auto", the default, picks one of the two by the target's size (``resolve_cpu_products``); the table
names its pick.
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
from retrace_jax.decoding.programs import resolve_cpu_products  # noqa: E402
from retrace_jax.training.data import chat_encoder, load_tokenizer, read_prompts  # noqa: E402

CHOICES = ("ynnpack", "eigen")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--prompts-file", action="append", required=True, metavar="NAME=FILE")
    p.add_argument("--prompts", type=int, default=4, help="prompts of each file, from its first")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.repeats < 3:
        p.error("--repeats must be at least 3 (medians)")
    path = os.path.expanduser(args.target)
    target = rj.load_target(path, dtype="float32")
    drafter = rj.load_drafter(os.path.expanduser(args.drafter), target)
    tokenizer = load_tokenizer(path)
    stops = [tokenizer.eos_token_id]
    result = {"target": os.path.basename(os.path.normpath(path)), "block_size": args.block_size or drafter.cfg.block_size,
              "auto": resolve_cpu_products(target.cfg, target.dtype.itemsize), "sets": {}}
    encode = chat_encoder(tokenizer)  # a raw piece as it stands, a request through the chat template
    for spec in args.prompts_file:
        name, _, file = spec.partition("=")
        ids = [encode(m) for m in read_prompts(os.path.expanduser(file))[: args.prompts]]

        def run(method):
            kwargs = {} if method == "plain" else {"drafter": drafter, "block_size": args.block_size,
                                                    "cpu_products": method}
            start, outs, taus = time.perf_counter(), [], []
            for prompt in ids:
                out = rj.generate(target, [prompt], args.max_new_tokens, stop_token_ids=stops, **kwargs)
                outs.append(out.tokens[0])
                taus.append(float(np.mean(out.acceptance_lengths[0])))
            return time.perf_counter() - start, outs, taus

        methods = ("plain",) + CHOICES
        for method in methods:
            run(method)  # compiles
        seconds = {m: [] for m in methods}
        for _ in range(args.repeats):
            for method in methods:
                took, outs, taus = run(method)
                seconds[method].append(took)
                if method == "plain":
                    want, tokens = outs, sum(map(len, outs))
                elif outs != want:
                    raise SystemExit(f"{name}: {method}'s tokens differ from plain decoding's")
        med = {m: float(np.median(v)) for m, v in seconds.items()}
        result["sets"][name] = {
            "prompts": len(ids), "tokens": tokens, "tau": float(np.mean(taus)),
            "plain_tokens_per_s": tokens / med["plain"],
            **{f"speedup_{m}": med["plain"] / med[m] for m in CHOICES},
            "eigen_over_ynnpack": med["ynnpack"] / med["eigen"],
            "seconds": {m: [round(x, 3) for x in v] for m, v in seconds.items()}, "outputs_equal_plain": True}
    print("| prompts | τ | plain tokens/s | speedup, ynnpack | speedup, eigen | eigen / ynnpack |")
    print("|---|---|---|---|---|---|")
    for name, r in result["sets"].items():
        print(f"| {name}, first {r['prompts']} | {r['tau']:.2f} | {r['plain_tokens_per_s']:.1f} | "
              f"{r['speedup_ynnpack']:.2f}x | {r['speedup_eigen']:.2f}x | {r['eigen_over_ynnpack']:.3f} |")
    report(result, args.out)


if __name__ == "__main__":
    main()
