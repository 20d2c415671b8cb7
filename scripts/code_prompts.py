"""Pieces of Python source as raw code-completion prompts (see ``retrace_jax/assets/code.py``).

    python scripts/code_prompts.py --tokenizer ~/.cache/retrace_jax/models/qwen2.5-coder-0.5b-instruct \
        --sources stdlib,numpy --exclude optax,flax --num 4096 --out code_train.jsonl

An error prints one line and exits with 1.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from retrace_jax.cli import run_main  # noqa: E402
from retrace_jax.cli.assets import code_main  # noqa: E402

if __name__ == "__main__":
    run_main(code_main)
