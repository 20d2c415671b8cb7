"""Compile time and per-round time of sharded generation on an 8-device CPU mesh next to one device.

Runs in its own process (sets XLA_FLAGS before importing jax). Random Qwen3-shaped target and drafter;
batch 8; each mesh is timed after compilation, alternating with the single-device run.

    python benchmarks/sharded_timing.py [--width 512 --layers 4]
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import retrace_jax as rj  # noqa: E402
from benchmarks.report import write_json  # noqa: E402
from retrace_jax.models.tiny import TINY_QWEN3, tiny_target  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cfg = dataclasses.replace(TINY_QWEN3, hidden_size=args.width, intermediate_size=3 * args.width,
                              num_layers=args.layers, num_heads=args.width // 32, num_kv_heads=8, head_dim=32,
                              vocab_size=4096)
    target = tiny_target(cfg=cfg)
    drafter = rj.init_drafter(cfg, mask_token_id=cfg.vocab_size - 1, num_layers=1, block_size=8)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, cfg.vocab_size - 1, (12,)).tolist() for _ in range(8)]
    rows = []
    meshes = [None, "data=8", "data=2,tensor=4", "tensor=8"]
    for method, kw in (("plain", {}), ("dflash", {"drafter": drafter})):
        for spec in meshes:
            mesh = rj.make_mesh(spec) if spec else None
            t = rj.shard_model(target, mesh) if mesh else target
            d = rj.shard_model(drafter, mesh) if (mesh and "drafter" in kw) else kw.get("drafter")
            call = dict(max_new_tokens=args.max_new_tokens, mesh=mesh, **({"drafter": d} if d is not None else {}))
            start = time.perf_counter()
            out = rj.generate(t, prompts, **call)
            compile_s = time.perf_counter() - start
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                rj.generate(t, prompts, **call)
                times.append(time.perf_counter() - start)
            rounds = max(len(a) for a in out.acceptance_lengths)
            rows.append({"method": method, "mesh": spec or "1 device", "first_call_s": round(compile_s, 2),
                         "ms_per_round": round(1e3 * float(np.median(times)) / rounds, 3)})
    base = {r["method"]: r for r in rows if r["mesh"] == "1 device"}
    print(f"target: random Qwen3-shaped d={args.width}, {args.layers} layers; batch 8; {args.max_new_tokens} new tokens")
    print("| method | mesh | first call (compile) s | ratio | ms per round | ratio |\n|---|---|---|---|---|---|")
    for r in rows:
        b = base[r["method"]]
        r["first_call_ratio"] = round(r["first_call_s"] / b["first_call_s"], 2)
        r["round_ratio"] = round(r["ms_per_round"] / b["ms_per_round"], 2)
        print(f"| {r['method']} | {r['mesh']} | {r['first_call_s']} | {r['first_call_ratio']} | "
              f"{r['ms_per_round']} | {r['round_ratio']} |")
    write_json(rows, args.out)


if __name__ == "__main__":
    main()
