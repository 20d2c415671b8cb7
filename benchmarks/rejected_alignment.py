"""The ReTrace paper's motivating measurement: after a round's first rejection, how often is the token the
target finally commits at a drafted position the drafter's top-1, and how often is it in its top-5?

    python benchmarks/rejected_alignment.py --per-category 4 --max-new-tokens 96 --batch-size 8 \\
        --out runs/rejected_alignment.json

A round anchored at position ``start`` drafts block slots 1..K (slot k at position ``start + k``); with
``a`` proposals accepted, slot ``a + 1`` is the first rejected one (the target's correction is committed
there) and slots ``a + 2 .. K`` are the **rejected suffix**, which ReTrace carries into the next round
(docs/retrace.md: the memory's slot j is the old slot a + 1 + j; numbers in docs/results.md, "What the
rejected suffix holds"). A round that accepts all J proposals has no rejection and counts nothing. Only
positions inside the final output count (a stop token or ``max_new_tokens`` may end the text before a
suffix position is reached).

Greedy decoding only. The drafter's top-1 at a rejected slot is the token it proposed there; at slot
``a + 1`` it differs from the target's token by definition, so only its top-5 says anything. The
rounds come from the library's ``SpeculativeStepper``, the same rounds as ``rj.generate`` (checked by
``tests/benchmarks/test_rejected_alignment.py``). Default target and drafter: SmolLM2-135M-Instruct and the ReTrace
drafter shipped for it (``rj.assets.shipped_drafter(model, "retrace")``), run with its memory on (``C``)
and off (``C-off``: ``use_retrace=False``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import retrace_jax as rj  # noqa: E402
from benchmarks.speculative_eval import DEFAULT_SPEC_BENCH, parse_drafters, pick, read_datasets  # noqa: E402
from retrace_jax.decoding.generation import _check_prompts, _pad_prompts, _pad_stops, _sampling_mode, bucket, prompt_bucket  # noqa: E402
from retrace_jax.decoding.layer_loop import resolve_layer_loop  # noqa: E402
from retrace_jax.decoding.sampling import SamplingParams  # noqa: E402
from retrace_jax.decoding.speculative import SpeculativeStepper  # noqa: E402
from retrace_jax.models.drafter import check_drafter_matches  # noqa: E402
from retrace_jax.training.data import chat_encoder, load_tokenizer, read_prompts  # noqa: E402

TOP = 5


class Tally:
    """Counts per distance ``d`` from the first rejection (``d = 0``: slot a + 1, the target's correction;
    ``d >= 1``: the rejected suffix, slot a + 1 + d). The next round drafts each suffix position afresh
    at its slot ``d``; ``fresh_*`` count how often that new draft is right, ``stale_only_top1`` how often
    the old proposal was right and the new one wrong (what carrying the top-1 could add at most)."""

    FIELDS = ("n", "top1", "topk", "fresh_top1", "fresh_topk", "stale_only_top1")

    def __init__(self, block_size: int):
        for name in self.FIELDS:
            setattr(self, name, np.zeros((block_size - 1,), np.int64))
        self.rounds = self.committed = 0  # rounds run and their a + 1 summed (τ pooled = committed / rounds)

    def add_round(self, active_b, start_b, accepted_b, top_bkn, final_tokens, prompt_lens_b, next_start_b=None,
                  next_top_bkn=None):
        """One round. ``top_bkn``: the drafter's ``n`` best tokens per slot 1..K, best first (its
        proposal at greedy); ``final_tokens[b]``: row b's committed new tokens, the first at absolute
        position ``prompt_lens_b[b]``; ``next_start_b``, ``next_top_bkn``: the next round's."""
        k = top_bkn.shape[1]
        for b in np.flatnonzero(active_b):
            a = int(accepted_b[b])
            self.rounds += 1
            self.committed += a + 1
            for slot in range(a + 1, k + 1):  # nothing when a == K
                index = int(start_b[b]) + slot - int(prompt_lens_b[b])  # into the new tokens
                if index >= len(final_tokens[b]):
                    break  # the output ends before this position
                token, top = final_tokens[b][index], top_bkn[b, slot - 1]
                d = slot - a - 1
                self.n[d] += 1
                self.top1[d] += token == top[0]
                self.topk[d] += token in top
                if d == 0:
                    continue
                # a suffix position inside the output: the row went on, and its next round starts at the
                # new anchor start + a + 1, so it drafts this position at slot d
                if next_start_b is None or int(next_start_b[b]) != int(start_b[b]) + a + 1:
                    raise ValueError(f"row {b}: the round after start {int(start_b[b])} (a = {a}) is missing")
                fresh = next_top_bkn[b, d - 1]
                self.fresh_top1[d] += token == fresh[0]
                self.fresh_topk[d] += token in fresh
                self.stale_only_top1[d] += (token == top[0]) & (token != fresh[0])

    def summary(self) -> dict:
        def row(sel, fresh=True):
            n = int(self.n[sel].sum())
            pct = (lambda x: round(100.0 * int(x[sel].sum()) / n, 2) if n else None)
            out = {"positions": n, "top1_pct": pct(self.top1), f"top{TOP}_pct": pct(self.topk)}
            if fresh:
                out.update({"fresh_top1_pct": pct(self.fresh_top1), f"fresh_top{TOP}_pct": pct(self.fresh_topk),
                            "stale_only_top1_pct": pct(self.stale_only_top1)})
            return out

        k = len(self.n)
        return {"rounds": self.rounds, "tau_pooled": round(self.committed / self.rounds, 4) if self.rounds else None,
                "rejected_suffix": row(slice(1, k)), "first_rejected": row(slice(0, 1), fresh=False),
                "by_distance": {str(d): row(slice(d, d + 1), fresh=d > 0) for d in range(k) if self.n[d]}}


