#!/usr/bin/env bash
# The Qwen2.5-Coder-0.5B-Instruct pair of docs/results.md, stage by stage: the prompt sets, then the DFlash
# drafter (regeneration, the feature store, training, export). Every stage is resumable: rerunning the same
# command skips what is finished and continues what was interrupted (shards, features, checkpoints).
#   pip install -e '.[assets]' && bash scripts/qwen25coder05.sh
set -euo pipefail
cd "$(dirname "$0")/.."
M=~/.cache/retrace_jax/models/qwen2.5-coder-0.5b-instruct
D=~/.cache/retrace_jax/data
python scripts/fetch_assets.py qwen2.5-coder-0.5b-instruct humaneval humaneval_raw mbpp
# held-out code: pieces of packages that no training prompt comes from
[ -f "$D/code_heldout.jsonl" ] || python scripts/code_prompts.py --tokenizer "$M" --sources optax,flax,orbax \
    --num 256 --seed 1 --out "$D/code_heldout.jsonl"
[ -f "$D/code_train.jsonl" ] || python scripts/code_prompts.py --tokenizer "$M" --exclude optax,flax,orbax,jax \
    --sources stdlib,numpy,scipy,sympy,networkx,matplotlib,pydantic,requests,rich,pygments,jinja2,hypothesis,setuptools \
    --num 8192 --seed 0 --out "$D/code_train.jsonl"
# the training mix, decontaminated against HumanEval (both forms) and the held-out pieces
[ -f "$D/code_mix.jsonl" ] || python scripts/mix_prompts.py --out "$D/code_mix.jsonl" \
    --take "$D/code_train.jsonl=all,mbpp=1000" \
    --eval "$D/humaneval_raw.jsonl" --eval "$D/humaneval.jsonl" --eval "$D/code_heldout.jsonl"
python train.py --config configs/qwen25coder05_dflash.yaml
