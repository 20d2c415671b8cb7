"""Checkpoint directories that readers never see half-written or mixed: versions behind one symbolic link.

A checkpoint saved at ``PATH`` is a symbolic link ``PATH -> PATH.versions/N`` to the directory of its
newest version. A save (:func:`replace_directory`) writes a whole new version beside the others, then
points the link at it with one rename, which readers see happen all at once. A reader
(:func:`read_directory`) resolves the link once and reads every file from the version it found: a
version is never changed after it is published, so what the reader gets is one save's files, never a
``config.json`` of one save with the weights of another. The version before the newest, and any version
replaced less than a minute ago, are kept for readers still busy with them; a later save removes older
ones, and a reader whose version was removed meanwhile reads the newest one instead.

A plain directory at ``PATH`` (the layout of earlier releases, or one made by other tools) still loads
as it is; the first save onto it replaces it with the link (the save's only moment without anything at
``PATH``, which a reader waits out).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import TypeVar

from retrace_jax.errors import CheckpointError

# Weight files of any layout: a saved checkpoint keeps none of the old ones, so none can shadow the new weights.
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")
VERSIONS = ".versions"  # PATH's versions live in PATH + VERSIONS
KEEP_VERSIONS = 2  # the newest and the one before it (for readers that resolved PATH just before a save)
GRACE_SECONDS = 60.0  # and any version replaced less than this ago (for readers that take their time)
READ_ATTEMPTS = 50  # how often a reader starts again before it gives up on a path that saves never leave alone
STALE_SECONDS = 24 * 3600  # what a killed save left in PATH.versions is removed by a save a day later

T = TypeVar("T")


def _versions_dir(path: str) -> str:
    """Where the versions of the checkpoint at ``path`` are kept."""
    return os.path.abspath(path) + VERSIONS


def replace_directory(path: str, write: Callable[[str], None], caller: str) -> None:
    """Calls ``write(tmp)`` on a new directory, which then becomes the newest version of ``path``.

    A failure (or a killed process) leaves the checkpoint at ``path`` as it was. Files of the current
    version that are neither ``config.json`` nor weights (a tokenizer, a README) are carried over; old
    weight files of any layout are not, so they cannot shadow the new ones. A plain directory at ``path``
    is replaced by the link (it is moved aside, then removed)."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise FileExistsError(f"{caller}: {path} exists and is not a directory")
    current = os.path.realpath(path) if os.path.isdir(path) else None
    kept = _kept_files(current, path, caller) if current is not None else []
    versions = _versions_dir(path)
    if os.path.exists(versions) and not os.path.isdir(versions):
        raise FileExistsError(f"{caller}: {versions} (where the versions of {path} go) is not a directory")
    os.makedirs(versions, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".saving-", dir=versions)  # invisible to readers and to pruning
    try:
        os.chmod(tmp, default_dir_mode())  # mkdtemp makes it private; a checkpoint gets the usual mode
        write(tmp)
        for file in kept:
            shutil.copy2(os.path.join(current, file), os.path.join(tmp, file))
        new = _publish(tmp, versions)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        _point(path, new, versions)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    _prune(versions, keep={os.path.basename(new)})


def read_directory(path: str, read: Callable[[str], T]) -> T:
    """``read(directory)`` on the directory that ``path`` is (a plain directory) or points to (a
    versioned checkpoint), resolved once: every file ``read`` opens comes from that one directory.

    When ``read`` fails because its version was removed meanwhile (pruned after newer saves), or when a
    plain directory was replaced while it was read, ``read`` runs again on what ``path`` is now.
    """
    for _ in range(READ_ATTEMPTS):
        link = os.path.islink(path)  # (first: a link stays a link)
        resolved = os.path.realpath(path)
        before = _identity(resolved)
        try:  # a plain directory is read through the name it was given (its errors name that path)
            result = read(resolved if link else path)
        except Exception:
            _wait_for_link(path)
            if not _changed(path, resolved, before):
                raise
            continue
        if link or not _changed(path, resolved, before):
            return result  # a version that was read whole is one save's files, even if it is no longer the newest
    raise CheckpointError(f"{path} was replaced {READ_ATTEMPTS} times while it was being read; is something "
                          f"saving to it without pause?")


