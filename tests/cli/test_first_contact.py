"""What a user meets first at the command line: --help and a bad flag answer without importing JAX, usage
errors exit with 2 and bad values with 1, Ctrl-C prints one line and exits with 130, and a closed or full
standard output prints no traceback (retrace_jax/cli/__init__.py lists the exit statuses)."""

import errno
import os
import signal
import subprocess
import sys
import time

import pytest

import decode
import train
from retrace_jax import cli
from retrace_jax.cli import run_main
from retrace_jax.cli import train as cli_train
from retrace_jax.validation import MAX_BLOCK_SIZE, MAX_TEMPERATURE, MIN_TEMPERATURE
from tests.helpers import cli_error

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "tiny_dflash.yaml")
ENV = dict(os.environ, JAX_PLATFORMS="cpu", RETRACE_JAX_CACHE_DIR="", PYTHONUNBUFFERED="1")
ENV.pop("RETRACE_JAX_TRACEBACK", None)


# Ctrl-C as a terminal delivers it, in the child: a suite started in the background (``cmd &`` in a script)
# inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler at all. A fresh interpreter
# restores SIGINT's default action and becomes ``python ARGS`` (same process): a preexec_fn would run in a
# fork of this process, which JAX's threads make unsafe (JAX warns at each such fork).
DEFAULT_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                  "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def _with_default_sigint(args):
    """The command line that runs ``python ARGS`` with SIGINT's default action."""
    return [sys.executable, "-c", DEFAULT_SIGINT, *args]


def _python(args, **kwargs):
    return subprocess.run(_with_default_sigint(args), capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300,
                          check=False, **kwargs)


def test_children_start_without_forking_this_jax_process_and_take_ctrl_c():
    """The default run printed 12 "os.fork() was called ... JAX is multithreaded" warnings from this file
    (a preexec_fn forks the test process). The child still gets SIGINT's default action when this process
    ignores it."""
    import threading
    import warnings

    import jax

    jax.devices()  # JAX's threads run, and its warning at each fork is registered
    ignored = threading.current_thread() is threading.main_thread()  # signal.signal works there only
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = signal.signal(signal.SIGINT, signal.SIG_IGN) if ignored else None
        try:
            run = _python(["-c", "import signal; print(signal.getsignal(signal.SIGINT).__name__)"])
        finally:
            if ignored:
                signal.signal(signal.SIGINT, before)
    assert [str(w.message) for w in caught if "fork" in str(w.message)] == []
    assert (run.returncode, run.stdout, run.stderr) == (0, "default_int_handler\n", "")


# ------------------------------------------------------------------------------------ E: no JAX before parsing

# Runs a root script as `python SCRIPT ARGS` does, then reports whether JAX was imported and the exit status.
PROBE = """
import runpy, sys
script, args = sys.argv[1], sys.argv[2:]
sys.argv = [script, *args]
code = 0
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as exit_:
    code = exit_.code
print("jax imported:", "jax" in sys.modules, "exit:", code, file=sys.stderr)
"""


@pytest.mark.parametrize("script, args, code", [
    ("decode.py", ["--help"], 0),
    ("decode.py", ["--bogus-flag"], 2),
    ("decode.py", ["--max-new-tokens", "many"], 2),
    ("decode.py", ["--dtype", "float64"], 2),
    ("train.py", ["--help"], 0),
    ("train.py", ["--bogus-flag"], 2),
    ("train.py", ["--stage", "train"], 2),  # --config missing
    ("decode.py", ["--target", "tiny", "--runs", "0"], 1),  # a bad value: checked before anything loads
    ("decode.py", ["--target", "/nonexistent/model"], 1),
])
def test_help_and_usage_errors_answer_before_jax_is_imported(script, args, code):
    run = _python(["-c", PROBE, script, *args])
    assert run.stderr.splitlines()[-1] == f"jax imported: False exit: {code}", run.stderr
    assert "Traceback" not in run.stderr
    if code == 0:
        assert run.stdout.startswith(f"usage: {script}")


def test_help_states_the_bounds_that_are_checked():
    """The help names the bounds of retrace_jax.validation without importing it (it imports pydantic)."""
    run = _python(["decode.py", "--help"])
    text = " ".join(run.stdout.split())
    assert (MAX_BLOCK_SIZE, MIN_TEMPERATURE, MAX_TEMPERATURE) == (256, 1e-6, 1e6)
    assert "block size (2 to 256)" in text and "between 1e-6 and 1e6" in text


