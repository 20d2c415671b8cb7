"""ReTrace's memory on against off, by position: τ of the rounds whose block starts in each position range,
with paired bootstrap intervals, so a memory that helps early and hurts past the drafter's training length
shows as such (issue: "ReTrace must never hurt").

    python benchmarks/retrace_positions.py                                   # lab pair, held-out code
    python benchmarks/retrace_positions.py --drafter lab/drafters/C --out lab/results/positions_C.json
    python benchmarks/retrace_positions.py --prompts chat --target smollm2-135m-instruct \\
        --drafter smollm2-135m-instruct:retrace --prompt-lengths 0 --new-tokens 512

- ``--prompts code`` (default): the Python files of optax and flax, which neither the laboratory target nor
  its drafters saw. Each file is read from the first line after its first third (past licence headers
  and imports, which many files share word for word), and files with fewer than the longest prompt
  plus ``--new-tokens`` tokens there are left out. For every length of ``--prompt-lengths`` each file
  gives the prompt of its first that many tokens; ``--num-prompts`` files spread evenly over the list.
- ``--prompts chat``: Spec-Bench questions (shipped with the package) through the target's chat
  template, ``--num-prompts`` spread evenly; ``--prompt-lengths 0`` (the questions as they are). The
  rounds then reach long positions through long generations: no stop token is given, so a row goes on
  past the end of its answer (the target's own text all the same).
- Greedy (T = 0), batched; memory on (``use_retrace=True``) and off (``use_retrace=False``: the same
  drafter's DFlash path). Both give the target's own greedy text (checked), so the rounds of a prompt
  cover the same positions either way.
- A round's position is its block's first position (the anchor's). For each ``--bin-width`` range of
  positions and each prompt, τ is the mean acceptance length (tokens committed, the target's own one
  included) of that prompt's rounds in the range; a range's τ is the mean over the prompts that have
  rounds there with the memory on and off. ``on / off`` is the ratio of those means, and its 95% interval
  is the percentile bootstrap over prompts (paired: one draw for both). The second table does the same
  by prompt length, over whole generations.
- ``--against DIR``: another drafter of the same target (e.g. the DFlash drafter B that the ReTrace
  drafter is compared with at equal budget), run on the same prompts; two more pairs of tables give the
  ReTrace drafter with its memory on against it and with its memory off against it, so a loss that sits
  in the ReTrace drafter's own DFlash weights shows by position as well:

      python benchmarks/retrace_positions.py --drafter lab/drafters/C --against lab/drafters/B \
          --prompt-lengths 64,192,320 --out lab/results/positions_C_against_B.json
- Targets and drafters: a directory, or for ``--target`` a name of ``rj.assets.fetch`` (the registries),
  and for ``--drafter`` ``MODEL:VARIANT`` of ``rj.assets.shipped_drafter``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "lab"))

import retrace_jax as rj  # noqa: E402


def code_prompts(tokenizer, lengths: list[int], n: int, new_tokens: int) -> dict[int, list[list[int]]]:
    """``{length: prompts}``: the first ``length`` tokens of each of ``n`` held-out files, read from the
    first line after each file's first third."""
    import build_prompts
    import build_target

    texts = sorted(build_prompts.read_texts(build_target.held_out_files()))
    need = max(lengths) + new_tokens
    bodies = []
    for _, text in texts:
        lines = text.splitlines(keepends=True)
        ids = tokenizer.encode("".join(lines[len(lines) // 3:]))
        if len(ids) >= need:
            bodies.append(ids)
    if len(bodies) < n:
        raise SystemExit(f"only {len(bodies)} held-out files have {need} tokens past their first third; "
                         f"lower --num-prompts, --prompt-lengths or --new-tokens")
    chosen = [bodies[i] for i in np.linspace(0, len(bodies) - 1, n).astype(int)]
    return {length: [ids[:length] for ids in chosen] for length in lengths}


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` Spec-Bench questions (the first user turn) spread over the file, through the chat template."""
    from retrace_jax.training.data import chat_encoder

    with gzip.open(rj.assets.SPEC_BENCH, "rt", encoding="utf-8") as f:
        questions = [json.loads(line)["turns"][0] for line in f if line.strip()]
    encode = chat_encoder(tokenizer)
    return [encode([{"role": "user", "content": questions[i]}])
            for i in np.linspace(0, len(questions) - 1, n).astype(int)]


def round_positions(prompt_len: int, lengths: list[int]) -> np.ndarray:
    """The first position of each round's block: the prompt's length (the prefill's token sits there),
    then one further per committed token."""
    return prompt_len + np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int)


def binned_tau(prompt_lens, acceptance, edges) -> np.ndarray:
    """``[prompts, bins]``: each prompt's mean acceptance length over its rounds in each position range
    (NaN where it has none)."""
    out = np.full((len(acceptance), len(edges) - 1), np.nan)
    for i, (length, acc) in enumerate(zip(prompt_lens, acceptance)):
        pos, acc = round_positions(length, acc), np.asarray(acc, float)
        which = np.searchsorted(edges, pos, side="right") - 1
        for k in range(len(edges) - 1):
            if (which == k).any():
                out[i, k] = acc[which == k].mean()
    return out


def paired_ratio(on: np.ndarray, off: np.ndarray, samples: int = 10_000, seed: int = 0,
                 names=("on", "off")) -> dict:
    """mean(on) / mean(off) over the prompts that have both, and its 95% percentile bootstrap interval
    (prompts drawn with replacement, the same draw for both); the two means are ``tau_{names[i]}``."""
    keep = ~np.isnan(on) & ~np.isnan(off)
    on, off = on[keep], off[keep]
    if len(on) == 0:
        return {"prompts": 0}
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(on), (samples, len(on)))
    ratios = on[idx].mean(1) / off[idx].mean(1)
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return {"prompts": int(len(on)), f"tau_{names[0]}": float(on.mean()), f"tau_{names[1]}": float(off.mean()),
            "ratio": float(on.mean() / off.mean()), "low": float(lo), "high": float(hi)}


def load_pair(target_arg: str, drafter_arg: str):
    target_dir = target_arg if os.path.isdir(target_arg) else rj.assets.fetch(target_arg)
    if os.path.isdir(drafter_arg):
        drafter_dir = drafter_arg
    else:
        model, _, variant = drafter_arg.partition(":")
        drafter_dir = rj.assets.shipped_drafter(model, variant or "default")
    target = rj.load_target(target_dir)
    drafter = rj.load_drafter(drafter_dir, target)
    if drafter.cfg.retrace is None:
        raise SystemExit(f"{drafter_dir} is not a ReTrace drafter (its config.json has no retrace_config)")
    return target_dir, drafter_dir, target, drafter


def print_table(title: str, rows: list[tuple[str, dict]], names=("on", "off")) -> None:
    a, b = names
    print(f"\n{title}\n| {'range':>11} | prompts | τ {a} | τ {b} | {a} / {b} | 95% interval |")
    print("|---|---|---|---|---|---|")
    for name, r in rows:
        if r["prompts"]:
            print(f"| {name:>11} | {r['prompts']:7d} | {r[f'tau_{a}']:.2f} | {r[f'tau_{b}']:.2f} | {r['ratio']:.3f} "
                  f"| [{r['low']:.3f}, {r['high']:.3f}] |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=os.path.join(ROOT, "lab", "target"))
    p.add_argument("--drafter", default=os.path.join(ROOT, "lab", "drafters", "C"))
    p.add_argument("--prompts", default="code", choices=["code", "chat"])
    p.add_argument("--prompt-lengths", default="64,128,256,384,512",
                   help="code: prompt lengths in tokens (comma separated); chat: 0 (the questions as they are)")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--bin-width", type=int, default=128, help="width of the position ranges")
    p.add_argument("--batch-size", type=int, default=40)
    p.add_argument("--against", default=None, help="another drafter (a directory) to compare with, by position")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.prompt_lengths.split(",")]
    if args.prompts == "chat" and lengths != [0]:
        p.error("--prompts chat takes the questions as they are: --prompt-lengths 0")
    from transformers import AutoTokenizer

    target_dir, drafter_dir, target, drafter = load_pair(args.target, args.drafter)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    if args.prompts == "code":
        sets = code_prompts(tokenizer, lengths, args.num_prompts, args.new_tokens)
    else:
        sets = {0: chat_prompts(tokenizer, args.num_prompts)}

    methods = {"on": (drafter, True), "off": (drafter, False)}
    if args.against:
        methods["against"] = (rj.load_drafter(args.against, target), False)
    runs = {}
    for length, prompts in sets.items():
        out = {}
        for name, (model, on) in methods.items():
            start = time.perf_counter()
            tokens, acceptance = [], []
            for i in range(0, len(prompts), args.batch_size):
                res = rj.generate(target, prompts[i: i + args.batch_size], args.new_tokens, drafter=model,
                                  use_retrace=on)
                tokens += res.tokens
                acceptance += res.acceptance_lengths
            out[name] = (tokens, acceptance)
            what = {"on": "memory on", "off": "memory off", "against": args.against}[name]
            print(f"prompt length {length or 'as is'}, {what}: τ {np.mean([np.mean(a) for a in acceptance]):.2f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
        if any(out[name][0] != out["on"][0] for name in out):
            raise SystemExit(f"prompt length {length}: the methods gave different tokens (not lossless)")
        runs[length] = {"prompt_lens": [len(x) for x in prompts], **{name: out[name][1] for name in out}}

    top = max(max(r["prompt_lens"]) for r in runs.values()) + args.new_tokens
    edges = np.arange(0, top + args.bin_width, args.bin_width)
    bins = {name: np.concatenate([binned_tau(r["prompt_lens"], r[name], edges) for r in runs.values()])
            for name in methods}
    means = {name: {length: np.array([np.mean(a) for a in r[name]]) for length, r in runs.items()} for name in methods}
    pairs = [("on", "off")] + ([("on", "against"), ("off", "against")] if args.against else [])
    print(f"\n{drafter_dir} on {target_dir}: {args.prompts} prompts, {args.num_prompts} per length, "
          f"{args.new_tokens} new tokens, greedy; every method lossless")
    result = {"target": target_dir, "drafter": drafter_dir, "args": vars(args)}
    for a, b in pairs:
        # A prompt of each length is its own sample (the files repeat across lengths, the positions do not).
        by_position = [(f"{lo}-{hi - 1}", paired_ratio(bins[a][:, k], bins[b][:, k], names=(a, b)))
                       for k, (lo, hi) in enumerate(zip(edges[:-1], edges[1:]))]
        by_length = [(str(length or "as is"), paired_ratio(means[a][length], means[b][length], names=(a, b)))
                     for length in runs]
        other = "B" if b == "against" else b
        print_table(f"{a} / {other}, by position of the round (its block's first position)", by_position, (a, b))
        print_table(f"{a} / {other}, by prompt length (whole generations)", by_length, (a, b))
        key = "" if (a, b) == ("on", "off") else f"_{a}_against"
        result[f"by_position{key}"], result[f"by_length{key}"] = dict(by_position), dict(by_length)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({**result, "runs": {str(k): v for k, v in runs.items()}}, f)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
