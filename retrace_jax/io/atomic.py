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
``PATH``, which a reader waits out). A save replaces only a checkpoint, an empty directory or one that
holds only a checkpoint's companion files (a tokenizer, a README): a directory of other files, or the
current directory, is refused untouched (:func:`check_destination`).
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
# A plain directory is a checkpoint (that a save may replace, dropping its config and weights) when it
# holds a config.json and weights in a layout that Hugging Face tools write.
CHECKPOINT_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                      "pytorch_model.bin.index.json")
# Files that may wait in a directory for its first save (carried into the checkpoint; a config.json there
# is replaced); a directory holding anything else that is not a checkpoint belongs to someone else.
COMPANION_FILES = ("special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                   "generation_config.json", "README.md", ".gitattributes")
COMPANION_PREFIXES = ("tokenizer", "chat_template")

T = TypeVar("T")


def _versions_dir(path: str) -> str:
    """Where the versions of the checkpoint at ``path`` are kept."""
    return os.path.abspath(path) + VERSIONS


def replace_directory(path: str, write: Callable[[str], None], caller: str) -> None:
    """Calls ``write(tmp)`` on a new directory, which then becomes the newest version of ``path``.

    A failure (or a killed process) leaves the checkpoint at ``path`` as it was. Files of the current
    version that are neither ``config.json`` nor weights (a tokenizer, a README) are carried over; old
    weight files of any layout are not, so they cannot shadow the new ones. A plain directory at ``path``
    is replaced by the link (it is moved aside, then removed); what :func:`check_destination` refuses is
    left untouched. Symbolic links among the carried files are carried as links, never as copies of what
    they point to."""
    path = check_destination(path, caller)
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
        _carry(current, kept, tmp)
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
        _carry(current, sorted(os.listdir(current)), tmp)
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


def check_destination(path, caller: str) -> str:
    """The absolute path of a save's destination, or a ``CheckpointError`` naming it when a save must not
    replace what is there: an empty path (it would mean the current directory), the current directory
    itself (or one holding it), a file, or a directory that is not a checkpoint and holds files other
    than a ``config.json`` and a checkpoint's companions (the save would drop or bury them). A checkpoint
    that a save wrote (the link to one of its versions) and a plain checkpoint directory are replaced."""
    if not os.fspath(path):
        raise CheckpointError(f"{caller}: the checkpoint path is empty; name the directory to save to")
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise FileExistsError(f"{caller}: {path} exists and is not a directory")
    if not os.path.isdir(path) or _is_own_link(path):
        return path  # a new checkpoint, or the link a save made (its versions hold only what saves wrote)
    here, there = os.path.realpath(os.getcwd()), os.path.realpath(path)
    if not os.path.islink(path) and (here == there or here.startswith(there.rstrip(os.sep) + os.sep)):
        raise CheckpointError(f"{caller}: {path} is the current directory (or holds it); a save replaces its "
                              f"destination, so choose a new or empty directory for the checkpoint")
    names = os.listdir(there)
    if "config.json" in names and any(n in names for n in CHECKPOINT_WEIGHTS):
        return path
    # (subdirectories and other things that are not files are refused by _kept_files, for every save)
    foreign = sorted(n for n in names if n not in COMPANION_FILES + ("config.json",)
                     and not n.startswith(COMPANION_PREFIXES) and os.path.isfile(os.path.join(there, n)))
    if foreign:
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        raise CheckpointError(f"{caller}: {path} is not a checkpoint (no config.json with weights) and holds "
                              f"other files ({', '.join(foreign[:5])}{more}), which a save would replace; "
                              f"choose a new or empty directory")
    return path


def _is_own_link(path: str) -> bool:
    """Whether ``path`` is the link that a save made: to a published version in ``path``'s versions."""
    if not os.path.islink(path):
        return False
    target = os.path.realpath(path)
    return os.path.basename(target).isdigit() and \
        os.path.dirname(target) == os.path.realpath(_versions_dir(path))


def _carry(directory: str, names: list[str], dst: str) -> None:
    """Copies the entries ``names`` of ``directory`` into ``dst``. A symbolic link stays a link, so a save
    never copies what a link points to (a ``tokenizer.json -> /etc/passwd`` stays that link, not the
    file's content): an absolute one as it is, a relative one to a carried file beside it as it is (it
    then names that file's copy), any other relative one rewritten from ``dst`` so that it names the
    same place (``dst`` and where it is renamed to share a parent directory)."""
    for name in names:
        src = os.path.join(directory, name)
        if os.path.isdir(src) and not os.path.islink(src):  # (only a version that someone changed has one)
            shutil.copytree(src, os.path.join(dst, name), symlinks=True)
            continue
        if not os.path.islink(src):
            shutil.copy2(src, os.path.join(dst, name), follow_symlinks=False)
            continue
        target = os.readlink(src)
        if not os.path.isabs(target):
            # ``directory`` is a resolved path, so normalising the joined target names where the link led
            resolved = os.path.normpath(os.path.join(directory, target))
            if not (os.path.dirname(resolved) == directory and os.path.basename(resolved) in names):
                target = os.path.relpath(resolved, dst)
        os.symlink(target, os.path.join(dst, name))


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
