"""Decode from the command line: ``python decode.py --help`` (the logic is in retrace_jax/cli/decode.py)."""

from retrace_jax.cli import script
from retrace_jax.cli.decode import main

if __name__ == "__main__":
    script(main)
