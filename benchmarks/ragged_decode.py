"""One plain decode step of a batch whose rows hold texts of different lengths: each row walking its own
filled chunks of the KV cache (``walk_rows``, what ``cached_attention`` runs for decode-sized calls) against
every row walking up to the longest row's length (``walk_cache``, what it ran before), side by side in one
process, medians of ``--runs`` alternating calls after a compiling one.

    python benchmarks/ragged_decode.py                      # SmolLM2-135M-Instruct, 8 rows, 1,024 slots
    python benchmarks/ragged_decode.py --target tiny        # a tiny random target (a smoke run)

A stream's slots (``rj.generate(..., slots=N)``) hold prompts at every stage of their responses, so its
rows' lengths spread like the "spread" case; a static batch's rows grow together.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import write_json
from benchmarks.stream_throughput import DEFAULT_TARGET, _commit, load
from retrace_jax import attention


def cases(longest: int, rows: int) -> dict[str, list[int]]:
    """Row lengths: all short, all long, one long row among short ones, evenly spread, all at the mean."""
    short, mean = longest * 3 // 8, longest * 9 // 16
    return {"all short": [short] * rows, "one long": [short] * (rows - 1) + [longest], "all long": [longest] * rows,
            "spread": np.linspace(longest // 8, longest, rows).astype(int).tolist(), "all at the mean": [mean] * rows}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET, help="a Hugging Face model directory, or 'tiny'")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--slots", type=int, default=1024, help="the cache's slots")
    p.add_argument("--longest", type=int, default=800, help="the longest row's length")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", help="write the results as JSON")
    args = p.parse_args(argv)
    if not 0 < args.longest < args.slots or min(args.rows, args.runs) < 1:
        p.error("need 0 < --longest < --slots and positive --rows and --runs")
    target = load(args.target)[0]
    slots = attention.cache_slots(args.slots)

    def program(row_walk: bool):
        limit = attention.ROW_WALK_MAX_T if row_walk else 0

        @functools.partial(jax.jit, donate_argnames=("cache",))
        def step(cache, tokens):
            out = target(tokens, cache)
            return out.cache.replace(lengths=cache.lengths), target.logits(out.hidden[:, -1]).argmax(-1)

        def run(cache, tokens):  # the walk is chosen when the step traces
            saved, attention.ROW_WALK_MAX_T = attention.ROW_WALK_MAX_T, limit
            try:
                return step(cache, tokens)
            finally:
                attention.ROW_WALK_MAX_T = saved
        return run

    ways = {"every row to the longest": program(False), "each row its own": program(True)}
    lengths = cases(args.longest, args.rows)
    cache = target.init_cache(args.rows, slots)
    tokens = jnp.ones((args.rows, 1), jnp.int32)
    seconds = {(case, way): [] for case in lengths for way in ways}
    outputs = {}
    for i in range(args.runs + 1):
        for case, row_lengths in lengths.items():
            for way, fn in ways.items():
                cache = cache.replace(lengths=jnp.asarray(row_lengths, jnp.int32))
                start = time.perf_counter()
                cache, chosen = jax.block_until_ready(fn(cache, tokens))
                if i:
                    seconds[case, way].append(time.perf_counter() - start)
                outputs.setdefault(case, {})[way] = np.asarray(chosen).tolist()
    name = os.path.basename(os.path.normpath(args.target))
    print(f"\nOne decode step of {args.rows} rows ({name}, {slots} slots, medians of {args.runs} alternating "
          f"calls, ms)\n")
    print("| row lengths | " + " | ".join(ways) + " | ratio |\n|---|" + "---|" * (len(ways) + 1))
    rows_out = []
    for case, row_lengths in lengths.items():
        ms = [1000 * statistics.median(seconds[case, way]) for way in ways]
        rows_out.append({"case": case, "lengths": row_lengths, **dict(zip(ways, ms)),
                         "same_tokens": len({tuple(v) for v in outputs[case].values()}) == 1})
        print(f"| {case} ({min(row_lengths)}-{max(row_lengths)}) | " + " | ".join(f"{m:.1f}" for m in ms)
              + f" | {ms[0] / ms[1]:.2f}x |")
    result = {"target": name, "rows": args.rows, "slots": slots, "runs": args.runs, "backend": jax.default_backend(),
              "jax": jax.__version__, "commit": _commit(), "cases": rows_out}
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
