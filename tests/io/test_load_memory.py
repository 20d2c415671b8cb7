"""What loading a target and decoding with it hold in memory (#58 first contact: the demo peaked at
6.25 GB for a 2.5 GB float32 model): the weights are read a block at a time into the arrays JAX keeps,
never held whole a second time, and the unrolled layer loop's per-layer weights share the stacked arrays'
memory instead of copying them."""

import dataclasses
import tracemalloc

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import retrace_jax as rj
from retrace_jax.decoding import layer_loop
from retrace_jax.io import weights
from retrace_jax.io.safetensors import TensorReader
from retrace_jax.models.tiny import TINY_QWEN3
from tests.helpers import count_compiles

# an untied head of 16 MB and a vocabulary-sized embedding: the largest tensors dominate what is measured
WIDE = dataclasses.replace(TINY_QWEN3, vocab_size=32768, tie_word_embeddings=False, num_layers=2)


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("wide") / "target")
    rj.save_target(rj.tiny.tiny_target(cfg=WIDE), directory)
    return directory


def test_loading_holds_no_second_copy_of_a_tensor(wide_dir, monkeypatch):
    """Each tensor is read a block of rows at a time into the array that JAX then keeps (without a copy
    on a CPU): beyond the loaded weights, loading holds at most one block. It held a whole tensor at
    least twice (safetensors' copy and the stacked or transposed copy handed to JAX)."""
    monkeypatch.setattr(weights, "LOAD_BLOCK_BYTES", 64 << 10, raising=False)
    rj.load_target(wide_dir)  # compiles nothing, but imports and builds what later loads reuse
    tracemalloc.start()
    try:
        target = rj.load_target(wide_dir)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    head = WIDE.vocab_size * WIDE.hidden_size * 4
    assert peak - current < head // 16, (peak, current)  # 4.2 MB before the change
    expected = load_file(f"{wide_dir}/model.safetensors")  # the same values
    np.testing.assert_array_equal(np.asarray(target.lm_head.kernel[...]), expected["lm_head.weight"].T)
    np.testing.assert_array_equal(np.asarray(target.layers.mlp.down_proj.kernel[...])[1],
                                  expected["model.layers.1.mlp.down_proj.weight"].T)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16"])
def test_plain_reads_equal_safetensors_reads(tmp_path, dtype):
    """TensorReader reads whole tensors and ranges of leading rows with plain reads (safetensors' memory
    map kept every page read resident until the file was closed); the values are safetensors' own."""
    import ml_dtypes

    dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    rng = np.random.default_rng(0)
    tensors = {"a": rng.normal(size=(37, 5, 3)).astype(dtype), "b": rng.normal(size=(11,)).astype(dtype),
               "c": rng.normal(size=(4, 9)).astype(dtype)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    reader = TensorReader(str(tmp_path))
    for name, value in tensors.items():
        got = reader.get(name)
        assert got.dtype == value.dtype and got.shape == value.shape
        np.testing.assert_array_equal(got, value)
    np.testing.assert_array_equal(reader.get("a", (slice(7, 20),)), tensors["a"][7:20])
    np.testing.assert_array_equal(reader.get("a", (slice(30, 99), slice(None))), tensors["a"][30:])
    np.testing.assert_array_equal(reader.get("a", (slice(2, 9), slice(1, 3))), tensors["a"][2:9, 1:3])  # mapped


def test_a_truncated_file_is_named(tmp_path):
    save_file({"a": np.ones((64, 64), np.float32)}, str(tmp_path / "model.safetensors"))
    reader = TensorReader(str(tmp_path))
    with open(tmp_path / "model.safetensors", "r+b") as f:  # cut short after it was opened
        f.truncate(1000)
    with pytest.raises(rj.CheckpointError, match="cannot read tensor a from .*ends early"):
        reader.get("a")


def test_the_unrolled_loop_reads_the_stacked_weights_in_place(wide_dir):
    """On a CPU the per-layer weights of the unrolled layer loop are views of the stacked arrays (same
    memory) instead of a second copy of every layer (1.4 GB for Qwen2.5-Coder-0.5B), and decode the
    same tokens as the scan over the stacked arrays."""
    target = rj.load_target(wide_dir)
    kept = layer_loop.decode_weights(target, "unrolled")
    stacked = jax.tree.leaves(nnx.split(target.layers)[1])
    for i, layer in enumerate(kept.layers):
        for whole, one in zip(stacked, jax.tree.leaves(layer)):
            assert one.unsafe_buffer_pointer() == whole.unsafe_buffer_pointer() + i * one.nbytes
            np.testing.assert_array_equal(np.asarray(one), np.asarray(whole)[i])
    prompt = [3, 14, 15, 92, 65]
    unrolled = rj.generate(target, [prompt], 12, layer_loop="unrolled").tokens
    assert unrolled == rj.generate(target, [prompt], 12, layer_loop="scan").tokens
    with count_compiles() as compiled:  # the views sit where the stacked arrays do: nothing new to compile
        assert rj.generate(target, [prompt], 12, layer_loop="unrolled").tokens == unrolled
    assert compiled == []
