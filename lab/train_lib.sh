# Sourced by the lab scripts. train OUT CONFIG [--set KEY=VALUE ...]: train.py into OUT, skipped once its
# metrics.jsonl records "done" (a run stopped before that resumes from its last checkpoint).
train() {
  local out=$1 config=$2
  shift 2
  if grep -qs '"event": "done"' "$out/metrics.jsonl"; then
    echo "$out: done"
  else
    python train.py --config "$config" --set out="$out" "$@"
  fi
}
