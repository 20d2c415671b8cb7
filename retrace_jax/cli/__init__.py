"""The command lines: ``decode.py`` and ``train.py`` (thin entry points at the top of the repository) and
the asset scripts run the functions here.

* ``decode`` -- plain and speculative decoding side by side;
* ``train`` -- data preparation, training and export of drafters;
* ``assets`` -- fetching real models and prompt sets, mixing prompt sets.

Exit statuses, the same for every command:

* 0: done.
* 1: bad input found after the command line was parsed: a value out of range, a file that is not there, a
  bad configuration or checkpoint (``ValueError`` and its kinds ``rj.ConfigError``, ``rj.CheckpointError``,
  ``rj.DataError``; ``OSError`` such as ``FileNotFoundError``; for ``train.py`` also a diverged run and a
  missing key). One ``error: MESSAGE`` line on stderr; anything else is a bug and keeps its traceback.
  ``RETRACE_JAX_TRACEBACK=1`` (or a command's ``--traceback``) shows the traceback of a user error too.
  The variable is on for ``1``, ``true`` or ``yes``, off for ``0``, ``false``, ``no`` or empty (any case);
  another value is an error (status 1) naming it.
* 2: a command line that argparse refuses (an unknown flag, a flag without its value, a value that is
  not a number or not one of the flag's choices, a required flag missing): the usage and one
  ``PROG: error: ...`` line, as every argparse program does.
* 130 (128 + SIGINT): interrupted (Ctrl-C). One ``interrupted`` line on stderr instead of the
  traceback of wherever the interrupt landed (often deep inside JAX); ``RETRACE_JAX_TRACEBACK=1`` shows
  that traceback.
* 141 (128 + SIGPIPE): standard output was closed by its reader (``decode.py | head -1``). Nothing is
  printed, since a reader that stops reading is no error of the command; the status is what a shell
  reports for a program that SIGPIPE ends (``yes | head -1``), so ``set -o pipefail`` sees the run as
  cut short. A standard output that fails otherwise (a full disk) is an error: status 1 and one line.

The command modules import JAX and the models only once their arguments are parsed and checked, so
``--help`` and a bad flag answer at once.
"""

from __future__ import annotations

import atexit
import errno
import os
import signal
import sys
import threading
import warnings
from typing import Callable

# FloatingPointError: a model whose logits are not finite (generate refuses to turn NaNs into tokens).
USER_ERRORS = (ValueError, OSError, FloatingPointError)
# train.py also reports a diverged run (ArithmeticError) and a key missing from its files as one line.
TRAIN_ERRORS = USER_ERRORS + (ArithmeticError, KeyError)
EXIT_ERROR = 1
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_CLOSED_PIPE = 128 + 13  # SIGPIPE (signal.SIGPIPE does not exist on Windows)
# owned: set by script; pending: a Ctrl-C arrived (script's handler); interrupted: run_main caught it
_process = {"owned": False, "pending": False, "interrupted": False}
TRACEBACK_VARIABLE = "RETRACE_JAX_TRACEBACK"
FLAG_VALUES = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False, "": False}


def env_flag(name: str) -> bool:
    """The environment variable ``name`` as a switch: on for ``1``, ``true`` or ``yes``, off for ``0``,
    ``false``, ``no``, empty or unset (any case, spaces around ignored); a ``ValueError`` naming the
    variable for anything else (``bool("0")`` is True)."""
    value = os.environ.get(name, "")
    flag = FLAG_VALUES.get(value.strip().lower())
    if flag is None:
        raise ValueError(f"{name}={value!r}: expected 1, true or yes (on) or 0, false, no or empty (off)")
    return flag


def script(main: Callable) -> None:
    """Runs a command line's ``main()`` as the whole process (the entry points at the top of the
    repository call it). After an interrupt the process ends with status 130 once Python's own exit
    functions (JAX's among them) have run, without the C++ static destructors that a normal exit runs
    next: XLA may still be compiling on its threads, and tearing LLVM down under them crashes the process
    (SIGSEGV). Python ends on an unhandled KeyboardInterrupt the same way, killing itself with SIGINT after
    its exit functions, which a shell reports as 130."""
    _process["owned"] = True
    atexit.register(_end_interrupted)  # before JAX is imported: exit functions run last registered first
    sys.unraisablehook = _redeliver_interrupts(sys.unraisablehook)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where SIGINT is ignored (cmd &)
        signal.signal(signal.SIGINT, _on_interrupt)
    main()


def _on_interrupt(signum, frame):
    """SIGINT's handler in a process that :func:`script` owns: Python's own (a ``KeyboardInterrupt``
    where the main thread is), remembering that it came, for :func:`raise_if_interrupted`."""
    _process["pending"] = True
    raise KeyboardInterrupt


def raise_if_interrupted() -> None:
    """Raises ``KeyboardInterrupt`` again where a Ctrl-C arrived and was swallowed: JAX's tracing has bare
    ``except:`` clauses (shape checks that try ``operator.index``), and an interrupt that lands inside one
    is lost, so decoding or training went on. The commands call it between their steps; it does nothing
    while the interrupt is still on its way out (inside the ``finally`` and ``except`` blocks it passes
    through), nor once :func:`run_main` has caught it, nor in a process that :func:`script` does not own."""
    if _process["pending"] and not _process["interrupted"] and sys.exc_info()[0] is None:
        raise KeyboardInterrupt


