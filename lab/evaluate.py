"""The A/B/C evaluation of the laboratory pair: τ of each drafter on held-out code, at T = 0
and T = 1, both conventions, with bootstrap confidence intervals of ratios over prompts and seeds.

    python lab/evaluate.py --drafter A=lab/drafters/A \\
        --drafter B:0=lab/work/runs/B_s0/drafter --drafter B:1=... --drafter C:0=... \\
        --compare C/B --compare C-off/B --out lab/results/eval.json

- ``--drafter NAME[:SEED]=DIR``: drafters with the same NAME and different SEEDs form one method, whose
  τ is the mean over its seeds. A ReTrace drafter is also run with its memory off (``NAME-off``:
  ``use_retrace=False``), the inference ablation.
- Prompts: ``--num-prompts`` pieces of ``--prompts`` (default: the held-out optax/flax pieces of
  ``lab/build_prompts.py``), spread evenly over the file, in fixed batches. At T = 0 every row decodes
  exactly as it would alone. At T = 1 batch ``j`` samples with seed ``j`` (row ``r`` of it with the
  stream ``(j, r)``), so every prompt has its own random stream, the same one for every method.
- τ is the mean number of tokens a round commits, the target's own token included. ``tau``: the mean
  over prompts of each prompt's mean over its rounds; ``tau_pooled``: all tokens over all rounds.
- At T = 0 every method's tokens are checked against plain greedy decoding (``lossless_T0``).
- ``--reuse FILE``: an earlier ``--out`` of the same target, prompts and settings, whose methods and
  seeds join this run's: every seed's acceptance lengths are in the file, so a new seed is trained and
  run alone and the comparison draws over all seeds, without the earlier drafters (a drafter seed given
  in both is refused). At T > 0 the earlier run must have used the same ``--batch-size`` (its random
  streams follow the batches).
- ``--compare X/Y``: the ratio τ(X)/τ(Y) with a 95% percentile bootstrap interval. One bootstrap sample
  draws the prompts with replacement (the same draw for X and Y: they are paired by prompt) and, for a
  method with several seeds, its seeds with replacement; the ratio is then taken of the resampled means,
  in both conventions (a method's pooled τ is the mean over its seeds of each seed's pooled τ).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import sys
import time

import numpy as np

LAB = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(LAB))

import retrace_jax as rj  # noqa: E402
from benchmarks.speculative_eval import pick, save  # noqa: E402
from retrace_jax.training.data import chat_encoder, load_tokenizer, read_prompts  # noqa: E402


def parse_drafters(items: list[str]) -> dict[str, dict[int, str]]:
    """``NAME[:SEED]=DIR`` items -> ``{name: {seed: dir}}`` (seed 0 when not given)."""
    out: dict[str, dict[int, str]] = collections.defaultdict(dict)
    for item in items:
        key, sep, path = item.partition("=")
        name, colon, seed = key.partition(":")
        if not sep or not name or not path or (colon and not seed.isdigit()):
            raise SystemExit(f"--drafter expects NAME=DIR or NAME:SEED=DIR, got {item!r}")
        if int(seed or 0) in out[name]:
            raise SystemExit(f"--drafter {name}:{seed or 0} given twice")
        out[name][int(seed or 0)] = os.path.expanduser(path)
    return dict(out)


def tau_arrays(lengths: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per prompt: mean acceptance length, tokens committed, rounds. A prompt without rounds (the target
    stopped at once) has no τ: refused, rather than a NaN that would spread into every mean."""
    empty = [i for i, a in enumerate(lengths) if not a]
    if empty:
        raise ValueError(f"prompts {empty[:5]} ended before their first round; leave them out of the set")
    return (np.array([np.mean(a) for a in lengths]), np.array([sum(a) for a in lengths], np.float64),
            np.array([len(a) for a in lengths], np.float64))


