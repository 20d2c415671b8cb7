#!/usr/bin/env bash
# The recipe's remaining levers, each tried on the long run's recipe and data (docs/results.md, "A lever on
# the long run"): the 2,048-sequence run (scripts/qwen25coder05_long.sh --shards 16, float32 products) is the
# baseline, and each lever below trains the same recipe with one change to the same step (--until, 200 by
# default; the same data and learning rate as the baseline's first steps, and as many drafted slots a step),
# measured on the same dev and fit sequences, so every row is paired with the baseline's point of that step.
# --precision bfloat16 trains the baseline and the levers with bfloat16 products instead (a CPU with
# AVX-512 BF16 or AMX takes about 0.6x the step time): the baseline is then the run tagged bf16
# (levers/tau_curve_2048_bf16.json), each lever's tag NAME-bf16, each paired with that baseline.
# Resumable: a lever measured already is skipped, one interrupted resumes from its checkpoint, and a later
# --until goes on.
#   pip install -e '.[assets,bench]' && bash scripts/qwen25coder05_levers.sh [--until STEP] [--precision P] [NAME ...]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=results/qwen2.5-coder-0.5b-instruct
UNTIL=200
if [ "${1:-}" = "--until" ]; then
    [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] && [ $(( $2 % 200 )) -eq 0 ] || { echo "$0: --until takes a multiple of 200" >&2; exit 2; }
    UNTIL=$2
    shift 2
fi
PRECISION=float32
if [ "${1:-}" = "--precision" ]; then
    [[ "${2:-}" =~ ^(float32|bfloat16)$ ]] || { echo "$0: --precision takes float32 or bfloat16" >&2; exit 2; }
    PRECISION=$2
    shift 2
fi
BASE=$OUT/tau_curve_2048.json
SUFFIX=
BASE_TAG=()
if [ "$PRECISION" = bfloat16 ]; then
    BASE=$OUT/levers/tau_curve_2048_bf16.json
    SUFFIX=-bf16
    BASE_TAG=(--tag bf16)
fi
# NAME and its overrides, one lever a line, in the order they are expected to matter; seed1 is no lever but
# the baseline again with another seed (drafter init, anchors, data order): how far two runs of one recipe
# differ, which a paired interval over the dev sequences does not include
LEVERS=(
    "seed1 train.seed=1"
    "reach train.slot_weights=reach"
    "uniform train.slot_weights=uniform"
    "lr3e-3 train.lr=3.0e-3"
    "vocab16k drafter.draft_vocab=16384"
    "active drafter.init_mlp_neurons=active"
    "fcmean drafter.init_fc=mean"
    "distill8 train.distill_topk=8"
    "anchors128 train.num_anchors=128 train.batch_size=8"
    "wide drafter.intermediate_size=4864"
    "layers3 drafter.num_layers=3 drafter.init_layers=[21,22,23]"
)
# the baseline to the same step, unless its committed curve holds every point up to it already (its run's
# checkpoints need not be on this machine)
if ! python benchmarks/recipe_probe.py holds "$BASE" --until "$UNTIL" --every 200
then
    bash scripts/qwen25coder05_long.sh --shards 16 ${BASE_TAG[@]+"${BASE_TAG[@]}"} --until "$UNTIL" \
        --set train.precision="$PRECISION"
fi
compared=()
for line in "${LEVERS[@]}"; do
    read -r name overrides <<< "$line"
    if [ $# -gt 0 ] && [[ ! " $* " =~ " $name " ]]; then continue; fi
    sets=(--set train.precision="$PRECISION")
    for o in $overrides; do sets+=(--set "$o"); done
    bash scripts/qwen25coder05_long.sh --shards 16 --tag "$name$SUFFIX" --until "$UNTIL" "${sets[@]}"
    compared+=("$OUT/levers/tau_curve_2048_$name$SUFFIX.json")
done
for f in ${compared[@]+"${compared[@]}"}; do
    echo "== $f"
    python benchmarks/recipe_probe.py points "$f" --against "$BASE" --block 4
done
