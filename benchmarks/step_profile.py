"""Where a plain decode step's time goes on a GPU, read from a ``jax.profiler`` trace: the device kernels
of a few steps of ``plain_step`` per layer loop, summed by kernel name, with the time the device was busy
against the span from the first kernel to the last (the gaps are launches and waits).

    python benchmarks/step_profile.py                               # Qwen3-4B's shape, bf16, on a GPU
    python benchmarks/step_profile.py --loops scan --out /tmp/p.json
    JAX_PLATFORMS=cpu python benchmarks/step_profile.py --smoke      # checks the script anywhere

Random weights of the preset's shape (``benchmarks/device_check.py``'s presets), batch 1, a prompt of
``--context`` tokens, attention dense (what ``"auto"`` runs on a GPU) unless ``--attention`` says
otherwise. ``step_ms`` is the untraced median; the traced steps run slower (the profiler's own cost), so
read the kernels' shares, not their sum, against it. Only a GPU's trace is read: a TPU's device lines
also hold module and step events over its ops, which this summary would count as kernels, and a CPU's
XLA runtime reports no device kernels here (``benchmarks/round_profile.py`` reads the CPU's own events).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import sys
import tempfile
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.report import write_json  # noqa: E402


def kernel_summary(events: list[dict], steps: int, top: int = 30) -> dict:
    """Device kernels of a Chrome/Perfetto trace (``traceEvents``) of ``steps`` steps, per step: how many,
    the time some kernel ran (overlaps counted once), the span from the first kernel's start to the last
    one's end, and the ``top`` kernel names by time. Kernels are the complete events ("X") of the
    processes named ``/device:GPU:...`` (one line per stream)."""
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, n in names.items() if n.startswith("/device:GPU")}
    spans, by_name = [], defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in device:
            spans.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))))
            entry = by_name[e.get("name", "?")]
            entry[0] += float(e.get("dur", 0))
            entry[1] += 1
    spans.sort()
    busy, end = 0.0, float("-inf")
    for a, b in spans:  # the union of the kernels' intervals
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    span = (max(b for _, b in spans) - spans[0][0]) if spans else 0.0
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"kernels_per_step": len(spans) / steps, "busy_us_per_step": round(busy / steps, 1),
            "span_us_per_step": round(span / steps, 1),
            "top": [{"kernel": n, "us_per_step": round(t / steps, 1), "calls_per_step": c / steps}
                    for n, (t, c) in ranked]}


def parse_options(text: str) -> dict:
    """``"xla_gpu_enable_triton_gemm=false,xla_gpu_dot_merger_threshold_mb=0"`` as XLA compiler options
    for ``jax.jit(compiler_options=...)``: true/false as booleans, integers as integers. An item without
    ``=`` after an option continues its value, a list as XLA takes it
    (``xla_gpu_enable_command_buffer=FUSION,CUBLAS,WHILE``)."""
    options, key = {}, None
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep:
            if key is None or not isinstance(options[key], str) or not options[key]:
                raise ValueError(f"compiler option {item!r} is not key=value")
            options[key] += "," + item.strip()
            continue
        key, lowered = name.strip(), value.strip().lower()
        options[key] = (lowered == "true" if lowered in ("true", "false")
                        else int(value) if value.strip().lstrip("-").isdigit() else value.strip())
    return options


def profile_step(preset: str, loop: str, attention: str, context: int, steps: int, traced: int,
                 options: dict | None = None) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.device_check import PRESETS, plain_step_program
    from benchmarks.report import median_ms_from
    from retrace_jax.models.tiny import tiny_target

    cfg, _, _ = PRESETS[preset]
    target = tiny_target(cfg=cfg, dtype=jnp.float32 if preset == "smoke" else jnp.bfloat16)
    tdef, tstate = nnx.split(target)
    init, step, kept, tokens = plain_step_program(tdef, tstate, 1, context, steps + traced, attention, loop,
                                                  options or None)
    consts, carry = init(tstate, kept, tokens)
    ms = median_ms_from(lambda c: step(tstate, kept, consts, c), carry, steps)
    consts, carry = init(tstate, kept, tokens)
    carry = jax.block_until_ready(step(tstate, kept, consts, carry))  # compiled and warm before the trace
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(traced):
                carry = step(tstate, kept, consts, carry)
            jax.block_until_ready(carry)
        trace = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
        with gzip.open(trace[0]) as f:
            events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    return {"preset": preset, "layer_loop": loop, "attention": attention, "options": options or {},
            "context": context, "backend": jax.default_backend(), "step_ms": round(ms, 3), **kernel_summary(events, traced)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-4b")
    p.add_argument("--smoke", action="store_true", help="the tiny preset (any machine)")
    p.add_argument("--loops", default="unrolled,scan", help="layer loops to profile, comma-separated")
    p.add_argument("--attention", default="dense", help="the attention implementation (default: dense, what "
                   "\"auto\" runs on a GPU)")
    p.add_argument("--context", type=int, default=None, help="prompt tokens (default 1024; smoke: 64)")
    p.add_argument("--steps", type=int, default=20, help="untraced, timed steps for the median")
    p.add_argument("--traced", type=int, default=10, help="steps in the trace")
    p.add_argument("--top", type=int, default=12, help="kernels printed per profile")
    p.add_argument("--options", action="append", default=[],
                   help="XLA compiler options of the step's program, key=value,... (repeatable): each set is "
                        "profiled beside XLA's defaults, in the same process")
    p.add_argument("--out", default=None, help="JSON of every profile's summary (up to 30 kernels)")
    args = p.parse_args()
    preset = "smoke" if args.smoke else args.preset
    context = args.context or (64 if args.smoke else 1024)
    results = []
    configurations = [{}] + [parse_options(o) for o in args.options]
    for loop in args.loops.split(","):
        for options in configurations:
            r = profile_step(preset, loop, args.attention, context, args.steps, args.traced, options)
            results.append(r)
            print(f"\n{preset}, layer loop {loop}, attention {args.attention}, "
                  f"options {options or 'default'}, context {context} ({r['backend']}): "
                  f"step {r['step_ms']} ms untraced; traced, per step: {r['kernels_per_step']:.0f} kernels, "
                  f"busy {r['busy_us_per_step']} us of a {r['span_us_per_step']} us span\n")
            print("| kernel | us per step | calls per step |\n|---|---|---|")
            for k in r["top"][:args.top]:
                print(f"| {k['kernel'][:80]} | {k['us_per_step']} | {k['calls_per_step']:g} |")
            write_json(results, args.out)


if __name__ == "__main__":
    main()