# ------------------------------------------------------------------------------------ F: 2 for usage, 1 for values

@pytest.mark.parametrize("main, argv", [
    (decode.main, ["--bogus-flag"]),
    (decode.main, ["--block-size", "big"]),
    (decode.main, ["--draft-rule", "greedy"]),
    (train.main, ["--bogus-flag"]),
    (train.main, []),  # --config missing
    (train.main, ["--config", CONFIG, "--step", "3"]),  # --step without --stage export
])
def test_usage_errors_exit_2_with_argparse_usage(main, argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ") and "error: " in err.splitlines()[-1] and "Traceback" not in err


@pytest.mark.parametrize("argv, line", [
    (["--block-size", "1000000"], f"error: --block-size must be between 2 and {MAX_BLOCK_SIZE}, got 1000000"),
    (["--block-size", "1"], f"error: --block-size must be between 2 and {MAX_BLOCK_SIZE}, got 1"),
    (["--temperature", "1e300"], "error: --temperature must be 0 (greedy) or between 1e-06 and 1e+06, got 1e+300"),
    (["--temperature", "nan"], "error: --temperature must be 0 (greedy) or between 1e-06 and 1e+06, got nan"),
    (["--temperature=-inf"], "error: --temperature must be 0 (greedy) or between 1e-06 and 1e+06, got -inf"),
    (["--top-p", "nan"], "error: --top-p must be in (0, 1], got nan"),
    (["--seed", "-1"], "error: --seed must be in [0, 2**32), got -1"),
])
def test_bad_values_exit_1_with_one_line_before_anything_loads(argv, line, capsys, monkeypatch):
    monkeypatch.delenv("RETRACE_JAX_TRACEBACK", raising=False)
    assert cli_error(capsys, decode.main, ["--target", "tiny", *argv]) == line


# ------------------------------------------------------------------------------------ B: Ctrl-C

def _interrupt(args, marker: str, stop_after: float = 180):
    """Starts ``python ARGS``, sends SIGINT once ``marker`` appeared on its stdout, returns (status, stdout,
    stderr)."""
    proc = subprocess.Popen(_with_default_sigint(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=ENV)
    out = ""
    try:
        while marker not in out:
            chunk = proc.stdout.read(1)
            assert chunk, f"exited before {marker!r}: {out}{proc.stderr.read()}"
            out += chunk
        time.sleep(0.5)  # inside the step that printed the marker
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=stop_after)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out + rest, err


def test_decode_interrupted_while_compiling_prints_one_line_and_exits_130():
    """It printed 60 lines of KeyboardInterrupt traceback from inside JAX."""
    code, out, err = _interrupt(["decode.py", "--target", "tiny", "--max-new-tokens", "2000"], "compiling plain")
    assert (code, err) == (cli.EXIT_INTERRUPTED, "interrupted\n"), (code, err)
    assert "timing" not in out


@pytest.mark.slow  # compiles plain decoding first (about 10-20 s)
def test_decode_interrupted_while_decoding_prints_one_line_and_exits_130():
    """It printed 258 lines of traceback."""
    code, _, err = _interrupt(["decode.py", "--target", "tiny", "--max-new-tokens", "2000", "--runs", "50"],
                              "timing plain")
    assert (code, err) == (cli.EXIT_INTERRUPTED, "interrupted\n"), (code, err)


@pytest.mark.slow  # prepares a small data set, then trains (about 20-40 s)
def test_train_interrupted_prints_one_line_and_exits_130(tmp_path):
    code, out, err = _interrupt(["train.py", "--config", CONFIG, "--set", f"out={tmp_path / 'run'}", "--set",
                                 "data.num_prompts=64", "--set", "data.shard_size=16"], '"event": "prepared"')
    assert code == cli.EXIT_INTERRUPTED, (code, err)
    assert err.splitlines()[-1] == "interrupted" and "Traceback" not in err and "Exception ignored" not in err, err


def test_train_turns_an_interrupt_into_one_line_and_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_train, "run", interrupted)
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as exit_:
            train.main(["--config", CONFIG])
    except KeyboardInterrupt:  # caught here: it would end the whole pytest session
        pytest.fail("the KeyboardInterrupt reached train.main's caller")
    assert exit_.value.code == 130 and capsys.readouterr().err == "interrupted\n"


def test_retrace_jax_traceback_shows_where_an_interrupt_landed(monkeypatch):
    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setenv("RETRACE_JAX_TRACEBACK", "1")
    with pytest.raises(KeyboardInterrupt):
        run_main(interrupted)


