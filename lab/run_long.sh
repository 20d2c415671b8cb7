#!/usr/bin/env bash
# Training past the 256-token sequences (lab/README.md, "C's own weights against B, by position"): the
# shipped A fine-tuned on longer sequences, so that training sees block-to-context distances up to 511,
# with the DFlash objective (B_seq512) and with the ReTrace objective of the shipped C (C_seq512), 300
# steps each, then both against each other by position at prompts of 64, 192 and 320 tokens. The prompts
# are pieces of 192-320 tokens of the standard library (lab/build_prompts.py), continued by the target
# for 160 tokens. Every stage resumes.
#   pip install -e '.[bench]' && bash lab/run_long.sh
#   SEEDS="0 1 2" bash lab/run_long.sh
set -euo pipefail
cd "$(dirname "$0")/.."
SEEDS="${SEEDS:-0}"
RUNS=lab/work/long
P=lab/work/prompts_long
[ -f $P/train.jsonl ] || python lab/build_prompts.py --min-tokens 192 --max-tokens 320 --out $P
DATA=(--set data.prompts=$P/train.jsonl --set data.dir=lab/work/data_long --set data.max_prompt_len=320
      --set train.seq_len=512 --set drafter.init=lab/drafters/A)
source lab/train_lib.sh                                      # train OUT CONFIG [--set ...]
for s in $SEEDS; do
  train $RUNS/B_seq512_s$s lab/configs/B.yaml "${DATA[@]}" --set train.seed=$s
  train $RUNS/C_seq512_s$s lab/configs/C.yaml "${DATA[@]}" --set train.seed=$s
done
python benchmarks/retrace_positions.py --drafter $RUNS/C_seq512_s0/drafter --against $RUNS/B_seq512_s0/drafter \
    --prompt-lengths 64,192,320 --out lab/results/positions_C_seq512_against_B_seq512.json
python benchmarks/retrace_positions.py --drafter $RUNS/C_seq512_s0/drafter --against lab/drafters/B \
    --prompt-lengths 64,192,320 --out lab/results/positions_C_seq512_against_B.json
