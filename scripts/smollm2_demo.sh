#!/usr/bin/env bash
# The demo's SmolLM2-135M-Instruct drafter (issue 15; docs/results.md, "The demo drafter"): prompts, the
# target's responses, the DFlash training with a draft vocabulary, then its evaluation. Every stage is
# cached and resumes (the prompt mix is rewritten identically, regeneration shards, the feature store and
# Orbax checkpoints are kept), so rerunning the script continues where it stopped.
#   pip install -e '.[assets,bench]' && bash scripts/smollm2_demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=~/.cache/retrace_jax/data
TARGET=~/.cache/retrace_jax/models/smollm2-135m-instruct
python scripts/fetch_assets.py smollm2-135m-instruct sharegpt math asdiv mbpp humaneval
[ -f $DATA/mix15.jsonl ] || python scripts/mix_prompts.py --out $DATA/mix15.jsonl \
    --take sharegpt=all,math=3000,asdiv=all,mbpp=3000
python train.py --config configs/smollm2_demo.yaml          # regeneration, feature store, training
python benchmarks/speculative_eval.py --target $TARGET \
    --drafter D8=runs/smollm2_demo/drafter --drafter D4=runs/smollm2_demo/drafter --block-size D4=4 \
    --per-dataset 8 --batch-size 32 --max-new-tokens 128 --temperatures 0 \
    --speed-methods plain,D4,D8 --speed-temperatures 0 --out runs/smollm2_demo_eval.json
