"""Printing a benchmark's results as a Markdown table and writing them as JSON."""

from __future__ import annotations

import json
import os
import tempfile


def write_json(data, out: str | None, indent: int | None = 2) -> None:
    """Writes ``data`` as JSON to ``out`` (nothing when None), making its folder; atomically: a file of
    that name is either the old one or the whole new one. ``indent=None``: compact."""
    if not out:
        return
    folder = os.path.dirname(os.path.abspath(out))
    os.makedirs(folder, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=folder, prefix=os.path.basename(out) + ".", suffix=".tmp",
                                     delete=False) as f:
        json.dump(data, f, **({"indent": indent} if indent is not None else {"separators": (",", ":")}))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(f.name, 0o666 & ~umask)  # as open() would have made it, not the temporary file's 0600
    os.replace(f.name, out)


def report(result: dict, out: str | None) -> None:
    print("| metric | value |\n|---|---|")
    for key, value in result.items():
        print(f"| {key} | {value} |")
    write_json(result, out)


def median_ms_from(fn, state, n: int) -> float:
    """Median milliseconds of ``fn(copy of state)`` over ``n`` calls after a first (compiling) one.

    The copy is made before the clock starts, so functions that donate their state (updating caches
    in place, as the decode loops do) can run again and again from the same state."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    times = []
    for i in range(n + 1):
        copy = jax.block_until_ready(jax.tree.map(jnp.copy, state))
        start = time.perf_counter()
        jax.block_until_ready(fn(copy))
        if i:
            times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))