def summary(per_seed: dict[int, list[list[int]]]) -> dict:
    """τ of one method in both conventions: per seed, and the mean over seeds."""
    seeds = {}
    for seed, lengths in sorted(per_seed.items()):
        mean, tokens, rounds = tau_arrays(lengths)
        seeds[seed] = {"tau": float(mean.mean()), "tau_pooled": float(tokens.sum() / rounds.sum())}
    return {"tau": float(np.mean([s["tau"] for s in seeds.values()])),
            "tau_pooled": float(np.mean([s["tau_pooled"] for s in seeds.values()])),
            "seeds": seeds, "prompts": len(next(iter(per_seed.values())))}


def bootstrap_ratio(x: dict[int, list[list[int]]], y: dict[int, list[list[int]]], samples: int = 10_000,
                    seed: int = 0) -> dict:
    """τ(x)/τ(y) and its 95% percentile bootstrap interval over prompts (paired) and seeds (per method)."""
    rng = np.random.default_rng(seed)

    def stack(per_seed):
        arrays = [tau_arrays(per_seed[s]) for s in sorted(per_seed)]
        return [np.stack([a[i] for a in arrays]) for i in range(3)]  # each [seeds, prompts]

    (xm, xt, xr), (ym, yt, yr) = stack(x), stack(y)
    if xm.shape[1] != ym.shape[1]:
        raise ValueError("the two methods were run on different prompts")
    n = xm.shape[1]

    def ratios(px, sx, sy):
        per = xm[sx][:, px].mean() / ym[sy][:, px].mean()
        pooled = ((xt[sx][:, px].sum(1) / xr[sx][:, px].sum(1)).mean()
                  / (yt[sy][:, px].sum(1) / yr[sy][:, px].sum(1)).mean())
        return per, pooled

    point = ratios(np.arange(n), np.arange(len(xm)), np.arange(len(ym)))
    draws = np.array([ratios(rng.integers(0, n, n), rng.integers(0, len(xm), len(xm)),
                             rng.integers(0, len(ym), len(ym))) for _ in range(samples)])
    out = {}
    for i, key in enumerate(("tau", "tau_pooled")):
        lo, hi = np.percentile(draws[:, i], [2.5, 97.5])
        out[key] = {"ratio": float(point[i]), "ci95": [float(lo), float(hi)]}
    out.update(seeds=[len(xm), len(ym)], prompts=n, samples=samples)
    return out


def _tail(path: str) -> str:
    """The last two components of a path: the same file in another clone of the repository."""
    return "/".join(os.path.normpath(path).split(os.sep)[-2:])


def reusable(old: dict, new: dict, drafters: dict[str, dict[int, str]]) -> dict:
    """Checks that the earlier result ``old`` was run on the same target, prompts and settings as ``new`` (the
    header of this run's result) and shares no drafter seed with ``drafters``; returns ``old``. Paths are
    compared by their last two components (another clone holds the same files elsewhere); the chosen
    prompts by the hash of their token ids where the earlier run recorded it."""
    checks = [(key, old.get(key), new[key]) for key in ("num_prompts", "max_new_tokens", "skipped_too_long")]
    checks += [(key, _tail(old[key]), _tail(new[key])) for key in ("target", "prompts")]
    if "prompt_ids_sha256" in old:
        checks.append(("prompt_ids_sha256", old["prompt_ids_sha256"], new["prompt_ids_sha256"]))
    for key, was, now in checks:
        if was != now:
            raise SystemExit(f"--reuse: the earlier run's {key} is {was!r}, this one's {now!r}")
    for name, seeds in old["drafters"].items():
        both = sorted(set(int(s) for s in seeds) & set(drafters.get(name, {})))
        if both:
            raise SystemExit(f"--reuse: {name} seed(s) {both} are in the earlier run already")
    return old


