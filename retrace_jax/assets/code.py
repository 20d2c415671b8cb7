"""Code-completion prompts: pieces of Python source, cut at line boundaries, as raw ``{"text"}`` records.

The real pair's drafters (``configs/qwen25coder05_*.yaml``) train on pieces of the standard library and
of installed packages, continued by the target; they are evaluated on pieces of other packages (held
out: no training piece comes from them) and on HumanEval. Sources are named as ``stdlib`` or an
importable package name; :func:`source_files` lists their ``.py`` files.

A piece starts at a randomly chosen non-blank line of a randomly chosen file (files drawn in proportion
to their length) and takes whole lines until it has at least ``min_tokens`` tokens; a piece longer than
``max_tokens`` is drawn again, so none is ever cut. The last line's newline is left off: byte-level BPE
tokenizers join a newline with the next line's indentation into one token, so a piece ending in a bare
newline would end on a token that in real code only precedes an unindented line.
"""

from __future__ import annotations

import importlib.util
import os
import sysconfig

import numpy as np

STDLIB = "stdlib"
# directories of the standard library that are not library code a user writes (test suites, the bundled
# pip wheel's vendored copies live in ensurepip as wheels, not .py files)
STDLIB_SKIP = ("site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__")


def source_root(name: str) -> str:
    """The directory of source ``name``: the standard library (``stdlib``) or an importable package."""
    if name == STDLIB:
        return sysconfig.get_paths()["stdlib"]
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"code source {name!r} is neither 'stdlib' nor an installed package (a directory)")
    return list(spec.submodule_search_locations)[0]


def source_files(name: str) -> list[tuple[str, str]]:
    """``(name/relative path, text)`` of every UTF-8, non-empty ``.py`` file of source ``name``, sorted by
    path (the standard library without its test suites and site-packages)."""
    root = source_root(name)
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not (name == STDLIB and x in STDLIB_SKIP) and x != "__pycache__")
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(d, f)
            try:
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
            except (UnicodeDecodeError, OSError):
                continue
            if text.strip():
                out.append((f"{name}/{os.path.relpath(path, root)}", text))
    return out


def code_pieces(texts: list[tuple[str, str]], n: int, count_tokens, seed: int, min_tokens: int = 48,
                max_tokens: int = 128, max_tries: int = 200_000) -> list[dict]:
    """``n`` pieces of whole lines with ``min_tokens`` to ``max_tokens`` tokens (``count_tokens(text)``)
    from ``texts`` (``(name, text)`` pairs), as ``{"text", "source": "name:first line"}`` records; the
    same arguments give the same pieces. A ``ValueError`` when ``max_tries`` draws find fewer."""
    if min_tokens < 1 or max_tokens < min_tokens:
        raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
    if not texts:
        raise ValueError("no source files to cut pieces from")
    rng = np.random.default_rng(seed)
    sizes = np.array([len(t) for _, t in texts], np.float64)
    lines = [t.splitlines(keepends=True) for _, t in texts]
    pieces, seen = [], set()
    for _ in range(max_tries):
        if len(pieces) == n:
            break
        f = int(rng.choice(len(texts), p=sizes / sizes.sum()))
        first = int(rng.integers(len(lines[f])))
        if (f, first) in seen or not lines[f][first].strip():
            continue
        text, count, last = "", 0, first
        while last < len(lines[f]) and (count < min_tokens or not lines[f][last - 1].strip()):
            text += lines[f][last]  # at least min_tokens, and never ending on a blank line
            last += 1
            count = count_tokens(text)
        if count < min_tokens or count > max_tokens or last >= len(lines[f]):
            continue  # too short at the end of the file, or one very long line; never cut
        seen.add((f, first))
        pieces.append({"text": text.rstrip("\r\n"), "source": f"{texts[f][0]}:{first + 1}"})
    if len(pieces) < n:
        raise ValueError(f"only {len(pieces)} of {n} pieces found in {max_tries} tries")
    return pieces