def to_plain_directory(path: str) -> None:
    """Replaces a versioned checkpoint at ``path`` by a plain directory holding a copy of its current
    version, and removes its versions: for checkpoints kept where links do not travel well (a git
    repository stores the link, not the files; ``cp -r`` copies the link). A plain directory stays as it
    is. Not for a checkpoint that others may be reading or saving at the same time."""
    if not os.path.islink(path):
        return
    current = os.path.realpath(path)
    tmp = tempfile.mkdtemp(prefix=".plain-", dir=os.path.dirname(os.path.abspath(path)))
    try:
        shutil.copytree(current, tmp, dirs_exist_ok=True)
        os.replace(tmp, path + ".plain")
        os.remove(path)
        os.replace(path + ".plain", path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(_versions_dir(path), ignore_errors=True)


def write_error(err: BaseException, doing: str) -> OSError:
    """An ``OSError`` saying ``doing: REASON`` with the errno of ``err``. safetensors and Orbax report a
    failed write (a full disk) as a ``SafetensorError`` or a ``ValueError`` that gives the errno only in
    their text ("os error 28", "os_error_code='28'"); as an ``OSError`` it is the I/O failure it is, and
    ``train.py`` prints it as one line."""
    code = getattr(err, "errno", None)
    if code is None:
        found = re.search(r"os error (\d+)|os_error_code='(\d+)'", str(err))
        code = int(found.group(1) or found.group(2)) if found else None
    out = OSError(f"{doing}: {os.strerror(code) if code else str(err) or type(err).__name__}")
    out.errno = code
    return out


def default_dir_mode() -> int:
    """The mode that ``mkdir`` gives a directory under the current umask."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o777 & ~umask


def _kept_files(directory: str, path: str, caller: str) -> list[str]:
    """The files of the current checkpoint that a new save keeps (all but config and weights)."""
    names = sorted(os.listdir(directory))
    subdirs = [n for n in names if not os.path.isfile(os.path.join(directory, n))]
    if subdirs:
        raise ValueError(f"{caller} replaces the checkpoint directory {path}, but it holds other things "
                         f"({', '.join(subdirs[:5])}); choose an empty or new directory")
    return [n for n in names if n != "config.json" and not n.endswith(WEIGHT_SUFFIXES)]


def _version_numbers(versions: str) -> list[int]:
    """The numbers of the published versions in ``versions``, in order (``.saving-*`` ones are not published)."""
    return sorted(int(n) for n in os.listdir(versions) if n.isdigit())


def _publish(tmp: str, versions: str) -> str:
    """Renames the finished ``tmp`` to the next version number; returns its path. A concurrent save that
    took the number first makes the rename fail on its (non-empty) directory, and the next number is tried."""
    while True:
        new = os.path.join(versions, str(max(_version_numbers(versions), default=0) + 1))
        try:
            os.rename(tmp, new)
            os.utime(new)  # its time is when it replaced the one before (which _prune's grace counts from)
            return new
        except OSError:
            if not os.path.isdir(new):
                raise


def _point(path: str, new: str, versions: str) -> None:
    """Makes ``path`` a symbolic link to ``new`` in one rename (relative, so the parent directory may move).
    A plain directory at ``path`` is moved aside first and removed after, as the save replaced it."""
    parent = os.path.dirname(path)
    link = os.path.join(parent, f".{os.path.basename(path)}.link-{os.getpid()}-{time.time_ns()}")
    os.symlink(os.path.relpath(new, parent), link)
    replaced = None
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            replaced = tempfile.mkdtemp(prefix=".replaced-", dir=versions)
            os.rename(path, replaced)  # onto the empty directory that reserved the name
        os.replace(link, path)
    except BaseException:
        if replaced is not None and not os.path.lexists(path):
            os.rename(replaced, path)
        if os.path.lexists(link):
            os.unlink(link)
        raise
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def _prune(versions: str, keep: set[str]) -> None:
    """Removes the versions that are neither among the newest ``KEEP_VERSIONS`` nor replaced less than
    ``GRACE_SECONDS`` ago (nor in ``keep``), and what killed saves left behind. A reader still busy with
    a removed version starts again (:func:`read_directory`)."""
    numbers = _version_numbers(versions)
    for i, n in enumerate(numbers[:-KEEP_VERSIONS]):
        replaced_at = _mtime(os.path.join(versions, str(numbers[i + 1])))  # when its successor was published
        if str(n) not in keep and time.time() - replaced_at > GRACE_SECONDS:
            shutil.rmtree(os.path.join(versions, str(n)), ignore_errors=True)
    for name in os.listdir(versions):
        stale = os.path.join(versions, name)
        if name.startswith((".saving-", ".replaced-")) and time.time() - _mtime(stale) > STALE_SECONDS:
            shutil.rmtree(stale, ignore_errors=True)


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return time.time()


def _identity(directory: str) -> tuple[int, int] | None:
    try:
        st = os.stat(directory)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _changed(path: str, resolved: str, before: tuple[int, int] | None) -> bool:
    """Whether ``path`` no longer resolves to the directory it resolved to when the read began (its name,
    or the directory itself: a plain directory moved away leaves its name to the link)."""
    now = os.path.realpath(path)
    return now != resolved or _identity(now) != before


def _wait_for_link(path: str) -> None:
    """Waits (briefly) while ``path`` is absent: a plain directory there is being replaced by the link."""
    for _ in range(100):
        if os.path.exists(path) or not os.path.isdir(_versions_dir(path)):
            return
        time.sleep(0.001)
