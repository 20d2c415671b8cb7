"""Train DFlash and ReTrace drafters: ``python train.py --help`` (the logic is in retrace_jax/cli/train.py)."""

from retrace_jax.cli import script
from retrace_jax.cli.train import main

if __name__ == "__main__":
    script(main)
