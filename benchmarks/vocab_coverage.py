"""How much of a prompt set's target responses a draft vocabulary can propose at all, and why not the rest.

    python benchmarks/vocab_coverage.py --data runs/probe_data_8 \\
        --target ~/.cache/retrace_jax/models/qwen2.5-coder-0.5b-instruct \\
        --prompts dev=~/.cache/retrace_jax/data/code_heldout.jsonl:128:192 \\
        --prompts humaneval=~/.cache/retrace_jax/data/humaneval.jsonl \\
        --drafter retrace_jax/assets/drafters/qwen2.5-coder-0.5b-instruct-dflash \\
        --out results/qwen2.5-coder-0.5b-instruct/vocab_coverage.json

A drafter with a draft vocabulary of ``U`` tokens never proposes a token outside it, so the share of a
set's response tokens inside it (its coverage) caps every slot's acceptance there. The vocabulary is the
``U`` tokens that the training responses (``--data``, prepared by ``train.py``) hold most often. For each
prompt set (``NAME=JSONL[:START:STOP]``: the lines' prompts with the float32 target's greedy responses of
``--max-new-tokens``, made once and kept in ``--cache``) this prints:

- the coverage of the ``--sizes`` most frequent training-response tokens and of each ``--drafter``'s own
  draft vocabulary;
- the share of response tokens that no training response holds (no draft vocabulary chosen from this
  data covers them on merit, and the drafter never saw them as labels), and how many of those the same
  sequence's prompt, or its response before them, already holds: tokens a drafter would copy from its
  context.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks.recipe_probe import _digest, cached, sequences_of  # noqa: E402
from benchmarks.report import write_json  # noqa: E402


def _prompt_spec(spec: str) -> tuple[str, str, slice]:
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise SystemExit(f"--prompts expects NAME=JSONL[:START:STOP], got {spec!r}")
    path, lines = rest, slice(0, None)
    parts = rest.rsplit(":", 2)
    if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
        path, lines = parts[0], slice(int(parts[1]), int(parts[2]))
        if lines.stop <= lines.start:
            raise SystemExit(f"--prompts {spec!r}: STOP must be above START")
    return name, os.path.expanduser(path), lines


def unseen_tokens(tokens: np.ndarray, loss_mask: np.ndarray, seen: np.ndarray) -> dict:
    """Of the response tokens of ``tokens [N, S]`` (``loss_mask``), the share outside ``seen`` (a boolean
    table over the vocabulary), and the shares of those that the sequence's prompt holds, or its prompt
    or its response before them."""
    total = unseen = in_prompt = in_context = 0
    for row, mask in zip(tokens, loss_mask.astype(bool)):
        if not mask.any():
            continue
        start = int(np.argmax(mask))
        context = set(row[:start].tolist())
        prompt = set(context)
        for token in row[mask].tolist():
            total += 1
            if not seen[token]:
                unseen += 1
                in_prompt += token in prompt
                in_context += token in context
            context.add(token)
    return {"response_tokens": total, "unseen_share": unseen / max(total, 1),
            "unseen_in_prompt": in_prompt / max(unseen, 1), "unseen_in_context": in_context / max(unseen, 1)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="prepared training data (train.py --stage prepare)")
    p.add_argument("--target", required=True, help="the target's Hugging Face directory")
    p.add_argument("--prompts", action="append", required=True, metavar="NAME=JSONL[:START:STOP]")
    p.add_argument("--drafter", action="append", default=[], help="a drafter directory whose vocabulary to measure")
    p.add_argument("--sizes", default="4096,8192,16384,32768,65536", help="draft vocabulary sizes")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--cache", default=os.path.join("runs", "probes", "_sets"), help="where the sets are kept")
    p.add_argument("--out", help="write the results as JSON")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.max_new_tokens < 1 or min(sizes) < 1:
        p.error("--max-new-tokens and --sizes must be positive")
    specs = [_prompt_spec(s) for s in args.prompts]

    from safetensors.numpy import load_file

    import retrace_jax as rj
    from retrace_jax.models.config import read_config_json
    from retrace_jax.models.draft_vocab import FILE, TENSOR, coverage, frequent_tokens, token_counts
    from retrace_jax.training.data import SequenceData, chat_encoder, iter_prompt_ids, load_tokenizer, read_prompts

    target_dir = os.path.expanduser(args.target)
    vocab = int(read_config_json(target_dir)["vocab_size"])
    data = SequenceData(args.data, 1 << 30)
    counts = token_counts(data.tokens, data.mask, vocab)
    seen = counts > 0
    vocabularies = {f"top {k}": frequent_tokens(counts, k) for k in sizes if k <= vocab}
    for d in args.drafter:
        path = os.path.join(d, FILE)
        if not os.path.exists(path):
            raise SystemExit(f"{d} has no draft vocabulary ({FILE}): it drafts over the whole vocabulary")
        vocabularies[os.path.basename(os.path.normpath(d))] = load_file(path)[TENSOR]
    result = {"data": args.data, "training_sequences": len(data), "training_response_tokens": int(counts.sum()),
              "distinct_training_response_tokens": int(seen.sum()), "vocab": vocab, "sets": {}}
    target = tokenizer = None
    for name, path, lines in specs:
        key = {"target": os.path.abspath(target_dir), "prompts": os.path.abspath(path),
               "lines": [lines.start, lines.stop], "new": args.max_new_tokens}

        def build(path=path, lines=lines):
            nonlocal target, tokenizer
            if target is None:
                target, tokenizer = rj.load_target(target_dir, dtype="float32"), load_tokenizer(target_dir)
            prompts = read_prompts(path, lines.stop)[lines]
            stops = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
            tokens, mask = sequences_of(target, iter_prompt_ids(prompts, chat_encoder(tokenizer)),
                                        args.max_new_tokens, stops)
            return {"tokens": tokens, "loss_mask": mask}

        s = cached(os.path.join(args.cache, f"{name}-{_digest(key)}.npz"), build)
        set_counts = token_counts(list(s["tokens"]), list(s["loss_mask"]), vocab)
        result["sets"][name] = {"prompts": os.path.basename(path), "lines": [lines.start, lines.stop],
                                "sequences": len(s["tokens"]),
                                "coverage": {v: coverage(set_counts, ids) for v, ids in vocabularies.items()},
                                **unseen_tokens(s["tokens"], s["loss_mask"], seen)}
    names = list(vocabularies)
    print(f"training data: {len(data)} sequences, {result['training_response_tokens']} response tokens, "
          f"{result['distinct_training_response_tokens']} distinct")
    head = ["set", "response tokens"] + [f"coverage: {v}" for v in names]
    head += ["not in training responses", "of those: in the prompt", "in prompt or earlier response"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for name, r in result["sets"].items():
        cells = [name, str(r["response_tokens"])] + [f"{r['coverage'][v]:.3f}" for v in names]
        cells += [f"{r['unseen_share']:.3f}", f"{r['unseen_in_prompt']:.3f}", f"{r['unseen_in_context']:.3f}"]
        print("| " + " | ".join(cells) + " |")
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
