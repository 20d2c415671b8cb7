"""Kernels per plain step and per speculative round, read from the compiled programs.

    python benchmarks/loop_kernels.py                     # random Qwen3 (4 layers) with a 1-layer drafter
    python benchmarks/loop_kernels.py --layers 30 --width 576 --vocab 49152 --drafter-layers 2

Each instruction at the top level of a decode loop's body that does work (a fusion, a dot, a copy, a
slice, a scatter, a custom call, ...) is one kernel that the loop launches at every iteration: on a CPU
each costs microseconds of dispatch, on a GPU one kernel launch. Instructions that only name buffers
(parameters, tuples, get-tuple-element, bitcasts, constants) are not counted; a nested loop (the
attention walk over cache chunks) counts as one, and its own body is counted apart. Prints a table of
counts by opcode for the plain step and the speculative round, as XLA compiles them for this backend
with the options ``generate`` uses; ``--out`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import sys

import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import retrace_jax as rj  # noqa: E402
from benchmarks.hlo import computations, entry_loops  # noqa: E402
from retrace_jax.decoding.buffers import empty_cache  # noqa: E402
from retrace_jax.decoding.layer_loop import decode_weights  # noqa: E402
from retrace_jax.decoding.plain import plain_generate  # noqa: E402
from retrace_jax.decoding.sampling import SamplingParams  # noqa: E402
from retrace_jax.decoding.speculative import speculative_generate  # noqa: E402
from retrace_jax.models.target import TargetModel  # noqa: E402
from retrace_jax.models.tiny import TINY_QWEN3  # noqa: E402

NOT_KERNELS = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "opt-barrier"}


def opcode(line: str) -> str | None:
    m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (?:\(.*?\)|[\w\[\]\d,{}:()]+?) ([\w\-]+)\(", line)
    return m.group(1) if m else None


def loop_kernels(hlo: str) -> list[collections.Counter]:
    """Kernel counts by opcode of each while loop's body in the entry computation (its outermost loops)."""
    comps = computations(hlo)
    out = []
    for body in entry_loops(hlo):
        counts = collections.Counter(op for op in map(opcode, comps[body]) if op and op not in NOT_KERNELS)
        out.append(counts)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=TINY_QWEN3.hidden_size)
    p.add_argument("--vocab", type=int, default=TINY_QWEN3.vocab_size)
    p.add_argument("--drafter-layers", type=int, default=1)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--layer-loop", default="auto", choices=["auto", "scan", "unrolled"])
    p.add_argument("--capacity", type=int, default=64,
                   help="new-token capacity of the compiled programs (caches of more than 512 slots walk "
                        "chunks of 512 and of 128)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cfg = dataclasses.replace(TINY_QWEN3, num_layers=args.layers, hidden_size=args.width,
                              intermediate_size=3 * args.width, vocab_size=args.vocab)
    target = TargetModel(cfg, rngs=nnx.Rngs(0))
    drafter = rj.init_drafter(cfg, mask_token_id=cfg.vocab_size - 1, num_layers=args.drafter_layers,
                              block_size=args.block_size)
    tokens = np.zeros((1, 16), np.int32)
    call = (tokens, np.asarray([8], np.int32), np.ones((1,), bool), np.int32(args.capacity), np.full((8,), -1, np.int32),
            SamplingParams.make())
    (tdef, tstate), (ddef, dstate) = nnx.split(target), nnx.split(drafter)
    slices = decode_weights(target, args.layer_loop, tstate)
    common = dict(capacity=args.capacity, layer_loop=args.layer_loop, kept=slices)
    # As generate calls them: decoding in donated spare caches (retrace_jax/decoding/buffers.py). Without
    # them a program makes its caches itself, and XLA copies a small cache that it cannot update in place.
    plain_len, spec_len = tokens.shape[1] + args.capacity, tokens.shape[1] + args.capacity + args.block_size
    programs = {
        "plain step": plain_generate.lower(tdef, tstate, *call, **common,
                                           spare=empty_cache(cfg, 1, plain_len, target.dtype)),
        "speculative round": speculative_generate.lower(
            tdef, tstate, ddef, dstate, *call, block_size=args.block_size, **common,
            spare=(empty_cache(cfg, 1, spec_len, target.dtype), empty_cache(drafter.cfg, 1, spec_len, drafter.dtype))),
    }
    rows = {}
    for name, lowered in programs.items():
        counts = loop_kernels(lowered.compile().as_text())
        rows[name] = max(counts, key=lambda c: sum(c.values()))  # the decode loop (the largest body)
    ops = sorted({op for c in rows.values() for op in c}, key=lambda op: -sum(c[op] for c in rows.values()))
    print(f"random Qwen3, {args.layers} layers, d={args.width}, vocab {args.vocab}; drafter "
          f"{args.drafter_layers} layer(s), block {args.block_size}; layer loop {args.layer_loop}; "
          f"capacity {args.capacity}")
    print("| opcode | " + " | ".join(rows) + " |")
    print("|---|" + "---|" * len(rows))
    for op in ops:
        print(f"| {op} | " + " | ".join(str(rows[n][op]) for n in rows) + " |")
    print("| **kernels** | " + " | ".join(str(sum(rows[n].values())) for n in rows) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({n: dict(c) for n, c in rows.items()}, f, indent=1)
    return {n: sum(c.values()) for n, c in rows.items()}


if __name__ == "__main__":
    main()
