"""One run at a time in an output directory: an exclusive lock on ``OUT/train.lock`` for the run's lifetime.

Two runs writing into one ``out`` overwrite each other's manifest and checkpoints and log the same steps
twice into ``metrics.jsonl``. The lock is a ``flock`` on the lock file, which the kernel releases when
the holding process ends in any way (``kill -9`` included), so a lock file that a killed run left
behind never blocks the next one; the file itself only says who holds the lock (its process id and
host). With several processes only process 0 takes it (they all write into the same ``out``).
``flock`` is advisory and per host: runs on two hosts that share ``out`` over NFS may not see each
other's lock (NFS's own locking permitting).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator

try:
    import fcntl
except ImportError:  # Windows: no flock, no lock (JAX's CPU wheels exist there; training is not tested on it)
    fcntl = None

LOCK_FILE = "train.lock"

_held: set[str] = set()  # the lock files whose locks this process holds


class OutDirInUse(OSError):
    """Another run holds the lock on the output directory."""


@contextlib.contextmanager
def hold_out_dir(out: str) -> Iterator[None]:
    """Holds the exclusive lock on ``out`` (created if needed) for the ``with`` block; raises
    :class:`OutDirInUse` at once, naming the holder, when another process holds it. Re-entrant within
    a process: ``train.py`` holds it across preparation and training, which each take it too."""
    path = os.path.realpath(os.path.join(out, LOCK_FILE))
    if path in _held:
        yield
        return
    os.makedirs(out, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process that just started"
                raise OutDirInUse(f"{out} is in use by another run ({holder}; lock file {path}): wait for it to "
                                  f"end, or train into another out directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
                  .encode(), 0)
        _held.add(path)
        try:
            yield
        finally:
            _held.discard(path)
    finally:
        os.close(fd)  # releases the lock (the file stays: removing it would let two runs lock two files)


def run_lock(out: str) -> contextlib.AbstractContextManager:
    """:func:`hold_out_dir` on process 0, nothing on the others (after ``jax.distributed`` has started)."""
    import jax

    return hold_out_dir(out) if jax.process_index() == 0 else contextlib.nullcontext()
