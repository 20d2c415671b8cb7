"""Compilation: JAX's persistent cache for the command lines (a second run loads its programs from disk),
and the compiler options of the decode programs."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import tempfile
import warnings

logger = logging.getLogger(__name__)

DEFAULT_DIR = os.path.join("~", ".cache", "retrace_jax", "xla")
CACHE_VARIABLE = "RETRACE_JAX_CACHE_DIR"


class CacheWarning(RuntimeWarning):
    """The persistent compilation cache cannot be used; programs are compiled without it."""


def enable_compilation_cache(directory: str | None = None) -> str:
    """Turns on JAX's persistent compilation cache in ``directory`` (default ``$RETRACE_JAX_CACHE_DIR``
    or ``~/.cache/retrace_jax/xla``) for every program, however fast it compiled. Returns the directory.

    Call it before the first compilation. ``RETRACE_JAX_CACHE_DIR=""`` turns it off (returns ""). A
    directory that cannot be created or written (a file, ``/dev/null``, a read-only place) leaves the
    cache off too: a :class:`CacheWarning` names it (and the variable, when the path came from it)."""
    import jax

    if directory is None:
        directory = os.environ.get(CACHE_VARIABLE, DEFAULT_DIR)
        source = f"{CACHE_VARIABLE}={directory}" if CACHE_VARIABLE in os.environ else \
            f"{directory} (the default; {CACHE_VARIABLE} moves it)"
    else:
        source = directory
    if not directory:
        return ""
    directory = os.path.expanduser(directory)
    problem = _unusable(directory)
    if problem:
        warnings.warn(f"the persistent compilation cache is off: {source} {problem} ({CACHE_VARIABLE}=\"\" turns "
                      f"the cache off without this warning); programs are compiled anew", CacheWarning, stacklevel=2)
        return ""
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory


def _unusable(directory: str) -> str:
    """What keeps ``directory`` from holding the cache ("is not a directory", "cannot be written: ..."),
    or "" when it can: it is created if need be and a file is written and removed there."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        return "is not a directory"
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as err:
        return f"cannot be written: {err.strerror or err}"
    return ""


# JAX's own timings of the compile stages (jax.monitoring duration events): tracing and lowering are
# recorded for top-level programs only (a jitted function called inside a trace adds to its caller's),
# and the XLA stage covers compiling or loading from the persistent cache.
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
COMPILE_STAGE_EVENTS = {TRACE_EVENT: "trace", LOWER_EVENT: "lower", BACKEND_COMPILE_EVENT: "xla"}


@contextlib.contextmanager
def compile_seconds():
    """Yields a dict that receives the seconds JAX spends in each compile stage (``trace``, ``lower``,
    ``xla``) inside the block, summed over the programs compiled there. Empty when nothing was
    compiled, or when this JAX records the stages under other event names."""
    import jax

    seconds: dict[str, float] = {}

    def listener(event, duration, **kwargs):
        stage = COMPILE_STAGE_EVENTS.get(event)
        if stage is not None:
            seconds[stage] = seconds.get(stage, 0.0) + duration

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seconds
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


# XLA's CPU preset that spends less compile time on optimisations: it shortens XLA's compilation of the
# decode programs without slowing decoding (benchmarks/compile_time.py; docs/performance.md measures
# both). GPUs and TPUs compile with XLA's defaults.
CPU_COMPILER_OPTIONS = {"xla_cpu_opt_preset": "CPU_OPT_PRESET_FAST_COMPILE"}

# Products of several rows through Eigen instead of YNNPACK. Which is faster depends on the size of the
# weights: with small ones (the laboratory pair, d=256) YNNPACK's rounds ran 8-12% faster and with
# SmolLM2-135M's as fast, while with Qwen2.5-Coder-0.5B's (35 MB gate and up projections per layer, read
# from memory at every product) YNNPACK's products of a verify pass's 4 rows stream the weights at about
# half the rate of a single row's and Eigen's speculative programs ran 1.19x faster on an Intel Xeon
# (docs/performance.md, "Several-row products on CPU"). The option is experimental in XLA:
# cpu_compiler_options keeps it only where a trivial program compiles with it.
SEVERAL_ROW_CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}

# How the speculative programs' products of several rows (the verify pass, the drafted block) compile
# on CPU: "ynnpack" (XLA's default options), "eigen" (SEVERAL_ROW_CPU_OPTIONS), or "auto": "eigen" when
# a layer's largest weight matrix holds at least EIGEN_FROM_BYTES, between the sizes measured each way.
CPU_PRODUCTS = ("auto", "ynnpack", "eigen")
EIGEN_FROM_BYTES = 16 * 2**20


