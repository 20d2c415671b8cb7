"""benchmarks/products.py: the products it times are the library's two precisions, and it reports each."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks import products
from retrace_jax.models.layers import bfloat16_kernels, linear, product_precision


def test_the_bfloat16_product_is_the_one_target_precision_computes():
    """A dense layer as a target's are made for target_precision bfloat16 (bfloat16_kernels, then the
    product under product_precision) gives the benchmark's bfloat16 product."""
    layer = bfloat16_kernels(linear(48, 40, False, jnp.float32, nnx.Rngs(0)))
    w = layer.kernel.get_value()
    assert w.dtype == jnp.bfloat16
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, w.shape[0])).astype(np.float32))
    with product_precision("bfloat16"):
        want = layer(x)
    got = products.product("bfloat16")(x, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    exact = products.product("float32")(x, w.astype(jnp.float32))
    assert not np.allclose(np.asarray(got), np.asarray(exact), rtol=1e-7, atol=0)  # the operands were rounded


def test_it_prints_a_row_per_count_and_writes_the_json(tmp_path, capsys):
    out = tmp_path / "products.json"
    result = products.main(["--rows", "1,3", "--din", "16", "--dout", "24", "--iters", "2", "--runs", "3",
                            "--json", str(out)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("| rows | float32 GFLOP/s") and [line.split(" | ")[0] for line in lines[3:]] == \
        ["| 1", "| 3"]
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(result)) and [r["rows"] for r in saved["rows"]] == [1, 3]
    for r in saved["rows"]:
        assert r["float32_gflops"] > 0 and r["bfloat16_gflops"] > 0
        assert r["bfloat16_over_float32"] == pytest.approx(r["bfloat16_gflops"] / r["float32_gflops"])
    with pytest.raises(SystemExit):
        products.main(["--rows", "0"])
