#!/usr/bin/env bash
# The whole SmolLM2 experiment of docs/results_smollm2.md, stage by stage; rerunning skips or resumes finished
# stages (regeneration shards, checkpoints and exported drafters are kept). About 2 hours on 2 CPU cores.
#   pip install -e '.[assets,bench]' && bash scripts/smollm2_experiment.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python scripts/fetch_assets.py smollm2-135m-instruct sharegpt humaneval
python train.py --config configs/smollm2_dflash.yaml       # A: regeneration, then DFlash from scratch
python train.py --config configs/smollm2_retrace.yaml      # C: A + K steps of ReTrace
python train.py --config configs/smollm2_dflash_ft.yaml    # B: A + the same K steps of DFlash
python benchmarks/speculative_eval.py --target ~/.cache/retrace_jax/models/smollm2-135m-instruct \
    --drafter A=runs/smollm2_dflash/drafter --drafter B=runs/smollm2_dflash_ft/drafter \
    --drafter C=runs/smollm2_retrace/drafter --per-dataset 8 --batch-size 32 --max-new-tokens 96 \
    --sampled-methods B,C,C-off --speed-temperatures 0,1 --out runs/smollm2_eval.json --plot docs/acceptance_lengths.png
python benchmarks/round_latency.py --target ~/.cache/retrace_jax/models/smollm2-135m-instruct \
    --drafter runs/smollm2_retrace/drafter --context 128 --iters 100 --out runs/smollm2_round_latency.json