def merge_reused(result: dict, old: dict, key: str, batch_size: int) -> None:
    """Adds the earlier run's methods and seeds at temperature ``key`` to ``result`` (acceptance lengths,
    τ and the lossless counts)."""
    if key not in old["lengths"]:
        return
    if key != "T=0" and old.get("batch_size") != batch_size:
        raise SystemExit(f"--reuse at {key}: the earlier run's batch size {old.get('batch_size')} is not "
                         f"{batch_size}, so its random streams differ")
    for method, per_seed in old["lengths"][key].items():
        merged = {**{int(s): v for s, v in per_seed.items()}, **result["lengths"][key].get(method, {})}
        result["lengths"][key][method] = dict(sorted(merged.items()))
        result["tau"][key][method] = summary(result["lengths"][key][method])
        if key == "T=0" and method in old["lossless_T0"]:
            now = result["lossless_T0"].get(method, {"rows": 0, "differing_from_plain": 0})
            result["lossless_T0"][method] = {k: now[k] + old["lossless_T0"][method][k] for k in now}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=os.path.join(LAB, "target"))
    p.add_argument("--prompts", default=os.path.join(LAB, "work", "prompts", "heldout.jsonl"))
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--drafter", action="append", default=[], help="NAME[:SEED]=DIR (repeatable)")
    p.add_argument("--max-prompt-len", type=int, default=1024, help="longer prompts are skipped (and counted), never cut")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--sampled-methods", default=None, help="methods run at T > 0 (comma separated; default: all)")
    p.add_argument("--compare", action="append", default=[], help="X/Y: bootstrap the ratio τ(X)/τ(Y)")
    p.add_argument("--reuse", default=None, help="an earlier --out whose methods and seeds join this run's")
    p.add_argument("--bootstrap-samples", type=int, default=10_000)
    p.add_argument("--out", default=None, help="write the results as JSON here (after every run)")
    args = p.parse_args(argv)
    if args.reuse and args.out and os.path.abspath(args.out) == os.path.abspath(args.reuse):
        p.error("--out must differ from --reuse: a run stopped part way would lose the earlier results")

    target = rj.load_target(args.target)
    tokenizer = load_tokenizer(args.target)
    encode = chat_encoder(tokenizer)
    stops = [tokenizer.eos_token_id]
    prompts, skipped = pick([encode(m) for m in read_prompts(args.prompts)], args.num_prompts, args.max_prompt_len)
    order = np.argsort([len(q) for q in prompts], kind="stable")  # tight padding buckets per batch
    batches = [order[i : i + args.batch_size] for i in range(0, len(order), args.batch_size)]

    drafter_dirs = parse_drafters(args.drafter)
    methods: dict[str, dict[int, dict]] = {}
    for name, seeds in drafter_dirs.items():
        loaded = {s: rj.load_drafter(d, target) for s, d in seeds.items()}
        methods[name] = {s: {"drafter": d} for s, d in loaded.items()}
        if all(d.cfg.retrace is not None for d in loaded.values()):
            methods[f"{name}-off"] = {s: {"drafter": d, "use_retrace": False} for s, d in loaded.items()}
    prompt_hash = hashlib.sha256(json.dumps([[int(t) for t in q] for q in prompts]).encode()).hexdigest()
    result = {"target": args.target, "prompts": args.prompts, "num_prompts": args.num_prompts,
              "prompt_ids_sha256": prompt_hash,
              "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size, "drafters": drafter_dirs,
              "skipped_too_long": skipped, "tau": {}, "lossless_T0": {}, "compare": {}, "lengths": {}}
    old = None
    if args.reuse:
        with open(args.reuse, encoding="utf-8") as f:
            old = reusable(json.load(f), result, drafter_dirs)
        result["drafters"] = {name: {**{int(s): d for s, d in old["drafters"].get(name, {}).items()},
                                     **drafter_dirs.get(name, {})} for name in {**old["drafters"], **drafter_dirs}}
        result["reused"] = args.reuse
    known = set(methods) | {m for per_t in (old or {}).get("lengths", {}).values() for m in per_t}
    for cmp in args.compare:
        x, slash, y = cmp.partition("/")
        if not slash or x not in known or y not in known:
            raise SystemExit(f"--compare {cmp!r}: expected X/Y with methods among {sorted(known)}")

    def run(temp: float, kwargs: dict) -> tuple[list[list[int]], list[list[int]]]:
        lengths, tokens = [None] * len(prompts), [None] * len(prompts)
        for j, idx in enumerate(batches):
            out = rj.generate(target, [prompts[i] for i in idx], args.max_new_tokens, temperature=temp,
                              stop_token_ids=stops, seed=j, **kwargs)
            for i, t, a in zip(idx, out.tokens, out.acceptance_lengths):
                tokens[i], lengths[i] = t, a
        return lengths, tokens

    for temp in [float(t) for t in args.temperatures.split(",")]:
        key = f"T={temp:g}"
        result["tau"][key], result["lengths"][key] = {}, {}
        plain = run(temp, {})[1] if temp == 0 else None
        for method, per_seed in methods.items():
            if temp > 0 and args.sampled_methods and method not in args.sampled_methods.split(","):
                continue
            start, lengths, differing = time.perf_counter(), {}, 0
            for seed, kwargs in per_seed.items():
                lengths[seed], tokens = run(temp, kwargs)
                if plain is not None:
                    differing += sum(t != q for t, q in zip(tokens, plain))
            if plain is not None:
                result["lossless_T0"][method] = {"rows": len(prompts) * len(per_seed), "differing_from_plain": differing}
            result["tau"][key][method] = summary(lengths)
            result["lengths"][key][method] = {s: v for s, v in lengths.items()}
            s = result["tau"][key][method]
            print(f"[{key}] {method}: tau {s['tau']:.3f} pooled {s['tau_pooled']:.3f} over {len(per_seed)} seed(s)"
                  + (f", {differing} rows differ from plain" if plain is not None else "")
                  + f" ({time.perf_counter() - start:.0f} s)", flush=True)
            save(result, args.out, compact=True)
        if old is not None:
            merge_reused(result, old, key, args.batch_size)
            save(result, args.out, compact=True)
        result["compare"][key] = {}
        for cmp in args.compare:
            x, _, y = cmp.partition("/")
            if x in result["lengths"][key] and y in result["lengths"][key]:
                r = bootstrap_ratio(result["lengths"][key][x], result["lengths"][key][y], args.bootstrap_samples)
                result["compare"][key][cmp] = r
                print(f"[{key}] {cmp}: {r['tau']['ratio']:.4f} [{r['tau']['ci95'][0]:.4f}, {r['tau']['ci95'][1]:.4f}]"
                      f" pooled {r['tau_pooled']['ratio']:.4f} [{r['tau_pooled']['ci95'][0]:.4f}, "
                      f"{r['tau_pooled']['ci95'][1]:.4f}]", flush=True)
        save(result, args.out, compact=True)
    print_table(result)
    return result


def print_table(result: dict) -> None:
    keys = list(result["tau"])
    print("| method | " + " | ".join(f"τ {k} | τ pooled {k}" for k in keys) + " |")
    print("|---|" + "---|---|" * len(keys))
    for method in result["tau"][keys[0]]:
        cells = []
        for k in keys:
            s = result["tau"][k].get(method)
            cells += [f"{s['tau']:.3f}", f"{s['tau_pooled']:.3f}"] if s else ["", ""]
        print(f"| {method} | " + " | ".join(cells) + " |")
    for k, comps in result["compare"].items():
        for cmp, r in comps.items():
            print(f"{k} {cmp}: τ {r['tau']['ratio']:.4f} (95% CI {r['tau']['ci95'][0]:.4f}-{r['tau']['ci95'][1]:.4f}), "
                  f"pooled {r['tau_pooled']['ratio']:.4f} ({r['tau_pooled']['ci95'][0]:.4f}-{r['tau_pooled']['ci95'][1]:.4f})")


if __name__ == "__main__":
    main()
