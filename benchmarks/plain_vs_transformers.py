"""Tokens/s of ``rj.generate`` (one compiled program) against transformers' ``generate`` (PyTorch eager),
greedy, on the same small random Qwen3 in float32, batch 1, alternating runs after a warm-up.

    python benchmarks/plain_vs_transformers.py [--layers 4 --width 256 --new-tokens 128]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import retrace_jax as rj  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=args.vocab, hidden_size=args.width, intermediate_size=3 * args.width,
                                      num_hidden_layers=args.layers, num_attention_heads=args.width // 32,
                                      num_key_value_heads=max(1, args.width // 128), head_dim=32,
                                      max_position_embeddings=1024, tie_word_embeddings=True)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        target = rj.load_target(d)
    prompt = np.random.RandomState(0).randint(0, args.vocab, (16,)).tolist()
    n = args.new_tokens

    def ours():
        return rj.generate(target, [prompt], n).tokens[0]

    def theirs():
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    assert ours() == theirs(), "greedy outputs differ"
    times = {"retrace_jax": [], "transformers": []}
    for _ in range(args.repeats):
        for name, fn in (("retrace_jax", ours), ("transformers", theirs)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    med = {k: float(np.median(v)) for k, v in times.items()}
    print(f"random Qwen3 d={args.width}, {args.layers} layers, vocab {args.vocab}; batch 1, {n} new tokens, float32, CPU")
    print("| implementation | tokens/s |\n|---|---|")
    for k, v in med.items():
        print(f"| {k} | {n / v:.1f} |")
    print(f"| ratio retrace_jax / transformers | {med['transformers'] / med['retrace_jax']:.2f}x |")


if __name__ == "__main__":
    main()