def _redeliver_interrupts(hook):
    """An unraisable-exception hook that delivers a Ctrl-C again when it landed where Python cannot raise
    it: in a garbage-collector callback (JAX runs one on every collection) or a ``__del__``, Python
    prints a traceback and carries on, and the interrupt would be lost."""

    def unraisable(info):
        if info.exc_type is not None and issubclass(info.exc_type, KeyboardInterrupt):
            # From another thread, a moment later: raised inside this hook, it would be swallowed again.
            timer = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT))
            timer.daemon = True
            timer.start()
            return
        hook(info)

    return unraisable


def _end_interrupted() -> None:
    if _process["interrupted"]:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        os._exit(EXIT_INTERRUPTED)


def run_main(main: Callable, argv: list[str] | None = None, traceback: bool = False,
             user_errors: tuple[type[BaseException], ...] = USER_ERRORS):
    """Returns ``main(argv)``; ends the process with the exit statuses of this module's docstring on a
    user error (one line, status 1), an interrupt (130) or a standard output that is closed (141) or
    fails (1). Standard output is flushed before it returns, so that a write that fails is reported here
    and not by the interpreter's exit ("Exception ignored ..." and status 120)."""
    try:
        env_traceback = env_flag(TRACEBACK_VARIABLE)
    except ValueError as err:
        _say(f"error: {err}")
        raise SystemExit(EXIT_ERROR) from None
    show_traceback = traceback or env_traceback
    stdout = _Watched(sys.stdout)
    if stdout.stream is not None:  # None under pythonw: print then writes nothing
        sys.stdout = stdout
    try:
        try:
            result = main(argv)
        except SystemExit:  # argparse's --help and usage errors, sys.exit: what they wrote must reach stdout
            stdout.flush()
            raise
        stdout.flush()
        return result
    except KeyboardInterrupt:
        if env_traceback:  # where it landed: Python's own report, and exit
            raise
        _process["interrupted"] = True
        if _process["owned"] and threading.current_thread() is threading.main_thread():
            # A second Ctrl-C during the cleanup that follows (a checkpoint being closed, JAX's exit
            # functions) ends the process at once, the default action, instead of raising inside it.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        _say("interrupted")
        raise SystemExit(EXIT_INTERRUPTED) from None
    except OSError as err:
        if err is stdout.failure:
            _silence(stdout.stream)
            if err.errno == errno.EPIPE:
                raise SystemExit(EXIT_CLOSED_PIPE) from None
            if show_traceback:
                raise
            _say(f"error: cannot write to standard output: {err.strerror or one_line(err)}")
            raise SystemExit(EXIT_ERROR) from None
        if not isinstance(err, user_errors) or show_traceback:
            raise
        _say(f"error: {one_line(err)}")
        raise SystemExit(EXIT_ERROR) from None
    except user_errors as err:
        if show_traceback:
            raise
        _say(f"error: {one_line(err)}")
        raise SystemExit(EXIT_ERROR) from None
    finally:
        if sys.stdout is stdout:
            sys.stdout = stdout.stream


def compilation_cache() -> str:
    """:func:`~retrace_jax.decoding.programs.enable_compilation_cache` for a command line: a cache directory
    that cannot be used is one ``warning: ...`` line on stderr, and the command runs without the cache."""
    from retrace_jax.decoding.programs import CacheWarning, enable_compilation_cache

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CacheWarning)
        directory = enable_compilation_cache()
    for warning in caught:
        if issubclass(warning.category, CacheWarning):
            _say(f"warning: {warning.message}")
        else:  # not this function's: as Python would have shown it
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return directory


def one_line(err: BaseException) -> str:
    """The error's message on one line (a ``KeyError`` says which key is missing)."""
    text = " ".join(str(err).split()) or type(err).__name__
    return f"missing key {text}" if isinstance(err, KeyError) else text


class _Watched:
    """Standard output, keeping the error of a write or flush that fails: it tells a closed or full
    standard output from the other ``OSError``s (a file's write has no file name in its error either)."""

    def __init__(self, stream):
        self.stream, self.failure = stream, None

    def write(self, text):
        try:
            return self.stream.write(text)
        except OSError as err:
            self.failure = err
            raise

    def flush(self):
        if self.stream is None:  # pythonw, a daemon: no standard output
            return
        try:
            self.stream.flush()
        except OSError as err:
            self.failure = err
            raise

    def __getattr__(self, name):  # fileno, isatty, encoding, buffer, ...: the stream's own
        return getattr(self.stream, name)


def _say(line: str) -> None:
    """``line`` on stderr; nothing if stderr is closed too (``2>&1 | head``)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _silence(stream) -> None:
    """Points the file descriptor of ``stream`` at /dev/null: what is still buffered goes there at exit,
    instead of failing again with "Exception ignored ..."."""
    try:
        fd = stream.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    except (AttributeError, OSError, ValueError):  # no standard output, or not a file descriptor
        pass
