"""Long contexts: decode cost against buffer size and filled length, prefill time and peak memory.

    python benchmarks/long_context.py                      # everything below, random Qwen3 d=256, 4 layers
    python benchmarks/long_context.py --sections buffer    # one section: buffer | filled | prefill
    python benchmarks/long_context.py --quick              # small sizes (a smoke run)

- **buffer**: the same greedy tokens (about 120, ended by a stop token found in a reference run) with
  buffers from 256 to 32K slots (``max_new_tokens`` sets the buffer), plain and speculative (a random
  2-layer drafter, block 8; τ near 1, so it shows the cost of a round). Milliseconds per generated token
  and the ratio to the smallest buffer: with attention that walks only the filled part of the cache the
  ratio stays near 1.
- **filled**: one plain step and one speculative round against the filled length (the prompt length)
  in caches of 32K slots: the library's ``plain_step`` and ``speculative_round`` jitted alone, started
  from the same state each time (medians of ``--steps`` calls).
- **prefill**: prompts of 1K to 32K tokens, each in a fresh process: prefill time (a generation of one
  token), the first call's time, compile time and the process's peak resident memory.

Times are medians of ``--repeats`` runs after compiling (in the buffer section, every configuration is
compiled first and the runs then go round-robin). ``first_call_s`` is the first call (compiling plus
one run); ``compile_s`` is the part of it that JAX spent tracing, lowering and compiling with XLA, as
JAX times those stages (``retrace_jax.decoding.programs.compile_seconds``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import retrace_jax as rj  # noqa: E402
from benchmarks.report import median_ms_from  # noqa: E402
from retrace_jax.decoding.plain import PlainStepper  # noqa: E402
from retrace_jax.decoding.programs import compile_seconds  # noqa: E402
from retrace_jax.decoding.sampling import SamplingParams  # noqa: E402
from retrace_jax.decoding.speculative import SpeculativeStepper  # noqa: E402
from retrace_jax.models.tiny import TINY_QWEN3, tiny_target  # noqa: E402


def model(width: int, layers: int, vocab: int):
    heads = max(2, width // 64)
    cfg = dataclasses.replace(TINY_QWEN3, hidden_size=width, intermediate_size=3 * width, num_layers=layers,
                              num_heads=heads, num_kv_heads=max(1, heads // 2), head_dim=64, vocab_size=vocab,
                              max_position_embeddings=70000)
    target = tiny_target(cfg=cfg)
    drafter = rj.init_drafter(cfg, mask_token_id=vocab - 1, num_layers=2, block_size=8, seed=1)
    return target, drafter


def first_call(fn):
    """``fn()``, the seconds it took and the seconds JAX spent compiling in it."""
    start = time.perf_counter()
    with compile_seconds() as stages:
        out = fn()
    return out, time.perf_counter() - start, sum(stages.values())


def timed(fn, repeats: int):
    """The output, the first call's seconds, its compile seconds and the median of ``repeats`` calls."""
    out, first_s, compile_s = first_call(fn)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return out, first_s, compile_s, float(np.median(times))


