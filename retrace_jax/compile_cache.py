"""JAX's persistent compilation cache for the command lines: a second run loads its programs from disk."""

from __future__ import annotations

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
