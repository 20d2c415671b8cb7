"""Copies the seed-0 laboratory drafters into ``lab/drafters/{A,B,C}`` in bf16 (the committed copies):
A, the 300-step B, and the C of the 1,200-step budget (``C_agreed_long_s0``: lab/README.md, "The shipped
C changed").

    python lab/ship_drafters.py      # after lab/run_experiment.sh (or the train.py runs)
"""

from __future__ import annotations

import argparse
import os
import sys

LAB = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(LAB))

import retrace_jax as rj  # noqa: E402
from retrace_jax.io.atomic import to_plain_directory  # noqa: E402

RUNS = {"A": "A", "B": "B_s0", "C": "C_agreed_long_s0"}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=os.path.join(LAB, "target"))
    p.add_argument("--runs", default=os.path.join(LAB, "work", "runs"))
    p.add_argument("--out", default=os.path.join(LAB, "drafters"))
    args = p.parse_args(argv)
    target = rj.load_target(args.target)
    for name, run in RUNS.items():
        src = os.path.join(args.runs, run, "drafter")
        drafter = rj.load_drafter(src, target)
        dst = os.path.join(args.out, name)
        rj.save_drafter(drafter, dst, dtype="bfloat16")
        to_plain_directory(dst)  # the repository keeps the files, not a link to a version
        size = sum(os.path.getsize(os.path.join(dst, f)) for f in os.listdir(dst))
        print(f"{name}: {src} -> {dst} (bf16, {size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
