#!/usr/bin/env bash
# Training past the 256-token sequences (lab/README.md, "C's own weights against B, by position"): the
# shipped A fine-tuned on longer sequences, so that training sees block-to-context distances up to 511,
# with the DFlash objective (B_seq512) and with the ReTrace objective of the shipped C (C_seq512), 300
# steps each, then both against each other by position at prompts of 64, 192 and 320 tokens. The prompts
# are pieces of 192-320 tokens of the standard library (lab/build_prompts.py), continued by the target
# for 160 tokens. Every stage resumes.
# Each seed's pair is measured against each other in lab/results/positions_long/s<seed>.json, the first
# seed's also against the shipped B (trained on 256-token sequences; one drafter for every seed, so it is
# decoded once); the seeds' files are then combined, the drafters' τ the mean over their seeds and the
# intervals drawn over seeds as well as prompts (seeds.json).
#   pip install -e '.[bench]' && bash lab/run_long.sh            # seeds 0, 1 and 2
#   SEEDS=0 bash lab/run_long.sh                                 # one seed
#   STAGE=train bash lab/run_long.sh                             # only train (STAGE=evaluate: only evaluate)
set -euo pipefail
cd "$(dirname "$0")/.."
SEEDS="${SEEDS:-0 1 2}"
STAGE="${STAGE:-all}"
case $STAGE in all|train|evaluate) ;; *) echo "STAGE must be all, train or evaluate, not $STAGE" >&2; exit 2 ;; esac
RUNS=lab/work/long
P=lab/work/prompts_long
[ -f $P/train.jsonl ] || python lab/build_prompts.py --min-tokens 192 --max-tokens 320 --out $P
DATA=(--set data.prompts=$P/train.jsonl --set data.dir=lab/work/data_long --set data.max_prompt_len=320
      --set train.seq_len=512 --set drafter.init=lab/drafters/A)
source lab/train_lib.sh                                      # train OUT CONFIG [--set ...]
for s in $SEEDS; do
  [ "$STAGE" = evaluate ] && break
  train $RUNS/B_seq512_s$s lab/configs/B.yaml "${DATA[@]}" --set train.seed=$s
  train $RUNS/C_seq512_s$s lab/configs/C.yaml "${DATA[@]}" --set train.seed=$s
done
[ "$STAGE" = train ] && exit 0
OUT=lab/results/positions_long
files=()
shipped=(--against B=lab/drafters/B)                         # the first seed only: --combine shares it
for s in $SEEDS; do
  python benchmarks/retrace_positions.py --drafter $RUNS/C_seq512_s$s/drafter \
      --against B_seq512=$RUNS/B_seq512_s$s/drafter "${shipped[@]}" \
      --prompt-lengths 64,192,320 --out $OUT/s$s.json
  files+=($OUT/s$s.json)
  shipped=()
done
python benchmarks/retrace_positions.py --combine "${files[@]}" --out $OUT/seeds.json
