"""Compile time of the decode programs, and tokens/s, for each way of running the target's layers.

Plain greedy and speculative (DFlash, and ReTrace with ``--retrace``) programs of a SmolLM2-135M-shaped
target (Llama, 30 layers, d 576, vocabulary 49,152: the first demo's model, random weights) with a random
2-layer, block-8 drafter. Each
program is traced, lowered and compiled by XLA with the persistent compilation cache off, and each
stage is timed on its own, ``--compile-repeats`` times round-robin (JAX's in-memory caches cleared
before each); then the compiled programs generate ``--tokens`` tokens at batch 1, round-robin, and the
table gives the medians.

    python benchmarks/compile_time.py                    # SmolLM2-135M's shapes (a few minutes on 2 cores)
    python benchmarks/compile_time.py --layers 4 --quick # a smoke run

XLA options: ``cpu`` are the options ``generate``'s programs compile with on CPU
(``retrace_jax.decoding.programs.cpu_compiler_options``: XLA's fast-compile preset; for the speculative
programs also Eigen instead of YNNPACK for products of several rows, where this XLA takes that option),
``cpu-preset`` the preset alone (what the plain programs use), ``default`` XLA's own.
Layer loops: ``unrolled`` is what ``generate`` runs on CPU (the per-layer weights that
``decode_weights`` keeps beside the target are arguments of the program); ``unrolled-sliced`` is the
same loop slicing those weights inside the program; ``scan`` is the accelerator default.
Random weights time compilation and decoding as well as real ones (no stop token is given, so every run
generates exactly ``--tokens`` tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import retrace_jax as rj  # noqa: E402
from benchmarks.report import write_json  # noqa: E402
from retrace_jax.decoding import programs  # noqa: E402
from retrace_jax.decoding.generation import bucket, prompt_bucket  # noqa: E402
from retrace_jax.decoding.layer_loop import decode_weights  # noqa: E402
from retrace_jax.decoding.plain import plain_generate  # noqa: E402
from retrace_jax.decoding.sampling import SamplingParams  # noqa: E402
from retrace_jax.decoding.speculative import speculative_generate  # noqa: E402
from retrace_jax.models.tiny import TINY_QWEN3, tiny_target  # noqa: E402

SMOLLM2_135M = dataclasses.replace(
    TINY_QWEN3, model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
    qk_norm=False)
VARIANTS = ("unrolled", "unrolled-sliced", "scan")
OPTIONS = ("cpu", "cpu-preset", "default")  # generate's CPU options, the preset alone, XLA's own


def jit_with(program, option):
    """The decode program jitted with the named compiler options (see the module docstring)."""
    if option == "cpu":
        return program.cpu
    if option == "default":
        return program.default
    return program.with_options(programs.CPU_COMPILER_OPTIONS)


def staged(fn, *args, **kwargs):
    """The compiled program and the seconds of each stage: tracing, lowering, XLA compilation."""
    t0 = time.perf_counter()
    traced = fn.trace(*args, **kwargs)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    return compiled, (t1 - t0, t2 - t1, t3 - t2)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=SMOLLM2_135M.num_layers)
    p.add_argument("--tokens", type=int, default=96, help="tokens generated per timed run")
    p.add_argument("--prompt-len", type=int, default=37)
    p.add_argument("--repeats", type=int, default=3, help="timed generations per program")
    p.add_argument("--compile-repeats", type=int, default=3, help="compilations per program")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--options", default=",".join(OPTIONS),
                   help="cpu: the compiler options generate uses on CPU; cpu-preset: XLA's fast-compile preset alone; "
                        "default: XLA's")
    p.add_argument("--retrace", action="store_true", help="also time a ReTrace program (random fusion weights)")
    p.add_argument("--quick", action="store_true", help="a small vocabulary and width: a smoke run")
    p.add_argument("--out", default=None, help="write the rows as JSON")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {VARIANTS}")
    if args.layers < 4:
        p.error("--layers must be at least 4 (the drafter's default feature layers need them)")
    options = args.options.split(",")
    if sorted(set(options) - set(OPTIONS)):
        p.error(f"unknown options {sorted(set(options) - set(OPTIONS))}; choose from {OPTIONS}")
    jax.config.update("jax_enable_compilation_cache", False)
    cfg = dataclasses.replace(SMOLLM2_135M, num_layers=args.layers)
    if args.quick:
        cfg = dataclasses.replace(cfg, vocab_size=512, hidden_size=128, intermediate_size=256, num_heads=4,
                                  num_kv_heads=2, head_dim=32)
    target = tiny_target(cfg=cfg)
    drafter = rj.init_drafter(cfg, mask_token_id=cfg.vocab_size - 1, num_layers=2, block_size=8)
    retrace_drafter = rj.init_drafter(cfg, mask_token_id=cfg.vocab_size - 1, num_layers=2, block_size=8,
                                      retrace=rj.ReTraceConfig())
    tdef, tstate = nnx.split(target)
    drafters = {"speculative": nnx.split(drafter), "retrace": nnx.split(retrace_drafter)}
    start = time.perf_counter()
    slices = jax.block_until_ready(decode_weights(target, "unrolled"))
    slice_s = time.perf_counter() - start

    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size - 1, args.prompt_len)
    tokens = np.zeros((1, prompt_bucket(args.prompt_len)), np.int32)
    tokens[0, : args.prompt_len] = prompt
    data = (tokens, np.asarray([args.prompt_len], np.int32), np.ones((1,), bool), np.int32(args.tokens),
            np.full((8,), -1, np.int32), SamplingParams.make())
    capacity = bucket(args.tokens)

    def program(method, variant, option):
        loop = "scan" if variant == "scan" else "unrolled"
        kept = slices if variant == "unrolled" else None
        if method == "plain":
            fn, fargs, dynamic = plain_generate, (tdef, tstate, *data), (tstate, *data)
            static = {"capacity": capacity, "layer_loop": loop}
        else:
            ddef, dstate = drafters[method]
            fn, fargs, dynamic = speculative_generate, (tdef, tstate, ddef, dstate, *data), (tstate, dstate, *data)
            static = {"capacity": capacity, "block_size": 8, "layer_loop": loop}
        return jit_with(fn, option), fargs, dynamic, static, kept

    methods = ("plain", "speculative") + (("retrace",) if args.retrace else ())
    configs = [(m, v, o) for m in methods for v in variants for o in options]
    stages, runs = {c: [] for c in configs}, {}
    for r in range(args.compile_repeats):  # round-robin; every compilation starts from empty in-memory caches
        for c in configs:
            fn, fargs, dynamic, static, kept = program(*c)
            jax.clear_caches()
            compiled, times = staged(fn, *fargs, **static, kept=kept)
            stages[c].append(times)
            print(f"{' '.join(c)}: trace {times[0]:.2f} s, lower {times[1]:.2f} s, XLA {times[2]:.2f} s", flush=True)
            if r == 0:
                runs[c] = functools.partial(compiled, *dynamic, kept=kept)  # a compiled program takes no static args
                jax.block_until_ready(runs[c]())  # the first run touches fresh memory
    seconds = {c: [] for c in configs}
    for _ in range(args.repeats):
        for c in configs:
            t0 = time.perf_counter()
            jax.block_until_ready(runs[c]())
            seconds[c].append(time.perf_counter() - t0)

    print(f"\n{cfg.model_type}, {cfg.num_layers} layers, d {cfg.hidden_size}, vocabulary {cfg.vocab_size}, float32, "
          f"batch 1, {args.tokens} tokens; compile times: medians of {args.compile_repeats}, decoding: median of "
          f"{args.repeats}; per-layer weights made in {slice_s:.2f} s; jax {jax.__version__}, "
          f"{jax.default_backend()}\n")
    print("| program | layer loop | XLA options | trace s | lower s | XLA compile s | total s | ms per token |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for c in configs:
        trace, lower, xla = (statistics.median(x) for x in zip(*stages[c]))
        total = statistics.median(sum(x) for x in stages[c])
        ms = 1e3 * statistics.median(seconds[c]) / args.tokens
        print(f"| {' | '.join(c)} | {trace:.2f} | {lower:.2f} | {xla:.2f} | {total:.2f} | {ms:.1f} |")
        rows.append({"program": c[0], "layer_loop": c[1], "options": c[2], "trace_s": trace, "lower_s": lower,
                     "compile_s": xla, "total_s": total, "ms_per_token": ms, "compile_stages_s": stages[c]})
    write_json({"rows": rows, "per_layer_weights_s": slice_s, "jax": jax.__version__}, args.out)


if __name__ == "__main__":
    main()
