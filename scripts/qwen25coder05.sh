#!/usr/bin/env bash
# The Qwen2.5-Coder-0.5B-Instruct pair of docs/results.md, stage by stage: the prompt sets, the first
# recipe's DFlash drafter A (regeneration, the feature store, training, export), its evaluation, then
# ReTrace against DFlash fine-tuning on the pair (B, C, and the shipped ReTrace drafter with the output
# mixture). Every stage is resumable: rerunning the same command skips what is finished and continues
# what was interrupted (shards, features, checkpoints).
#   pip install -e '.[assets]' && bash scripts/qwen25coder05.sh
set -euo pipefail
cd "$(dirname "$0")/.."
M=~/.cache/retrace_jax/models/qwen2.5-coder-0.5b-instruct
D=~/.cache/retrace_jax/data
bash scripts/qwen25coder05_prompts.sh   # the model and the prompt sets
# ship RUN DIR: the bfloat16 copy of RUN's drafter that ships in the package (DIR), as a plain directory
# (save_drafter's versioned layout is a symbolic link, which package data cannot hold), with the
# SHA256SUMS that rj.assets.shipped_drafter checks
ship() {
    python -c "import retrace_jax as rj; from retrace_jax.assets.shipped import ship_drafter; \
t = rj.load_target('$M'); ship_drafter(rj.load_drafter('$1/drafter', t), '$2')"
}
# against_b NAME RUN OUT: τ of B, NAME (RUN's drafter) and NAME with its memory off on 64 prompts of each
# set, T = 0, with 95% bootstrap intervals over prompts; OUT_{humaneval,heldout}.json
against_b() {
    for set in humaneval=$D/humaneval_raw.jsonl heldout=$D/code_heldout.jsonl; do
        python lab/evaluate.py --target "$M" --prompts "${set#*=}" --num-prompts 64 --max-prompt-len 512 \
            --drafter B=runs/qwen25coder05_dflash_ft/drafter --drafter "$1=$2/drafter" \
            --compare "$1/B" --compare "$1-off/B" --compare "$1/$1-off" --temperatures 0 --batch-size 32 \
            --out "$3_${set%%=*}.json"
    done
}
python train.py --config configs/qwen25coder05_dflash.yaml
# A, the first recipe's drafter (it shipped until the long run's drafter replaced it:
# bash scripts/qwen25coder05_long.sh --ship STEP), evaluated from its run directory
A=runs/qwen25coder05_dflash/drafter
# τ at T = 0 at blocks 16, 8 and 4 (the drafter trained at 16, run at smaller blocks too), batch-1 speed
# against plain decoding, every greedy output checked: HumanEval as raw completion (164 prompts), 64 of the
# 256 held-out package pieces; then τ at T = 1 on 32 prompts of each
finished() { python -c "import json, sys; sys.exit(not json.load(open(sys.argv[1])).get('complete'))" "$1" 2>/dev/null; }
EVAL="--target $M --drafter dflash=$A --drafter b8=$A --block-size b8=8 --drafter b4=$A --block-size b4=4
      --spec-bench none --humaneval none --max-prompt-len 512 --max-new-tokens 128 --batch-size 32"
finished runs/qwen25coder05_eval_humaneval.json || python benchmarks/speculative_eval.py $EVAL --prompts humaneval=$D/humaneval_raw.jsonl --per-dataset 0 \
    --temperatures 0 --speed-methods plain,dflash,b8,b4 --speed-prompts 8 --out runs/qwen25coder05_eval_humaneval.json
finished runs/qwen25coder05_eval_heldout.json || python benchmarks/speculative_eval.py $EVAL --prompts heldout=$D/code_heldout.jsonl --per-dataset 64 \
    --temperatures 0 --speed-methods plain,dflash,b8,b4 --speed-prompts 8 --out runs/qwen25coder05_eval_heldout.json
finished runs/qwen25coder05_eval_T1.json || python benchmarks/speculative_eval.py $EVAL --prompts humaneval=$D/humaneval_raw.jsonl \
    --prompts heldout=$D/code_heldout.jsonl --per-dataset 32 --temperatures 1 --sampled-methods dflash,b4 \
    --speed-prompts 0 --speed-temperatures '' --out runs/qwen25coder05_eval_T1.json
# batch-1 speed at T = 1 (sampled, so no token check) on the first 4 prompts of each set
finished runs/qwen25coder05_speed_T1.json || python benchmarks/speculative_eval.py $EVAL --prompts humaneval=$D/humaneval_raw.jsonl \
    --prompts heldout=$D/code_heldout.jsonl --per-dataset 0 --temperatures '' --speed-temperatures 1 \
    --speed-methods plain,dflash,b4 --speed-prompts 4 --out runs/qwen25coder05_speed_T1.json
# ReTrace on the pair: A fine-tuned 300 more steps with the DFlash objective (B) and with the ReTrace
# objective (C), then τ of B, C and C-off on 64 prompts of each set with 95% bootstrap intervals over prompts
python train.py --config configs/qwen25coder05_dflash_ft.yaml
python train.py --config configs/qwen25coder05_retrace.yaml
against_b C runs/qwen25coder05_retrace runs/qwen25coder05_retrace
# the ReTrace drafter that ships (rj.assets.shipped_drafter("qwen2.5-coder-0.5b-instruct", "retrace")): C's
# recipe with every slot kept, the output mixture and a rank-64 fusion; the same comparison against B
python train.py --config configs/qwen25coder05_retrace_mix.yaml
SHIPR=retrace_jax/assets/drafters/qwen2.5-coder-0.5b-instruct-retrace
ship runs/qwen25coder05_retrace_mix "$SHIPR"
against_b Cmix runs/qwen25coder05_retrace_mix runs/qwen25coder05_retrace_mix
# the mixture closed at inference: Cmix's weights with retrace.mix_scale at 0 (the fusion kept), on HumanEval
CLOSED=runs/qwen25coder05_retrace_mix/drafter_nomix
python -c "import os, shutil, sys; from safetensors.numpy import load_file, save_file
src, dst = os.path.realpath(sys.argv[1]), sys.argv[2]
shutil.rmtree(dst, ignore_errors=True); shutil.copytree(src, dst)
t = load_file(dst + '/model.safetensors'); t['retrace.mix_scale'] = 0 * t['retrace.mix_scale']
save_file(t, dst + '/model.safetensors', metadata={'format': 'pt'})" runs/qwen25coder05_retrace_mix/drafter "$CLOSED"
python lab/evaluate.py --target "$M" --prompts $D/humaneval_raw.jsonl --num-prompts 64 --max-prompt-len 512 \
    --drafter Cnomix=$CLOSED --compare Cnomix/Cnomix-off --temperatures 0 --batch-size 32 \
    --out runs/qwen25coder05_retrace_nomix_humaneval.json
# batch-1 speed of A and the shipped ReTrace drafter at blocks 16 and 4 (the first 4 HumanEval prompts, T = 0)
finished runs/qwen25coder05_speed_retrace.json || python benchmarks/speculative_eval.py --target $M \
    --drafter dflash=$A --drafter b4=$A --block-size b4=4 --drafter retrace=$SHIPR --drafter retrace4=$SHIPR \
    --block-size retrace4=4 --spec-bench none --humaneval none --max-prompt-len 512 --max-new-tokens 128 \
    --prompts humaneval=$D/humaneval_raw.jsonl --per-dataset 0 --temperatures '' --speed-temperatures 0 \
    --speed-methods plain,dflash,b4,retrace,retrace4 --speed-prompts 4 --out runs/qwen25coder05_speed_retrace.json