def resolve_cpu_products(cfg, itemsize: int, choice: str = "auto") -> str:
    """``choice`` ("auto", "ynnpack" or "eigen") for a target of config ``cfg`` whose weights take
    ``itemsize`` bytes an entry: "auto" is "eigen" when the largest weight matrix of a layer (the joined
    gate and up projections, the joined q/k/v projection or the output projection) holds at least
    :data:`EIGEN_FROM_BYTES`, else "ynnpack"."""
    if choice not in CPU_PRODUCTS:
        raise ValueError(f"cpu_products must be one of {CPU_PRODUCTS}, got {choice!r}")
    if choice != "auto":
        return choice
    d, heads = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    largest = max(d * 2 * cfg.intermediate_size, d * (heads + 2 * cfg.num_kv_heads * cfg.head_dim), heads * d)
    return "eigen" if largest * itemsize >= EIGEN_FROM_BYTES else "ynnpack"


def cpu_products_options(cfg, itemsize: int, choice: str = "auto") -> dict[str, str] | None:
    """The extra CPU compiler options of a speculative program for this target and ``choice``
    (:func:`resolve_cpu_products`): ``SEVERAL_ROW_CPU_OPTIONS`` for "eigen", None for "ynnpack"."""
    return dict(SEVERAL_ROW_CPU_OPTIONS) if resolve_cpu_products(cfg, itemsize, choice) == "eigen" else None


@functools.cache
def _xla_takes(name: str, value: str) -> bool:
    import jax

    try:
        jax.jit(lambda x: x + 1, compiler_options={name: value}).lower(1.0).compile()
    except Exception as e:  # noqa: BLE001  (XLA has no such option, or not this value)
        logger.info("XLA here does not take the compiler option %s=%r (%s); compiling without it",
                    name, value, str(e).splitlines()[0] if str(e) else type(e).__name__)
        return False
    return True


def cpu_compiler_options(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The options a decode program compiles with on CPU: :data:`CPU_COMPILER_OPTIONS`, and those of
    ``extra`` (e.g. :data:`SEVERAL_ROW_CPU_OPTIONS`) that this XLA takes (each probed once per process)."""
    kept = {name: value for name, value in (extra or {}).items() if _xla_takes(name, value)}
    return {**CPU_COMPILER_OPTIONS, **kept}


class DecodeProgram:
    """``jax.jit(fn, **jit_kwargs)`` that compiles with :func:`cpu_compiler_options` (with
    ``cpu_extra_options``) when the default backend is the CPU and with XLA's defaults elsewhere (one
    jitted function each, picked at call time: ``default`` and ``cpu``, the latter made on first use).
    ``lower`` and ``trace`` pick the same way, for ahead-of-time use and HLO checks."""

    def __init__(self, fn, *, cpu_extra_options: dict[str, str] | None = None, **jit_kwargs):
        import jax

        self._fn, self._jit_kwargs, self.cpu_extra_options = fn, jit_kwargs, cpu_extra_options
        self.default = jax.jit(fn, **jit_kwargs)
        functools.update_wrapper(self, fn)

    @functools.cached_property
    def cpu(self):
        return self.with_options(cpu_compiler_options(self.cpu_extra_options))

    def with_options(self, compiler_options: dict[str, str] | None):
        """A new ``jax.jit`` of the function with these XLA options (for benchmarks and checks)."""
        import jax

        return jax.jit(self._fn, compiler_options=compiler_options, **self._jit_kwargs)

    def _pick(self):
        import jax

        return self.cpu if jax.default_backend() == "cpu" else self.default

    def with_cpu_options(self, extra: dict[str, str] | None):
        """The function this program runs with ``extra`` CPU options instead of ``cpu_extra_options``
        (made once per distinct options and kept): on CPU its jit with :func:`cpu_compiler_options` of
        ``extra``, elsewhere the default jit (the options are CPU options)."""
        import jax

        if jax.default_backend() != "cpu":
            return self.default
        if extra == self.cpu_extra_options:
            return self.cpu
        key = tuple(sorted((extra or {}).items()))
        variants = self.__dict__.setdefault("_variants", {})
        if key not in variants:
            variants[key] = self.with_options(cpu_compiler_options(extra))
        return variants[key]

    def __call__(self, *args, **kwargs):
        return self._pick()(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self._pick().lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        return self._pick().trace(*args, **kwargs)
