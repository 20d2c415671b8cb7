"""Prompt sets of the laboratory pair: pieces of Python source, cut at line boundaries, as JSONL.

    python lab/build_prompts.py        # lab/work/prompts/{train,heldout}.jsonl

- ``train.jsonl``: pieces of the standard-library files that trained the target (``lab/build_target.py``:
  the same file list). The drafters are trained on the target's own greedy continuations of them.
- ``heldout.jsonl``: pieces of the held-out packages' files (optax and flax), which no training step of
  the target or of a drafter saw. The A/B/C evaluation runs on these.

A piece starts at the first line of a randomly chosen place in a randomly chosen file (files drawn in
proportion to their length) and takes whole lines until it has at least ``min_tokens`` tokens of the lab
tokenizer; pieces longer than ``max_tokens`` are drawn again, so none is ever cut. The last line's newline
is left off: the byte-level BPE joins a newline with the next line's indentation into one token, so a
piece that ends in a bare newline would end on a token that in the training text only comes before an
unindented line (and the target would start a new ``class`` or ``def``). Every record is
``{"prompt": text, "source": "path:first line"}``; the set is a function of ``--seed`` and the files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

LAB = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, LAB)
sys.path.insert(0, os.path.dirname(LAB))

import build_target  # noqa: E402  (the lab target's file lists)

from retrace_jax.assets.code import code_pieces as library_pieces  # noqa: E402


def read_texts(pairs) -> list[tuple[str, str]]:
    """``(relative path, text)`` of the files among ``(root, relative path)`` pairs that the target's
    build reads (UTF-8, not empty: ``build_target.read_docs``)."""
    return [(d["path"], d["text"]) for d in build_target.read_docs(pairs)]


def code_pieces(texts, n: int, tokenizer, seed: int, min_tokens: int = 48, max_tokens: int = 128,
                max_tries: int = 100_000) -> list[dict]:
    """``n`` pieces of whole lines with ``min_tokens`` to ``max_tokens`` tokens of the lab tokenizer
    (``retrace_jax.assets.code.code_pieces``), as ``{"prompt", "source"}`` records: the lab target has no
    chat template, so its prompts are continued as they stand."""
    try:
        pieces = library_pieces(texts, n, lambda t: len(tokenizer.encode(t)), seed, min_tokens, max_tokens, max_tries)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    return [{"prompt": p["text"], "source": p["source"]} for p in pieces]


def write_jsonl(path: str, records) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(path + ".tmp", path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=os.path.join(LAB, "target"), help="the lab target (its tokenizer)")
    p.add_argument("--out", default=os.path.join(LAB, "work", "prompts"))
    p.add_argument("--train", type=int, default=4096, help="training pieces (standard library)")
    p.add_argument("--heldout", type=int, default=256, help="held-out pieces (optax, flax)")
    p.add_argument("--min-tokens", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    root, files = build_target.training_files()
    sets = {"train": (read_texts([(root, f) for f in files]), args.train, args.seed),
            "heldout": (read_texts(build_target.held_out_files()), args.heldout, args.seed + 1)}
    for name, (texts, n, seed) in sets.items():
        pieces = code_pieces(texts, n, tokenizer, seed, args.min_tokens, args.max_tokens)
        path = os.path.join(args.out, f"{name}.jsonl")
        write_jsonl(path, pieces)
        lengths = [len(tokenizer.encode(r["prompt"])) for r in pieces]
        print(json.dumps({"set": name, "path": path, "pieces": len(pieces), "files": len(texts),
                          "tokens_min": min(lengths), "tokens_median": float(np.median(lengths)),
                          "tokens_max": max(lengths)}))


if __name__ == "__main__":
    main()
