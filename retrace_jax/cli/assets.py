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


def code_main(argv=None):
    """The command line of ``scripts/code_prompts.py``: pieces of Python source as raw prompts."""
    from retrace_jax.assets.code import code_pieces, source_files
    from retrace_jax.assets.prompts import write_records
    from retrace_jax.training.data import load_tokenizer

    p = argparse.ArgumentParser(description="Pieces of Python source (whole lines) as raw code-completion prompts "
                                "({\"text\", \"source\"} JSONL; see retrace_jax/assets/code.py).")
    p.add_argument("--out", required=True, help="the JSONL file to write")
    p.add_argument("--tokenizer", required=True, help="a model directory whose tokenizer counts the tokens")
    p.add_argument("--sources", required=True, help="comma-separated: 'stdlib' and/or installed package names")
    p.add_argument("--exclude", default="", help="comma-separated sources that must not be among --sources (the "
                   "held-out packages): a safeguard against evaluating on training code")
    p.add_argument("--num", type=int, required=True, help="how many pieces")
    p.add_argument("--min-tokens", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    names = [s.strip() for s in args.sources.split(",") if s.strip()]
    clash = sorted(set(names) & {s.strip() for s in args.exclude.split(",") if s.strip()})
    if clash:
        raise ValueError(f"--sources names held-out source(s) {clash} (--exclude)")
    if args.num < 1:
        raise ValueError(f"--num must be >= 1, got {args.num}")
    tokenizer = load_tokenizer(args.tokenizer)
    if tokenizer is None:
        raise ValueError(f"{args.tokenizer} has no tokenizer (tokenizer.json or tokenizer_config.json)")
    texts = [t for name in names for t in source_files(name)]
    pieces = code_pieces(texts, args.num, lambda t: len(tokenizer.encode(t, add_special_tokens=False)), args.seed,
                         args.min_tokens, args.max_tokens)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_records(pieces, args.out)
    per_source = {name: sum(p["source"].startswith(name + "/") for p in pieces) for name in names}
    log(f"wrote {args.out}: {len(pieces)} pieces from {len(texts)} files ({per_source})")
    return pieces


def main(argv=None):
    """The command line of ``scripts/fetch_assets.py``; errors raise (the script prints them as one line)."""
    p = argparse.ArgumentParser(description=assets.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("assets", nargs="+", choices=sorted(MODELS) + sorted(DATASETS))
    p.add_argument("--cache", default=DEFAULT_CACHE, help="model directory (prompt sets go to its ../data)")
    p.add_argument("--keep-gguf", action="store_true", help="keep a model's GGUF file after its conversion "
                   "(removed by default: nothing reads it later but scripts/real_parity.py)")
    args = p.parse_args(argv)
    for name in args.assets:
        if name in MODELS:
            fetch(name, args.cache, keep_gguf=args.keep_gguf)
        else:
            fetch_dataset(name, args.cache)
