"""The sha256 of a file, read in blocks: what checks a downloaded asset, fingerprints a prompt file and
records a training checkpoint's files; and the record of a directory's files in ``SHA256SUMS``
(``sha256sum``'s format, so ``cd DIR && sha256sum -c SHA256SUMS`` checks it too), which training
checkpoints and the shipped drafters keep beside their files."""

from __future__ import annotations

import hashlib
import os

CHECKSUMS = "SHA256SUMS"  # in a recorded directory: the sha256 of every other file in it


def file_sha256(path: str) -> str:
    """The hex sha256 of the file at ``path``, read 4 MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def directory_digests(directory: str, only=None) -> dict[str, str]:
    """``{relative path: sha256}`` of the regular files under ``directory`` (those named in ``only``, when
    given), the checksum file itself left out, and links and other things that are not files with it."""
    out = {}
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, directory).replace(os.sep, "/")
            if rel in (CHECKSUMS, CHECKSUMS + ".tmp") or (only is not None and rel not in only):
                continue
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            out[rel] = file_sha256(path)
    return out


def write_checksums(directory: str) -> str:
    """Records the sha256 of every file under ``directory`` in its ``SHA256SUMS``, written whole and then
    renamed into place; returns its path. A failed write is the ``OSError``."""
    lines = "".join(f"{digest}  {name}\n" for name, digest in directory_digests(directory).items())
    target = os.path.join(directory, CHECKSUMS)
    with open(target + ".tmp", "w") as f:
        f.write(lines)
        f.flush()
        os.fsync(f.fileno())
    os.replace(target + ".tmp", target)
    return target


def read_checksums(directory: str) -> dict[str, str] | None:
    """``{name: sha256}`` as ``directory``'s ``SHA256SUMS`` records them; None when it has none. A
    ``ValueError`` says why one cannot be used (unreadable, or a line that is no checksum)."""
    try:
        with open(os.path.join(directory, CHECKSUMS)) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"its {CHECKSUMS} cannot be read: {err}") from None
    recorded = {}
    for line in text.splitlines():
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or not name:
            raise ValueError(f"its {CHECKSUMS} is damaged")
        recorded[name] = digest
    return recorded


def changed_files(directory: str, recorded: dict[str, str]) -> list[str]:
    """The files of ``recorded`` whose content differs from it, each named ``name`` or, when it is gone,
    ``name (missing)``; empty when every one matches. An ``OSError`` when one cannot be read."""
    found = directory_digests(directory, only=recorded)
    return [name if name in found else f"{name} (missing)"
            for name, digest in recorded.items() if found.get(name) != digest]
