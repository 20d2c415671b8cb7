"""Per-device memory of a training step, computed ahead of time without weights or accelerators.

    python benchmarks/train_memory.py --config configs/qwen3_4b_retrace.yaml --target qwen3-4b --devices 8
    python benchmarks/train_memory.py --config configs/qwen3_4b_b16.yaml --target qwen3-4b --devices 8 \\
        --set train.mesh=fsdp=8

The step of the configuration is built on abstract arrays for a target of the given shapes
(retrace_jax.training.memory), placed on a mesh of ``--devices`` CPU devices, compiled, and XLA's
``memory_analysis()`` is printed per device: arguments (target and drafter weights, optimizer state,
batch), outputs, temporaries, aliased (donated) buffers and the peak they add up to, and XLA's count of
floating-point operations per device per step (it counts a loop body once: layers run under ``lax.scan``
are undercounted). The numbers are
XLA:CPU's; TPU and GPU compilers schedule differently, so treat them as an estimate of the same program.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--target", choices=["qwen3-4b", "qwen3-8b", "tiny"], required=True)
    p.add_argument("--devices", type=int, default=8, help="CPU devices standing in for the accelerators")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    from retrace_jax.models.tiny import TINY_QWEN3
    from retrace_jax.parallel.sharding import make_mesh
    from retrace_jax.training.config import load_config
    from retrace_jax.training.memory import (
        QWEN3_4B,
        QWEN3_8B,
        abstract_step,
        memory_report,
        per_device_bytes,
        step_flops,
    )

    cfg = load_config(args.config, args.set)
    target_cfg = {"qwen3-4b": QWEN3_4B, "qwen3-8b": QWEN3_8B, "tiny": TINY_QWEN3}[args.target]
    mesh = make_mesh(cfg.train.mesh)
    start = time.perf_counter()
    step, step_args = abstract_step(cfg, target_cfg, mesh)
    compiled = step.lower(*step_args).compile()
    mem = memory_report(compiled)
    gib = lambda n: round(n / 2**30, 2)  # noqa: E731
    print(json.dumps({
        "config": args.config, "target": args.target, "overrides": args.set, "mesh": dict(mesh.shape),
        "batch_size": cfg.train.batch_size, "seq_len": cfg.train.seq_len, "num_anchors": cfg.train.num_anchors,
        "per_device_gib": {k: gib(v) for k, v in mem.items() if k != "generated_code"},
        "weights_gib": {"target": gib(per_device_bytes(step_args[0])), "drafter": gib(per_device_bytes(step_args[1])),
                        "optimizer": gib(per_device_bytes(step_args[2]))},
        "tflop_per_device_per_step": round(step_flops(compiled) / 1e12, 2),
        "compile_seconds": round(time.perf_counter() - start, 1),
    }))


if __name__ == "__main__":
    main()
