"""Per-round latency split of speculative decoding against one plain decode step, each piece jitted
and timed alone (batch 1, after compilation): the plain step, the drafter's block, the target's
verification of the block, and the drafter context-cache update.

    python benchmarks/round_latency.py                          # the tiny target (d=128)
    python benchmarks/round_latency.py --width 1024 --layers 8 --vocab 32768
    python benchmarks/round_latency.py --target ~/.cache/retrace_jax/models/smollm2-135m-instruct \
        --drafter runs/smollm2_retrace/drafter                 # a real target and a trained drafter
    python benchmarks/round_latency.py --preset qwen3-4b --dtype bfloat16   # random Qwen3-4B-shaped weights
                                                                            # (5-layer drafter, block 16): a GPU

Random weights time the rounds as well as real ones (the work does not depend on the values); how many
tokens a round commits (τ) comes from trained drafters (benchmarks/speculative_eval.py).
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


# Qwen3-4B and Qwen3-8B shapes with the published DFlash drafter for them (5 layers, block 16)
QWEN3_COMMON = dict(num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, vocab_size=151936,
                    rope_theta=1000000.0, max_position_embeddings=40960)
PRESETS = {
    "qwen3-4b": (dataclasses.replace(TINY_QWEN3, hidden_size=2560, intermediate_size=9728, **QWEN3_COMMON), 5, 16),
    "qwen3-8b": (dataclasses.replace(TINY_QWEN3, hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False,
                                     **QWEN3_COMMON), 5, 16),
}


def timed(fn, *args, n):
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(n):
        out = fn(*args)
    jax.block_until_ready(out)
    return 1e3 * (time.perf_counter() - start) / n


def in_loop_ms(target, prompt, kwargs, iters) -> float:
    """Milliseconds per round (per token without a drafter) inside ``rj.generate``: the difference of a
    long and a short generation over the difference of their round counts, so prefill cancels out."""
    short, long_ = 16, 16 + max(32, min(iters, 112))
    times, rounds = [], []
    for n in (short, long_):
        rj.generate(target, prompt, n, **kwargs)  # compile
        start = time.perf_counter()
        out = rj.generate(target, prompt, n, **kwargs)
        times.append(time.perf_counter() - start)
        rounds.append(len(out.acceptance_lengths[0]))
    return 1e3 * (times[1] - times[0]) / max(1, rounds[1] - rounds[0])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=TINY_QWEN3.hidden_size)
    p.add_argument("--layers", type=int, default=TINY_QWEN3.num_layers)
    p.add_argument("--vocab", type=int, default=TINY_QWEN3.vocab_size)
    p.add_argument("--drafter-layers", type=int, default=2)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--context", type=int, default=64, help="tokens already in the caches")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--target", default=None, help="a Hugging Face directory instead of random weights")
    p.add_argument("--drafter", default=None, help="a drafter directory for --target (default: a random one)")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS), help="random weights of this model's shape")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.target:
        target = rj.load_target(os.path.expanduser(args.target), dtype=args.dtype)
        cfg = target.cfg
        described = f"{os.path.basename(os.path.normpath(args.target))} ({args.dtype})"
    else:
        if args.preset:
            cfg, args.drafter_layers, args.block_size = PRESETS[args.preset]
            described = f"random {args.preset}-shaped ({args.dtype})"
        else:
            heads = max(2, args.width // 32)
            cfg = dataclasses.replace(TINY_QWEN3, hidden_size=args.width, intermediate_size=2 * args.width,
                                      num_layers=args.layers, num_heads=heads, num_kv_heads=max(1, heads // 2),
                                      head_dim=32, vocab_size=args.vocab)
            described = f"random Qwen3-shaped, d={args.width}, {args.layers} layers, vocab {args.vocab}"
        target = tiny_target(cfg=cfg, dtype=args.dtype)
    if args.drafter:
        drafter = rj.load_drafter(os.path.expanduser(args.drafter), target, dtype=args.dtype)
        args.block_size = drafter.cfg.block_size
    else:
        drafter = rj.init_drafter(cfg, mask_token_id=cfg.vocab_size - 1, num_layers=args.drafter_layers,
                                  block_size=args.block_size, dtype=jnp.dtype(args.dtype))
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
    # the same inside rj.generate's loop, where acceptance, commits and the ReTrace memory also run
    prompt = [[1 + i % (cfg.vocab_size - 1) for i in range(args.context)]]
    ms["plain_step_in_loop_ms"] = in_loop_ms(target, prompt, {}, args.iters)
    ms["round_in_loop_ms"] = in_loop_ms(target, prompt, {"drafter": drafter}, args.iters)
    ms["bookkeeping_ms"] = ms["round_in_loop_ms"] - round_ms
    result = {"target": described,
              "drafter": f"{drafter.cfg.num_layers} layers, block {k}" + (" (ReTrace)" if drafter.cfg.retrace else ""),
              "device": jax.devices()[0].platform, "context": args.context,
              **{key: round(v, 4) for key, v in ms.items()},
              # a round must commit this many tokens on average (tau) to match plain decoding's speed
              "round_over_plain_step (break-even tau)": round(round_ms / ms["plain_step_ms"], 2),
              "in_loop_round_over_plain_step": round(ms["round_in_loop_ms"] / ms["plain_step_in_loop_ms"], 2)}
    report(result, args.out)


if __name__ == "__main__":
    main()
