#!/usr/bin/env bash
# ReTrace variants against DFlash at equal budget on the laboratory pair (docs/retrace.md, "Token hints"
# and "Training on rollouts"): every run starts from the shipped bf16 drafter A (lab/drafters/A) and trains
# 300 steps on A's data, three seeds each. B: DFlash. C_paper: the paper's memory (every slot). C_agreed:
# the slot rule of the shipped C. C_hints: the paper's memory plus the target's token and the rejected
# proposal as token hints. C_mix: the paper's memory plus the output mixture with the target's stale
# distribution. C_fixed: C_hints trained with a zero-started scale, memory dropout 0.5 and the loss weighted
# toward the slots the memory-off draft gets wrong. A train.py run resumes from its last
# checkpoint and a finished one is skipped, so rerunning the script continues where it stopped.
#   pip install -e '.[bench]' && bash lab/run_variants.sh
#   SEEDS="0" VARIANTS="B C_hints" bash lab/run_variants.sh       # a subset
#   STAGE=train bash lab/run_variants.sh                         # only train (STAGE=evaluate: only evaluate)
# The evaluation of SEEDS can join an earlier one's seeds (lab/evaluate.py --reuse: its file holds every
# seed's acceptance lengths), so a new seed is trained and run without the earlier drafters:
#   STAGE=train SEEDS=2 bash lab/run_variants.sh
#   STAGE=evaluate SEEDS=2 REUSE=lab/results/variants_T0.json OUT=lab/results/variants_T0_s012.json \
#       bash lab/run_variants.sh
set -euo pipefail
cd "$(dirname "$0")/.."
SEEDS="${SEEDS:-0 1 2}"
VARIANTS="${VARIANTS:-B C_paper C_agreed C_hints C_mix C_fixed}"
STAGE="${STAGE:-all}"
OUT="${OUT:-lab/results/variants_T0.json}"
REUSE="${REUSE:-}"
RUNS=lab/work/variants
case $STAGE in all|train|evaluate) ;; *) echo "STAGE must be all, train or evaluate, not $STAGE" >&2; exit 2 ;; esac

INIT=(--set drafter.init=lab/drafters/A)
source lab/train_lib.sh                                      # train OUT CONFIG [--set ...]

if [ ! -f lab/work/prompts/train.jsonl ] || [ ! -f lab/work/prompts/heldout.jsonl ]; then
  python lab/build_prompts.py                                # lab/work/prompts/{train,heldout}.jsonl
fi
python train.py --config lab/configs/A.yaml --stage prepare  # A's data (lab/work/data), if not there yet
HINTS=(--set retrace.slots=all --set retrace.hints=tokens)
FIXED=("${HINTS[@]}" --set retrace.zero_start=scale --set train.memory_dropout=0.5 --set train.miss_weight=1.0)
for s in $SEEDS; do
  [ "$STAGE" = evaluate ] && break
  for v in $VARIANTS; do
    case $v in
      B) train $RUNS/B_s$s lab/configs/B.yaml "${INIT[@]}" --set train.seed=$s ;;
      C_paper) train $RUNS/C_paper_s$s lab/configs/C.yaml "${INIT[@]}" --set train.seed=$s --set retrace.slots=all ;;
      C_agreed) train $RUNS/C_agreed_s$s lab/configs/C.yaml "${INIT[@]}" --set train.seed=$s ;;
      C_hints) train $RUNS/C_hints_s$s lab/configs/C.yaml "${INIT[@]}" --set train.seed=$s "${HINTS[@]}" ;;
      C_mix) train $RUNS/C_mix_s$s lab/configs/C.yaml "${INIT[@]}" --set train.seed=$s --set retrace.slots=all \
               --set retrace.mixture=target ;;
      C_fixed) train $RUNS/C_fixed_s$s lab/configs/C.yaml "${INIT[@]}" --set train.seed=$s "${FIXED[@]}" ;;
      *) echo "unknown variant $v" >&2; exit 2 ;;
    esac
  done
done
[ "$STAGE" = train ] && exit 0
# τ on 128 held-out pieces at T = 0, every variant against B and its memory on against off, 95% intervals
args=()
for v in $VARIANTS; do
  for s in $SEEDS; do
    [ -d $RUNS/${v}_s$s/drafter ] && args+=(--drafter "$v:$s=$RUNS/${v}_s$s/drafter")
  done
  [ "$v" != B ] && args+=(--compare "$v/B" --compare "$v/$v-off")
done
python lab/evaluate.py "${args[@]}" ${REUSE:+--reuse "$REUSE"} --temperatures 0 --out "$OUT"
