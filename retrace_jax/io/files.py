"""A file that a checkpoint needs, checked before it is opened: missing is one error, there but no regular
file (a directory, a FIFO, a device) another, which says what it is. Opening a FIFO would wait for a writer
forever; ``os.stat`` does not open it."""

from __future__ import annotations

import os
import stat

from retrace_jax.errors import CheckpointError

KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
         (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def regular_file(path: str, missing: str, error: type[Exception] = CheckpointError) -> str:
    """``path`` when it is a regular file (or a symbolic link to one). ``FileNotFoundError(missing)`` when
    nothing is there; ``error`` (a ``CheckpointError`` unless given) naming ``path`` and what it is
    otherwise: a directory, a FIFO, a device, a broken link."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):
            raise error(f"{path} is a broken symbolic link (to {os.readlink(path)})") from None
        raise FileNotFoundError(missing) from None
    except OSError as err:
        raise error(f"{path} cannot be read: {err.strerror or err}") from None
    if stat.S_ISREG(mode):
        return path
    kind = next((name for test, name in KINDS if test(mode)), f"of file type {stat.S_IFMT(mode):#o}")
    raise error(f"{path} is {kind}, not a regular file")
