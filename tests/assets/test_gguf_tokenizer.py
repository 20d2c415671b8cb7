"""The tokenizer built from a GGUF file's metadata without PyTorch (``assets.models.gguf_tokenizer``)
equals the one transformers' own GGUF loader builds, on a tiny byte-level BPE file written here."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from retrace_jax.assets.models import gguf_tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXTS = ["def f(x):\n    return x + 1", "  the quick brown fox, 12345!", "<|im_start|>user\nhi<|im_end|>", "ünï 你好"]


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    extra, out = 0, {}
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def write_tiny_gguf(path: str) -> None:
    alphabet = byte_alphabet()
    space, newline = alphabet[ord(" ")], alphabet[ord("\n")]
    merges = [f"{space} {space}", "d e", "de f", "r e", "re t", f"{space} t", f"{space}t h", f"{space}th e",
              f"{newline} {space}{space}"]
    tokens = alphabet + [m.replace(" ", "") for m in merges] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 3) + [3, 3, 3]  # normal, then control tokens
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 3)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_pad_token_id(len(tokens) - 3)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def behaviour(tok) -> dict:
    chat = [{"role": "user", "content": "Write a haiku."}]
    return {"ids": [tok.encode(t) for t in TEXTS], "decoded": [tok.decode(tok.encode(t)) for t in TEXTS],
            "special": [tok.bos_token, tok.eos_token, tok.pad_token], "vocab": tok.get_vocab(),
            "chat": list(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    write_tiny_gguf(path)
    return path


def test_equals_transformers_gguf_loader_and_survives_a_save(tiny_gguf, tmp_path):
    pytest.importorskip("torch")  # transformers' own GGUF loader reads the file with PyTorch
    from transformers import AutoTokenizer

    ours = gguf_tokenizer(gguf.GGUFReader(tiny_gguf))
    reference = AutoTokenizer.from_pretrained(os.path.dirname(tiny_gguf), gguf_file=os.path.basename(tiny_gguf))
    assert behaviour(ours) == behaviour(reference)
    ours.save_pretrained(str(tmp_path))  # what convert() writes, as decode.py and train.py load it
    assert behaviour(AutoTokenizer.from_pretrained(str(tmp_path))) == behaviour(reference)


def test_builds_without_pytorch(tiny_gguf, tmp_path):
    """In a process where importing PyTorch fails, the tokenizer still builds and PyTorch stays out."""
    code = f"""
import builtins, sys
real = builtins.__import__
def guarded(name, *args, **kwargs):
    if name == "torch" or name.startswith("torch."):
        raise ImportError("PyTorch is not installed here")
    return real(name, *args, **kwargs)
builtins.__import__ = guarded
sys.path.insert(0, {ROOT!r})
import gguf
from retrace_jax.assets.models import gguf_tokenizer
tok = gguf_tokenizer(gguf.GGUFReader({tiny_gguf!r}))
print(json.dumps([tok.encode("def f(x):"), "torch" in sys.modules]))
"""
    out = subprocess.run([sys.executable, "-c", "import json\n" + code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    ids, torch_loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert ids and not torch_loaded


def test_a_file_without_a_tokenizer_is_refused(tmp_path):
    path = str(tmp_path / "bare.gguf")
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="no tokenizer"):
        gguf_tokenizer(gguf.GGUFReader(path))
