"""Code-completion prompts: pieces of source files as raw ``{"text"}`` records, read and encoded without a
chat template, kept raw through the prompt mix, and the held-out sources kept out. No network."""

import json
import os

import pytest

from retrace_jax.assets import code, mixing
from retrace_jax.cli import assets as cli_assets
from retrace_jax.training.data import DataError, chat_encoder, is_raw, read_prompts

SOURCE = "\n".join(f"def f{i}(x):\n    y = x * {i}\n    return y + {i}\n" for i in range(40))


def words(text: str) -> int:
    return len(text.split())


class WordTokenizer:
    """A stand-in tokenizer: whitespace-separated words, and a chat template that wraps the user turn."""

    chat_template = "wrap"

    def encode(self, text, add_special_tokens=True):
        return [len(w) for w in text.split()] + ([99] if add_special_tokens else [])

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kw):
        return [7] + self.encode(messages[-1]["content"], add_special_tokens=False) + [8]


def test_pieces_are_whole_lines_within_the_range_and_seeded():
    texts = [("pkg/a.py", SOURCE), ("pkg/b.py", SOURCE.replace("x", "z"))]
    pieces = code.code_pieces(texts, 25, words, seed=3, min_tokens=10, max_tokens=30)
    assert pieces == code.code_pieces(texts, 25, words, seed=3, min_tokens=10, max_tokens=30)
    assert pieces != code.code_pieces(texts, 25, words, seed=4, min_tokens=10, max_tokens=30)
    sources = dict(texts)
    for piece in pieces:
        name, first = piece["source"].rsplit(":", 1)
        lines = sources[name].splitlines(keepends=True)
        assert "".join(lines[int(first) - 1:]).startswith(piece["text"] + "\n")  # whole lines from there on
        assert 10 <= words(piece["text"]) <= 30 and not piece["text"].endswith("\n")
    assert len({p["source"] for p in pieces}) == 25


def test_pieces_refuse_what_cannot_be_had():
    with pytest.raises(ValueError, match="min_tokens"):
        code.code_pieces([("a", SOURCE)], 1, words, 0, min_tokens=5, max_tokens=4)
    with pytest.raises(ValueError, match="only 0 of 3 pieces"):
        code.code_pieces([("a", "x = 1\ny = 2\n")], 3, words, 0, min_tokens=50, max_tokens=60, max_tries=200)


def test_source_files_of_a_package_and_of_the_standard_library():
    files = dict(code.source_files("json"))  # a package of the standard library, importable by name
    assert "json/decoder.py" in files and "JSONDecodeError" in files["json/decoder.py"]
    stdlib = [name for name, _ in code.source_files("stdlib")]
    assert "stdlib/json/decoder.py" in stdlib
    assert not any("/test/" in n or "site-packages" in n for n in stdlib)
    with pytest.raises(ValueError, match="neither 'stdlib' nor an installed package"):
        code.source_root("no_such_package_here")


def test_text_records_are_raw_prompts_encoded_without_the_template(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"text": "def f(x):\n    return"}) + "\n" + json.dumps({"prompt": "hello there"}) + "\n")
    raw, chat = read_prompts(str(path))
    assert is_raw(raw) and not is_raw(chat)
    encode = chat_encoder(WordTokenizer())
    assert encode(raw) == [3, 5, 6]  # as it stands, no special tokens
    assert encode(chat) == [7, 5, 5, 8]  # through the chat template
    for bad in ('{"text": ""}', '{"text": 3}'):
        path.write_text(bad + "\n")
        with pytest.raises(DataError, match=r"p\.jsonl:1: 'text' must be a non-empty string"):
            read_prompts(str(path))


def test_mix_keeps_raw_prompts_raw_and_drops_what_overlaps_the_evaluation(tmp_path):
    held_out = "def held_out_function(a, b):\n    return a ** b + held_out_constant"
    train = tmp_path / "code_train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in [
        {"text": "import os\nprint(os.getcwd())", "source": "stdlib/x.py:1"},
        {"text": "x = 1\n" + held_out + "\n", "source": "stdlib/y.py:3"}]))
    chats = tmp_path / "chat.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "Write a sort."}]}) + "\n")
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(json.dumps({"text": held_out}) + "\n")
    out = str(tmp_path / "mix.jsonl")
    stats = mixing.mix_prompts([("code", str(train), None), ("chat", str(chats), None)], out, [str(heldout)])
    assert stats["code"]["overlap"] == 1 and stats["code"]["taken"] == 1 and stats["chat"]["taken"] == 1
    records = [json.loads(line) for line in open(out)]
    by_source = {r["source"]: r for r in records}
    assert by_source["code"]["text"] == "import os\nprint(os.getcwd())" and "messages" not in by_source["code"]
    assert by_source["chat"]["messages"] == [{"role": "user", "content": "Write a sort."}]
    prompts = read_prompts(out)
    assert sorted(is_raw(p) for p in prompts) == [False, True]


def test_code_command_refuses_held_out_sources(tmp_path):
    with pytest.raises(ValueError, match=r"held-out source\(s\) \['flax'\]"):
        cli_assets.code_main(["--out", str(tmp_path / "o.jsonl"), "--tokenizer", str(tmp_path), "--sources",
                              "stdlib,flax", "--exclude", "optax,flax", "--num", "4"])
    with pytest.raises(ValueError, match="has no tokenizer"):
        cli_assets.code_main(["--out", str(tmp_path / "o.jsonl"), "--tokenizer", str(tmp_path), "--sources", "json",
                              "--num", "4"])
    assert not os.path.exists(tmp_path / "o.jsonl")
