"""The command lines: ``decode.py`` and ``train.py`` (thin entry points at the top of the repository) and
the asset scripts run the functions here.

* ``decode`` -- plain and speculative decoding side by side;
* ``train`` -- data preparation, training and export of drafters;
* ``assets`` -- fetching real models and prompt sets, mixing prompt sets.

Errors that bad input causes (``ValueError`` and its kinds ``rj.ConfigError``, ``rj.CheckpointError``,
``rj.DataError``; ``OSError`` such as ``FileNotFoundError``; for ``train.py`` also a diverged run and a
missing key) print one ``error: MESSAGE`` line on stderr and exit with status 1; anything else is a bug
and keeps its traceback.
``RETRACE_JAX_TRACEBACK=1`` (or a command's ``--traceback``) shows the traceback of a user error too.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

# FloatingPointError: a model whose logits are not finite (generate refuses to turn NaNs into tokens).
USER_ERRORS = (ValueError, OSError, FloatingPointError)
# train.py also reports a diverged run (ArithmeticError) and a key missing from its files as one line.
TRAIN_ERRORS = USER_ERRORS + (ArithmeticError, KeyError)


def run_main(main: Callable, argv: list[str] | None = None, traceback: bool = False,
             user_errors: tuple[type[BaseException], ...] = USER_ERRORS):
    """Returns ``main(argv)``; on one of ``user_errors`` prints one line and exits with status 1."""
    try:
        return main(argv)
    except user_errors as err:
        if traceback or os.environ.get("RETRACE_JAX_TRACEBACK"):
            raise
        print(f"error: {one_line(err)}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def one_line(err: BaseException) -> str:
    """The error's message on one line (a ``KeyError`` says which key is missing)."""
    text = " ".join(str(err).split()) or type(err).__name__
    return f"missing key {text}" if isinstance(err, KeyError) else text
