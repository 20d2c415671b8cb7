"""benchmarks/round_profile.py reads XLA's CPU trace events: products, walks (loops inside the decode
loop, their own kernels included) and the rest."""

import pytest


def test_kernel_times_split_products_walks_and_other():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.round_profile import profile

    if jax.default_backend() != "cpu":
        pytest.skip("XLA's CPU runtime events")

    def program(x, w):
        def step(i, c):  # a product, an inner loop (a "walk") of elementwise work, an elementwise op
            inner = jax.lax.fori_loop(0, i + 2, lambda j, d: jnp.sin(d) * 1.5, c)
            return jnp.tanh(c @ w) + inner

        return jax.lax.fori_loop(0, 5, step, x)

    run = jax.jit(program, compiler_options={"xla_cpu_enable_xprof_traceme": True})
    x, w = jnp.ones((8, 256)), jnp.asarray(np.random.RandomState(0).randn(256, 256) / 16, jnp.float32)
    run(x, w).block_until_ready()
    (times, counts), _ = profile(lambda: run(x, w).block_until_ready(), "test")
    assert counts.get("products") == 5  # one product per outer iteration, none counted twice
    assert counts.get("walks", 0) >= 5 + 20  # each inner loop and at least one kernel per inner iteration
    assert counts.get("other", 0) >= 5
    assert times.get("products", 0) > 0 and times.get("walks", 0) > 0
