"""τ against training steps for the laboratory runs: the ``eval`` records of their ``metrics.jsonl``
(real speculative decoding of the 32 held-out standard-library pieces at T = 0, every ``eval_every``
steps), with drafter A's final evaluation as step 0 of B and C. Runs still training are left out.

    python lab/plot_training.py --out docs/lab_tau_vs_steps.png
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re

LAB = os.path.dirname(os.path.abspath(__file__))


def evals(run_dir: str) -> list[tuple[int, float]]:
    """``(step, eval_tau)`` of a run, in step order (the final one included)."""
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("event") == "eval":
                out[r["step"]] = r["eval_tau"]
    return sorted(out.items())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default=os.path.join(LAB, "work", "runs"))
    p.add_argument("--out", default="docs/lab_tau_vs_steps.png")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = evals(os.path.join(args.runs, "A"))
    start = a[-1][1] if a else None
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    colors = {"B": "tab:blue", "C": "tab:orange"}
    for run in sorted(glob.glob(os.path.join(args.runs, "[BC]_s*"))):
        name = os.path.basename(run)
        m = re.fullmatch(r"([BC])_s(\d+)", name)
        path = os.path.join(run, "metrics.jsonl")
        if not m or not os.path.exists(path):
            continue
        with open(path) as f:
            if not any(json.loads(line).get("event") == "done" for line in f):
                continue  # still training: plotted once finished
        points = ([(0, start)] if start is not None else []) + evals(run)
        ax.plot([s for s, _ in points], [t for _, t in points], marker="o", ms=3, color=colors[m[1]],
                alpha=1.0 if m[2] == "0" else 0.5, label=f"{m[1]} seed {m[2]}")
    ax.set_xlabel("training steps after A")
    ax.set_ylabel("τ (T = 0, 32 held-out stdlib pieces)")
    ax.set_title("B (DFlash) and C (ReTrace) fine-tuned from A")
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
