"""Parity of this project's target with transformers on a real model (a script, not CI).

    pip install -e '.[assets]'
    python scripts/fetch_assets.py smollm2-135m-instruct
    python scripts/real_parity.py smollm2-135m-instruct [--max-new-tokens 48]

transformers loads the same GGUF file itself (its own dequantisation), so the check covers the whole
path: GGUF -> Hugging Face directory -> ``rj.load_target`` -> forward and ``rj.generate``. Prints the
largest logit difference on chat prompts and whether the greedy continuations are identical.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import retrace_jax as rj  # noqa: E402
from retrace_jax.assets import DEFAULT_CACHE, MODELS, fetch  # noqa: E402
from retrace_jax.assets.models import fetch_gguf  # noqa: E402
from retrace_jax.training.data import chat_encoder, load_tokenizer  # noqa: E402

PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string.",
           "Explain photosynthesis in two sentences.", "List three prime numbers greater than 100."]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", choices=sorted(MODELS))
    p.add_argument("--cache", default=DEFAULT_CACHE)
    p.add_argument("--max-new-tokens", type=int, default=48)
    args = p.parse_args()
    from transformers import AutoModelForCausalLM

    directory = fetch(args.model, args.cache, keep_gguf=True)
    gguf_path = fetch_gguf(args.model, MODELS[args.model], args.cache)  # fetched again if a conversion removed it
    ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                               dtype=torch.float32).eval()
    target = rj.load_target(directory)
    encode = chat_encoder(load_tokenizer(directory))
    prompts = [encode([{"role": "user", "content": q}]) for q in PROMPTS]
    worst, same = 0.0, 0
    ours = rj.generate(target, prompts, args.max_new_tokens).tokens
    for ids, mine in zip(prompts, ours):
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0].numpy()
            theirs = ref.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        out = target(np.asarray([ids], np.int32), target.init_cache(1, len(ids)))
        got = np.asarray(target.logits(out.hidden))[0]
        worst = max(worst, float(np.abs(got - want).max()))
        same += mine == theirs
    print(f"{args.model}: max |logit difference| {worst:.2e} over {len(prompts)} chat prompts; "
          f"greedy continuations of {args.max_new_tokens} tokens identical for {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
