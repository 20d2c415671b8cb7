"""Wall time of a ReTrace round against a DFlash round, measured side by side.

The same drafter runs with its ReTrace memory on and off (``use_retrace``). Its ReTrace module is
zero-initialised, so both runs make identical proposals and the same number of rounds: the time ratio
is the per-round overhead of the buffer shift and the fusion (all of which still execute).

    python benchmarks/retrace_overhead.py                  # tiny target (d=128)
    python benchmarks/retrace_overhead.py --width 1024 --layers 8 --vocab 32768
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import retrace_jax as rj  # noqa: E402
from benchmarks.report import report  # noqa: E402
from retrace_jax.models.tiny import TINY_QWEN3, tiny_target  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=TINY_QWEN3.hidden_size)
    p.add_argument("--layers", type=int, default=TINY_QWEN3.num_layers)
    p.add_argument("--vocab", type=int, default=TINY_QWEN3.vocab_size)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    heads = max(2, args.width // 64)
    cfg = dataclasses.replace(TINY_QWEN3, hidden_size=args.width, intermediate_size=3 * args.width,
                              num_layers=args.layers, num_heads=heads, num_kv_heads=max(1, heads // 4),
                              head_dim=64, vocab_size=args.vocab)
    target = tiny_target(cfg=cfg)
    drafter = rj.init_drafter(cfg, mask_token_id=args.vocab - 1, num_layers=1, block_size=args.block_size,
                              retrace=rj.ReTraceConfig())
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, args.vocab - 1, (12,)).tolist() for _ in range(args.batch)]
    runs = {"dflash": dict(use_retrace=False), "retrace": dict(use_retrace=True)}
    outs = {name: rj.generate(target, prompts, args.max_new_tokens, drafter=drafter, **kw) for name, kw in runs.items()}
    assert outs["dflash"] == outs["retrace"], "zero-initialised ReTrace must draft exactly as DFlash"
    rounds = sum(len(a) for a in outs["dflash"].acceptance_lengths)
    times = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, kw in runs.items():
            start = time.perf_counter()
            rj.generate(target, prompts, args.max_new_tokens, drafter=drafter, **kw)
            times[name].append(time.perf_counter() - start)
    med = {name: float(np.median(v)) for name, v in times.items()}
    result = {
        "target": f"random Qwen3-shaped, d={args.width}, {args.layers} layers, vocab {args.vocab}",
        "drafter": f"1 layer, block {args.block_size}", "batch": args.batch, "rounds_per_generation": rounds,
        "dflash_ms_per_round": round(1e3 * med["dflash"] / rounds, 4),
        "retrace_ms_per_round": round(1e3 * med["retrace"] / rounds, 4),
        "retrace_over_dflash": round(med["retrace"] / med["dflash"], 4),
    }
    report(result, args.out)


if __name__ == "__main__":
    main()
