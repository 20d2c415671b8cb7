"""A bound on the kernels a decode loop launches per iteration (a structural check, not a timing): the
counts ``benchmarks/loop_kernels.py`` reads from the compiled programs must not grow unnoticed."""

import pytest

from benchmarks import loop_kernels

# The counts at the default shapes (random 4-layer Qwen3, 1-layer drafter, block 8; the unrolled layer
# loop and XLA options of generate on CPU) when the bound was set: 185 per plain step, 292 per round.
# docs/performance.md ("Kernels per step") reports them; a change that adds kernels raises the bound
# there and here, with its reason.
BOUNDS = {"plain step": 190, "speculative round": 300}


def test_kernels_per_iteration_stay_within_their_bounds(capsys):
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("the bounds are those of XLA's CPU backend")
    counts = loop_kernels.main([])
    assert set(counts) == set(BOUNDS)
    for name, bound in BOUNDS.items():
        assert 0 < counts[name] <= bound, (name, counts[name], bound)
    assert "| **kernels** |" in capsys.readouterr().out
