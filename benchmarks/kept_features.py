"""Training-data throughput with the features kept from the generation (``data.keep_features``) against
regeneration followed by the feature store's pass, side by side in one process.

    python benchmarks/kept_features.py --target ~/.cache/retrace_jax/models/qwen2.5-coder-0.5b-instruct \\
        --prompts ~/.cache/retrace_jax/data/code_mix_varied.jsonl --num-prompts 64 --slots 32

Both pipelines run as ``train.py`` runs them, with ``--precision`` products (bfloat16: bfloat16 operands,
float32 accumulation, the kernels rounded once): the stream of ``rj.generate(..., slots=N)``, then either
the feature pass over the sequences (batches of ``--batch-size`` in order of length, each as wide as the
prompt bucket of its longest sequence, as ``feature_store.build_stores`` computes them) or nothing, since
``feature_layers`` kept the features during the stream. Per pipeline: seconds and response tokens per
second of the whole (medians of ``--runs`` alternating runs after a compiling one); whether the tokens are
the same; and how far the kept features are from the pass's (largest and RMS difference relative to the
features' RMS).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import retrace_jax as rj  # noqa: E402
from benchmarks.report import write_json  # noqa: E402
from retrace_jax.decoding.generation import prompt_bucket  # noqa: E402
from retrace_jax.models.layers import bfloat16_kernels, product_precision  # noqa: E402
from retrace_jax.training.data import chat_encoder, iter_prompt_ids, load_tokenizer, read_prompts  # noqa: E402
from retrace_jax.training.dflash_loss import features_fn  # noqa: E402


def feature_pass(fn, seqs: list[list[int]], batch_size: int) -> list[np.ndarray]:
    """The features of every sequence, computed as the feature store computes them (``build_stores``)."""
    order = np.argsort([len(s) for s in seqs], kind="stable")
    out: list = [None] * len(seqs)
    for i in range(0, len(seqs), batch_size):
        idx = order[i:i + batch_size]
        wide = prompt_bucket(max(len(seqs[j]) for j in idx))
        tokens = np.zeros((batch_size, wide), np.int32)
        for row, j in enumerate(idx):
            tokens[row, :len(seqs[j])] = seqs[j]
        values = np.asarray(jax.device_get(fn(tokens)))
        for row, j in enumerate(idx):
            out[j] = values[row, :len(seqs[j])]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="a Hugging Face model directory")
    p.add_argument("--prompts", required=True, help="a JSONL prompt file (train.py's formats)")
    p.add_argument("--num-prompts", type=int, default=64, help="prompts of the stream (the first ones)")
    p.add_argument("--slots", type=int, default=32, help="rows of the stream (data.gen_batch_size)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--layers", default="1,11,21", help="target layers whose features are kept")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per batch of the feature pass")
    p.add_argument("--precision", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", help="write the results as JSON")
    args = p.parse_args(argv)
    if min(args.num_prompts, args.slots, args.max_new_tokens, args.batch_size, args.runs) < 1:
        p.error("--num-prompts, --slots, --max-new-tokens, --batch-size and --runs must be positive")
    layers = tuple(int(x) for x in args.layers.split(","))

    target = rj.load_target(args.target, dtype="float32")
    tokenizer = load_tokenizer(args.target)
    ids = iter_prompt_ids(read_prompts(args.prompts, args.num_prompts), chat_encoder(tokenizer))
    stops = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    model = bfloat16_kernels(target) if args.precision == "bfloat16" else target
    fn = features_fn(model, layers)

    def with_pass():
        with product_precision(args.precision):
            start = time.perf_counter()
            tokens = rj.generate(model, ids, args.max_new_tokens, stop_token_ids=stops, slots=args.slots).tokens
            features = feature_pass(fn, [a + b for a, b in zip(ids, tokens)], args.batch_size)
            return tokens, features, time.perf_counter() - start

    def kept():
        with product_precision(args.precision):
            start = time.perf_counter()
            out = rj.generate(model, ids, args.max_new_tokens, stop_token_ids=stops, slots=args.slots,
                              feature_layers=layers)
            return out.tokens, out.features, time.perf_counter() - start

    pipelines = {"generate, then the feature pass": with_pass, "generate keeping the features": kept}
    first = {name: run() for name, run in pipelines.items()}  # compiles
    seconds = {name: [] for name in pipelines}
    for _ in range(args.runs):
        for name, run in pipelines.items():
            seconds[name].append(run()[2])
    (tokens_a, feats_a, _), (tokens_b, feats_b, _) = first.values()
    new_tokens = sum(len(t) for t in tokens_a)
    diff = np.concatenate([a - b for a, b in zip(feats_a, feats_b)]) if tokens_a == tokens_b else None
    rms = float(np.sqrt(np.mean(np.concatenate(feats_a) ** 2)))
    rows = {name: {"seconds": statistics.median(s), "runs_s": s,
                   "response_tokens_per_s": new_tokens / statistics.median(s)} for name, s in seconds.items()}
    names = list(pipelines)
    result = {
        "target": os.path.abspath(args.target), "prompts": len(ids), "slots": args.slots,
        "max_new_tokens": args.max_new_tokens, "layers": list(layers), "precision": args.precision,
        "batch_size": args.batch_size, "runs": args.runs, "backend": jax.default_backend(), "jax": jax.__version__,
        "response_tokens": new_tokens, "positions": sum(len(a) + len(b) for a, b in zip(ids, tokens_a)),
        "pipelines": rows, "speedup": rows[names[0]]["seconds"] / rows[names[1]]["seconds"],
        "same_tokens": tokens_a == tokens_b,
        "features_max_abs_diff_over_rms": None if diff is None else float(np.max(np.abs(diff))) / rms,
        "features_rms_diff_over_rms": None if diff is None else float(np.sqrt(np.mean(diff ** 2))) / rms,
    }
    print(f"{len(ids)} prompts through {args.slots} slots, up to {args.max_new_tokens} new tokens "
          f"({new_tokens} in all), {args.precision} products, medians of {args.runs} alternating runs "
          f"({jax.default_backend()}, jax {jax.__version__})\n")
    print("| pipeline | seconds | response tokens/s | runs (s) |\n|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['seconds']:.1f} | {row['response_tokens_per_s']:.1f} | "
              f"{', '.join(f'{x:.1f}' for x in row['runs_s'])} |")
    print(f"\nkept / pass: {result['speedup']:.2f}x faster; the same tokens: {result['same_tokens']}; kept features "
          f"against the pass's: largest difference {result['features_max_abs_diff_over_rms']}, RMS difference "
          f"{result['features_rms_diff_over_rms']} (relative to the features' RMS)")
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
