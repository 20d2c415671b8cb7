"""Held-out prompts of a fixed token length for ``lab/evaluate.py --prompts``: the first N tokens of
held-out optax/flax files, read from past each file's first third, as ``benchmarks/retrace_positions.py``
cuts them (files too short for N + 128 tokens are left out), written as JSONL text records.

    python lab/long_prompts.py --tokens 192 --num-prompts 128 --out lab/work/prompts/heldout_192.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys

LAB = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(LAB), "benchmarks"))
sys.path.insert(0, LAB)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=os.path.join(LAB, "target"))
    p.add_argument("--tokens", type=int, default=192)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128, help="files must hold this many more tokens")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import retrace_positions
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = retrace_positions.code_prompts(tokenizer, [args.tokens], args.num_prompts, args.new_tokens)[args.tokens]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for ids in prompts:
            f.write(json.dumps({"prompt": tokenizer.decode(ids)}) + "\n")
    lengths = [len(tokenizer.encode(tokenizer.decode(ids))) for ids in prompts]
    print(f"{len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens -> {args.out}")


if __name__ == "__main__":
    main()