def _user_error(argv):
    raise ValueError("bad value")


@pytest.mark.parametrize("value, shown", [("1", True), ("true", True), ("YES", True), (" yes ", True),
                                          ("0", False), ("false", False), ("No", False), ("", False)])
def test_retrace_jax_traceback_is_on_for_1_true_yes_and_off_for_0_false_no(value, shown, monkeypatch, capsys):
    """RETRACE_JAX_TRACEBACK=0 and =false turned tracebacks on (any non-empty value did)."""
    monkeypatch.setenv("RETRACE_JAX_TRACEBACK", value)
    if shown:
        with pytest.raises(ValueError, match="bad value"):
            run_main(_user_error)
    else:
        assert cli_error(capsys, lambda argv: run_main(_user_error, argv), []) == "error: bad value"


@pytest.mark.parametrize("value", ["2", "on?", "tru", "-1"])
def test_retrace_jax_traceback_with_another_value_is_an_error_naming_it(value, monkeypatch, capsys):
    monkeypatch.setenv("RETRACE_JAX_TRACEBACK", value)
    line = cli_error(capsys, lambda argv: run_main(_user_error, argv), [])
    assert line == (f"error: RETRACE_JAX_TRACEBACK={value!r}: expected 1, true or yes (on) or 0, false, no or "
                    f"empty (off)")


def test_retrace_jax_traceback_0_reports_an_interrupt_as_one_line(monkeypatch, capsys):
    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setenv("RETRACE_JAX_TRACEBACK", "0")
    try:
        with pytest.raises(SystemExit) as exit_:
            run_main(interrupted)
    except KeyboardInterrupt:  # caught here: it would end the whole pytest session
        pytest.fail("RETRACE_JAX_TRACEBACK=0 let the KeyboardInterrupt through")
    assert exit_.value.code == cli.EXIT_INTERRUPTED and capsys.readouterr().err == "interrupted\n"


GC_INTERRUPT = """
import gc, os, signal, sys, time
from retrace_jax.cli import run_main, script

def callback(phase, info):  # as JAX's: Python cannot raise from a garbage-collector callback
    if phase == "start":
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10000):
            pass

def run(argv):
    gc.callbacks.append(callback)
    gc.collect()
    gc.callbacks.remove(callback)
    time.sleep(5)
    print("the interrupt was lost")

script(lambda: run_main(run))
"""


def test_an_interrupt_that_lands_in_a_gc_callback_is_not_lost():
    """JAX runs a callback on every garbage collection; a Ctrl-C that arrived there printed "Exception
    ignored ... KeyboardInterrupt" and training went on."""
    run = _python(["-c", GC_INTERRUPT])
    assert (run.returncode, run.stdout, run.stderr) == (130, "", "interrupted\n")


SWALLOWED_INTERRUPT = """
import os, signal, sys, time
from retrace_jax.cli import raise_if_interrupted, run_main, script

def run(argv):
    try:  # as JAX's tracing does around operator.index: a bare except where the interrupt lands
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(2)
    except:
        pass
    try:
        raise_if_interrupted()  # a command's next step
    finally:
        raise_if_interrupted()  # on the interrupt's way out: it stays the same interrupt
        print("cleaned up")
    print("the interrupt was lost")

script(lambda: run_main(run))
"""


def test_an_interrupt_that_a_bare_except_swallowed_is_raised_at_the_next_step():
    """A Ctrl-C while decode.py compiled was lost now and then: it landed inside one of the bare
    ``except:`` clauses of JAX's tracing, and decoding went on to time every method."""
    run = _python(["-c", SWALLOWED_INTERRUPT])
    assert (run.returncode, run.stdout, run.stderr) == (130, "cleaned up\n", "interrupted\n")


def _swallowed_interrupt(monkeypatch):
    """As if a Ctrl-C had come (script's handler records it) and something had swallowed it."""
    monkeypatch.setitem(cli._process, "interrupted", False)  # run_main in earlier tests of this process set it
    monkeypatch.setitem(cli._process, "pending", True)


