"""The command lines of ``scripts/fetch_assets.py`` and ``scripts/mix_prompts.py``."""

from __future__ import annotations

import argparse
import os

from retrace_jax import assets
from retrace_jax.assets.mixing import MIX_COUNTS, SPEC_BENCH, mix_prompts, parse_take
from retrace_jax.assets.models import DEFAULT_CACHE, MODELS, fetch
from retrace_jax.assets.prompts import DATASETS, fetch_dataset
from retrace_jax.assets.wheels import log


def mix_main(argv=None):
    """The command line of ``scripts/mix_prompts.py``."""
    p = argparse.ArgumentParser(description="Mix prompt sets into one decontaminated, deduplicated training "
                                "file (see retrace_jax/assets/).")
    p.add_argument("--out", required=True, help="the JSONL file to write")
    p.add_argument("--take", required=True, help="NAME=COUNT|all,...: a set of DATASETS (fetched on first use) "
                   "or a JSONL prompt file, and how many of its prompts to take")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval", action="append", metavar="FILE", help="evaluation prompts to keep out (repeatable; "
                   "default: the vendored Spec-Bench questions and HumanEval, fetched on first use)")
    p.add_argument("--overlap", type=int, default=50, help="drop prompts sharing this many normalised "
                   "characters with an evaluation prompt")
    p.add_argument("--cache", default=DEFAULT_CACHE, help="model directory (prompt sets are in its ../data)")
    args = p.parse_args(argv)
    sources = []
    for name, count in parse_take(args.take):
        if name in DATASETS:
            sources.append((name, fetch_dataset(name, args.cache), count))
        elif os.path.isfile(name):
            sources.append((os.path.splitext(os.path.basename(name))[0], name, count))
        else:
            raise ValueError(f"--take: {name!r} is neither a prompt set ({', '.join(DATASETS)}) nor a file")
    if args.eval is None:
        if not os.path.isfile(SPEC_BENCH):
            raise FileNotFoundError(f"the vendored Spec-Bench questions are missing ({SPEC_BENCH}); name the "
                                    f"evaluation files with --eval")
        args.eval = [SPEC_BENCH, fetch_dataset("humaneval", args.cache)]
    stats = mix_prompts(sources, args.out, args.eval, args.seed, args.overlap)
    log(f"{'set':<14}" + "".join(f"{k:>10}" for k in MIX_COUNTS))
    for name, st in stats.items():
        log(f"{name:<14}" + "".join(f"{st[k]:>10}" for k in MIX_COUNTS))
    total = {k: sum(st[k] for st in stats.values()) for k in MIX_COUNTS}
    log(f"{'total':<14}" + "".join(f"{total[k]:>10}" for k in MIX_COUNTS))
    log(f"wrote {args.out}: {total['taken']} prompts (evaluation files: {', '.join(args.eval)})")
    return stats


def main(argv=None):
    """The command line of ``scripts/fetch_assets.py``; errors raise (the script prints them as one line)."""
    p = argparse.ArgumentParser(description=assets.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("assets", nargs="+", choices=sorted(MODELS) + sorted(DATASETS))
    p.add_argument("--cache", default=DEFAULT_CACHE, help="model directory (prompt sets go to its ../data)")
    args = p.parse_args(argv)
    for name in args.assets:
        (fetch if name in MODELS else fetch_dataset)(name, args.cache)
