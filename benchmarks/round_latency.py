"""Per-round latency of speculative decoding against one plain decode step (batch 1, after compilation):
the library's own ``plain_step`` and ``speculative_round`` (through ``PlainStepper`` and
``SpeculativeStepper``, with the layer loop that ``generate`` uses), jitted one at a time, and inside them
the drafter's block and the target's verification pass alone (each with its LM head and greedy choice,
compiled as the round compiles them), and what is left of a round without them (the context update,
acceptance, commits, the ReTrace memory), in a stepped round and in ``rj.generate``'s loop.

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
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import retrace_jax as rj  # noqa: E402
from benchmarks.device_check import PRESETS  # noqa: E402  (Qwen3-4B/8B shapes, published drafter)
from benchmarks.report import median_ms_from, report  # noqa: E402
from retrace_jax.decoding.layer_loop import decode_weights, merge_target  # noqa: E402
from retrace_jax.decoding.plain import PlainStepper  # noqa: E402
from retrace_jax.decoding.programs import DecodeProgram, cpu_products_options, resolve_cpu_products  # noqa: E402
from retrace_jax.decoding.sampling import SamplingParams, argmax  # noqa: E402
from retrace_jax.decoding.speculative import SpeculativeStepper, draft_block  # noqa: E402
from retrace_jax.models.draft_vocab import draft_head, head_logits  # noqa: E402
from retrace_jax.models.drafter import with_draft_vocab  # noqa: E402
from retrace_jax.models.tiny import TINY_QWEN3, tiny_target  # noqa: E402


def timed(fn, n):
    jax.block_until_ready(fn())
    start = time.perf_counter()
    for _ in range(n):
        out = fn()
    jax.block_until_ready(out)
    return 1e3 * (time.perf_counter() - start) / n


def in_loop_ms(target, prompt, kwargs, iters) -> float:
    """Milliseconds per round (per token without a drafter) inside ``rj.generate``: the difference of a
    long and a short generation (each the median of 5 runs, alternated) over the difference of their
    round counts, so prefill cancels out."""
    lengths = (16, 16 + max(32, min(iters, 112)))
    rounds = []
    for n in lengths:
        out = rj.generate(target, prompt, n, **kwargs)  # compile
        rounds.append(len(out.acceptance_lengths[0]))
    times = {n: [] for n in lengths}
    for _ in range(5):
        for n in lengths:
            start = time.perf_counter()
            rj.generate(target, prompt, n, **kwargs)
            times[n].append(time.perf_counter() - start)
    short, long_ = (float(np.median(times[n])) for n in lengths)
    return 1e3 * (long_ - short) / max(1, rounds[1] - rounds[0])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=TINY_QWEN3.hidden_size)
    p.add_argument("--layers", type=int, default=TINY_QWEN3.num_layers)
    p.add_argument("--vocab", type=int, default=TINY_QWEN3.vocab_size)
    p.add_argument("--drafter-layers", type=int, default=2)
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per block (default: the drafter's; 8 for a random drafter)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="draft over this many token ids (a draft vocabulary; the first N ids: the cost is the same)")
    p.add_argument("--context", type=int, default=64, help="tokens already in the caches")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--target", default=None, help="a Hugging Face directory instead of random weights")
    p.add_argument("--drafter", default=None, help="a drafter directory for --target (default: a random one)")
    p.add_argument("--preset", default=None, choices=sorted(set(PRESETS) - {"smoke"}), help="random weights of this model's shape")
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
        args.block_size = args.block_size or drafter.cfg.block_size
    else:
        args.block_size = args.block_size or 8
        drafter = rj.init_drafter(cfg, mask_token_id=cfg.vocab_size - 1, num_layers=args.drafter_layers,
                                  block_size=args.block_size, dtype=jnp.dtype(args.dtype))
    if args.draft_vocab:
        drafter = with_draft_vocab(drafter, np.arange(args.draft_vocab))
    tdef, tstate = nnx.split(target)
    ddef, dstate = nnx.split(drafter)
    k = args.block_size
    ids = drafter.cfg.target_layer_ids
    sampling, stops = SamplingParams.make(), jnp.full((8,), -1, jnp.int32)
    tokens = jnp.asarray([[1 + i % (cfg.vocab_size - 1) for i in range(args.context)]], jnp.int32)
    lens, live = jnp.full((1,), args.context, jnp.int32), jnp.ones((1,), bool)

    # the library's own step and round functions, jitted one at a time
    plain = PlainStepper(target, capacity=2 * k + 16)
    plain_carry = plain.init(tokens, lens, live, 10**6, stops, sampling)
    stepper = SpeculativeStepper(target, drafter, capacity=2 * k + 16, block_size=k)
    head = draft_head(target, drafter)
    first = stepper.init(tokens, lens, live, 10**6, stops, sampling)

    def one_round(state):
        stepper.carry = state
        return stepper.step().accepted_b

    def one_step(state):
        plain.carry = state
        return plain.step().last_b

    # the round's two passes alone, as the round runs them: the same layer loop and kept weights, the
    # same compiler options, and the head's logits and greedy choice of each
    kept = decode_weights(target)

    def verify(ts, kept, cache, block):
        m = merge_target(tdef, ts, "auto", kept)
        return argmax(m.logits(m(block, cache, feature_layers=ids).hidden))

    def draft(ts, kept, ds, head, cache, anchor):
        m, d = merge_target(tdef, ts, "auto", kept), nnx.merge(ddef, ds)
        return argmax(head_logits(m, head, draft_block(m, d, anchor, cache, k))[:, 1:])

    # compiled with the several-row products that the round uses (generate's cpu_products="auto")
    products = cpu_products_options(cfg, target.dtype.itemsize)
    verify, draft = DecodeProgram(verify, cpu_extra_options=products), DecodeProgram(draft, cpu_extra_options=products)
    ms = {
        "plain_step_ms": median_ms_from(one_step, plain_carry, args.iters),
        "draft_ms": timed(lambda: draft(tstate, kept, dstate, head, first.draft_cache, first.anchor_b),
                          n=args.iters),
        "verify_ms": timed(lambda: verify(tstate, kept, first.target_cache, jnp.zeros((1, k), jnp.int32)),
                           n=args.iters),
        "round_ms": median_ms_from(one_round, first, args.iters),
    }
    round_ms = ms["round_ms"]
    # the same inside rj.generate's loop, where acceptance, commits and the ReTrace memory also run
    prompt = [[1 + i % (cfg.vocab_size - 1) for i in range(args.context)]]
    ms["plain_step_in_loop_ms"] = in_loop_ms(target, prompt, {}, args.iters)
    ms["round_in_loop_ms"] = in_loop_ms(target, prompt, {"drafter": drafter, "block_size": k}, args.iters)
    ms["rest_of_round_ms"] = round_ms - ms["draft_ms"] - ms["verify_ms"]  # context update, acceptance, memory
    ms["rest_of_round_in_loop_ms"] = ms["round_in_loop_ms"] - ms["draft_ms"] - ms["verify_ms"]
    result = {"target": described,
              "drafter": f"{drafter.cfg.num_layers} layers, block {k}" + (" (ReTrace)" if drafter.cfg.retrace else "")
              + (f", draft vocabulary {drafter.cfg.draft_vocab_size}" if drafter.cfg.draft_vocab_size else ""),
              "device": jax.devices()[0].platform, "context": args.context,
              "cpu_products": resolve_cpu_products(cfg, target.dtype.itemsize),
              **{key: round(v, 4) for key, v in ms.items()},
              # a round must commit this many tokens on average (tau) to match plain decoding's speed
              "round_over_plain_step (break-even tau)": round(round_ms / ms["plain_step_ms"], 2),
              "in_loop_round_over_plain_step": round(ms["round_in_loop_ms"] / ms["plain_step_in_loop_ms"], 2),
              # the share of an in-loop round that is neither the draft nor the verify pass
              "rest_share_in_loop": round(ms["rest_of_round_in_loop_ms"] / ms["round_in_loop_ms"], 3)}
    report(result, args.out)


if __name__ == "__main__":
    main()
