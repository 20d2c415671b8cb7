"""Batch-1 speed with two conventions: end to end, and decode only (after prefill).

``rj.generate`` runs prefill and decoding as one compiled program, so prefill cannot be timed from the
inside. It is timed as the same program stopped right after its first token: the run is repeated with
that token (known from the full run; the first token comes from prefill and its random stream does not
depend on the method) added to the stop list. That run does everything a full run does before its first
decoding step (padding, prefill, the first token, the drafter's context cache, host transfers) and then
ends; its stop list stays in the same bucket, so it runs the same compiled program.

- **end to end**: new tokens / the full run's time (prefill included), as before;
- **decode only**: the tokens after the first / (full time - prefill time): the time per output token
  after prefill. The official DFlash benchmark reports speedup this way, against the same loop with
  block size 1; here the baseline is the plain loop (``rj.generate`` without a drafter: one target
  forward per token). The official script divides the decoding time by all output tokens (the first
  included); both rules give the same speedup when the two methods produce the same number of tokens
  (always at T = 0).

Every time is the median of ``repeats`` runs, the methods alternating within each repeat, after a
compiling run of each.
"""

from __future__ import annotations

import statistics
import time
import warnings

import retrace_jax as rj


def time_methods(target, ids: list[int], max_new_tokens: int, methods: dict[str, dict], repeats: int = 3,
                 stop_token_ids=(), **common) -> dict[str, dict]:
    """Per method: ``tokens`` (new tokens of the run), ``total_s`` and ``prefill_s`` (medians over
    ``repeats`` runs) for one prompt at batch 1. ``methods`` maps a name to ``rj.generate`` keywords;
    ``common`` are keywords for all of them."""
    if repeats < 1:
        raise ValueError(f"repeats must be positive, got {repeats}")
    stops = list(stop_token_ids)

    def run(kwargs, extra_stop=()):
        start = time.perf_counter()
        out = rj.generate(target, [ids], max_new_tokens, stop_token_ids=stops + list(extra_stop), **common, **kwargs)
        return out.tokens[0], time.perf_counter() - start

    first = {}
    for name, kwargs in methods.items():  # compiles both variants of every method's program
        tokens, _ = run(kwargs)
        first[name] = (tokens, tokens[0])
        run(kwargs, [tokens[0]])
    totals = {name: [] for name in methods}
    prefills = {name: [] for name in methods}
    for _ in range(repeats):
        for name, kwargs in methods.items():
            tokens, seconds = run(kwargs)
            if tokens != first[name][0]:  # the seed fixes them; only a nondeterministic device could differ
                warnings.warn(f"{name}: a repeated run gave other tokens ({len(tokens)} instead of "
                              f"{len(first[name][0])}); timing kept")
            totals[name].append(seconds)
            head, seconds = run(kwargs, [first[name][1]])
            if head != [first[name][1]]:
                raise RuntimeError(f"{name}: the prefill-only run did not stop at its first token")
            prefills[name].append(seconds)
    return {name: {"tokens": len(first[name][0]), "total_s": statistics.median(totals[name]),
                   "prefill_s": statistics.median(prefills[name])} for name in methods}


def rates(timings: list[dict]) -> dict[str, float]:
    """Pooled over runs: ``end_to_end`` (new tokens/s, prefill included) and ``decode`` (tokens after the
    first per second of decoding)."""
    tokens = sum(t["tokens"] for t in timings)
    total = sum(t["total_s"] for t in timings)
    decode_tokens = sum(t["tokens"] - 1 for t in timings)
    decode_s = sum(t["total_s"] - t["prefill_s"] for t in timings)
    return {"end_to_end": tokens / total, "decode": decode_tokens / decode_s if decode_s > 0 else float("nan")}
