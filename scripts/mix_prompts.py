"""Mix prompt sets into one training file, without duplicates and without the evaluation prompts.

    python scripts/mix_prompts.py --out ~/.cache/retrace_jax/data/mix15.jsonl \
        --take sharegpt=all,math=all,asdiv=all,mbpp=all [--seed 0] [--eval FILE ...] [--overlap 50]

Sets named in ``--take`` are fetched on first use (``scripts/fetch_assets.py``); a path to a JSONL prompt
file works too. By default the vendored Spec-Bench questions and HumanEval are kept out. Prints, for each
set, how many prompts it had, how many were dropped (an evaluation prompt, a shared 50-character
substring with one, a duplicate) and how many were taken. See ``retrace_jax/assets/``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from retrace_jax.cli import run_main  # noqa: E402
from retrace_jax.cli.assets import mix_main  # noqa: E402

if __name__ == "__main__":
    run_main(mix_main)
