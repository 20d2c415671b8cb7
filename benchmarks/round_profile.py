"""Where a plain step's and a speculative round's time goes, read from a profile of XLA's CPU runtime:
the matrix products, the attention walks over the KV caches (the nested loops), and every other kernel.
It gives the bound that the products alone put on the speedup: a round cannot cost fewer plain steps
than its products do, so a drafter with acceptance τ can be at most ``τ / (round's products / plain
step)`` times faster, whatever the rest of the round is made of.

    python benchmarks/round_profile.py                              # the laboratory pair, block 8
    python benchmarks/round_profile.py --block-size 16 --prompts 8

CPU only. The programs are those ``rj.generate`` runs (with XLA's per-kernel trace events switched on);
``--prompts`` held-out file starts of the laboratory target (as ``benchmarks/speedup.py --prompt-set
starts``), greedy. Each kernel XLA launches is one trace event named after its HLO instruction:
``ynn_fusion`` / ``dot`` are products, a ``while`` inside the decode loop is one attention walk (the
kernels it runs are counted in it), the rest is "other". The trace slows each kernel by a microsecond
or two, so the traced times run above the untraced wall times, the plain step's most (it has more
kernels per unit of work); the bound compares the round's traced products with the plain step's
untraced wall time, so it errs towards a lower speedup by at most that. The host's other tenants move
both, so run it more than once. A long and a short generation are profiled
and subtracted, so the prefill and the per-call costs cancel out and what is left is per iteration of
the decode loop.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "lab"))

RUNTIME_EVENTS = ("ThunkExecutor", "Threadpool", "Slinky", "end:")  # the runtime's own events, not kernels
CATEGORIES = ("products", "walks", "other")


def category(name: str) -> str:
    if name.startswith(("ynn_fusion", "dot", "xnn_fusion", "onednn")):
        return "products"
    return "walks" if name.startswith("while") else "other"


def kernel_times(xspace_path: str) -> tuple[dict, dict]:
    """Microseconds and kernel counts by category in a profile. A ``while`` event that encloses no other
    ``while`` is a walk: its time counts as walk time, and it counts as many kernels as it ran (itself
    and those inside it). One that does enclose others (a loop of loops) counts for nothing itself."""
    from jax.profiler import ProfileData

    totals, kernels = collections.Counter(), collections.Counter()
    for plane in ProfileData.from_file(xspace_path).planes:
        for line in plane.lines:
            events = sorted(((e.start_ns, e.duration_ns, e.name) for e in line.events
                             if not any(r in e.name for r in RUNTIME_EVENTS) and "::" not in e.name
                             and not e.name.startswith(("$", "Pjit", "np.", "Array", "Parse", "Common"))),
                            key=lambda e: (e[0], -e[1]))
            whiles = [e for e in events if e[2].startswith("while")]
            outer = {w for w in whiles if any(o is not w and w[0] <= o[0] and o[0] + o[1] <= w[0] + w[1]
                                              for o in whiles)}
            walk_end = -1.0
            for start, duration, name in events:
                if (start, duration, name) in outer:
                    continue
                kernels["walks" if start < walk_end else category(name)] += 1
                if start < walk_end:  # inside a walk: its time is the walk's
                    continue
                totals[category(name)] += duration / 1e3
                if name.startswith("while"):
                    walk_end = start + duration
    return dict(totals), dict(kernels)


def profile(fn, label: str):
    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with tempfile.TemporaryDirectory(prefix=f"round_profile_{label}_") as d:
        jax.profiler.start_trace(d, profiler_options=options)
        try:
            count = fn()
        finally:
            jax.profiler.stop_trace()
        (path,) = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        return kernel_times(path), count


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=os.path.join(ROOT, "lab", "target"))
    p.add_argument("--drafter", default=os.path.join(ROOT, "lab", "drafters", "B"))
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--start-tokens", type=int, default=96)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--short-new-tokens", type=int, default=24)
    p.add_argument("--passes", type=int, default=5, help="passes of the untraced wall-time measurement")
    args = p.parse_args(argv)
    import jax

    if jax.default_backend() != "cpu":
        raise SystemExit("round_profile reads XLA's CPU runtime events; run it on CPU (JAX_PLATFORMS=cpu)")
    from transformers import AutoTokenizer

    import retrace_jax as rj
    from benchmarks.speedup import held_out_starts
    from retrace_jax.decoding import programs
    from retrace_jax.decoding.plain import plain_generate
    from retrace_jax.decoding.speculative import speculative_generate

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = held_out_starts(tokenizer, args.prompts, args.start_tokens)
    target = rj.load_target(args.target)
    drafter = rj.load_drafter(args.drafter, target)
    spec_name = f"round, block {args.block_size}"
    methods = {"plain step": {}, spec_name: {"drafter": drafter, "block_size": args.block_size}}

    def run(new_tokens, kwargs):  # (iterations of the decode loop, tokens)
        iterations = tokens = 0
        for prompt in prompts:
            out = rj.generate(target, [prompt], new_tokens, **kwargs)
            iterations += len(out.acceptance_lengths[0])
            tokens += len(out.tokens[0])
        return iterations, tokens

    def per_iteration_ms(kwargs):
        """Per iteration: a long minus a short generation over their iteration counts; per call (the
        prefill, the drafter's context, the host's work): what the long one took beyond its iterations."""
        (t_long, (n_long, _)), (t_short, (n_short, _)) = (timed(run, n, kwargs) for n in
                                                          (args.max_new_tokens, args.short_new_tokens))
        per = (t_long - t_short) / (n_long - n_short)
        return 1e3 * per, 1e3 * (t_long - per * n_long) / len(prompts), 1e3 * t_long / len(prompts)

    # Wall time per iteration without trace events, as generate compiles the programs (the first pass
    # compiles; the median of the others, methods alternating).
    wall = collections.defaultdict(list)
    for k in range(args.passes + 1):
        for name, kwargs in methods.items():
            ms = per_iteration_ms(kwargs)
            if k:
                wall[name].append(ms)
    wall = {name: np.median(np.asarray(v), axis=0) for name, v in wall.items()}  # [per iteration, per call, call]

    programs.CPU_COMPILER_OPTIONS = dict(programs.CPU_COMPILER_OPTIONS, xla_cpu_enable_xprof_traceme=True)
    for program in (plain_generate, speculative_generate):
        program.__dict__.pop("cpu", None)  # compiled again, with the trace events
    rows = {}
    for name, kwargs in methods.items():
        run(args.max_new_tokens, kwargs), run(args.short_new_tokens, kwargs)  # compile both sizes
        (long_t, long_k), (long_n, tokens) = profile(lambda: run(args.max_new_tokens, kwargs), "long")
        (short_t, short_k), (short_n, _) = profile(lambda: run(args.short_new_tokens, kwargs), "short")
        n = long_n - short_n
        traced = {c: (long_t.get(c, 0.0) - short_t.get(c, 0.0)) / n / 1e3 for c in CATEGORIES}
        count = {c: (long_k.get(c, 0) - short_k.get(c, 0)) / n for c in CATEGORIES}
        rows[name] = {"wall_ms": float(wall[name][0]), "traced_ms": sum(traced.values()), **traced,
                      "product_kernels": count["products"], "kernels": sum(count.values()), "tau": tokens / long_n}
    print(f"{len(prompts)} prompts of {args.start_tokens} tokens, greedy; per iteration of the decode loop "
          f"({args.max_new_tokens} minus {args.short_new_tokens} new tokens). wall: untraced, median of "
          f"{args.passes}; traced: the kernels' times from XLA's trace events (the trace slows each kernel by "
          f"a microsecond or two)")
    print("| program | wall ms | traced ms | products | walks | other | kernels run (products) |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['wall_ms']:.3f} | {r['traced_ms']:.3f} | {r['products']:.3f} | {r['walks']:.3f} | "
              f"{r['other']:.3f} | {r['kernels']:.0f} ({r['product_kernels']:.0f}) |")
    plain, spec = rows["plain step"], rows[spec_name]
    steps, floor = spec["wall_ms"] / plain["wall_ms"], spec["products"] / plain["wall_ms"]
    fixed, calls = {n: float(wall[n][1]) for n in rows}, {n: float(wall[n][2]) for n in rows}
    print(f"\nPer call beyond its iterations: plain {fixed['plain step']:.1f} ms, speculative {fixed[spec_name]:.1f} ms; "
          f"whole calls of {args.max_new_tokens} new tokens: {calls['plain step']:.1f} and {calls[spec_name]:.1f} ms "
          f"({calls['plain step'] / calls[spec_name]:.2f}x).")
    print(f"τ {spec['tau']:.2f}. A round costs {steps:.2f} plain steps (wall): {spec['tau'] / steps:.2f}x per "
          f"iteration. Its products alone cost {floor:.2f} plain steps: at most {spec['tau'] / floor:.2f}x at this τ "
          f"if nothing else in the round took any time.")
    return rows


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


if __name__ == "__main__":
    main()
