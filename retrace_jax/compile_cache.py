"""Compilation: JAX's persistent cache for the command lines (a second run loads its programs from disk),
and the compiler options of the decode programs."""

from __future__ import annotations

import functools
import os

DEFAULT_DIR = os.path.join("~", ".cache", "retrace_jax", "xla")


def enable_compilation_cache(directory: str | None = None) -> str:
    """Turns on JAX's persistent compilation cache in ``directory`` (default ``$RETRACE_JAX_CACHE_DIR``
    or ``~/.cache/retrace_jax/xla``) for every program, however fast it compiled. Returns the directory.

    Call it before the first compilation. ``RETRACE_JAX_CACHE_DIR=""`` turns it off (returns "")."""
    import jax

    if directory is None:
        directory = os.environ.get("RETRACE_JAX_CACHE_DIR", DEFAULT_DIR)
    if not directory:
        return ""
    directory = os.path.expanduser(directory)
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory


# XLA's CPU preset that spends less compile time on optimisations. For the demo-shaped decode programs
# it saved 0.5 to 3.6 s of 11-15 s of XLA compile time in most compilations (noisy) and left decoding as
# fast (benchmarks/compile_time.py, docs/performance.md); GPUs and TPUs compile with XLA's defaults.
CPU_COMPILER_OPTIONS = {"xla_cpu_opt_preset": "CPU_OPT_PRESET_FAST_COMPILE"}


class DecodeProgram:
    """``jax.jit(fn, **jit_kwargs)`` that compiles with :data:`CPU_COMPILER_OPTIONS` when the default
    backend is the CPU and with XLA's defaults elsewhere (one jitted function each, picked at call
    time: ``default`` and ``cpu``). ``lower`` and ``trace`` pick the same way, for ahead-of-time use and HLO
    checks."""

    def __init__(self, fn, **jit_kwargs):
        import jax

        self.default = jax.jit(fn, **jit_kwargs)
        self.cpu = jax.jit(fn, compiler_options=CPU_COMPILER_OPTIONS, **jit_kwargs)
        functools.update_wrapper(self, fn)

    def _pick(self):
        import jax

        return self.cpu if jax.default_backend() == "cpu" else self.default

    def __call__(self, *args, **kwargs):
        return self._pick()(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self._pick().lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        return self._pick().trace(*args, **kwargs)
