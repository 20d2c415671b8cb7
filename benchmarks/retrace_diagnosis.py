"""Why a ReTrace memory hurts where it does: the same drafter with its memory changed at inference, one
change per variant, τ with the memory on against off by position range (``benchmarks/retrace_positions.py``
measures; this script asks why). Each variant changes one thing inside the compiled round; decoding
stays lossless (checked), only the drafts change.

    python benchmarks/retrace_diagnosis.py --drafter lab/drafters/C                # every variant
    python benchmarks/retrace_diagnosis.py --variants paper,no_mem_d,agreed --num-prompts 40

Variants (the hypothesis each one tests):
- ``paper``: the memory as the drafter was trained (the reference row);
- ``no_mem_t``: the target's states zeroed (is it the target-aware correction?);
- ``no_mem_d``: the drafter's own rejected states zeroed (is it what the drafter carries?);
- ``memory_free_states``: the memory is built from a second draft of the round without memory, so no
  round's memory comes from a memory-conditioned round (is it drift of the recurrence?);
- ``half_residual``: the fused residual halved (is it the size of the residual?);
- ``window``: every drafter layer sees the context through a sliding window of the training length
  (is it attention over longer contexts than trained?);
- ``agreed`` / ``disagreed``: only the slots whose rejected proposal the target's verify pass shared, or
  only the others (``retrace.slots: agreed``; which slots carry the harm?).

``--copy-rates`` adds a second table from the same drafter run round by round (``SpeculativeStepper``),
memory on and off: at the positions a memory slot describes (the rejected suffix of the round before),
how often the old, rejected proposal was right, how often the new draft repeats it, and how often the new
draft is right, before and past ``--train-len``.

Prompts: the held-out code of ``retrace_positions.py`` (optax and flax files, read from past their first
third), 64 tokens with ``--long-new-tokens`` new ones, and ``--train-len`` tokens with ``--new-tokens``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import retrace_jax as rj  # noqa: E402
from benchmarks.retrace_positions import binned_tau, code_prompts, load_pair, paired_ratio  # noqa: E402
from retrace_jax.decoding import speculative  # noqa: E402
from retrace_jax.decoding.sampling import argmax  # noqa: E402
from retrace_jax.models import retrace  # noqa: E402

VARIANTS = ("paper", "no_mem_t", "no_mem_d", "memory_free_states", "half_residual", "window", "agreed",
            "disagreed")


class Patches:
    """The round's functions that a variant replaces (as they were at start), restored after it."""

    def __init__(self, drafter):
        self.drafter, self.cfg = drafter, drafter.cfg
        self.fusion = retrace.ReTraceFusion.__call__
        self.draft_block = speculative.draft_block
        self.verify_round = speculative.verify_round
        self.shift_memory = speculative.shift_memory

    def restore(self):
        self.drafter.cfg = self.cfg
        retrace.ReTraceFusion.__call__ = self.fusion
        speculative.draft_block, speculative.verify_round = self.draft_block, self.verify_round
        speculative.shift_memory = self.shift_memory


def apply(variant: str, drafter, train_len: int, saved: Patches) -> None:
    """Installs ``variant`` (traced into the next compiled program); ``saved.restore()`` undoes it."""
    fusion, draft_block, verify_round, shift = saved.fusion, saved.draft_block, saved.verify_round, saved.shift_memory
    if variant in ("no_mem_t", "no_mem_d", "half_residual"):
        def fused(self, emb, memory, beta=1.0):
            if variant == "no_mem_t":
                memory = memory.replace(mem_t=jnp.zeros_like(memory.mem_t))
            if variant == "no_mem_d":
                memory = memory.replace(mem_d=jnp.zeros_like(memory.mem_d))
            out = fusion(self, emb, memory, beta)
            return emb + 0.5 * (out - emb) if variant == "half_residual" else out
        retrace.ReTraceFusion.__call__ = fused
    elif variant == "memory_free_states":
        free = {}

        def drafted(target, drafter, anchor_b, cache, block_size, memory=None, attention="auto"):
            if memory is not None:
                free["hidden"] = draft_block(target, drafter, anchor_b, cache, block_size, None, attention)
            return draft_block(target, drafter, anchor_b, cache, block_size, memory, attention)

        speculative.draft_block = drafted
        speculative.shift_memory = lambda hidden, target_hidden, a, agreed=None: shift(free["hidden"], target_hidden,
                                                                                       a, agreed)
    elif variant in ("agreed", "disagreed"):
        seen = {}

        def verified(keys, proposals, draft_logits, target_logits, *args, **kwargs):
            seen["agreed"] = proposals == argmax(target_logits)[:, :-1]
            return verify_round(keys, proposals, draft_logits, target_logits, *args, **kwargs)

        def shifted(hidden, target_hidden, a, agreed=None):
            keep = seen["agreed"] if variant == "agreed" else ~seen["agreed"]
            return shift(hidden, target_hidden, a, keep if agreed is None else keep & agreed)

        speculative.verify_round, speculative.shift_memory = verified, shifted
    elif variant == "window":
        drafter.cfg = dataclasses.replace(drafter.cfg, layer_types=("sliding_attention",) * drafter.cfg.num_layers,
                                          sliding_window=train_len)  # restored by Patches.restore
    elif variant != "paper":
        raise SystemExit(f"unknown variant {variant!r}; one of {', '.join(VARIANTS)}")


