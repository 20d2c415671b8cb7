"""The LM head and the greedy choice on CPU: a few rows against the vocabulary, as a verify pass or a
drafted block multiplies them at every round.

    python benchmarks/lm_head.py                          # the laboratory target's shape (d=256, V=4096)
    python benchmarks/lm_head.py --width 576 --vocab 49152  # SmolLM2-135M's

Times, in milliseconds per call (medians of 5 runs of ``--iters`` calls, one process), the product of
``rows`` hidden states with the head laid out ``[V, d]`` (the tied embedding, contracted on ``d``) and
``[d, V]`` (the copy that ``retrace_jax.decoding.layer_loop.decode_weights`` keeps), under XLA's default
CPU options (YNNPACK, which the decode programs use) and with ``SEVERAL_ROW_CPU_OPTIONS`` (Eigen); and
``jnp.argmax`` against the library's two-level ``argmax`` on the logits, and ``lax.top_k`` against its
two-level ``largest_k`` (``--top-k``, the ReTrace mixture's stale top-k).

    python benchmarks/lm_head.py --width 896 --vocab 151936 --rows 16   # Qwen2.5-0.5B's verify pass
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from retrace_jax.decoding.programs import CPU_COMPILER_OPTIONS, SEVERAL_ROW_CPU_OPTIONS  # noqa: E402
from retrace_jax.decoding.sampling import argmax, largest_k  # noqa: E402


def median_ms(fn, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        runs.append(1e3 * (time.perf_counter() - start) / iters)
    return float(np.median(runs))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--rows", default="1,8,16")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--top-k", type=int, default=8)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    head_vd = jnp.asarray(rng.normal(size=(args.vocab, args.width)).astype(np.float32))
    head_dv = jnp.asarray(np.asarray(head_vd).T.copy())
    options = {"YNNPACK": CPU_COMPILER_OPTIONS, "Eigen": {**CPU_COMPILER_OPTIONS, **SEVERAL_ROW_CPU_OPTIONS}}
    print(f"d={args.width}, V={args.vocab}, {jax.devices()[0].platform}")
    k = args.top_k
    print(f"| rows | options | [V, d] head | [d, V] head | jnp.argmax | two-level argmax | lax.top_k {k} "
          f"| two-level top {k} |")
    print("|---|---|---|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        hidden = jnp.asarray(rng.normal(size=(rows, args.width)).astype(np.float32))
        logits = hidden @ head_dv
        for name, opts in options.items():
            vd = jax.jit(lambda h, w: jnp.einsum("td,vd->tv", h, w), compiler_options=opts)
            dv = jax.jit(lambda h, w: jnp.dot(h, w), compiler_options=opts)
            plain = jax.jit(lambda x: jnp.argmax(x, -1), compiler_options=opts)
            two_level = jax.jit(argmax, compiler_options=opts)
            plain_k = jax.jit(lambda x: jax.lax.top_k(x, k), compiler_options=opts)
            two_level_k = jax.jit(lambda x: largest_k(x, k), compiler_options=opts)
            assert (np.asarray(plain(logits)) == np.asarray(two_level(logits))).all()
            assert all((np.asarray(a) == np.asarray(b)).all() for a, b in zip(plain_k(logits), two_level_k(logits)))
            times = [median_ms(f, *xs, iters=args.iters) for f, xs in (
                (vd, (hidden, head_vd)), (dv, (hidden, head_dv)), (plain, (logits,)), (two_level, (logits,)),
                (plain_k, (logits,)), (two_level_k, (logits,)))]
            print(f"| {rows} | {name} | " + " | ".join(f"{t:.3f}" for t in times) + " |", flush=True)


if __name__ == "__main__":
    main()