def stop_at(tokens: list[int], n: int) -> tuple[int, int]:
    """A stop token that first occurs at index ``i >= n`` of ``tokens``, and ``i + 1`` (the count)."""
    for i in range(n, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return tokens[i], i + 1
    raise RuntimeError(f"no token first occurs after index {n}; use another seed")


def buffer_section(args, target, drafter):
    prompt = [[(7 * i) % (target.cfg.vocab_size - 2) + 1 for i in range(16)]]
    ref = rj.generate(target, prompt, 256).tokens[0]
    stop, count = stop_at(ref, args.tokens)
    runs = {}
    for slots in args.buffers:
        for name, kwargs in (("plain", {}), ("speculative", {"drafter": drafter})):
            max_new = slots - 16 - (8 if kwargs else 0)  # prompt bucket 16 (+ block 8): the buffer is `slots`
            runs[name, slots] = lambda max_new=max_new, kwargs=kwargs: rj.generate(
                target, prompt, max_new, stop_token_ids=[stop], **kwargs)
    compiled, times = {}, {key: [] for key in runs}
    for key, run in runs.items():  # compile every configuration first
        out, _, compiled[key] = first_call(run)
        assert out.tokens[0] == ref[:count], "the tokens changed with the buffer size"
    for _ in range(args.repeats):  # then time them round-robin, so that load changes hit all alike
        for key, run in runs.items():
            start = time.perf_counter()
            run()
            times[key].append(time.perf_counter() - start)
    rows = []
    for (name, slots), t in times.items():
        rows.append({"section": "buffer", "method": name, "buffer_slots": slots, "tokens": count,
                     "ms_per_token": round(1e3 * float(np.median(t)) / count, 3),
                     "compile_s": round(compiled[name, slots], 2)})
    for row in rows:
        base = next(r for r in rows if r["method"] == row["method"])
        row["vs_smallest_buffer"] = round(row["ms_per_token"] / base["ms_per_token"], 2)
    return rows


def filled_section(args, target, drafter):
    """One plain step and one speculative round timed alone (the library's ``plain_step`` and
    ``speculative_round`` through ``PlainStepper`` and ``SpeculativeStepper``: jitted with the carry
    donated as in the loop, with the layer loop that ``generate`` uses) on caches of ``filled_buffer``
    slots holding ``filled`` positions, each call started from a copy of the same state."""
    sampling, stops = SamplingParams.make(), jnp.full((8,), -1, jnp.int32)
    rows = []
    for filled in args.filled:
        tokens = jnp.asarray(np.random.default_rng(filled).integers(1, target.cfg.vocab_size - 2, (1, filled)),
                             jnp.int32)
        lens, live = jnp.full((1,), filled, jnp.int32), jnp.ones((1,), bool)
        capacity = args.filled_buffer - filled - 8
        plain = PlainStepper(target, capacity=capacity)
        carry = plain.init(tokens, lens, live, 10**6, stops, sampling)
        stepper = SpeculativeStepper(target, drafter, capacity=capacity, block_size=8)
        first = stepper.init(tokens, lens, live, 10**6, stops, sampling)

        def one_step(state):
            plain.carry = state
            return plain.step().last_b

        def one_round(state):
            stepper.carry = state
            return stepper.step().accepted_b

        ms_step = median_ms_from(one_step, carry, args.steps)
        ms_round = median_ms_from(one_round, first, args.steps)
        rows.append({"section": "filled", "buffer_slots": first.target_cache.max_len, "filled": filled,
                     "plain_step_ms": round(ms_step, 3), "speculative_round_ms": round(ms_round, 3)})
    return rows


def prefill_one(args, length: int) -> dict:
    """Runs in a fresh process: prefill time, compile time and peak memory of one prompt length."""
    target, _ = model(args.width, args.layers, args.vocab)
    prompt = [np.random.default_rng(length).integers(1, args.vocab - 2, length).tolist()]
    _, first_s, compile_s, run_s = timed(lambda: rj.generate(target, prompt, 1), args.repeats)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"section": "prefill", "prompt": length, "prefill_s": round(run_s, 3), "first_call_s": round(first_s, 2),
            "compile_s": round(compile_s, 2), "peak_rss_mib": round(peak_mib)}


def prefill_section(args):
    rows = []
    for length in args.prompts:
        cmd = [sys.executable, os.path.abspath(__file__), "--prefill-one", str(length), "--width", str(args.width),
               "--layers", str(args.layers), "--vocab", str(args.vocab), "--repeats", str(args.repeats)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            rows.append({"section": "prefill", "prompt": length, "error": out.stderr.strip().splitlines()[-1:]})
        else:
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def table(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="buffer,filled,prefill")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=120, help="about this many tokens in the buffer section")
    p.add_argument("--buffers", default="256,1024,4096,16384,32768")
    p.add_argument("--filled", default="256,1024,4096,16384")
    p.add_argument("--filled-buffer", type=int, default=32768)
    p.add_argument("--prompts", default="1024,4096,16384,32768")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="timed calls per size in the filled section")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    p.add_argument("--prefill-one", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="write the rows as JSON")
    args = p.parse_args()
    if args.quick:
        args.buffers, args.filled, args.filled_buffer, args.prompts = "256,2048", "256,1024", 2048, "512,2048"
        args.tokens = 40
    for key in ("buffers", "filled", "prompts"):
        setattr(args, key, [int(x) for x in getattr(args, key).split(",") if x])
    if args.prefill_one:
        print(json.dumps(prefill_one(args, args.prefill_one)))
        return
    rj.enable_compilation_cache(os.environ.get("RETRACE_JAX_CACHE_DIR", ""))  # off unless asked for
    print(f"random Qwen3 d={args.width}, {args.layers} layers, vocab {args.vocab}; batch 1, float32, "
          f"{jax.devices()[0].platform}; medians of {args.repeats} runs", flush=True)
    sections = args.sections.split(",")
    rows = []
    if "buffer" in sections or "filled" in sections:
        target, drafter = model(args.width, args.layers, args.vocab)
        if "buffer" in sections:
            rows += buffer_section(args, target, drafter)
            print(table([r for r in rows if r["section"] == "buffer"]) + "\n", flush=True)
        if "filled" in sections:
            rows += filled_section(args, target, drafter)
            print(table([r for r in rows if r["section"] == "filled"]) + "\n", flush=True)
    if "prefill" in sections:
        rows += prefill_section(args)
        print(table([r for r in rows if r["section"] == "prefill"]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
