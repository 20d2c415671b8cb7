"""One training prompt file from several sets: deduplicated and decontaminated against evaluation prompts.

``--take NAME=COUNT,...`` takes COUNT prompts (or ``all``) of each set, in a shuffle seeded by ``--seed``
and the set's name; drops exact duplicates (text compared lower-cased with whitespace collapsed) and
prompts of the evaluation files (by default the Spec-Bench questions shipped in ``assets/data`` and
HumanEval): a prompt is dropped when its normalised text equals an evaluation prompt, or when it shares a
normalised substring of ``--overlap`` characters (default 50) with one. The result is shuffled once more
with the seed, so the same inputs give the same file.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable

from retrace_jax.assets.prompts import write_records
from retrace_jax.errors import DataError
from retrace_jax.training.data import is_raw, prompt_records, read_jsonl


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
    ``question``, ``text``, and the user messages of ``messages`` or ``conversations``."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"evaluation file not found: {path}")
    texts = []
    for n, record in read_jsonl(path):
        found = [t for t in record.get("turns") or [] if isinstance(t, str)]
        found += [record[k] for k in ("prompt", "question", "text") if isinstance(record.get(k), str)]
        for key, role, content in (("messages", "role", "content"), ("conversations", "from", "value")):
            found += [m[content] for m in record.get(key) or [] if isinstance(m, dict)
                      and m.get(role) in ("user", "human") and isinstance(m.get(content), str)]
        if not found:
            raise DataError(f"{path}:{n}: no prompt text ('turns', 'prompt', 'question', 'text', 'messages' or "
                            f"'conversations')")
        texts += found
    return texts


def source_prompts(path: str) -> list[tuple[str, str | None, list[dict]]]:
    """(id, category, chat up to the first user message) of each record of a prompt file, in file order."""
    out = []
    for n, record, chat in prompt_records(path):
        rid = record.get("id", record.get("task_id", record.get("question_id", n)))
        out.append((str(rid), record.get("category"), chat))
    return out


MIX_COUNTS = ("read", "exact", "overlap", "duplicate", "taken")


def mix_prompts(sources: list[tuple[str, str, int | None]], out: str, eval_paths: list[str], seed: int = 0,
                overlap: int = 50) -> dict[str, dict[str, int]]:
    """Writes one JSONL of prompts from ``sources`` (name, file, how many or None for all) and returns, for
    each source, how many it had (``read``), how many were dropped as evaluation prompts (``exact``) or for
    sharing ``overlap`` normalised characters with one (``overlap``), as repeats of a prompt met before
    (``duplicate``, within the set or taken from an earlier set) and how many were taken.

    Each set is walked in a shuffle seeded by ``seed`` and its name; the prompts taken are shuffled together
    (seeded too). Records: ``{"id": "NAME/ID", "source", "category", "messages"}``, or ``"text"`` in place of
    ``"messages"`` for a raw prompt."""
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
                    record = {"id": f"{name}/{rid}", "source": name, "category": category or name}
                    # a raw prompt stays raw (no chat template), a chat stays a chat
                    record.update({"text": chat[0]["content"]} if is_raw(chat) else {"messages": chat})
                    chosen.append(record)
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


# The Spec-Bench questions, shipped as package data (assets/data/SOURCES.md says where they come from).
SPEC_BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "spec_bench_questions.jsonl.gz")
