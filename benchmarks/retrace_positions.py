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

      python benchmarks/retrace_positions.py --drafter lab/drafters/C --against lab/drafters/B \\
          --prompt-lengths 64,192,320 --out lab/results/positions_C_against_B.json

  ``--against NAME=DIR`` names it (the tables then say ``on / NAME``); the option repeats, so one run
  compares with several drafters on the same prompts.
- ``--combine A.json B.json ...``: no decoding; the tables over seeds from earlier ``--out`` files of
  drafters trained with different seeds (the same target, prompts and settings, and the same names for
  the drafters compared with). Each drafter's τ is then the mean over its seeds, and a bootstrap sample
  draws the seeds with replacement as well as the prompts (one seed draw for memory on and off, which
  are the same drafters; one for each other drafter), so the interval holds the spread between
  trainings too. A drafter compared with in one file only (``--against`` given with one seed's run: a
  fixed drafter such as a shipped one) joins every seed with that file's rounds, which decoding it again
  would reproduce:

      python benchmarks/retrace_positions.py --combine lab/results/positions_long/s0.json \\
          lab/results/positions_long/s1.json lab/results/positions_long/s2.json
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
from benchmarks.speculative_eval import save  # noqa: E402


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
                 names=("on", "off"), same_seeds: bool = True) -> dict:
    """mean(on) / mean(off) over the prompts that have both, and its 95% percentile bootstrap interval;
    the two means are ``tau_{names[i]}``.

    ``on`` and ``off`` are ``[prompts]`` (one drafter each) or ``[seeds, prompts]`` (S drafters trained
    with different seeds; a side's mean is the mean over its seeds). A prompt counts if every seed of both
    sides has a value there. One bootstrap sample draws the prompts with replacement (the same draw for
    both sides: they are paired by prompt) and each side's seeds with replacement, one draw for both
    sides when ``same_seeds`` (the same drafters, e.g. memory on and off) and one each otherwise. With one
    seed a side this is the bootstrap over prompts alone."""
    on, off = np.atleast_2d(np.asarray(on, float)), np.atleast_2d(np.asarray(off, float))
    if same_seeds and len(on) != len(off):
        raise ValueError(f"same_seeds needs as many seeds on both sides, not {len(on)} and {len(off)}")
    keep = ~np.isnan(on).any(0) & ~np.isnan(off).any(0)
    on, off = on[:, keep], off[:, keep]
    n = on.shape[1]
    if n == 0:
        return {"prompts": 0}
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, (samples, n))

    def resampled(x, draw):  # x [S, P], draw [samples, S] -> the mean of each sample, [samples]
        weights = np.stack([np.bincount(d, minlength=len(x)) for d in draw]) / len(x)  # [samples, S]
        per_prompt = weights @ x  # [samples, P]: the mean over the drawn seeds
        return np.take_along_axis(per_prompt, idx, 1).mean(1)

    if len(on) == 1 and len(off) == 1:
        ratios = on[0, idx].mean(1) / off[0, idx].mean(1)
    else:
        draw_on = rng.integers(0, len(on), (samples, len(on)))
        draw_off = draw_on if same_seeds else rng.integers(0, len(off), (samples, len(off)))
        ratios = resampled(on, draw_on) / resampled(off, draw_off)
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    tau_on, tau_off = float(on.mean()), float(off.mean())
    out = {"prompts": int(n), f"tau_{names[0]}": tau_on, f"tau_{names[1]}": tau_off,
           "ratio": tau_on / tau_off, "low": float(lo), "high": float(hi)}
    if len(on) > 1 or len(off) > 1:
        out["seeds"] = [len(on), len(off)]
    return out


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


def against_items(items: list[str]) -> dict[str, str]:
    """``--against [NAME=]DIR`` items -> ``{name: dir}``; a bare DIR is named ``against``."""
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        name, path = (name, path) if sep else ("against", item)
        if not name.isidentifier() or name in ("on", "off"):
            raise SystemExit(f"--against {item}: NAME must be a word other than 'on' and 'off'")
        if name in out:
            raise SystemExit(f"--against: the name {name} is given twice")
        out[name] = path
    return out


