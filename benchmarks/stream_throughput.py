"""Throughput of a stream through N slots (``rj.generate(..., slots=N)``) against static batches of N
prompts (what ``train.py``'s preparation ran before it streamed: batches in order of prompt length, each
as slow as its longest response), plain and speculative, side by side in one process.

    python benchmarks/stream_throughput.py                      # SmolLM2-135M-Instruct, Spec-Bench, 8 slots
    python benchmarks/stream_throughput.py --num-prompts 48 --slots 8 --max-new-tokens 192 --runs 3

The prompts are Spec-Bench questions (``rj.assets.SPEC_BENCH``) through the target's chat template, taken
evenly over the file (its categories, from writing to translation, follow one another) among those of at
most ``--max-prompt-len`` tokens, so the greedy responses end at very different lengths (the table reports
their spread). Per method, the medians of
``--runs`` alternating runs (static, then stream) after a compiling one: new tokens per second over the
whole set, the ratio, and how many prompts' tokens differ between the two (greedy: none should).

``--memory P1,P2,...`` also runs, each in a fresh process, a stream of that many 1-token prompts with
``--memory-new-tokens`` new tokens each through ``--slots`` slots on ``--memory-target`` and reports the
process's peak resident memory: the stream holds ``--slots`` rows of caches whatever the number of prompts
(``--memory-only`` skips the throughput runs).

    python benchmarks/stream_throughput.py --memory-only --memory 16,10000 --slots 16
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import retrace_jax as rj  # noqa: E402
from benchmarks.report import write_json  # noqa: E402
from retrace_jax.training.data import chat_encoder, iter_prompt_ids, load_tokenizer, read_prompts  # noqa: E402

DEFAULT_TARGET = os.path.expanduser("~/.cache/retrace_jax/models/smollm2-135m-instruct")


def static_batches(target, prompts, max_new, batch, by_length=True, **kwargs):
    """The prompts in static batches of ``batch``, in order of prompt length (as preparation batched
    them) or as given, put back in their own order."""
    order = sorted(range(len(prompts)), key=lambda j: len(prompts[j])) if by_length else list(range(len(prompts)))
    tokens = [None] * len(prompts)
    for i in range(0, len(prompts), batch):
        rows = order[i:i + batch]
        out = rj.generate(target, [prompts[j] for j in rows], max_new, **kwargs)
        for j, new in zip(rows, out.tokens):
            tokens[j] = new
    return tokens


def stream(target, prompts, max_new, batch, by_length=True, **kwargs):
    del by_length
    return rj.generate(target, prompts, max_new, slots=batch, **kwargs).tokens


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    tokens = fn(*args, **kwargs)
    return tokens, time.perf_counter() - start


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def memory_child(args) -> None:
    """One stream of ``--memory-child`` 1-token prompts; prints the peak resident memory as JSON."""
    target = load(args.target)[0]
    n = args.memory_child
    rng = np.random.RandomState(0)
    prompts = rng.randint(0, target.cfg.vocab_size, (n, 1)).tolist()
    before = peak_rss_mib()
    start = time.perf_counter()
    out = rj.generate(target, prompts, args.memory_new_tokens, slots=args.slots)
    print(json.dumps({"prompts": n, "peak_rss_mib": peak_rss_mib(), "rss_before_mib": before,
                      "seconds": time.perf_counter() - start, "tokens": sum(map(len, out.tokens))}))


def load(path):
    if path == "tiny":
        return rj.tiny.tiny_target(), None
    return rj.load_target(path, dtype="float32"), load_tokenizer(path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET, help="a Hugging Face model directory, or 'tiny'")
    p.add_argument("--drafter", default="shipped",
                   help="a drafter directory for the speculative rows; 'shipped': the package's for the target")
    p.add_argument("--prompts", default=rj.assets.SPEC_BENCH, help="a JSONL prompt file (train.py's formats)")
    p.add_argument("--methods", default="plain,dflash", help="plain and/or dflash (the --drafter)")
    p.add_argument("--num-prompts", type=int, default=48, help="prompts taken evenly spread over the file")
    p.add_argument("--max-prompt-len", type=int, default=256, help="longer prompts are left out")
    p.add_argument("--slots", type=int, default=8, help="rows of the stream, and prompts per static batch")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--static-order", choices=("length", "given"), default="length",
                   help="static batches in order of prompt length (as preparation batched them) or as given")
    p.add_argument("--memory", default="", help="comma-separated prompt counts for the peak-memory runs")
    p.add_argument("--memory-target", default="tiny", help="the target of the peak-memory runs ('tiny': the "
                                                           "tiny random target, whose prompts cost little)")
    p.add_argument("--memory-only", action="store_true", help="only the peak-memory runs")
    p.add_argument("--memory-new-tokens", type=int, default=2)
    p.add_argument("--memory-child", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", help="write the results as JSON")
    args = p.parse_args(argv)
    if args.memory_child:
        return memory_child(args)
    if args.memory_only:
        result = {"commit": _commit(), "memory": memory_runs(args)}
        write_json(result, args.out)
        return result
    if min(args.num_prompts, args.slots, args.max_new_tokens, args.runs) < 1:
        p.error("--num-prompts, --slots, --max-new-tokens and --runs must be positive")

    target, tokenizer = load(args.target)
    if tokenizer is None:
        p.error("--target needs a tokenizer for the chat prompts")
    ids = iter_prompt_ids(read_prompts(args.prompts), chat_encoder(tokenizer))
    ids = [x for x in ids if len(x) <= args.max_prompt_len]
    if len(ids) < args.num_prompts:
        p.error(f"{args.prompts} holds {len(ids)} prompts of at most {args.max_prompt_len} tokens, fewer than "
                f"--num-prompts {args.num_prompts}")
    # spread over the file: Spec-Bench's categories follow one another, and their responses differ in length
    ids = [ids[i] for i in np.linspace(0, len(ids) - 1, args.num_prompts).round().astype(int)]
    stops = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    methods = {"plain": {}} if "plain" in args.methods.split(",") else {}
    if "dflash" in args.methods.split(","):
        path = args.drafter
        if path == "shipped":
            path = rj.assets.shipped_drafter(os.path.basename(os.path.normpath(args.target)))
        methods["dflash"] = {"drafter": rj.load_drafter(path, target)}
    kwargs = {m: dict(extra, stop_token_ids=stops, by_length=args.static_order == "length") for m, extra in
              methods.items()}
    ways = {"static": static_batches, "stream": stream}

    first = {}
    for m in methods:  # compiles; the greedy tokens of each way
        for way, fn in ways.items():
            first[m, way] = fn(target, ids, args.max_new_tokens, args.slots, **kwargs[m])
    seconds = {key: [] for key in first}
    for _ in range(args.runs):
        for m in methods:
            for way, fn in ways.items():
                tokens, s = timed(fn, target, ids, args.max_new_tokens, args.slots, **kwargs[m])
                assert tokens == first[m, way], "greedy tokens changed between runs"
                seconds[m, way].append(s)
    lengths = [len(t) for t in first[next(iter(methods)), "static"]]
    rows = {}
    for m in methods:
        new = {way: sum(map(len, first[m, way])) for way in ways}
        rate = {way: new[way] / statistics.median(seconds[m, way]) for way in ways}
        differ = sum(a != b for a, b in zip(first[m, "static"], first[m, "stream"]))
        rows[m] = {"static_tokens_per_s": rate["static"], "stream_tokens_per_s": rate["stream"],
                   "ratio": rate["stream"] / rate["static"], "static_s": seconds[m, "static"],
                   "stream_s": seconds[m, "stream"], "new_tokens": new, "prompts_differing": differ}
    result = {
        "target": os.path.abspath(args.target) if args.target != "tiny" else "tiny", "prompts": len(ids),
        "slots": args.slots, "max_new_tokens": args.max_new_tokens, "runs": args.runs,
        "static_order": args.static_order,
        "backend": jax.default_backend(), "jax": jax.__version__, "commit": _commit(),
        "response_lengths": {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths),
                             "p10": float(np.percentile(lengths, 10)), "p90": float(np.percentile(lengths, 90)),
                             "at_max_new_tokens": sum(n == args.max_new_tokens for n in lengths)},
        "prompt_lengths": {"min": min(map(len, ids)), "max": max(map(len, ids))},
        "methods": rows,
    }
    r = result["response_lengths"]
    print(f"{len(ids)} prompts ({result['prompt_lengths']['min']}-{result['prompt_lengths']['max']} tokens), "
          f"{args.slots} slots / static batches of {args.slots} (order: {args.static_order}), max_new_tokens {args.max_new_tokens}; response "
          f"lengths {r['min']}-{r['max']} (p10 {r['p10']:.0f}, median {r['median']:.0f}, p90 {r['p90']:.0f}, "
          f"{r['at_max_new_tokens']} at the limit); medians of {args.runs} alternating runs "
          f"({jax.default_backend()}, jax {jax.__version__}, commit {result['commit']})\n")
    print("| method | static batches tokens/s | stream tokens/s | stream / static | prompts differing |")
    print("|---|---|---|---|---|")
    for m, row in rows.items():
        print(f"| {m} | {row['static_tokens_per_s']:.1f} | {row['stream_tokens_per_s']:.1f} | {row['ratio']:.2f}x | "
              f"{row['prompts_differing']} |")
    if args.memory:
        result["memory"] = memory_runs(args)
    write_json(result, args.out)
    return result


def memory_runs(args) -> list[dict]:
    """Each count of ``--memory`` in a fresh process (:func:`memory_child`); prints a table."""
    runs = []
    print(f"\n{args.memory_target} target, {args.memory_new_tokens} new tokens per 1-token prompt\n")
    print("| prompts | slots | peak resident memory (MiB) | seconds |\n|---|---|---|---|")
    for n in (int(x) for x in args.memory.split(",")):
        cmd = [sys.executable, os.path.abspath(__file__), "--target", args.memory_target, "--slots", str(args.slots),
               "--memory-new-tokens", str(args.memory_new_tokens), "--memory-child", str(n)]
        child = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
        runs.append(child)
        print(f"| {n} | {args.slots} | {child['peak_rss_mib']:.0f} | {child['seconds']:.1f} |")
    return runs


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
