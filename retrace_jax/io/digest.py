"""The sha256 of a file, read in blocks: what checks a downloaded asset, fingerprints a prompt file and
records a training checkpoint's files."""

from __future__ import annotations

import hashlib


def file_sha256(path: str) -> str:
    """The hex sha256 of the file at ``path``, read 4 MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()