def tables(seed_runs: list[dict], bin_width: int, new_tokens: int) -> tuple[dict, list]:
    """The on / off table and, for every other drafter X of the runs, on / X and off / X, by position range
    and by prompt length, from the runs of one or more seeds (each ``{length: {"prompt_lens": [...],
    method: acceptance lengths per prompt}}``, the same prompts in each). Returns the JSON's tables and
    the printed ones."""
    first = seed_runs[0]
    methods = [m for m in next(iter(first.values())) if m != "prompt_lens"]
    top = max(max(r["prompt_lens"]) for r in first.values()) + new_tokens
    edges = np.arange(0, top + bin_width, bin_width)
    # [seeds, prompts, ranges]; a prompt of each length is its own sample (the files repeat across
    # lengths, the positions do not)
    bins = {m: np.stack([np.concatenate([binned_tau(r["prompt_lens"], r[m], edges) for r in runs.values()])
                         for runs in seed_runs]) for m in methods}
    means = {m: {length: np.stack([[np.mean(a) for a in runs[length][m]] for runs in seed_runs])
                 for length in first} for m in methods}
    pairs = [("on", "off")] + [(a, b) for b in methods if b not in ("on", "off") for a in ("on", "off")]
    result, printed = {}, []
    for a, b in pairs:
        same = b == "off"  # memory on and off: the same drafters, one seed draw
        by_position = [(f"{lo}-{hi - 1}", paired_ratio(bins[a][..., k], bins[b][..., k], names=(a, b),
                                                        same_seeds=same))
                       for k, (lo, hi) in enumerate(zip(edges[:-1], edges[1:]))]
        by_length = [(str(length or "as is"), paired_ratio(means[a][length], means[b][length], names=(a, b),
                                                           same_seeds=same)) for length in first]
        key = "" if (a, b) == ("on", "off") else f"_{a}_{b}"
        result[f"by_position{key}"], result[f"by_length{key}"] = dict(by_position), dict(by_length)
        printed.append((f"{a} / {b}, by position of the round (its block's first position)", by_position, (a, b)))
        printed.append((f"{a} / {b}, by prompt length (whole generations)", by_length, (a, b)))
    return result, printed


SAME_ARGS = ("target", "prompts", "prompt_lengths", "num_prompts", "new_tokens", "bin_width")


def share_fixed_drafters(paths: list[str], loaded: list[dict]) -> None:
    """A drafter compared with in some of the files only (a fixed one, such as a shipped drafter, decoded
    with one seed's run) joins the others with the same rounds, as decoding it again on the same prompts
    would give them (greedy decoding is deterministic). Every file that has it names the same directory."""
    fixed = {name for res in loaded for name in res.get("against", {})
             if any(name not in other.get("against", {}) for other in loaded)}
    for name in sorted(fixed):
        having = [(path, res) for path, res in zip(paths, loaded) if name in res.get("against", {})]
        src_path, src = having[0]
        for path, res in having[1:]:
            if res["against"][name] != src["against"][name]:
                raise SystemExit(f"{path}: {name} is {res['against'][name]}, {src_path} has {src['against'][name]}; "
                                 f"a drafter missing from some files must be the same drafter in the others")
        for res in loaded:
            if name not in res.get("against", {}):
                res.setdefault("against", {})[name] = src["against"][name]
                for length, runs in res["runs"].items():
                    if length in src["runs"] and runs["prompt_lens"] == src["runs"][length]["prompt_lens"]:
                        runs[name] = src["runs"][length][name]


