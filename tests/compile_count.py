"""Counts XLA backend compilations through jax.monitoring (public API)."""

import contextlib

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_compiles():
    """Yields a list that receives the name of every function compiled inside the block."""
    names: list[str] = []

    def listener(event, duration_secs, **kwargs):
        if event == BACKEND_COMPILE_EVENT:
            names.append(kwargs.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
