"""Throughput of a stream through N slots (``rj.generate(..., slots=N)``) against static batches of N
prompts (what ``train.py``'s preparation ran before it streamed: batches in order of prompt length, each
as slow as its longest response), plain and speculative, side by side in one process.

    python benchmarks/stream_throughput.py                      # SmolLM2-135M-Instruct, Spec-Bench, 8 slots
    python benchmarks/stream_throughput.py --num-prompts 48 --slots 8 --max-new-tokens 256 \
        --warmup-new-tokens 129 --runs 1 --static-order length,given

The prompts are Spec-Bench questions (``rj.assets.SPEC_BENCH``) through the target's chat template, taken
evenly over the file (its categories, from writing to translation, follow one another) among those of at
most ``--max-prompt-len`` tokens, so the greedy responses end at very different lengths (the table reports
their spread: p10, median, p90 and max over min). Per method, the medians of ``--runs`` alternating runs
(static batches in each ``--static-order``, then the stream) after a compiling one (of
``--warmup-new-tokens``, which compiles the same programs when it pads to the same output capacity): new
tokens per second over the whole set, the ratio, how many prompts' tokens differ (greedy: none should),
and the rounds each way ran beside the rounds of slots that never idle (the sum of the prompts' rounds
over the slots), which bound what a stream can gain.

``--memory P1,P2,...`` also runs, each in a fresh process, a stream of that many 1-token prompts with
``--memory-new-tokens`` new tokens each through ``--slots`` slots on ``--memory-target`` and reports the
process's peak resident memory: the stream holds ``--slots`` rows of caches whatever the number of prompts
(``--memory-only`` skips the throughput runs).

    python benchmarks/stream_throughput.py --memory-only --memory 16,10000 --slots 16

``--prefill-only`` times one pass of a refill's prefill over one row and over all ``--slots`` rows, at 32
and 64 tokens per pass (what ``PREFILL_CHUNK`` and ``REFILL_TOGETHER`` in ``decoding/stream.py`` rest on).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import retrace_jax as rj  # noqa: E402
from benchmarks.report import write_json  # noqa: E402
from retrace_jax.decoding.generation import bucket  # noqa: E402
from retrace_jax.decoding.programs import BACKEND_COMPILE_EVENT  # noqa: E402
from retrace_jax.training.data import chat_encoder, iter_prompt_ids, load_tokenizer, read_prompts  # noqa: E402

DEFAULT_TARGET = os.path.expanduser("~/.cache/retrace_jax/models/smollm2-135m-instruct")


def static_batches(target, prompts, max_new, batch, by_length=True, **kwargs):
    """The prompts in static batches of ``batch``, in order of prompt length (as preparation batched
    them) or as given, put back in their own order: the tokens, acceptance lengths and rounds run."""
    order = sorted(range(len(prompts)), key=lambda j: len(prompts[j])) if by_length else list(range(len(prompts)))
    tokens, accept, rounds = [None] * len(prompts), [None] * len(prompts), 0
    for i in range(0, len(prompts), batch):
        rows = order[i:i + batch]
        out = rj.generate(target, [prompts[j] for j in rows], max_new, **kwargs)
        for j, new, a in zip(rows, out.tokens, out.acceptance_lengths):
            tokens[j], accept[j] = new, a
        rounds += max(prompt_rounds(a, "drafter" in kwargs) for a in out.acceptance_lengths)
    return tokens, accept, rounds


def stream(target, prompts, max_new, batch, **kwargs):
    seen = []
    out = rj.generate(target, prompts, max_new, slots=batch, progress=seen.append, **kwargs)
    return out.tokens, out.acceptance_lengths, seen[-1].rounds


def prompt_rounds(accept, speculative: bool) -> int:
    """The rounds a prompt ran after its prefill (whose token is its first): speculative, one per
    acceptance length; plain, one per token after the first."""
    return len(accept) if speculative else max(len(accept) - 1, 0)


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    tokens = fn(*args, **kwargs)
    return tokens, time.perf_counter() - start


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def memory_child(args) -> None:
    """One stream of ``--memory-child`` 1-token prompts; prints the peak resident memory and the seconds
    spent compiling each program (XLA's backend compile, through ``jax.monitoring``) as JSON."""
    target = load(args.target)[0]
    n = args.memory_child
    rng = np.random.RandomState(0)
    prompts = rng.randint(0, target.cfg.vocab_size, (n, 1)).tolist()
    compiled: dict[str, float] = {}

    def listener(event, duration_secs, **kwargs):
        if event == BACKEND_COMPILE_EVENT:
            name = kwargs.get("fun_name", "?")
            compiled[name] = compiled.get(name, 0.0) + duration_secs

    jax.monitoring.register_event_duration_secs_listener(listener)
    before = peak_rss_mib()
    start = time.perf_counter()
    out = rj.generate(target, prompts, args.memory_new_tokens, slots=args.slots)
    print(json.dumps({"prompts": n, "peak_rss_mib": peak_rss_mib(), "rss_before_mib": before,
                      "seconds": time.perf_counter() - start, "tokens": sum(map(len, out.tokens)),
                      "compile_s": compiled}))


def prefill_passes(args, commit: str) -> dict:
    """Seconds per prefill pass of a refill (:func:`~retrace_jax.decoding.stream.prefill_rows`) over one
    row and over all ``--slots`` rows, at 32 and 64 tokens per pass, side by side (medians of ``--runs``
    alternating calls after a compiling one), in a cache whose other rows hold 256 positions of text."""
    from retrace_jax.decoding.stream import prefill_rows

    target = load(args.target)[0]
    b = args.slots
    cache = target.init_cache(b, 1024).replace(lengths=jnp.full((b,), 256, jnp.int32))

    @functools.partial(jax.jit, static_argnames=("rows", "chunk"), donate_argnames=("cache",))
    def run(cache, tokens, *, rows, chunk):
        refill = jnp.ones((rows,), bool)
        out, _, last = prefill_rows(target, None, cache, None, 0 if rows == b else b // 2, refill, tokens,
                                    jnp.full((rows,), chunk, jnp.int32), chunk)
        return out.replace(lengths=cache.lengths), last

    cases = [(rows, chunk) for chunk in (32, 64) for rows in (1, b)]
    seconds = {case: [] for case in cases}
    for i in range(args.runs + 1):
        for rows, chunk in cases:
            tokens = jnp.ones((rows, chunk), jnp.int32)
            start = time.perf_counter()
            cache, last = jax.block_until_ready(run(cache, tokens, rows=rows, chunk=chunk))
            if i:
                seconds[rows, chunk].append(time.perf_counter() - start)
    name = os.path.basename(os.path.normpath(args.target))
    print(f"\nOne prefill pass of a refill ({name}, medians of {args.runs} alternating calls)\n")
    print("| rows | tokens per pass | ms per pass | ms per row-token |\n|---|---|---|---|")
    rows_out = []
    for (rows, chunk), s in seconds.items():
        ms = 1000 * statistics.median(s)
        rows_out.append({"rows": rows, "chunk": chunk, "ms_per_pass": ms, "seconds": s})
        print(f"| {rows} | {chunk} | {ms:.0f} | {ms / (rows * chunk):.2f} |")
    return {"commit": commit, "prefill_passes": rows_out}


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
    p.add_argument("--static-order", default="length",
                   help="static batches in order of prompt length (as preparation batched them) and/or as given: "
                        "'length', 'given' or 'length,given' (both beside the same stream)")
    p.add_argument("--warmup-new-tokens", type=int, default=0,
                   help="max_new_tokens of the compiling run (default: --max-new-tokens); one in the same bucket "
                        "(the next power of two) compiles the same programs for less time")
    p.add_argument("--memory", default="", help="comma-separated prompt counts for the peak-memory runs")
    p.add_argument("--memory-target", default="tiny", help="the target of the peak-memory runs ('tiny': the "
                                                           "tiny random target, whose prompts cost little)")
    p.add_argument("--memory-only", action="store_true", help="only the peak-memory runs")
    p.add_argument("--memory-new-tokens", type=int, default=2)
    p.add_argument("--memory-child", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--prefill-only", action="store_true",
                   help="only time one refill's prefill pass over 1 and --slots rows at 32 and 64 tokens per pass")
    p.add_argument("--out", help="write the results as JSON")
    args = p.parse_args(argv)
    commit = _commit()  # the code this process loaded, whatever HEAD is when it ends
    if args.memory_child:
        return memory_child(args)
    if args.prefill_only:
        result = prefill_passes(args, commit)
        write_json(result, args.out)
        return result
    if args.memory_only:
        result = {"commit": commit, "memory": memory_runs(args)}
        write_json(result, args.out)
        return result
    if min(args.num_prompts, args.slots, args.max_new_tokens, args.runs) < 1:
        p.error("--num-prompts, --slots, --max-new-tokens and --runs must be positive")
    orders = args.static_order.split(",")
    if not orders or any(o not in ("length", "given") for o in orders) or len(set(orders)) < len(orders):
        p.error(f"--static-order takes 'length', 'given' or both, comma-separated; got {args.static_order!r}")
    warmup = args.warmup_new_tokens or args.max_new_tokens
    if warmup < 1 or bucket(warmup) != bucket(args.max_new_tokens):
        p.error(f"--warmup-new-tokens {warmup} compiles other programs than --max-new-tokens {args.max_new_tokens}: "
                f"take one that pads to the same output capacity, {bucket(args.max_new_tokens)}")

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
    kwargs = {m: dict(extra, stop_token_ids=stops) for m, extra in methods.items()}
    ways = {f"static_{o}": functools.partial(static_batches, by_length=o == "length") for o in orders}
    ways["stream"] = stream

    for m in methods:  # compiles
        for fn in ways.values():
            fn(target, ids, warmup, args.slots, **kwargs[m])
    seconds = {(m, way): [] for m in methods for way in ways}
    first = {}
    for _ in range(args.runs):
        for m in methods:
            for way, fn in ways.items():
                out, s = timed(fn, target, ids, args.max_new_tokens, args.slots, **kwargs[m])
                assert first.setdefault((m, way), out) == out, "greedy tokens changed between runs"
                seconds[m, way].append(s)
    lengths = [len(t) for t in first[next(iter(methods)), "stream"][0]]
    rows = {}
    for m in methods:
        new = {way: sum(map(len, first[m, way][0])) for way in ways}
        rate = {way: new[way] / statistics.median(seconds[m, way]) for way in ways}
        busy = -(-sum(prompt_rounds(a, m != "plain") for a in first[m, "stream"][1]) // args.slots)
        rows[m] = {}
        for o in orders:
            static = f"static_{o}"
            differ = sum(a != b for a, b in zip(first[m, static][0], first[m, "stream"][0]))
            rows[m][o] = {"static_tokens_per_s": rate[static], "stream_tokens_per_s": rate["stream"],
                          "ratio": rate["stream"] / rate[static], "static_s": seconds[m, static],
                          "stream_s": seconds[m, "stream"], "new_tokens": {"static": new[static],
                                                                           "stream": new["stream"]},
                          "static_rounds": first[m, static][2], "stream_rounds": first[m, "stream"][2],
                          "busy_rows_rounds": busy, "prompts_differing": differ}
    result = {
        "target": os.path.abspath(args.target) if args.target != "tiny" else "tiny", "prompts": len(ids),
        "slots": args.slots, "max_new_tokens": args.max_new_tokens, "warmup_new_tokens": warmup, "runs": args.runs,
        "static_orders": orders,
        "backend": jax.default_backend(), "jax": jax.__version__, "commit": commit,
        "response_lengths": {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths),
                             "p10": float(np.percentile(lengths, 10)), "p90": float(np.percentile(lengths, 90)),
                             "max_over_min": max(lengths) / max(min(lengths), 1),
                             "at_max_new_tokens": sum(n == args.max_new_tokens for n in lengths)},
        "prompt_lengths": {"min": min(map(len, ids)), "max": max(map(len, ids))},
        "methods": rows,
    }
    r = result["response_lengths"]
    print(f"{len(ids)} prompts ({result['prompt_lengths']['min']}-{result['prompt_lengths']['max']} tokens), "
          f"{args.slots} slots / static batches of {args.slots}, max_new_tokens {args.max_new_tokens}; response "
          f"lengths {r['min']}-{r['max']} (max/min {r['max_over_min']:.1f}x; p10 {r['p10']:.0f}, median "
          f"{r['median']:.0f}, p90 {r['p90']:.0f}, {r['at_max_new_tokens']} at the limit); medians of {args.runs} "
          f"alternating runs ({jax.default_backend()}, jax {jax.__version__}, commit {commit})\n")
    print("| method | static batches | static tokens/s | stream tokens/s | stream / static | static rounds | "
          "stream rounds | busy-rows rounds | prompts differing |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m, by_order in rows.items():
        for o, row in by_order.items():
            print(f"| {m} | {'in order of prompt length' if o == 'length' else 'in the given order'} | "
                  f"{row['static_tokens_per_s']:.1f} | {row['stream_tokens_per_s']:.1f} | {row['ratio']:.2f}x | "
                  f"{row['static_rounds']} | {row['stream_rounds']} | {row['busy_rows_rounds']} | "
                  f"{row['prompts_differing']} |")
    if args.memory:
        result["memory"] = memory_runs(args)
    write_json(result, args.out)
    return result


def memory_runs(args) -> list[dict]:
    """Each count of ``--memory`` in a fresh process (:func:`memory_child`); prints a table."""
    runs = []
    print(f"\n{args.memory_target} target, {args.memory_new_tokens} new tokens per 1-token prompt\n")
    print("| prompts | slots | peak resident memory (MiB) | seconds | of which compiling stream_chunk |\n"
          "|---|---|---|---|---|")
    for n in (int(x) for x in args.memory.split(",")):
        cmd = [sys.executable, os.path.abspath(__file__), "--target", args.memory_target, "--slots", str(args.slots),
               "--memory-new-tokens", str(args.memory_new_tokens), "--memory-child", str(n)]
        child = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
        runs.append(child)
        stream_compile = sum(s for name, s in child["compile_s"].items() if "stream_chunk" in name)
        print(f"| {n} | {args.slots} | {child['peak_rss_mib']:.0f} | {child['seconds']:.1f} | {stream_compile:.1f} |")
    return runs


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
