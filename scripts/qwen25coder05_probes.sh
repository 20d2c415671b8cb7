#!/usr/bin/env bash
# The recipe probes of the Qwen2.5-Coder-0.5B-Instruct drafter (docs/results.md, "The recipe, lever by
# lever"): today's recipe (configs/qwen25coder05_probe.yaml) at a quarter of its scale, 400 steps over one
# fixed snapshot of the first 8 shards (1,024 sequences) of its bfloat16-product data, the same 6.25 passes
# over the data as the shipped drafter's 1,600 steps over 4,096, and one lever changed at a time; each probe
# measured on the same dev and fit sequences. Resumable at every level: rerunning the same command skips finished
# probes, resumes the one that was interrupted (checkpoints, feature store) and continues the preparation.
#   pip install -e '.[assets]' && bash scripts/qwen25coder05_probes.sh [NAME ...]   # all probes, or those named
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
# NAME and its overrides, one probe a line: the baseline first (every other is compared with it), then the
# levers in the order they are expected to matter, so that a partial run answers the largest questions.
# Equal budget is equal work: every probe drafts 16 x 16 x 16 = 4,096 block slots a step (batch x anchors x
# block), so a smaller block takes more anchors and more anchors take fewer sequences.
PROBES=(
    "base"
    "qknorm drafter.init_qk_norm=target"
    "fnorm drafter.init_final_norm=true"
    "copy drafter.init_qk_norm=target drafter.attention_bias=true drafter.init_final_norm=true"
    "b4 drafter.block_size=4 train.num_anchors=64"
    "norm drafter.init_final_norm=true drafter.init_fc=mean"
    "anchors64 train.num_anchors=64 train.batch_size=4"
    "lr3e-3 train.lr=3.0e-3"
    "constant train.schedule=constant"
    "expected train.slot_weights=expected_length"
    "uniform train.slot_weights=uniform"
    "reach train.slot_weights=reach"
    "b8 drafter.block_size=8 train.num_anchors=32"
    "bias drafter.attention_bias=true"
    "active drafter.init_mlp_neurons=active"
    "buckets train.length_buckets=true"
    "vocab16k drafter.draft_vocab=16384"
    "layers3 drafter.num_layers=3 drafter.init_layers=[21,22,23]"
    "wide drafter.intermediate_size=4864"
    "bf16 train.precision=bfloat16"
    "distill8 train.distill_topk=8"
)
for line in "${PROBES[@]}"; do
    read -r name overrides <<< "$line"
    if [ $# -gt 0 ] && [[ ! " $* " =~ " $name " ]]; then continue; fi
    sets=(--set "data.dir=$SNAP")
    for o in $overrides; do sets+=(--set "$o"); done
    python benchmarks/recipe_probe.py run "$name" --config "$CONFIG" "${sets[@]}"
done
python benchmarks/recipe_probe.py table runs/probes/*/probe.json --baseline base \
    --out results/qwen2.5-coder-0.5b-instruct/probes.json