@jax.jit
def _top(draft_logits_bjv):
    return jax.lax.top_k(draft_logits_bjv, TOP)[1]


def stepped_generate(target, drafter, prompts, max_new_tokens: int, *, stop_token_ids=(), use_retrace=True,
                     block_size=None, layer_loop="auto", on_round=None):
    """Greedy speculative decoding of ``prompts`` one jitted round at a time, padded and passed to the
    stepper exactly as ``rj.generate`` passes them to its compiled loop. ``on_round(info, top_bkn)`` sees
    every round (``top_bkn``: the drafter's top-5 per slot, host arrays). Returns the new tokens per prompt,
    the padded prompt lengths ``[rows]`` and the block size."""
    batch = _check_prompts(target, prompts, max_new_tokens)
    check_drafter_matches(drafter.cfg, target.cfg)
    block_size = drafter.cfg.block_size if block_size is None else int(block_size)
    tokens, lens, live = _pad_prompts(prompts, bucket(batch, 1), prompt_bucket(max(map(len, prompts))))
    stepper = SpeculativeStepper(target, drafter, layer_loop=resolve_layer_loop(layer_loop),
                                 capacity=bucket(max_new_tokens), block_size=block_size,
                                 use_retrace=bool(use_retrace), mode=_sampling_mode(0.0, 0, 1.0, "argmax"))
    stepper.init(tokens, lens, live, np.int32(max_new_tokens), _pad_stops(stop_token_ids, target.cfg.vocab_size),
                 SamplingParams.make(0.0, 0, 1.0, 0))
    while not stepper.done:
        info = stepper.step()
        if on_round is not None:
            on_round(jax.device_get(info._replace(draft_logits_bjv=None)), np.asarray(_top(info.draft_logits_bjv)))
    out_tokens, num = jax.device_get((stepper.carry.buf.tokens, stepper.carry.buf.num))
    return [out_tokens[b, : num[b]].tolist() for b in range(batch)], lens, block_size


def measure(target, drafter, prompts, max_new_tokens: int, *, stop_token_ids=(), use_retrace=True,
            block_size=None) -> tuple[Tally, list[list[int]]]:
    """The tally over all rounds of one batch, and its committed tokens."""
    rounds = []
    tokens, lens, block_size = stepped_generate(target, drafter, prompts, max_new_tokens, stop_token_ids=stop_token_ids,
                                       use_retrace=use_retrace, block_size=block_size,
                                       on_round=lambda info, top: rounds.append((info, top)))
    tally = Tally(block_size)
    for r, (info, top) in enumerate(rounds):
        after = rounds[r + 1] if r + 1 < len(rounds) else (None, None)
        tally.add_round(info.active_b[: len(prompts)], info.start_b, info.accepted_b, top, tokens, lens,
                        None if after[0] is None else after[0].start_b, after[1])
    return tally, tokens


