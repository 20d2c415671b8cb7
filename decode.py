"""Decode from the command line: plain greedy generation with a Hugging Face target directory.

    python decode.py --target DIR --prompt "Write a haiku about JAX."

Without --target it decodes with a tiny random Qwen3 made on the spot (meaningless tokens; a smoke run).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import retrace_jax as rj
from retrace_jax.tiny import tiny_target


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="Hugging Face model directory (config.json, safetensors, tokenizer)")
    p.add_argument("--prompt", default="Explain speculative decoding in one paragraph.")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    return p.parse_args(argv)


def load_tokenizer(directory: str):
    from transformers import AutoTokenizer

    if not any(os.path.exists(os.path.join(directory, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        raise FileNotFoundError(f"no tokenizer files in {directory}")
    return AutoTokenizer.from_pretrained(directory)


def encode(tokenizer, prompt: str, raw: bool) -> list[int]:
    if raw or not getattr(tokenizer, "chat_template", None):
        return tokenizer.encode(prompt)
    messages = [{"role": "user", "content": prompt}]
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False,
                                             tokenize=True, return_dict=False)
    except TypeError:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


def timed_generate(target, ids, **kwargs):
    """Compiles once, then times a second call (the steady-state speed)."""
    start = time.perf_counter()
    rj.generate(target, [ids], **kwargs)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    out = rj.generate(target, [ids], **kwargs)
    return out, compile_s, time.perf_counter() - start


def main(argv=None):
    args = parse_args(argv)
    if args.target:
        target = rj.load_target(args.target, dtype=args.dtype)
        tokenizer = load_tokenizer(args.target)
        ids = encode(tokenizer, args.prompt, args.raw)
        stops = [t for t in {tokenizer.eos_token_id, tokenizer.pad_token_id} if t is not None]
    else:
        print("No --target given: decoding with a tiny random Qwen3 made on the spot "
              "(its tokens are meaningless). Pass --target DIR to decode with a real model.")
        target, tokenizer = tiny_target(), None
        ids = [b % target.cfg.vocab_size for b in args.prompt.encode()]
        stops = []
    out, compile_s, wall_s = timed_generate(target, ids, max_new_tokens=args.max_new_tokens, stop_token_ids=stops)
    tokens = out.tokens[0]
    print(tokenizer.decode(tokens) if tokenizer else f"token ids: {tokens}")
    print(f"\nplain greedy: {len(tokens)} tokens in {wall_s:.3f}s = {len(tokens) / wall_s:.1f} tokens/s "
          f"(first call, with compilation: {compile_s:.2f}s)")


if __name__ == "__main__":
    main()
