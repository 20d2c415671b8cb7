#!/usr/bin/env bash
# The laboratory A/B/C experiment (lab/README.md, "The drafters" and "Experiments"), stage by
# stage. A train.py run resumes from its last Orbax checkpoint, and a run whose metrics.jsonl records
# "done" is skipped, so rerunning the script continues where it stopped. Work files go to lab/work/
# (ignored by git).
#   pip install -e '.[bench]' && bash lab/run_experiment.sh
#   SEEDS="0" ABLATIONS=0 bash lab/run_experiment.sh       # seed 0 of B and C only
#   LONG_SEEDS="0 1 2" bash lab/run_experiment.sh           # the 1,200-step budget at three seeds
#                                                           # (lab/README.md, "Four times the budget")
set -euo pipefail
cd "$(dirname "$0")/.."
SEEDS="${SEEDS:-0 1 2}"
ABLATIONS="${ABLATIONS:-1}"
LONG_SEEDS="${LONG_SEEDS:-0}"  # seed 0 at least: the shipped C is C_agreed_long_s0
RUNS=lab/work/runs

source lab/train_lib.sh                                      # train OUT CONFIG [--set ...]

if [ ! -f lab/work/prompts/train.jsonl ] || [ ! -f lab/work/prompts/heldout.jsonl ]; then
  python lab/build_prompts.py                                # lab/work/prompts/{train,heldout}.jsonl
fi
train $RUNS/A lab/configs/A.yaml                             # regeneration, then A: DFlash from scratch
for s in $SEEDS; do
  train $RUNS/B_s$s lab/configs/B.yaml --set train.seed=$s    # A + K steps of DFlash
  train $RUNS/C_s$s lab/configs/C.yaml --set train.seed=$s    # A + the same K steps of ReTrace
done
if [ "$ABLATIONS" = 1 ]; then                                # seed 0 of C, one key changed each
  train $RUNS/C_sig_drafter lab/configs/C.yaml --set retrace.signals=drafter
  train $RUNS/C_sig_target lab/configs/C.yaml --set retrace.signals=target
  train $RUNS/C_no_gate lab/configs/C.yaml --set retrace.gate=false
  train $RUNS/C_teacher lab/configs/C.yaml --set train.correction_source=teacher
  train $RUNS/C_K2 lab/configs/C.yaml --set train.rounds=2
  train $RUNS/C_keys lab/configs/C.yaml --set retrace.fusion=keys   # the memory as extra keys of the block
fi
# Four times the budget: B and C from the shipped bf16 A (as the shipped C was trained), 1,200 steps each,
# the ReTrace module's learning rate 4 times the drafter's; then, at that budget (seed 0), the two ablations
# of where the memory enters: the target's states as extra keys of the block, and the drafter's states alone.
LONG=(--set drafter.init=lab/drafters/A --set train.steps=1200 --set train.eval_every=200)
for s in $LONG_SEEDS; do
  train $RUNS/B_long_s$s lab/configs/B.yaml "${LONG[@]}" --set train.seed=$s
  train $RUNS/C_agreed_long_s$s lab/configs/C.yaml "${LONG[@]}" --set train.retrace_lr_multiplier=4.0 --set train.seed=$s
done
if [ -n "$LONG_SEEDS" ] && [ "$ABLATIONS" = 1 ]; then
  train $RUNS/C_keys_long_s0 lab/configs/C.yaml "${LONG[@]}" --set train.retrace_lr_multiplier=4.0 \
    --set retrace.fusion=keys
  train $RUNS/C_sig_drafter_long_s0 lab/configs/C.yaml "${LONG[@]}" --set train.retrace_lr_multiplier=4.0 \
    --set retrace.signals=drafter
fi
python lab/ship_drafters.py                                  # lab/drafters/{A,B,C} in bf16 (see the script)