def merge(tallies: list[Tally]) -> Tally:
    out = Tally(len(tallies[0].n) + 1)
    for t in tallies:
        for name in Tally.FIELDS:
            setattr(out, name, getattr(out, name) + getattr(t, name))
        out.rounds += t.rounds
        out.committed += t.committed
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="target directory (default: rj.assets.fetch of the model)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="asset name of the target (with --target unset)")
    p.add_argument("--drafter", action="append", default=[],
                   help="NAME=DIR (repeatable; default: C=the shipped drafter of --model)")
    p.add_argument("--spec-bench", default=DEFAULT_SPEC_BENCH,
                   help="Spec-Bench questions (JSONL, optionally .gz; default: the copy in retrace_jax/assets/data)")
    p.add_argument("--per-category", type=int, default=4, help="prompts per Spec-Bench category")
    p.add_argument("--prompts", default=None, help="a JSONL prompt file (data.read_prompts' formats) to use "
                   "instead of Spec-Bench, as one category named after the file; e.g. the lab's held-out code")
    p.add_argument("--num-prompts", type=int, default=64, help="prompts taken from --prompts, spread evenly")
    p.add_argument("--max-prompt-len", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--check-plain", action="store_true", help="also check the tokens against plain greedy")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    target_dir = os.path.expanduser(args.target) if args.target else rj.assets.fetch(args.model)
    drafter_dirs = parse_drafters(args.drafter) or [("C", rj.assets.shipped_drafter(args.model, "retrace"))]
    target = rj.load_target(target_dir)
    tokenizer = load_tokenizer(target_dir)
    encode = chat_encoder(tokenizer)
    stops = [tokenizer.eos_token_id]
    prompts, skipped = {}, {}
    if args.prompts:
        name = os.path.splitext(os.path.basename(args.prompts))[0]
        ids = [encode(m) for m in read_prompts(args.prompts)]
        prompts[name], skipped[name] = pick(ids, args.num_prompts, args.max_prompt_len)
    else:
        for name, texts in read_datasets(args.spec_bench, None).items():
            ids = [encode([{"role": "user", "content": t}]) for t in texts]
            prompts[name], skipped[name] = pick(ids, args.per_category, args.max_prompt_len)
    rows = sorted((len(ids), name, i) for name, ps in prompts.items() for i, ids in enumerate(ps))
    batches = [[prompts[n][i] for _, n, i in rows[j : j + args.batch_size]]
               for j in range(0, len(rows), args.batch_size)]
    methods = {}
    for name, path in drafter_dirs:
        d = rj.load_drafter(path, target)
        methods[name] = (d, True)
        if d.cfg.retrace is not None:
            methods[f"{name}-off"] = (d, False)

    result = {"target": target_dir, "drafters": dict(drafter_dirs), "spec_bench": None if args.prompts else args.spec_bench,
              "prompts": args.prompts,
              "per_category": args.num_prompts if args.prompts else args.per_category, "max_new_tokens": args.max_new_tokens, "temperature": 0,
              "skipped_too_long": skipped, "methods": {}}
    plain = None
    if args.check_plain:
        plain = [rj.generate(target, b, args.max_new_tokens, stop_token_ids=stops).tokens for b in batches]
    for method, (drafter, use_retrace) in methods.items():
        start = time.perf_counter()
        tallies, mismatches = [], 0
        for j, batch in enumerate(batches):
            tally, tokens = measure(target, drafter, batch, args.max_new_tokens, stop_token_ids=stops,
                                    use_retrace=use_retrace)
            tallies.append(tally)
            if plain is not None:
                mismatches += sum(t != q for t, q in zip(tokens, plain[j]))
        s = merge(tallies).summary()
        s["block_size"] = drafter.cfg.block_size
        s["prompts"] = len(rows)
        if plain is not None:
            s["differing_from_plain"] = mismatches
        result["methods"][method] = s
        print(f"{method}: rejected suffix {s['rejected_suffix']} | first rejected {s['first_rejected']} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
        print("  by distance:", json.dumps(s["by_distance"]), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
