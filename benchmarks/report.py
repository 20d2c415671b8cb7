"""Printing a benchmark's results as a Markdown table and writing them as JSON."""

from __future__ import annotations

import json
import os


def report(result: dict, out: str | None) -> None:
    print("| metric | value |\n|---|---|")
    for key, value in result.items():
        print(f"| {key} | {value} |")
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
