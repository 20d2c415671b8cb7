"""What the rejected suffix of a round holds: the ReTrace paper's motivating measurement (after a round's
first rejection, is the token finally committed at a drafted position the drafter's top-1, its top-5?),
set beside the next round's fresh draft, the target's stale view of the same slots, shifted proposals and
oracle ceilings on τ. Any target/drafter pair, greedy (T = 0) only.

    python benchmarks/rejected_alignment.py --per-category 4 --max-new-tokens 96 --batch-size 8 \\
        --out runs/rejected_alignment.json
    python benchmarks/rejected_alignment.py --target lab/target --drafter B=lab/drafters/B \\
        --drafter C=lab/drafters/C --memory on --prompts lab/work/prompts/heldout.jsonl --num-prompts 64 \\
        --max-new-tokens 128 --out runs/suffix_contents.json

**Slots.** A round anchored at position ``start`` drafts block slots 1..J (slot k at position
``start + k``); with ``a`` proposals accepted, slot ``a + 1`` is the first rejected one (the target's
correction is committed there) and slots ``a + 2 .. J`` are the **rejected suffix**, which ReTrace
carries into the next round (docs/retrace.md: the memory's slot j is the old slot a + 1 + j). ``d`` is
the distance from the first rejection: ``d = 0`` is slot ``a + 1``, ``d >= 1`` the suffix slot
``a + 1 + d``; it is also the memory slot j and the slot at which the next round drafts that position.
A round that accepts all J proposals has no rejection and counts nothing. Only positions inside the final
output count (a stop token or ``max_new_tokens`` may end the text before a suffix position is reached);
every count compares with the token finally committed there, the target's greedy token.

**Measures,** per suffix position (``by_distance`` splits them by ``d``; ``first_rejected`` is d = 0):

- ``fresh_top1/top5``: the next round's own draft of the position (its slot d). The next round's block
  always covers every suffix position of the round before (d <= J - 1 - a), and a suffix position inside
  the output always has a next round, so no position goes uncovered. With a ReTrace drafter and its memory
  on, that fresh draft is itself conditioned on the memory.
- ``top1/top5``: the drafter's **stale** proposal there (its top-1 is the token it proposed; what the
  ReTrace memory's ``mem_d`` encodes).
- ``target_top1/top5``: the target's **stale** choice: its logits at that slot from the same verify pass,
  computed on a context that holds the rejected proposals of slots a + 1 .. a + d (what ``mem_t``
  encodes; at d = 0 its top-1 is the committed correction itself, 100 % by construction).
- ``stale_only_top1`` / ``target_only_top1``: the stale drafter's / stale target's top-1 is right while
  the fresh draft's top-1 is wrong.
- ``shift_-2 .. shift_+2``: the drafter's stale proposal at slot ``k + o`` (``o`` = -2, -1, +1, +2; a
  drafted slot 1..J, else no match) is the token committed at slot k: the right token one or two slots
  off. ``shift_only``: the proposal at slot k is wrong and one of those four is right. ``repeat_-2 ..
  repeat_+2``, their baseline: the committed token at slot ``k + o`` (a drafted slot inside the output)
  equals the one at slot k, i.e. the text itself repeats at that offset.
- ``agreed``: the stale drafter's and the stale target's top-1 are equal (the slots that
  ``retrace.slots: agreed`` keeps); ``agreed_top1``: of those, the share where that token is right.

**Oracle ceilings on τ** (``tau_oracle_drafter``, ``_target``, ``_either``), simulated on the recorded
rounds, not by decoding again. Round R' follows round R (anchor ``start + a + 1``) and drafts R's suffix
position ``d`` at its slot d. The oracle replaces R''s fresh proposal at such a slot by the stale top-1
(the drafter's; the target's; either's) exactly where that stale token is right and the fresh one wrong.
R' then accepts its recorded ``a'`` slots and, if its first rejected slot ``a' + 1`` was fixed, goes on
through slots ``a' + 2, ...`` for as long as each is fixed or its fresh proposal was already right and
the position lies inside the output, up to slot J. A fix therefore counts only when every earlier slot of
its round is accepted: a fixed slot behind a still-wrong one adds nothing. The extra accepted slots are
added to the committed tokens over the same rounds: ``tau_oracle = (Σ (a + 1) + extra) / rounds``. Later
rounds are left as recorded (a real oracle would move their anchors), so this is a per-round ceiling,
and with no fix at any first rejected slot it equals τ.

The rounds come from the library's ``SpeculativeStepper``, the same rounds as ``rj.generate`` (checked by
``tests/benchmarks/test_rejected_alignment.py``). Default target and drafter: SmolLM2-135M-Instruct and the
ReTrace drafter shipped for it (``rj.assets.shipped_drafter(model, "retrace")``), run with its memory on
(``C``) and off (``C-off``: ``use_retrace=False``; ``--memory`` picks).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import NamedTuple

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import retrace_jax as rj  # noqa: E402
from benchmarks.report import write_json  # noqa: E402
from benchmarks.speculative_eval import DEFAULT_SPEC_BENCH, parse_drafters, pick, read_datasets  # noqa: E402
from retrace_jax.decoding.generation import _check_prompts, _pad_prompts, _pad_stops, _sampling_mode, bucket, prompt_bucket  # noqa: E402
from retrace_jax.decoding.layer_loop import resolve_layer_loop  # noqa: E402
from retrace_jax.decoding.sampling import SamplingParams  # noqa: E402
from retrace_jax.decoding.speculative import SpeculativeStepper  # noqa: E402
from retrace_jax.models.drafter import check_drafter_matches  # noqa: E402
from retrace_jax.training.data import chat_encoder, load_tokenizer, read_prompts  # noqa: E402

TOP = 5
SHIFTS = (-2, -1, 1, 2)  # slot offsets at which a stale proposal may hold the right token
ORACLES = ("drafter", "target", "either")


class Round(NamedTuple):
    """One round as the tally reads it (host arrays over the batch's rows)."""

    active_b: np.ndarray
    start_b: np.ndarray
    accepted_b: np.ndarray
    draft_top_bj: np.ndarray  # [B, J, TOP] the drafter's best tokens per slot 1..J, best first (its proposal)
    target_top_bw: np.ndarray  # [B, W, TOP] the target's best tokens per verify slot w (scoring start + w + 1)


class Tally:
    """Counts per distance ``d`` from the first rejection (the module docstring defines each count)."""

    FIELDS = ("n", "top1", "topk", "fresh_top1", "fresh_topk", "stale_only_top1", "target_top1", "target_topk",
              "target_only_top1", *(f"shift_{o:+d}" for o in SHIFTS), "shift_only",
              *(f"repeat_{o:+d}" for o in SHIFTS), "agreed", "agreed_top1")
    SCALARS = ("rounds", "committed", *(f"oracle_{o}" for o in ORACLES))

    def __init__(self, block_size: int):
        for name in self.FIELDS:
            setattr(self, name, np.zeros((block_size - 1,), np.int64))
        # rounds run, their a + 1 summed (τ pooled = committed / rounds) and each oracle's extra accepted slots
        for name in self.SCALARS:
            setattr(self, name, 0)

    def add_round(self, rnd: Round, final_tokens, prompt_lens_b, nxt: Round | None = None):
        """One round ``rnd`` and the one after it, ``nxt`` (None after the last); ``final_tokens[b]``: row
        b's committed new tokens, the first at absolute position ``prompt_lens_b[b]``."""
        j_max = rnd.draft_top_bj.shape[1]
        for b in np.flatnonzero(rnd.active_b):
            a, start = int(rnd.accepted_b[b]), int(rnd.start_b[b])
            final, base = final_tokens[b], start - int(prompt_lens_b[b])  # new-token index of position start
            proposals = rnd.draft_top_bj[b, :, 0]
            self.rounds += 1
            self.committed += a + 1
            fixed = {o: set() for o in ORACLES}  # the next round's slots each oracle fixes
            for slot in range(a + 1, j_max + 1):  # nothing when a == J
                if base + slot >= len(final):
                    break  # the output ends before this position
                token = final[base + slot]
                top, target = rnd.draft_top_bj[b, slot - 1], rnd.target_top_bw[b, slot - 1]
                d = slot - a - 1
                self.n[d] += 1
                self.top1[d] += token == top[0]
                self.topk[d] += token in top
                self.target_top1[d] += token == target[0]
                self.target_topk[d] += token in target
                self.agreed[d] += top[0] == target[0]
                self.agreed_top1[d] += (top[0] == target[0]) & (token == top[0])
                shifted = [1 <= slot + o <= j_max and proposals[slot + o - 1] == token for o in SHIFTS]
                for o, hit in zip(SHIFTS, shifted):
                    getattr(self, f"shift_{o:+d}")[d] += hit
                self.shift_only[d] += (token != top[0]) & any(shifted)
                for o in SHIFTS:  # the same offsets in the output itself: how often a shift is a repetition
                    getattr(self, f"repeat_{o:+d}")[d] += (1 <= slot + o <= j_max and base + slot + o < len(final)
                                                            and final[base + slot + o] == token)
                if d == 0:
                    continue
                # a suffix position inside the output: the row went on, and its next round starts at the
                # new anchor start + a + 1, so it drafts this position at slot d
                if nxt is None or int(nxt.start_b[b]) != start + a + 1:
                    raise ValueError(f"row {b}: the round after start {start} (a = {a}) is missing")
                fresh = nxt.draft_top_bj[b, d - 1]
                self.fresh_top1[d] += token == fresh[0]
                self.fresh_topk[d] += token in fresh
                drafter_fixes = (token == top[0]) & (token != fresh[0])
                target_fixes = (token == target[0]) & (token != fresh[0])
                self.stale_only_top1[d] += drafter_fixes
                self.target_only_top1[d] += target_fixes
                for o, fix in (("drafter", drafter_fixes), ("target", target_fixes),
                               ("either", drafter_fixes | target_fixes)):
                    if fix:
                        fixed[o].add(d)
            if any(fixed.values()):
                for o in ORACLES:
                    setattr(self, f"oracle_{o}", getattr(self, f"oracle_{o}") +
                            _oracle_extra(nxt, b, final, base + a + 1, fixed[o]))

    def summary(self) -> dict:
        def row(sel, fresh=True):
            n = int(self.n[sel].sum())
            pct = (lambda x, of=n: round(100.0 * int(x[sel].sum()) / of, 2) if of else None)
            out = {"positions": n, "top1_pct": pct(self.top1), f"top{TOP}_pct": pct(self.topk),
                   "target_top1_pct": pct(self.target_top1), f"target_top{TOP}_pct": pct(self.target_topk)}
            if fresh:
                out.update({"fresh_top1_pct": pct(self.fresh_top1), f"fresh_top{TOP}_pct": pct(self.fresh_topk),
                            "stale_only_top1_pct": pct(self.stale_only_top1),
                            "target_only_top1_pct": pct(self.target_only_top1)})
            out.update({f"shift_{o:+d}_pct": pct(getattr(self, f"shift_{o:+d}")) for o in SHIFTS})
            out.update({f"repeat_{o:+d}_pct": pct(getattr(self, f"repeat_{o:+d}")) for o in SHIFTS})
            out.update({"shift_only_pct": pct(self.shift_only), "agreed_pct": pct(self.agreed),
                        "agreed_top1_pct": pct(self.agreed_top1, int(self.agreed[sel].sum()))})
            return out

        k = len(self.n)
        tau = (lambda extra: round((self.committed + extra) / self.rounds, 4) if self.rounds else None)
        return {"rounds": self.rounds, "tau_pooled": tau(0),
                **{f"tau_oracle_{o}": tau(getattr(self, f"oracle_{o}")) for o in ORACLES},
                "rejected_suffix": row(slice(1, k)), "first_rejected": row(slice(0, 1), fresh=False),
                "by_distance": {str(d): row(slice(d, d + 1), fresh=d > 0) for d in range(k) if self.n[d]}}


def _oracle_extra(nxt: Round, b: int, final, base: int, fixed: set[int]) -> int:
    """The slots that row b of round ``nxt`` (anchored at new-token index ``base``) accepts beyond its
    recorded ``a'`` once the oracle has fixed its slots ``fixed``: none unless slot a' + 1 (its first
    rejection) is fixed; then from slot a' + 2 on, each slot must be fixed or already right, and inside the
    output."""
    j_max, first = nxt.draft_top_bj.shape[1], int(nxt.accepted_b[b]) + 1
    if first not in fixed:
        return 0
    slot = first
    while (slot <= j_max and base + slot < len(final)
           and (slot in fixed or nxt.draft_top_bj[b, slot - 1, 0] == final[base + slot])):
        slot += 1
    return slot - first


@jax.jit
def _tops(draft_logits_bjv, target_logits_bwv):
    return jax.lax.top_k(draft_logits_bjv, TOP)[1], jax.lax.top_k(target_logits_bwv, TOP)[1]


def stepped_generate(target, drafter, prompts, max_new_tokens: int, *, stop_token_ids=(), use_retrace=True,
                     block_size=None, layer_loop="auto", on_round=None):
    """Greedy speculative decoding of ``prompts`` one jitted round at a time, padded and passed to the
    stepper exactly as ``rj.generate`` passes them to its compiled loop. ``on_round(info, draft_top_bj,
    target_top_bw)`` sees every round (host arrays; the tops are the drafter's and the verify pass's
    ``TOP`` best tokens per slot, as in :class:`Round`). Returns the new tokens per prompt, the padded
    prompt lengths ``[rows]`` and the block size."""
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
            tops = jax.device_get(_tops(info.draft_logits_bjv, info.target_logits_bwv))
            on_round(jax.device_get(info._replace(draft_logits_bjv=None, target_logits_bwv=None)), *tops)
    out_tokens, num = jax.device_get((stepper.carry.buf.tokens, stepper.carry.buf.num))
    return [out_tokens[b, : num[b]].tolist() for b in range(batch)], lens, block_size


def measure(target, drafter, prompts, max_new_tokens: int, *, stop_token_ids=(), use_retrace=True,
            block_size=None) -> tuple[Tally, list[list[int]]]:
    """The tally over all rounds of one batch, and its committed tokens."""
    rounds = []
    tokens, lens, block_size = stepped_generate(
        target, drafter, prompts, max_new_tokens, stop_token_ids=stop_token_ids, use_retrace=use_retrace,
        block_size=block_size, on_round=lambda info, draft, verify: rounds.append(
            Round(info.active_b[: len(prompts)], info.start_b, info.accepted_b, draft, verify)))
    tally = Tally(block_size)
    for r, rnd in enumerate(rounds):
        tally.add_round(rnd, tokens, lens, rounds[r + 1] if r + 1 < len(rounds) else None)
    return tally, tokens


def merge(tallies: list[Tally]) -> Tally:
    out = Tally(len(tallies[0].n) + 1)
    for t in tallies:
        for name in Tally.FIELDS + Tally.SCALARS:
            setattr(out, name, getattr(out, name) + getattr(t, name))
    return out


def markdown(methods: dict) -> str:
    """The summaries of :func:`main` as two markdown tables: the rejected suffix per method, then per
    method and distance d."""

    def f(x):
        return "-" if x is None else f"{x:.1f}" if isinstance(x, float) else str(x)

    head = ("| method | rounds | τ | τ oracle drafter | τ oracle target | τ oracle either | suffix positions "
            f"| fresh top-1 | fresh top-{TOP} | drafter top-1 | drafter top-{TOP} "
            f"| target top-1 | target top-{TOP} "
            "| drafter right, fresh wrong | target right, fresh wrong | drafter at -2 / -1 / +1 / +2 | shift only "
            "| output repeats at -2 / -1 / +1 / +2 | agreed | agreed right |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for name, s in methods.items():
        r = s["rejected_suffix"]
        lines.append(
            f"| {name} | {s['rounds']} | {s['tau_pooled']:.3f} | {s['tau_oracle_drafter']:.3f} "
            f"| {s['tau_oracle_target']:.3f} | {s['tau_oracle_either']:.3f} | {r['positions']} "
            f"| {f(r['fresh_top1_pct'])} | {f(r[f'fresh_top{TOP}_pct'])} | {f(r['top1_pct'])} "
            f"| {f(r[f'top{TOP}_pct'])} | {f(r['target_top1_pct'])} | {f(r[f'target_top{TOP}_pct'])} "
            f"| {f(r['stale_only_top1_pct'])} | {f(r['target_only_top1_pct'])} "
            f"| {' / '.join(f(r[f'shift_{o:+d}_pct']) for o in SHIFTS)} | {f(r['shift_only_pct'])} "
            f"| {' / '.join(f(r[f'repeat_{o:+d}_pct']) for o in SHIFTS)} "
            f"| {f(r['agreed_pct'])} | {f(r['agreed_top1_pct'])} |")
    head = ("| method | d | positions | fresh top-1 | drafter top-1 | drafter top-5 | target top-1 | target top-5 "
            "| drafter right, fresh wrong | target right, fresh wrong | drafter at -1 / +1 | agreed |")
    lines += ["", "Percent of the suffix positions (d = 0: the first rejected slot, not in the table above).", "",
              head, "|" + "---|" * head.count(" | ") + "---|"]
    for name, s in methods.items():
        for d, r in s["by_distance"].items():
            lines.append(
                f"| {name} | {d} | {r['positions']} | {f(r.get('fresh_top1_pct'))} | {f(r['top1_pct'])} "
                f"| {f(r[f'top{TOP}_pct'])} | {f(r['target_top1_pct'])} | {f(r[f'target_top{TOP}_pct'])} "
                f"| {f(r.get('stale_only_top1_pct'))} | {f(r.get('target_only_top1_pct'))} "
                f"| {f(r['shift_-1_pct'])} / {f(r['shift_+1_pct'])} | {f(r['agreed_pct'])} |")
    return "\n".join(lines)


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
    p.add_argument("--memory", choices=("both", "on", "off"), default="both",
                   help="a ReTrace drafter's memory: on (NAME), off (NAME-off) or both")
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
        if d.cfg.retrace is None or args.memory != "off":
            methods[name] = (d, True)
        if d.cfg.retrace is not None and args.memory != "on":
            methods[f"{name}-off"] = (d, False)

    result = {"target": target_dir, "drafters": dict(drafter_dirs), "spec_bench": None if args.prompts else args.spec_bench,
              "prompts": args.prompts,
              "per_category": args.num_prompts if args.prompts else args.per_category, "max_new_tokens": args.max_new_tokens, "temperature": 0,
              "memory": args.memory,
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
        s["seconds"] = round(time.perf_counter() - start, 1)
        print(f"{method}: τ {s['tau_pooled']}, rejected suffix {s['rejected_suffix']} ({s['seconds']:.0f} s)",
              flush=True)
    print(markdown(result["methods"]))
    write_json(result, args.out, indent=1)
    return result


if __name__ == "__main__":
    main()
