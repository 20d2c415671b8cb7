"""Checks an exported laboratory target: transformers and ``retrace_jax.load_target`` load it and agree
(float32 logits, greedy tokens) on prompts cut from the held-out text, and prints their greedy
continuations.

    python lab/check_target.py [--target lab/target] [--work lab/work] [--prompts 3] [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's retrace_jax


def held_out_prompts(work: str, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens at evenly spaced offsets of the held-out token stream."""
    tokens = np.load(os.path.join(work, "data", "heldout_tokens.npy"))
    starts = np.linspace(0, tokens.size - length - 1, n + 2).astype(np.int64)[1:-1]
    return [tokens[s : s + length].astype(int).tolist() for s in starts]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="lab/target")
    parser.add_argument("--work", default="lab/work", help="the build's work directory (its held-out tokens)")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    import jax.numpy as jnp
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import retrace_jax as rj

    tok = AutoTokenizer.from_pretrained(args.target)
    hf = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    target = rj.load_target(args.target, dtype="float32")
    prompts = held_out_prompts(args.work, args.prompts, args.prompt_tokens)
    mine = rj.generate(target, prompts, args.new_tokens).tokens
    report = {"logits_max_abs_diff": 0.0, "greedy_equal": True}
    for ids, ours in zip(prompts, mine):
        with torch.no_grad():
            ref_logits = hf(torch.tensor([ids])).logits[0].numpy()
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                              do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        out = target(jnp.asarray([ids]), target.init_cache(1, len(ids)), attention="dense")
        diff = float(np.abs(np.asarray(target.logits(out.hidden))[0] - ref_logits).max())
        report["logits_max_abs_diff"] = max(report["logits_max_abs_diff"], diff)
        report["greedy_equal"] &= ours == ref
        print(f"--- prompt (last 200 characters) ---\n{tok.decode(ids)[-200:]}\n--- greedy continuation ---\n"
              f"{tok.decode(ours)}\n")
    print(json.dumps(report))
    if not report["greedy_equal"]:
        raise SystemExit("transformers and load_target disagree on the greedy tokens")


if __name__ == "__main__":
    main()