def combine(paths: list[str]) -> dict:
    """The tables over the seeds of several runs of this script (one JSON each, the same target, prompts
    and settings, and drafters of the same names): each drafter's τ is the mean over its seeds, and the
    intervals draw seeds as well as prompts."""
    loaded = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            loaded.append(json.load(f))
    share_fixed_drafters(paths, loaded)
    first = loaded[0]
    for path, res in zip(paths[1:], loaded[1:]):
        for key in SAME_ARGS:
            if res["args"][key] != first["args"][key]:
                raise SystemExit(f"{path}: {key} is {res['args'][key]!r}, {paths[0]} has {first['args'][key]!r}")
        if res["runs"].keys() != first["runs"].keys() or any(
                res["runs"][k].keys() != first["runs"][k].keys()
                or res["runs"][k]["prompt_lens"] != first["runs"][k]["prompt_lens"] for k in first["runs"]):
            raise SystemExit(f"{path}: other prompts or drafters than {paths[0]}")
    seed_runs = [{int(length): runs for length, runs in r["runs"].items()} for r in loaded]
    result, printed = tables(seed_runs, first["args"]["bin_width"], first["args"]["new_tokens"])
    print(f"\n{len(paths)} seeds on {first['target']}: {first['args']['prompts']} prompts, "
          f"{first['args']['num_prompts']} per length, {first['args']['new_tokens']} new tokens, greedy")
    for res in loaded:
        print(f"  drafter {res['drafter']}" + "".join(f", {m} {d}" for m, d in res.get("against", {}).items()))
    for title, rows, names in printed:
        print_table(title, rows, names)
    return {"combined": paths, "drafters": [r["drafter"] for r in loaded],
            "against": [r.get("against", {}) for r in loaded], "args": first["args"], **result}


def write(path: str | None, result: dict) -> None:
    save(result, path, compact=True)  # atomic: a stopped run leaves the earlier file whole
    if path:
        print(f"wrote {path}")


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
    p.add_argument("--against", action="append", default=[], metavar="[NAME=]DIR",
                   help="another drafter of the target to compare with, by position (repeatable; named "
                        "'against' when NAME is not given)")
    p.add_argument("--combine", nargs="+", default=None, metavar="JSON",
                   help="instead of decoding: the tables over the seeds of earlier --out files")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.combine:
        result = combine(args.combine)
        write(args.out, result)
        return
    lengths = [int(x) for x in args.prompt_lengths.split(",")]
    if args.prompts == "chat" and lengths != [0]:
        p.error("--prompts chat takes the questions as they are: --prompt-lengths 0")
    against = against_items(args.against)
    from transformers import AutoTokenizer

    target_dir, drafter_dir, target, drafter = load_pair(args.target, args.drafter)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    if args.prompts == "code":
        sets = code_prompts(tokenizer, lengths, args.num_prompts, args.new_tokens)
    else:
        sets = {0: chat_prompts(tokenizer, args.num_prompts)}

    methods = {"on": (drafter, True), "off": (drafter, False)}
    methods.update({name: (rj.load_drafter(path, target), False) for name, path in against.items()})
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
            what = {"on": "memory on", "off": "memory off"}.get(name, f"{name} ({against.get(name)})")
            print(f"prompt length {length or 'as is'}, {what}: τ {np.mean([np.mean(a) for a in acceptance]):.2f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
        if any(out[name][0] != out["on"][0] for name in out):
            raise SystemExit(f"prompt length {length}: the methods gave different tokens (not lossless)")
        runs[length] = {"prompt_lens": [len(x) for x in prompts], **{name: out[name][1] for name in out}}

    result, printed = tables([runs], args.bin_width, args.new_tokens)
    print(f"\n{drafter_dir} on {target_dir}: {args.prompts} prompts, {args.num_prompts} per length, "
          f"{args.new_tokens} new tokens, greedy; every method lossless")
    for title, rows, names in printed:
        print_table(title, rows, names)
    write(args.out, {"target": target_dir, "drafter": drafter_dir, "against": against, "args": vars(args),
                     **result, "runs": {str(k): v for k, v in runs.items()}})


if __name__ == "__main__":
    main()
