"""Replacing a checkpoint directory in one step: written beside it, then renamed into place."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable

# Weight files of any layout: a saved checkpoint keeps none of the old ones, so none can shadow the new weights.
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")


def replace_directory(path: str, write: Callable[[str], None], caller: str) -> None:
    """Calls ``write(tmp)`` on a new directory beside ``path``, then renames it to ``path``.

    A failure (or a killed process) leaves an existing directory at ``path`` as it was. Files already at
    ``path`` that are neither ``config.json`` nor weights (a tokenizer, a README) are carried over; old
    weight files of any layout are not, so they cannot shadow the new ones. Replacing an existing
    directory takes two renames (old out, new in); a process killed between them leaves the old one as
    ``.NAME.old-*`` beside ``path``."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise FileExistsError(f"{caller}: {path} exists and is not a directory")
    kept = _kept_files(path, caller) if os.path.isdir(path) else []
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.saving-", dir=parent)
    try:
        os.chmod(tmp, default_dir_mode())  # mkdtemp makes it private; a checkpoint gets the usual mode
        write(tmp)
        for file in kept:
            shutil.copy2(os.path.join(path, file), os.path.join(tmp, file))
        _swap_in(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def default_dir_mode() -> int:
    """The mode that ``mkdir`` gives a directory under the current umask."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o777 & ~umask


def _kept_files(path: str, caller: str) -> list[str]:
    """The files of an existing checkpoint directory that a new save keeps (all but config and weights)."""
    names = sorted(os.listdir(path))
    subdirs = [n for n in names if not os.path.isfile(os.path.join(path, n))]
    if subdirs:
        raise ValueError(f"{caller} replaces the checkpoint directory {path}, but it holds other things "
                         f"({', '.join(subdirs[:5])}); choose an empty or new directory")
    return [n for n in names if n != "config.json" and not n.endswith(WEIGHT_SUFFIXES)]


def _swap_in(tmp: str, path: str) -> None:
    """Renames the finished directory ``tmp`` to ``path``, replacing what is there."""
    if not os.path.exists(path):
        os.rename(tmp, path)
        return
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-", dir=os.path.dirname(path))
    os.rmdir(old)  # only the unique name is wanted
    os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        os.rename(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)
