"""Per-round latency split of speculative decoding against one plain decode step, each piece jitted
and timed alone (batch 1, after compilation): the plain step, the drafter's block, the target's
verification of the block, and the drafter context-cache update.

    python benchmarks/round_latency.py                          # the tiny target (d=128)
    python benchmarks/round_latency.py --width 1024 --layers 8 --vocab 32768
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import retrace_jax as rj  # noqa: E402
from benchmarks.report import report  # noqa: E402
from retrace_jax.speculative_loop import draft_block  # noqa: E402
from retrace_jax.tiny import TINY_QWEN3, tiny_target  # noqa: E402


def timed(fn, *args, n):
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(n):
        out = fn(*args)
    jax.block_until_ready(out)
    return 1e3 * (time.perf_counter() - start) / n


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=TINY_QWEN3.hidden_size)
    p.add_argument("--layers", type=int, default=TINY_QWEN3.num_layers)
    p.add_argument("--vocab", type=int, default=TINY_QWEN3.vocab_size)
    p.add_argument("--drafter-layers", type=int, default=2)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--context", type=int, default=64, help="tokens already in the caches")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    heads = max(2, args.width // 32)
    cfg = dataclasses.replace(TINY_QWEN3, hidden_size=args.width, intermediate_size=2 * args.width,
                              num_layers=args.layers, num_heads=heads, num_kv_heads=max(1, heads // 2), head_dim=32,
                              vocab_size=args.vocab)
    target = tiny_target(cfg=cfg)
    drafter = rj.init_drafter(cfg, mask_token_id=args.vocab - 1, num_layers=args.drafter_layers,
                              block_size=args.block_size)
    tdef, tstate = nnx.split(target)
    ddef, dstate = nnx.split(drafter)
    k, size = args.block_size, args.context + 2 * args.block_size
    lengths = jnp.full((1,), args.context, jnp.int32)
    tcache = target.init_cache(1, size).replace(lengths=lengths)
    dcache = drafter.init_cache(1, size).replace(lengths=lengths)
    ids = drafter.cfg.target_layer_ids

    @jax.jit
    def plain_step(ts, cache, tok):
        m = nnx.merge(tdef, ts)
        out = m(tok, cache)
        return jnp.argmax(m.logits(out.hidden), -1), out.cache

    @jax.jit
    def verify(ts, cache, block):
        m = nnx.merge(tdef, ts)
        out = m(block, cache, feature_layers=ids)
        return jnp.argmax(m.logits(out.hidden), -1), out.cache, out.features

    @jax.jit
    def draft(ts, ds, cache, anchor):
        m, d = nnx.merge(tdef, ts), nnx.merge(ddef, ds)
        return jnp.argmax(m.logits(draft_block(m, d, anchor, cache, k)[:, 1:]), -1)

    @jax.jit
    def extend(ds, cache, features):
        return nnx.merge(ddef, ds).extend_cache(features, cache)

    features = verify(tstate, tcache, jnp.zeros((1, k), jnp.int32))[2]
    ms = {
        "plain_step_ms": timed(plain_step, tstate, tcache, jnp.zeros((1, 1), jnp.int32), n=args.iters),
        "draft_ms": timed(draft, tstate, dstate, dcache, jnp.zeros((1,), jnp.int32), n=args.iters),
        "verify_ms": timed(verify, tstate, tcache, jnp.zeros((1, k), jnp.int32), n=args.iters),
        "context_update_ms": timed(extend, dstate, dcache, features, n=args.iters),
    }
    round_ms = ms["draft_ms"] + ms["verify_ms"] + ms["context_update_ms"]
    result = {"target": f"random Qwen3-shaped, d={args.width}, {args.layers} layers, vocab {args.vocab}",
              "drafter": f"{args.drafter_layers} layers, block {k}", "device": jax.devices()[0].platform,
              **{key: round(v, 4) for key, v in ms.items()},
              # a round must commit this many tokens on average (tau) to match plain decoding's speed
              "round_over_plain_step (break-even tau)": round(round_ms / ms["plain_step_ms"], 2)}
    report(result, args.out)


if __name__ == "__main__":
    main()
