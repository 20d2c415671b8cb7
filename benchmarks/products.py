"""Whether bfloat16 products pay on this machine: one dense layer's product ``x [rows, din] @ w [din, dout]``
in float32 against bfloat16 operands with float32 accumulation, as ``target_precision: bfloat16`` and
``train.precision: bfloat16`` compute them (``retrace_jax.models.layers.products``), in GFLOP/s.

    python benchmarks/products.py                        # Qwen2.5-0.5B's MLP up projection (896 x 4864)
    python benchmarks/products.py --rows 1,16,64,256 --din 896 --dout 896 --json out.json

Whether bfloat16 is faster depends on the CPU: with AVX-512 BF16 (or AMX) it can be about twice as fast
at 8-64 rows; without them XLA converts the operands and multiplies in float32, slower than float32 alone
(most of all at one row). The table names the CPU and the flags it has. Medians of 5 runs of ``--iters``
calls each, float32 and bfloat16 alternating, in one process; the weights are rounded to bfloat16 once,
outside the timed calls, as ``bfloat16_kernels`` rounds a target's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = ("avx512f", "avx512_bf16", "amx_bf16", "avx2")


def cpu_description() -> dict:
    """The CPU's model name and which of :data:`FLAGS` it has (Linux; empty elsewhere)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and ":" in line:
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and ":" in line:
                    flags = set(line.split(":", 1)[1].split())
                if flags and name:
                    break
    except OSError:
        pass
    return {"cpu": name, "flags": [f for f in FLAGS if f in flags]}


def product(precision: str):
    """The jitted product of one precision: float32 operands, or bfloat16 ones accumulated in float32."""
    if precision == "float32":
        return jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
    if precision == "bfloat16":
        return jax.jit(lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32))
    raise ValueError(f"precision is float32 or bfloat16, got {precision!r}")


def measure(rows: int, din: int, dout: int, iters: int, runs: int = 5, seed: int = 0) -> dict:
    """GFLOP/s of each precision at ``rows`` (medians of ``runs`` alternating runs) and their ratio."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(rows, din)).astype(np.float32))
    w32 = jnp.asarray((rng.normal(size=(din, dout)) / np.sqrt(din)).astype(np.float32))
    weights = {"float32": w32, "bfloat16": w32.astype(jnp.bfloat16)}
    fns = {p: product(p) for p in weights}
    for p, fn in fns.items():
        jax.block_until_ready(fn(x, weights[p]))
    seconds: dict[str, list[float]] = {p: [] for p in fns}
    for _ in range(runs):
        for p, fn in fns.items():
            start = time.perf_counter()
            for _ in range(iters):
                out = fn(x, weights[p])
            jax.block_until_ready(out)
            seconds[p].append((time.perf_counter() - start) / iters)
    flop = 2.0 * rows * din * dout
    rate = {p: flop / float(np.median(s)) / 1e9 for p, s in seconds.items()}
    return {"rows": rows, "float32_gflops": rate["float32"], "bfloat16_gflops": rate["bfloat16"],
            "bfloat16_over_float32": rate["bfloat16"] / rate["float32"]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,16,64", help="comma-separated row counts")
    p.add_argument("--din", type=int, default=896)
    p.add_argument("--dout", type=int, default=4864)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        p.error(f"--rows takes comma-separated integers, got {args.rows!r}")
    if any(r < 1 for r in rows) or args.din < 1 or args.dout < 1 or args.iters < 1 or args.runs < 1:
        p.error("--rows, --din, --dout, --iters and --runs must be positive")
    cpu = cpu_description()
    result = {**cpu, "backend": jax.default_backend(), "jax": jax.__version__, "din": args.din, "dout": args.dout,
              "runs": args.runs, "iters": args.iters,
              "rows": [measure(r, args.din, args.dout, args.iters, args.runs) for r in rows]}
    print(f"{cpu['cpu']} ({', '.join(cpu['flags']) or 'none of ' + ', '.join(FLAGS)}), {result['backend']}, "
          f"jax {jax.__version__}: x [rows, {args.din}] @ w [{args.din}, {args.dout}], medians of {args.runs}")
    print("| rows | float32 GFLOP/s | bfloat16 operands GFLOP/s | bfloat16 / float32 |")
    print("|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['rows']} | {r['float32_gflops']:.1f} | {r['bfloat16_gflops']:.1f} | "
              f"{r['bfloat16_over_float32']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
