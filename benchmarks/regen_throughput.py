"""Training-data throughput: regeneration and the feature pass with float32 products against bfloat16
products (float32 accumulation, ``jax.default_matmul_precision("bfloat16")``), side by side in one process.

    python benchmarks/regen_throughput.py --target ~/.cache/retrace_jax/models/qwen2.5-coder-0.5b-instruct \\
        --prompts ~/.cache/retrace_jax/data/code_mix_varied.jsonl --num-prompts 64 --max-new-tokens 32

Per precision: response tokens per second of ``rj.generate`` on one batch of prompts (the regeneration of
``train.py``'s preparation) and positions per second of the target's feature pass over the same sequences
(the feature store's), medians of ``--runs`` alternating runs after a compiling one; then how many rows'
greedy responses differ from float32's (and from which token on), and the largest feature difference.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import retrace_jax as rj  # noqa: E402
from benchmarks.products import cpu_description  # noqa: E402
from benchmarks.report import write_json  # noqa: E402
from retrace_jax.training.data import chat_encoder, iter_prompt_ids, load_tokenizer, read_prompts  # noqa: E402
from retrace_jax.models.layers import bfloat16_kernels, product_precision  # noqa: E402
from retrace_jax.training.dflash_loss import features_fn  # noqa: E402

PRECISIONS = ("float32", "bfloat16")


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (a shorter one ends there), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="a Hugging Face model directory")
    p.add_argument("--prompts", required=True, help="a JSONL prompt file (train.py's formats)")
    p.add_argument("--num-prompts", type=int, default=64, help="prompts in the batch (the first ones)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--layers", default="1,11,21", help="target layers of the feature pass")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", help="write the results as JSON")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.max_new_tokens < 1 or args.runs < 1:
        p.error("--num-prompts, --max-new-tokens and --runs must be positive")
    layers = tuple(int(x) for x in args.layers.split(","))

    target = rj.load_target(args.target, dtype="float32")
    tokenizer = load_tokenizer(args.target)
    ids = iter_prompt_ids(read_prompts(args.prompts, args.num_prompts), chat_encoder(tokenizer))
    stops = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    # as train.py runs them: bfloat16 products from kernels rounded once (bfloat16_kernels)
    models = {"float32": target, "bfloat16": bfloat16_kernels(target)}
    features = {pr: features_fn(m, layers) for pr, m in models.items()}

    def regenerate(precision):
        with product_precision(precision):
            start = time.perf_counter()
            out = rj.generate(models[precision], ids, args.max_new_tokens, stop_token_ids=stops)
            return out.tokens, time.perf_counter() - start

    def feature_pass(precision, tokens):
        with product_precision(precision):
            start = time.perf_counter()
            f = jax.block_until_ready(features[precision](tokens))
            return f, time.perf_counter() - start

    responses = {pr: regenerate(pr)[0] for pr in PRECISIONS}  # compiles
    length = max(len(a) + len(b) for a, b in zip(ids, responses["float32"]))
    seqs = np.zeros((len(ids), length), np.int32)
    for i, (a, b) in enumerate(zip(ids, responses["float32"])):
        seqs[i, : len(a) + len(b)] = a + b
    seqs = jnp.asarray(seqs)
    feats = {pr: np.asarray(feature_pass(pr, seqs)[0]) for pr in PRECISIONS}  # compiles
    gen_s = {pr: [] for pr in PRECISIONS}
    feat_s = {pr: [] for pr in PRECISIONS}
    for _ in range(args.runs):
        for pr in PRECISIONS:
            gen_s[pr].append(regenerate(pr)[1])
            feat_s[pr].append(feature_pass(pr, seqs)[1])
    new_tokens = {pr: sum(len(t) for t in responses[pr]) for pr in PRECISIONS}
    diffs = [first_difference(a, b) for a, b in zip(responses["float32"], responses["bfloat16"])]
    rows = {pr: {"regen_tokens_per_s": new_tokens[pr] / statistics.median(gen_s[pr]),
                 "regen_s": statistics.median(gen_s[pr]), "response_tokens": new_tokens[pr],
                 "feature_positions_per_s": int(seqs.size) / statistics.median(feat_s[pr]),
                 "feature_s": statistics.median(feat_s[pr])} for pr in PRECISIONS}
    result = {
        "target": os.path.abspath(args.target), "prompts": len(ids), "max_new_tokens": args.max_new_tokens,
        "runs": args.runs, "layers": list(layers), "backend": jax.default_backend(), "jax": jax.__version__,
        **cpu_description(), "precisions": rows,
        "regen_speedup": rows["bfloat16"]["regen_tokens_per_s"] / rows["float32"]["regen_tokens_per_s"],
        "feature_speedup": rows["float32"]["feature_s"] / rows["bfloat16"]["feature_s"],
        "rows_differing": sum(d is not None for d in diffs),
        "first_difference": [d for d in diffs if d is not None],
        "feature_max_abs_diff": float(np.max(np.abs(feats["float32"] - feats["bfloat16"]))),
        "feature_rel_rms_diff": float(np.sqrt(np.mean((feats["float32"] - feats["bfloat16"]) ** 2))
                                      / np.sqrt(np.mean(feats["float32"] ** 2))),
    }
    print(f"{len(ids)} prompts, {args.max_new_tokens} new tokens, medians of {args.runs} alternating runs "
          f"({jax.default_backend()}, jax {jax.__version__})\n")
    print("| products | regeneration tokens/s | feature pass positions/s |\n|---|---|---|")
    for pr in PRECISIONS:
        print(f"| {pr} | {rows[pr]['regen_tokens_per_s']:.1f} | {rows[pr]['feature_positions_per_s']:.1f} |")
    print(f"\nbfloat16 / float32: regeneration {result['regen_speedup']:.2f}x, feature pass "
          f"{result['feature_speedup']:.2f}x; {result['rows_differing']} of {len(ids)} greedy responses differ "
          f"(first at tokens {result['first_difference']}); features relative RMS difference "
          f"{result['feature_rel_rms_diff']:.2e}")
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
