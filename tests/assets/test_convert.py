"""Converting a GGUF model (``rj.assets.fetch``, ``convert``) on a tiny file written here: the tensors are
dequantised and written a block at a time (the 2.5 GB float32 Qwen2.5-Coder-0.5B was held whole, twice,
while it was written), the result loads, and the GGUF file is removed once the converted directory is
checked (it stayed beside it: 491 MB for the demo's model), unless asked to keep it (#58 first contact)."""

import json
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import retrace_jax as rj  # noqa: E402
from retrace_jax.assets import models  # noqa: E402
from retrace_jax.io.digest import file_sha256  # noqa: E402
from retrace_jax.training.data import load_tokenizer  # noqa: E402
from tests.assets.test_gguf_tokenizer import CHAT_TEMPLATE, byte_alphabet  # noqa: E402

Q8 = gguf.GGMLQuantizationType.Q8_0
HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 96, 2


def write_model_gguf(path: str, arch: str) -> dict[str, np.ndarray]:
    """A two-layer model with a byte-level tokenizer; returns each tensor as GGUF's dequantisation gives
    it, in Hugging Face's [out, in] layout (before llama.cpp's q/k interleaving is undone)."""
    alphabet = byte_alphabet()
    space = alphabet[ord(" ")]
    merges = [f"{space} {space}", "d e", "de f"]
    tokens = alphabet + [m.replace(" ", "") for m in merges] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(LAYERS)
    w.add_context_length(64)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 3) + [3, 3, 3])
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 3)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(0)
    head_dim = HIDDEN // HEADS
    shapes = {"token_embd.weight": (len(tokens), HIDDEN), "output.weight": (len(tokens), HIDDEN),
              "output_norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        shapes |= {f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                   f"blk.{i}.attn_q.weight": (HEADS * head_dim, HIDDEN),
                   f"blk.{i}.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
                   f"blk.{i}.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
                   f"blk.{i}.attn_output.weight": (HIDDEN, HEADS * head_dim),
                   f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN), f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
                   f"blk.{i}.ffn_down.weight": (HIDDEN, FFN)}
        if arch == "qwen2":
            shapes |= {f"blk.{i}.attn_q.bias": (HEADS * head_dim,), f"blk.{i}.attn_k.bias": (KV_HEADS * head_dim,),
                       f"blk.{i}.attn_v.bias": (KV_HEADS * head_dim,)}
    out = {}
    for name, shape in shapes.items():
        value = rng.normal(size=shape).astype(np.float32) * 0.1
        if len(shape) == 2:
            data = gguf.quants.quantize(value, Q8)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=Q8)
            out[name] = gguf.quants.dequantize(data, Q8).reshape(shape)
        else:
            w.add_tensor(name, value)
            out[name] = value
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture
def tiny_model(tmp_path, monkeypatch):
    """``(name, cache, gguf_path, tensors)``: a tiny model in ``MODELS``, its GGUF file already in the
    cache with its sha256 (so nothing is downloaded)."""
    def make(arch="qwen2"):
        cache = str(tmp_path / "cache")
        name = f"tiny-{arch}"
        path = os.path.join(cache, "gguf", f"{name}.gguf")
        os.makedirs(os.path.dirname(path))
        tensors = write_model_gguf(path, arch)
        spec = {"wheels": [], "sha256": file_sha256(path), "gguf_name": f"{name}.gguf"}
        monkeypatch.setitem(models.MODELS, name, spec)
        return name, cache, path, tensors

    return make


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_conversion_writes_a_block_at_a_time_what_the_gguf_file_holds(tiny_model, monkeypatch, arch):
    name, cache, path, tensors = tiny_model(arch)
    monkeypatch.setattr(models, "CONVERT_BLOCK_BYTES", 2048, raising=False)  # 8 rows of 64 float32
    sizes = []
    dequantize = gguf.quants.dequantize

    def counting(data, qtype):
        out = dequantize(data, qtype)
        sizes.append(out.size)
        return out

    monkeypatch.setattr(gguf.quants, "dequantize", counting)
    directory = models.fetch(name, cache)
    monkeypatch.setattr(gguf.quants, "dequantize", dequantize)
    # at most 8 rows of 64 values at a time; llama's q is dequantised whole (its rows are put back in
    # order per head)
    assert max(sizes) == (8 * HIDDEN if arch == "qwen2" else HIDDEN * HIDDEN)
    from safetensors.numpy import load_file

    written = load_file(os.path.join(directory, "model.safetensors"))
    assert len(written) == len(tensors)
    for gguf_name, value in tensors.items():
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            n = HEADS if "attn_q" in gguf_name else KV_HEADS
            value = value.reshape(n, value.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(value.shape)
        np.testing.assert_array_equal(written[models._hf_name(gguf_name)], value)
    target = rj.load_target(directory)
    assert target.cfg.num_layers == LAYERS and not target.cfg.tie_word_embeddings
    assert load_tokenizer(directory).decode(load_tokenizer(directory).encode("def f(x)")) == "def f(x)"


def test_the_gguf_file_is_removed_once_the_converted_directory_is_checked(tiny_model, capsys):
    name, cache, path, _ = tiny_model()
    directory = models.fetch(name, cache)
    assert not os.path.exists(path)  # nothing reads it later: 491 MB for the demo's model
    assert sorted(os.listdir(directory)) == ["chat_template.jinja", "config.json", "model.safetensors",
                                             "tokenizer.json", "tokenizer_config.json"]
    assert f"removed {path}" in capsys.readouterr().out
    with open(os.path.join(directory, "config.json")) as f:
        assert json.load(f)["num_hidden_layers"] == LAYERS
    assert load_tokenizer(directory) is not None  # built from the GGUF metadata, saved before the removal
    assert models.fetch(name, cache) == directory  # ready: nothing to fetch again


def test_keep_gguf_keeps_it_and_a_left_over_one_is_named(tiny_model, capsys):
    name, cache, path, _ = tiny_model()
    models.fetch(name, cache, keep_gguf=True)
    assert os.path.isfile(path)
    capsys.readouterr()
    models.fetch(name, cache)  # an earlier conversion's GGUF file: named as one that may be removed
    assert f"{path} (0 MB), the file it was converted from, is no longer needed" in capsys.readouterr().out
    assert os.path.isfile(path)


def test_a_conversion_that_fails_its_check_keeps_the_gguf_file(tiny_model, monkeypatch):
    name, cache, path, _ = tiny_model()

    def broken(name, out_dir, shapes):
        raise ValueError("the converted directory is not usable")

    monkeypatch.setattr(models, "check_converted", broken, raising=False)
    with pytest.raises(ValueError, match="not usable"):
        models.fetch(name, cache)
    assert os.path.isfile(path)


def test_the_check_refuses_a_directory_without_its_tokenizer(tiny_model):
    name, cache, path, _ = tiny_model()
    directory = models.fetch(name, cache, keep_gguf=True)
    shapes = {n: tuple(s) for n, s in _header_shapes(os.path.join(directory, "model.safetensors")).items()}
    models.check_converted(name, directory, shapes)
    os.remove(os.path.join(directory, "tokenizer.json"))
    os.remove(os.path.join(directory, "tokenizer_config.json"))
    with pytest.raises(ValueError, match="no usable tokenizer"):
        models.check_converted(name, directory, shapes)


def _header_shapes(path):
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return {n: v["shape"] for n, v in header.items() if n != "__metadata__"}