def test_decode_raises_a_swallowed_interrupt_after_the_compiling_call(monkeypatch, capsys):
    import retrace_jax as rj

    real = rj.generate

    def generate(*args, **kwargs):  # the first call compiles; an interrupt there was swallowed
        out = real(*args, **kwargs)
        _swallowed_interrupt(monkeypatch)
        return out

    monkeypatch.setattr(rj, "generate", generate)
    monkeypatch.delenv("RETRACE_JAX_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        decode.main(["--target", "tiny", "--max-new-tokens", "8"])
    out, err = capsys.readouterr()
    assert (exit_.value.code, err) == (cli.EXIT_INTERRUPTED, "interrupted\n") and "timing" not in out


def test_train_raises_a_swallowed_interrupt_at_its_next_record(monkeypatch, capsys, tmp_path):
    from retrace_jax.training import prepare

    def preparing(cfg, log):
        _swallowed_interrupt(monkeypatch)
        log({"event": "prepared"})
        raise AssertionError("the record went through")

    monkeypatch.setattr(prepare, "prepare", preparing)
    monkeypatch.delenv("RETRACE_JAX_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        train.main(["--config", CONFIG, "--set", f"out={tmp_path / 'run'}"])
    assert exit_.value.code == cli.EXIT_INTERRUPTED and capsys.readouterr().err == "interrupted\n"


# ------------------------------------------------------------------------------------ C: closed or full stdout

def _with_closed_stdout(args):
    """Runs ``python ARGS`` with a standard output whose reader is gone (``| head -0``)."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, *args], stdout=write, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env=ENV, timeout=300, check=False)
    finally:
        os.close(write)
    return proc.returncode, proc.stderr


@pytest.mark.parametrize("args", [
    ["train.py", "--describe"],
    ["decode.py", "--target", "tiny", "--max-new-tokens", "2000"],  # the first lines are written before compiling
])
def test_a_closed_stdout_ends_the_command_quietly_with_141(args):
    """decode.py | head -1 printed "error: [Errno 32] Broken pipe"."""
    code, err = _with_closed_stdout(args)
    assert (code, err) == (cli.EXIT_CLOSED_PIPE, ""), (code, err)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_a_full_stdout_is_one_error_line(unbuffered):
    """train.py --describe > /dev/full printed a traceback."""
    with open("/dev/full", "w") as full:
        run = subprocess.run([sys.executable, "train.py", "--describe"], stdout=full, stderr=subprocess.PIPE,
                             text=True, cwd=ROOT, env=dict(ENV, PYTHONUNBUFFERED=unbuffered), timeout=300,
                             check=False)
    assert (run.returncode, run.stderr) == (1, "error: cannot write to standard output: No space left on device\n")


class _ClosedPipe:
    def write(self, text):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    def flush(self):
        pass


def test_run_main_exits_141_on_a_closed_pipe_and_1_on_other_write_errors(monkeypatch, capsys):
    def prints(argv):
        print("hello")

    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    with pytest.raises(SystemExit) as exit_:
        run_main(prints)
    assert exit_.value.code == 141 and capsys.readouterr().err == ""
    monkeypatch.undo()

    def writes_a_file(argv):  # a broken pipe that is not standard output's is an error like any other
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    with pytest.raises(SystemExit) as exit_:
        run_main(writes_a_file)
    assert exit_.value.code == 1 and capsys.readouterr().err == "error: [Errno 32] Broken pipe\n"


# ------------------------------------------------------------------------------------ G: no PyTorch

# Loads a tokenizer (decode.py --target DIR) or transformers' GGUF tokenizer converter (the demo's first
# fetch) first, with PyTorch hidden as on an install without it; reports whether transformers saw no PyTorch.
NO_TORCH = """
import sys
sys.modules["torch"] = None  # importlib.util.find_spec("torch") is then None: not installed
from retrace_jax.assets.models import _tokenizer_converter
from retrace_jax.training.data import load_tokenizer
if sys.argv[1] == "gguf":
    _tokenizer_converter()
assert load_tokenizer(sys.argv[2]).encode("w5 w6") == [5, 6]
import transformers
print("torch available:", transformers.utils.is_torch_available())
"""


@pytest.mark.parametrize("first", ["tokenizer", "gguf"])
def test_loading_a_tokenizer_without_pytorch_prints_no_notice_about_it(first, tmp_path):
    """decode.py printed "[transformers] PyTorch was not found. Models won't be available ..." on an
    install without PyTorch, which retrace_jax never needs."""
    from tests.helpers import save_word_tokenizer

    save_word_tokenizer(str(tmp_path))
    run = _python(["-c", NO_TORCH, first, str(tmp_path)])
    assert (run.returncode, run.stdout) == (0, "torch available: False\n"), run.stderr
    assert "PyTorch" not in run.stderr, run.stderr