def copy_rates(target, drafter, prompts, new_tokens: int, use_retrace: bool, train_len: int) -> dict:
    """Over the positions each round's memory describes (next-round slots ``1..B-2-a``): counts of
    positions, of old proposals that were right, of new drafts equal to the old proposal, and of new
    drafts that are right; split into positions below and from ``train_len``."""
    from retrace_jax.decoding.sampling import SamplingParams

    k = drafter.cfg.block_size
    rows, length = len(prompts), len(prompts[0])
    stepper = speculative.SpeculativeStepper(target, drafter, capacity=new_tokens + k, block_size=k, use_retrace=use_retrace)
    stepper.init(jnp.asarray(np.asarray(prompts, np.int32)), jnp.full((rows,), length, jnp.int32),
                 jnp.ones((rows,), bool), np.int32(new_tokens), jnp.full((8,), -1, jnp.int32), SamplingParams.make())
    rounds = []
    while not stepper.done:
        info = stepper.step()
        rounds.append(tuple(np.asarray(x) for x in (info.active_b, info.start_b, info.accepted_b, info.proposals_bj)))
    out, num = np.asarray(stepper.carry.buf.tokens), np.asarray(stepper.carry.buf.num)
    counts = {"before": np.zeros(4, int), "past": np.zeros(4, int)}
    for b in range(rows):
        for (act0, start0, a0, prop0), (act1, start1, _, prop1) in zip(rounds, rounds[1:]):
            if not act1[b]:
                break
            for j in range(1, k - 1 - a0[b]):  # next-round slot j: position start1 + j, old proposal a0 + j
                pos = start1[b] + j
                if pos - length >= num[b]:
                    break
                truth, old, fresh = out[b, pos - length], prop0[b, a0[b] + j], prop1[b, j - 1]
                counts["past" if pos >= train_len else "before"] += (1, old == truth, fresh == old, fresh == truth)
    return counts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=os.path.join(ROOT, "lab", "target"))
    p.add_argument("--drafter", default=os.path.join(ROOT, "lab", "drafters", "C"))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--train-len", type=int, default=256, help="the drafter's training sequence length")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--new-tokens", type=int, default=256, help="new tokens after the --train-len prompts")
    p.add_argument("--long-new-tokens", type=int, default=448, help="new tokens after the 64-token prompts")
    p.add_argument("--bin-width", type=int, default=128)
    p.add_argument("--copy-rates", action="store_true", help="also the copy-rate table (see above)")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    target_dir, _, target, drafter = load_pair(args.target, args.drafter)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    cases = [(64, args.long_new_tokens), (args.train_len, args.new_tokens)]
    longest = max(length + new for length, new in cases)
    files = code_prompts(tokenizer, [args.train_len], args.num_prompts, args.new_tokens)[args.train_len]
    saved = Patches(drafter)
    edges = np.arange(0, longest + args.bin_width, args.bin_width)
    print(f"| variant | prompt | {' | '.join(f'{lo}-{hi - 1}' for lo, hi in zip(edges[:-1], edges[1:]))} |")
    print("|---|---|" + "---|" * (len(edges) - 1))
    for variant in args.variants.split(","):
        for length, new in cases:
            prompts = [ids[:length] for ids in files]
            runs = {}
            for on in (True, False):  # the patches touch only the memory's path, so "off" is the DFlash path
                jax.clear_caches()  # retrace: a compiled program of an earlier variant would be reused
                apply(variant, drafter, args.train_len, saved)
                runs[on] = rj.generate(target, prompts, new, drafter=drafter, use_retrace=on)
                saved.restore()
            if runs[True].tokens != runs[False].tokens:
                raise SystemExit(f"{variant}: memory on and off gave different tokens")
            lens = [length] * len(prompts)
            on_b = binned_tau(lens, runs[True].acceptance_lengths, edges)
            off_b = binned_tau(lens, runs[False].acceptance_lengths, edges)
            cells = []
            for k in range(len(edges) - 1):
                r = paired_ratio(on_b[:, k], off_b[:, k])
                cells.append(f"{r['tau_on']:.2f}/{r['tau_off']:.2f} = {r['ratio']:.3f}" if r["prompts"] else "")
            print(f"| {variant} | {length} + {new} | {' | '.join(cells)} |", flush=True)
    if args.copy_rates:
        jax.clear_caches()
        print("\n| prompt | memory | positions | count | old proposal right | new draft = old | new draft right |")
        print("|---|---|---|---|---|---|---|")
        for length, new in cases:
            for on in (True, False):
                counts = copy_rates(target, drafter, [ids[:length] for ids in files], new, on, args.train_len)
                for where, (n, old, same, fresh) in counts.items():
                    if n:
                        print(f"| {length} + {new} | {'on' if on else 'off'} | {where} {args.train_len} | {n} | "
                              f"{old / n:.3f} | {same / n:.3f} | {fresh / n:.3f} |", flush=True)


if __name__ == "__main__":
    main()
