"""τ and speed of trained drafters on a real target, per dataset, at T = 0 and T = 1 (the SmolLM2 experiment
of docs/results_smollm2.md; prompts that no training step saw).

    python benchmarks/speculative_eval.py \\
        --target ~/.cache/retrace_jax/models/smollm2-135m-instruct \\
        --drafter A=runs/smollm2_dflash/drafter --drafter B=runs/smollm2_dflash_ft/drafter \\
        --drafter C=runs/smollm2_retrace/drafter --per-dataset 8 --batch-size 32 --max-new-tokens 96 \
    --sampled-methods B,C,C-off --speed-temperatures 0,1 --out runs/smollm2_eval.json --plot docs/acceptance_lengths.png

Datasets: the six Spec-Bench groups (MT-Bench's 80 questions, first turn, as one group; translation,
summarization, qa, math_reasoning, rag; shipped in ``retrace_jax/assets/data``) and HumanEval
(``scripts/fetch_assets.py humaneval``), with
``--per-dataset`` prompts spread evenly over each file (0: all). Prompts longer than ``--max-prompt-len``
tokens are skipped (and counted), never cut. ``--prompts NAME=FILE`` (repeatable) adds a prompt file in
any format ``train.py`` reads; its raw ``{"text"}`` records are continued as they stand (code completion),
the others through the chat template. ``--spec-bench none --humaneval none`` leaves those two out:

    python benchmarks/speculative_eval.py --target ~/.cache/retrace_jax/models/qwen2.5-coder-0.5b-instruct \
        --drafter dflash=runs/qwen25coder05_dflash/drafter --spec-bench none --humaneval none \
        --prompts humaneval=~/.cache/retrace_jax/data/humaneval_raw.jsonl \
        --prompts heldout=~/.cache/retrace_jax/data/code_heldout.jsonl --per-dataset 0 --speed-prompts 8

- **τ** (mean acceptance length per round, the bonus token included) comes from batched runs: every
  row of a batch decodes exactly as it would alone. Both conventions are reported: ``tau`` (mean of
  per-prompt means) and ``tau_pooled`` (over all rounds). A ReTrace drafter is also run with its memory
  off (``NAME-off``: ``use_retrace=False``), the ablation. At T = 0 every method's tokens are checked
  against plain greedy decoding.
- **Speed** comes from batch-1 runs of ``--speed-prompts`` prompts per dataset, with two conventions
  (``benchmarks/speed.py``): **end to end** (new tokens / wall time, prefill included) and **decode
  only** (tokens after the first / time after prefill, the official benchmark's convention; prefill is
  timed as the same compiled program stopped at its first token). Each time is the median of
  ``--repeats`` runs (at least 3) after a compiling run, plain and speculative alternating in one
  process; the speedups are ratios of tokens/s pooled over each dataset's prompts, against plain decoding
  (the loop with one target forward per token: the official baseline's block size 1).
- **Block size**: each drafter runs at its own block size unless ``--block-size NAME=K`` sets another
  (a drafter trained at one block size can run at a smaller one; give the same directory under two names
  to compare them side by side).
- **Draft rule at T > 0** (``--draft-rule``, recorded in the JSON): ``argmax`` (default: one-hot
  rejection sampling), ``target_sample`` (the official DFlash rule: argmax proposals accepted while they
  equal the target's own samples) or ``sample`` (proposals drawn from the drafter). The first two give the
  same distribution of tokens and τ.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import retrace_jax as rj  # noqa: E402
from benchmarks.report import write_json  # noqa: E402
from benchmarks.speed import rates, time_methods  # noqa: E402
from retrace_jax.decoding.generation import DRAFT_RULES  # noqa: E402
from retrace_jax.training.data import chat_encoder, load_tokenizer, read_prompts  # noqa: E402

MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
# the Spec-Bench questions, shipped as package data (retrace_jax/assets/data/SOURCES.md)
DEFAULT_SPEC_BENCH = rj.assets.SPEC_BENCH
DEFAULT_HUMANEVAL = os.path.join(os.path.expanduser("~"), ".cache", "retrace_jax", "data", "humaneval.jsonl")


def read_datasets(spec_bench: str | None, humaneval: str | None) -> dict[str, list[str]]:
    """Dataset name -> user messages, in file order (either file left out when None)."""
    sets: dict[str, list[str]] = collections.defaultdict(list)
    for path in (x for x in (spec_bench, humaneval) if x is not None):
        if not os.path.isfile(path):
            raise SystemExit(f"prompt file not found: {path}" + (" (python scripts/fetch_assets.py humaneval)"
                                                                 if path == humaneval else ""))
    if spec_bench is not None:
        with _open_text(spec_bench) as f:
            for line in f:
                r = json.loads(line)
                sets["mt_bench" if r["category"] in MT_BENCH else r["category"]].append(r["turns"][0])
    if humaneval is None:
        return dict(sets)
    with _open_text(humaneval) as f:
        for line in f:
            sets["humaneval"].append(json.loads(line)["prompt"])
    return dict(sets)


def _open_text(path: str):
    """A text file, gzip-compressed when its name ends in ``.gz``."""
    return gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")


def read_prompt_files(items: list[str]) -> dict[str, list[list[dict]]]:
    """``NAME=FILE`` items -> ``{name: prompts}`` (message lists, as ``train.py`` reads them)."""
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--prompts expects NAME=FILE, got {item!r}")
        if name in out:
            raise SystemExit(f"--prompts names {name!r} twice")
        out[name] = read_prompts(os.path.expanduser(path))
    return out


def pick(ids: list[list[int]], n: int, max_len: int) -> tuple[list[list[int]], int]:
    """``n`` prompts spread evenly over the list (0: all), skipping those longer than ``max_len``."""
    fitting = [p for p in ids if len(p) <= max_len]
    if n == 0:
        return fitting, len(ids) - len(fitting)
    if len(fitting) < n:
        raise SystemExit(f"only {len(fitting)} prompts fit in {max_len} tokens, {n} asked")
    chosen = [fitting[int(i)] for i in np.linspace(0, len(fitting) - 1, n).round()]
    return chosen, len(ids) - len(fitting)


def parse_drafters(items: list[str]) -> list[tuple[str, str]]:
    out = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--drafter expects NAME=DIR, got {item!r}")
        out.append((name, os.path.expanduser(path)))
    return out


def parse_block_sizes(items: list[str], drafters: dict) -> dict[str, int]:
    """``NAME=K`` items -> ``{name: K}``, for drafters given with ``--drafter``."""
    out = {}
    for item in items:
        name, sep, k = item.partition("=")
        if not sep or not k.isdigit() or int(k) < 2:
            raise SystemExit(f"--block-size expects NAME=K with K >= 2, got {item!r}")
        if name not in drafters:
            raise SystemExit(f"--block-size {item!r}: no drafter named {name!r} (given: {', '.join(drafters) or 'none'})")
        out[name] = int(k)
    return out


def summarize(lengths: list[list[int]]) -> dict:
    per_prompt = [np.mean(a) for a in lengths if a]
    pooled = [x for a in lengths for x in a]
    return {"tau": round(float(np.mean(per_prompt)), 4), "tau_pooled": round(float(np.mean(pooled)), 4),
            "rounds": len(pooled), "prompts": len(per_prompt)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", action="append", default=[], help="NAME=DIR (repeatable)")
    p.add_argument("--block-size", action="append", default=[],
                   help="NAME=K: run drafter NAME (and NAME-off) at block size K instead of its own (repeatable; "
                        "the same directory may be given under several names to compare block sizes)")
    p.add_argument("--spec-bench", default=DEFAULT_SPEC_BENCH, help="Spec-Bench questions (JSONL, optionally .gz; "
                   "default: the copy in retrace_jax/assets/data)")
    p.add_argument("--humaneval", default=DEFAULT_HUMANEVAL, help="HumanEval as chat requests ('none': left out)")
    p.add_argument("--prompts", action="append", default=[], metavar="NAME=FILE",
                   help="a prompt file as one more dataset (repeatable; raw {\"text\"} records stay raw)")
    p.add_argument("--per-dataset", type=int, default=12, help="prompts per dataset for τ (0: all)")
    p.add_argument("--speed-prompts", type=int, default=1, help="prompts per dataset timed at batch 1 (0: none)")
    p.add_argument("--speed-methods", default="plain,B,C", help="methods timed at batch 1 (comma separated)")
    p.add_argument("--max-prompt-len", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=64, help="rows per batched τ run")
    p.add_argument("--temperatures", default="0,1", help="temperatures of the batched τ runs ('': none, speed only)")
    p.add_argument("--sampled-methods", default=None,
                   help="methods run at T > 0 (comma separated; default: all)")
    p.add_argument("--speed-temperatures", default="0", help="temperatures of the batch-1 speed runs")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per prompt and method (median; >= 3)")
    p.add_argument("--draft-rule", default="argmax", choices=DRAFT_RULES,
                   help="speculative sampling rule at T > 0 (target_sample: the official DFlash rule)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--plot", default=None, help="write the acceptance-length distribution (PNG) here")
    args = p.parse_args(argv)
    if args.repeats < 3:
        p.error(f"--repeats must be at least 3 (times are medians), got {args.repeats}")
    if args.speed_prompts < 0:
        p.error(f"--speed-prompts must be 0 (no speed runs) or more, got {args.speed_prompts}")

    target = rj.load_target(os.path.expanduser(args.target))
    tokenizer = load_tokenizer(os.path.expanduser(args.target))
    encode = chat_encoder(tokenizer)
    stops = [tokenizer.eos_token_id]
    drafters = {name: rj.load_drafter(path, target) for name, path in parse_drafters(args.drafter)}
    block_sizes = parse_block_sizes(args.block_size, drafters)
    methods: dict[str, dict] = {"plain": {}}
    for name, d in drafters.items():
        methods[name] = {"drafter": d, "draft_rule": args.draft_rule, "block_size": block_sizes.get(name)}
        if d.cfg.retrace is not None:
            methods[f"{name}-off"] = {**methods[name], "use_retrace": False}
    temperatures = [float(t) for t in args.temperatures.split(",") if t]

    datasets, skipped = {}, {}
    chats = {name: [[{"role": "user", "content": t}] for t in texts] for name, texts in read_datasets(
        None if args.spec_bench == "none" else args.spec_bench, None if args.humaneval == "none" else args.humaneval).items()}
    for name, messages in {**chats, **read_prompt_files(args.prompts)}.items():
        ids = [encode(m) for m in messages]
        datasets[name], skipped[name] = pick(ids, args.per_dataset, args.max_prompt_len)
    if not datasets:
        raise SystemExit("no datasets: give --prompts, or leave --spec-bench / --humaneval on")
    # one flat list, sorted by length so each batch pads to a tight prompt bucket
    rows = sorted(((len(ids), name, i) for name, ps in datasets.items() for i, ids in enumerate(ps)))
    batches = [rows[i : i + args.batch_size] for i in range(0, len(rows), args.batch_size)]

    result = {"target": args.target, "drafters": dict(parse_drafters(args.drafter)), "block_sizes": block_sizes,
              "per_dataset": args.per_dataset, "max_new_tokens": args.max_new_tokens,
              "draft_rule": args.draft_rule, "repeats": args.repeats,
              "max_prompt_len": args.max_prompt_len, "skipped_too_long": skipped,
              "prompt_tokens_mean": {n: round(float(np.mean([len(p) for p in ps])), 1) for n, ps in datasets.items()},
              "tau": {}, "lengths": {}, "lossless_T0": {}, "speed": {}}
    plain_tokens: dict[tuple[str, int], list[int]] = {}
    for temp in temperatures:
        key = f"T={temp:g}"
        result["tau"][key], result["lengths"][key] = {}, {}
        for method, kwargs in methods.items():
            if method == "plain" and temp > 0:
                continue  # plain τ is 1 by definition; plain tokens matter only for the greedy check
            if temp > 0 and args.sampled_methods and method not in args.sampled_methods.split(","):
                continue
            start = time.perf_counter()
            per_set: dict[str, list[list[int]]] = collections.defaultdict(list)
            mismatches = 0
            for batch in batches:
                prompts = [datasets[name][i] for _, name, i in batch]
                out = rj.generate(target, prompts, args.max_new_tokens, temperature=temp, stop_token_ids=stops,
                                  seed=0, **kwargs)
                for (_, name, i), toks, lens in zip(batch, out.tokens, out.acceptance_lengths):
                    per_set[name].append(lens)
                    if temp == 0 and method == "plain":
                        plain_tokens[(name, i)] = toks
                    elif temp == 0:
                        mismatches += toks != plain_tokens[(name, i)]
            if method == "plain":
                print(f"[{key}] plain: {time.perf_counter() - start:.0f} s", flush=True)
                continue
            if temp == 0:
                result["lossless_T0"][method] = {"rows": len(rows), "differing_from_plain": int(mismatches)}
            result["tau"][key][method] = {name: summarize(v) for name, v in per_set.items()}
            result["tau"][key][method]["all"] = summarize([a for v in per_set.values() for a in v])
            result["lengths"][key][method] = [x for v in per_set.values() for a in v for x in a]
            print(f"[{key}] {method}: tau {result['tau'][key][method]['all']['tau']:.3f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
            save(result, args.out)  # after every run: an interrupted evaluation keeps what it measured

    # --speed-prompts 0: no batch-1 speed runs (tau and losslessness only)
    speed_methods = [m for m in args.speed_methods.split(",") if m in methods] if args.speed_prompts else []
    result["speed_decode"], result["speed_runs"] = {}, {}
    for temp in [float(t) for t in args.speed_temperatures.split(",") if t]:
        key = f"T={temp:g}"
        runs: dict[str, dict[str, list[dict]]] = {m: collections.defaultdict(list) for m in speed_methods}
        for name, ps in datasets.items():
            for ids in ps[: args.speed_prompts]:
                timed = time_methods(target, ids, args.max_new_tokens, {m: methods[m] for m in speed_methods},
                                     args.repeats, stops, temperature=temp, seed=0)
                for method, t in timed.items():
                    runs[method][name].append(t)
        result["speed"][key], result["speed_decode"][key] = {}, {}
        for method in speed_methods:
            per_set = {name: rates(v) for name, v in runs[method].items()}
            per_set["all"] = rates([t for v in runs[method].values() for t in v])
            result["speed"][key][method] = {n: round(r["end_to_end"], 2) for n, r in per_set.items()}
            result["speed_decode"][key][method] = {n: round(r["decode"], 2) for n, r in per_set.items()}
        result["speed_runs"][key] = {m: dict(v) for m, v in runs.items()}
        print(f"[{key}] speed done", flush=True)
        save(result, args.out)

    result["complete"] = True  # every run above finished (an interrupted evaluation's file lacks this)
    save(result, args.out)
    print_tables(result)
    if args.plot:
        plot_lengths(result, args.plot)


def save(result: dict, out: str | None, compact: bool = False) -> None:
    """Writes ``result`` as JSON to ``out`` (nothing when None), atomically; ``compact`` leaves out the
    indentation (for results that hold every round's length)."""
    write_json(result, out, indent=None if compact else 1)


def print_tables(result: dict) -> None:
    for key, by_method in result["tau"].items():
        methods = list(by_method)
        sets = list(next(iter(by_method.values())))
        per_set = result["per_dataset"] or "all"
        print(f"\nτ at {key} (mean of per-prompt means / pooled over rounds), {per_set} prompts per set")
        print("| dataset | " + " | ".join(methods) + " |")
        print("|---|" + "---|" * len(methods))
        for s in sets:
            cells = [f"{by_method[m][s]['tau']:.2f} / {by_method[m][s]['tau_pooled']:.2f}" for m in methods]
            print(f"| {s} | " + " | ".join(cells) + " |")
    for table, title in (("speed", "end to end (prefill included)"), ("speed_decode", "decode only (after prefill)")):
        for key, by_method in result.get(table, {}).items():
            if "plain" not in by_method:
                continue
            plain = by_method["plain"]
            print(f"\nbatch-1 tokens/s at {key}, {title} (speedup over plain)")
            methods = list(by_method)
            print("| dataset | " + " | ".join(methods) + " |")
            print("|---|" + "---|" * len(methods))
            for s in plain:
                cells = [f"{by_method[m][s]:.1f}" + ("" if m == "plain" else f" ({by_method[m][s] / plain[s]:.2f}x)")
                         for m in methods]
                print(f"| {s} | " + " | ".join(cells) + " |")
    if result["lossless_T0"]:
        print("\ngreedy outputs differing from plain decoding:",
              {m: f"{v['differing_from_plain']}/{v['rows']}" for m, v in result["lossless_T0"].items()})


def plot_lengths(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(result["lengths"])
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys):
        methods = list(result["lengths"][key])
        top = max(max(v) for v in result["lengths"][key].values())
        width = 0.8 / len(methods)
        for j, m in enumerate(methods):
            counts = np.bincount(result["lengths"][key][m], minlength=top + 1)[1:]
            ax.bar(np.arange(1, top + 1) + (j - (len(methods) - 1) / 2) * width, counts / counts.sum(), width,
                   label=f"{m} (τ {np.mean(result['lengths'][key][m]):.2f})")
        ax.set_xlabel("tokens committed per round (accepted + 1)")
        ax.set_ylabel("fraction of rounds")
        ax.set_title(f"acceptance length, {key}, all datasets")
        ax.set_xticks(range(1, top + 1))
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
