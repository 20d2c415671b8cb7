"""Running a command line: a library error becomes one line on stderr and exit status 1.

Errors that bad input causes (``ValueError`` and its kinds ``rj.ConfigError``, ``rj.CheckpointError``,
``DataError``; ``OSError`` such as ``FileNotFoundError``)
print ``error: MESSAGE`` without a traceback. ``RETRACE_JAX_TRACEBACK=1`` shows the traceback instead.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

USER_ERRORS = (ValueError, OSError)


def run_main(main: Callable, argv: list[str] | None = None) -> None:
    """Calls ``main(argv)``; exits with status 1 and a one-line message on a user-facing error."""
    try:
        main(argv)
    except USER_ERRORS as err:
        if os.environ.get("RETRACE_JAX_TRACEBACK"):
            raise
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(1)
