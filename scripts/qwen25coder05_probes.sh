#!/usr/bin/env bash
# The recipe probes of the Qwen2.5-Coder-0.5B-Instruct drafter (docs/results.md, "The recipe, lever by
# lever"): today's recipe (configs/qwen25coder05_probe.yaml) at a quarter of its scale, 400 steps over one
# fixed snapshot of the first 8 shards (1,024 sequences) of its bfloat16-product data, the same 6.25 passes
# over the data as the shipped drafter's 1,600 steps over 4,096, and one lever changed at a time; each probe
# measured on the same dev and fit sequences. Resumable at every level: rerunning the same command skips finished
# probes, resumes the one that was interrupted (checkpoints, feature store) and continues the preparation.
#   pip install -e '.[assets]' && bash scripts/qwen25coder05_probes.sh [NAME ...]   # all probes, or those named
#   bash scripts/qwen25coder05_probes.sh --prepare-only   # only the model, the prompts, the data and its snapshot
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=configs/qwen25coder05_probe.yaml
DATA=runs/qwen25coder05_code_data_bf16
SNAP=runs/probe_data_8
# the model, the prompt sets and the data (all 32 shards, resumable), then a fixed copy of its first 8
if [ ! -f "$SNAP/manifest.json" ]; then
    bash scripts/qwen25coder05_prompts.sh
    python train.py --config "$CONFIG" --stage prepare
    python benchmarks/recipe_probe.py snapshot "$DATA" "$SNAP" --shards 8
fi
if [ "${1:-}" = "--prepare-only" ]; then exit 0; fi
# NAME and its overrides, one probe a line, in two stages. Stage 1: the starting scales, each against
# today's recipe (base, compared with every other). Stage 2: every other lever on top of stage 1's winner
# (copy: the q/k norms at the target's scale, the q/k/v biases, the target's final norm; +11% dev tau at
# block 16), compared with it, in the order the levers are expected to matter, so that a partial run
# answers the largest questions. Equal budget is equal work: every probe drafts 16 x 16 x 16 = 4,096 block
# slots a step (batch x anchors x block), so a smaller block takes more anchors and more anchors take fewer
# sequences.
STAGE1=(
    "base"
    "qknorm drafter.init_qk_norm=target"
    "fnorm drafter.init_final_norm=true"
    "copy drafter.init_qk_norm=target drafter.attention_bias=true drafter.init_final_norm=true"
)
WINNER="drafter.init_qk_norm=target drafter.attention_bias=true drafter.init_final_norm=true"
STAGE2=(
    "copy-b4 drafter.block_size=4 train.num_anchors=64"
    "copy-distill8 train.distill_topk=8"
    "copy-expected train.slot_weights=expected_length"
    "copy-constant train.schedule=constant"
    "copy-anchors64 train.num_anchors=64 train.batch_size=4"
    "copy-b8 drafter.block_size=8 train.num_anchors=32"
    "copy-reach train.slot_weights=reach"
    "copy-uniform train.slot_weights=uniform"
    "copy-lr3e-3 train.lr=3.0e-3"
    "copy-active drafter.init_mlp_neurons=active"
    "copy-buckets train.length_buckets=true"
    "copy-vocab16k drafter.draft_vocab=16384"
    "copy-layers3 drafter.num_layers=3 drafter.init_layers=[21,22,23]"
    "copy-wide drafter.intermediate_size=4864"
    "copy-fcmean drafter.init_fc=mean"
    "copy-bf16 train.precision=bfloat16"
    "copy-allpos train.loss_positions=all"
)
PROBES=("${STAGE1[@]}")
for line in "${STAGE2[@]}"; do
    read -r name overrides <<< "$line"
    PROBES+=("$name $WINNER $overrides")
done
for line in "${PROBES[@]}"; do
    read -r name overrides <<< "$line"
    if [ $# -gt 0 ] && [[ ! " $* " =~ " $name " ]]; then continue; fi
    sets=(--set "data.dir=$SNAP")
    for o in $overrides; do sets+=(--set "$o"); done
    python benchmarks/recipe_probe.py run "$name" --config "$CONFIG" "${sets[@]}"
done
results() { for line in "$@"; do f="runs/probes/${line%% *}/probe.json"; if [ -f "$f" ]; then echo "$f"; fi; done; }
python benchmarks/recipe_probe.py table $(results "${STAGE1[@]}") --baseline base \
    --out results/qwen2.5-coder-0.5b-instruct/probes.json
python benchmarks/recipe_probe.py table runs/probes/copy/probe.json $(results "${STAGE2[@]}") --baseline copy \
    --out results/qwen2.5-coder-0.5b-instruct/probes_stage2.json
