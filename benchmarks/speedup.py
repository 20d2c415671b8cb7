"""Speculative against plain decoding, side by side in one process, on many prompts: τ, tokens/s and the
speedup at each block size, and what a round costs in plain steps.

    python benchmarks/speedup.py                                  # the laboratory pair on held-out code
    python benchmarks/speedup.py --block-sizes 4,8,16 --prompts 16 --passes 3 --out runs/speedup.json
    python benchmarks/speedup.py --target DIR --drafter DIR --prompt-file prompts.jsonl

Default pair: ``lab/target`` with ``lab/drafters/B``. Prompts come from the Python files of optax and
flax, which neither the laboratory target nor its drafters were trained on (so those packages must be
installed): ``--prompt-set pieces`` (the default) takes pieces of whole lines (48 to 128 tokens) from
anywhere in the files, as ``lab/build_prompts.py`` cuts them; ``--prompt-set starts`` takes the first
``--start-tokens`` tokens of files spread evenly over the sorted list (licence headers, docstrings and
imports: text that drafts well). ``--prompt-file`` takes a JSONL file of ``{"prompt": ...}`` records
instead (raw text, no chat template).

Greedy, batch 1, through the public ``rj.generate``. Every method is compiled and checked lossless
against plain decoding first; then ``--passes`` passes run every method over every prompt, the methods
alternating prompt by prompt, so a change in the machine's load hits them alike. A method's tokens/s in a
pass is all its new tokens over all its time (whole calls: prefill included); the table reports the
median over passes, and the speedup is the median of the per-pass ratios to plain decoding. ``round /
plain step`` is a round's time in plain steps (time per round over plain decoding's time per token):
a block size wins where τ exceeds it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "lab"))

import retrace_jax as rj  # noqa: E402


def held_out_code(tokenizer, n: int, seed: int = 1) -> list[str]:
    """``n`` pieces of the held-out packages' Python files, as ``lab/build_prompts.py`` cuts them."""
    import build_prompts
    import build_target

    texts = build_prompts.read_texts(build_target.held_out_files())
    if len(texts) == 0:
        raise SystemExit("no held-out Python files found (optax and flax must be installed); use --prompt-file")
    return [tokenizer.encode(r["prompt"]) for r in build_prompts.code_pieces(texts, n, tokenizer, seed)]


def held_out_starts(tokenizer, n: int, length: int) -> list[list[int]]:
    """The first ``length`` tokens of ``n`` held-out files (of those that long) spread over the sorted list."""
    import build_prompts
    import build_target

    texts = sorted(build_prompts.read_texts(build_target.held_out_files()))
    encoded = [ids for ids in (tokenizer.encode(text) for _, text in texts) if len(ids) >= length]
    if len(encoded) < n:
        raise SystemExit(f"only {len(encoded)} held-out files have {length} tokens; use --prompt-file")
    return [encoded[i][:length] for i in np.linspace(0, len(encoded) - 1, n).astype(int)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=os.path.join(ROOT, "lab", "target"))
    p.add_argument("--drafter", default=os.path.join(ROOT, "lab", "drafters", "B"))
    p.add_argument("--block-sizes", default="4,8,16")
    p.add_argument("--prompts", type=int, default=12, help="number of prompts")
    p.add_argument("--prompt-set", default="pieces", choices=["pieces", "starts"])
    p.add_argument("--start-tokens", type=int, default=96, help="prompt length of --prompt-set starts")
    p.add_argument("--prompt-file", default=None, help="JSONL records with a 'prompt' field (first --prompts)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.passes < 3:
        p.error("--passes must be at least 3 (the table reports medians)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompts = [tokenizer.encode(json.loads(line)["prompt"]) for line in f if line.strip()][: args.prompts]
    elif args.prompt_set == "starts":
        prompts = held_out_starts(tokenizer, args.prompts, args.start_tokens)
    else:
        prompts = held_out_code(tokenizer, args.prompts)
    target = rj.load_target(args.target)
    drafter = rj.load_drafter(args.drafter, target)
    blocks = [int(b) for b in args.block_sizes.split(",")]
    methods = {"plain": {}} | {f"block {b}": {"drafter": drafter, "block_size": b} for b in blocks}

    reference = {}
    for name, kwargs in methods.items():  # compile, and check lossless
        for i, prompt in enumerate(prompts):
            out = rj.generate(target, [prompt], args.max_new_tokens, **kwargs)
            if name == "plain":
                reference[i] = out.tokens[0]
            elif out.tokens[0] != reference[i]:
                raise SystemExit(f"{name}: prompt {i} differs from plain greedy decoding")
    print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.max_new_tokens} new tokens; all methods lossless", flush=True)

    seconds = {n: np.zeros(args.passes) for n in methods}
    tokens = {n: np.zeros(args.passes) for n in methods}
    rounds = {n: np.zeros(args.passes) for n in methods}
    for k in range(args.passes):
        for prompt in prompts:
            for name, kwargs in methods.items():
                start = time.perf_counter()
                out = rj.generate(target, [prompt], args.max_new_tokens, **kwargs)
                seconds[name][k] += time.perf_counter() - start
                tokens[name][k] += len(out.tokens[0])
                rounds[name][k] += len(out.acceptance_lengths[0])
        print(f"pass {k + 1}: " + ", ".join(f"{n} {tokens[n][k] / seconds[n][k]:.1f} tokens/s" for n in methods),
              flush=True)

    plain_ms = 1e3 * seconds["plain"] / tokens["plain"]  # per token, per pass
    rows = []
    for name in methods:
        tau = tokens[name][0] / rounds[name][0]
        round_ms = 1e3 * seconds[name] / rounds[name]
        rows.append({"method": name, "tau": round(float(tau), 2),
                     "tokens_per_s": round(float(np.median(tokens[name] / seconds[name])), 1),
                     "speedup": round(float(np.median(plain_ms / (1e3 * seconds[name] / tokens[name]))), 2),
                     "round_ms": round(float(np.median(round_ms)), 3),
                     "round_over_plain_step": round(float(np.median(round_ms / plain_ms)), 2)})
    print("| method | τ | tokens/s | speedup | ms per round | round / plain step |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['tau']} | {r['tokens_per_s']} | {r['speedup']}x | {r['round_ms']} | "
              f"{r['round_over_plain_step']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "prompts": len(prompts), "prompt_set": args.prompt_file or args.prompt_set, "max_new_tokens": args.max_new_tokens,
                       "passes": args.passes}, f, indent=1)


if __name__ == "__main__":
    main()
