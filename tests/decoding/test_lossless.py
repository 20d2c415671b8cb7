"""Greedy speculative decoding equals plain decoding at every acceptance length, on every decode path.

The drafter is the oracle of ``tests/oracle.py``: it proposes the target's own continuation with errors
placed so that each round accepts a chosen number of proposals, from none to a full block. The rounds'
acceptance lengths are checked against the plan as well as the tokens against plain decoding. A control
breaks the verify pass's causal mask for the block's later slots and shows that these tests catch it,
where a drafter that is never right does not.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import retrace_jax as rj
import retrace_jax.models.target as target_module
from retrace_jax.models.tiny import tiny_target
from tests.oracle import Oracle

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [3], [40, 41, 42, 43, 44, 45, 46]]
BLOCK = 5
NEW = 30


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def oracle(target):
    return Oracle.build(target, PROMPTS, NEW, BLOCK)


def check(out, oracle):
    assert out.tokens == oracle.expected_tokens()
    assert out.acceptance_lengths == oracle.expected_acceptance()


def test_every_acceptance_length_occurs_and_the_rounds_follow_the_plan(target, oracle):
    out = rj.generate(target, PROMPTS, NEW, drafter=oracle.drafter)
    assert oracle.expected_tokens() == rj.generate(target, PROMPTS, NEW).tokens
    check(out, oracle)
    assert {n for row in out.acceptance_lengths for n in row} == set(range(1, BLOCK + 1))


@pytest.mark.parametrize("kwargs", [{"layer_loop": "scan"}, {"attention": "dense"}, {"use_retrace": False}])
def test_layer_loops_and_attention_paths(target, oracle, kwargs):
    check(rj.generate(target, PROMPTS, NEW, drafter=oracle.drafter, **kwargs), oracle)


def test_a_cache_walked_in_small_chunks(target):
    """120 new tokens: caches of 256 slots, which the attention walks in chunks of 128, past the first."""
    from retrace_jax.attention import cache_slots, walk_chunk

    assert walk_chunk(cache_slots(8 + 128 + BLOCK)) == 128
    oracle = Oracle.build(target, PROMPTS[:2], 120, BLOCK)
    check(rj.generate(target, PROMPTS[:2], 120, drafter=oracle.drafter), oracle)


def test_stops_and_limits_inside_a_block(target):
    """A stop token and ``max_new_tokens`` that fall inside an accepted block cut the row there."""
    row = rj.generate(target, PROMPTS, NEW).tokens[1]
    cut = next(i for i in range(7, NEW) if row[i] not in row[:i] and i % BLOCK)  # inside a full block of row 1
    stop = row[cut]
    for new, stops in ((13, ()), (NEW, (stop,))):
        oracle = Oracle.build(target, PROMPTS, new, BLOCK, schedule=lambda row: [BLOCK - 1], stop_token_ids=stops)
        out = rj.generate(target, PROMPTS, new, drafter=oracle.drafter, stop_token_ids=list(stops))
        check(out, oracle)
        assert out.tokens == rj.generate(target, PROMPTS, new, stop_token_ids=list(stops)).tokens
    assert len(out.tokens[1]) == cut + 1 and out.tokens[1][-1] == stop


@pytest.mark.parametrize("slots,fusion,hints", [("all", "embedding", "none"), ("agreed", "embedding", "none"),
                                                ("all", "keys", "none"), ("agreed", "embedding", "tokens"),
                                                ("all", "embedding", "mixture")])
def test_a_retrace_drafter_with_its_memory_on_and_off(target, slots, fusion, hints):
    mixture = "target" if hints == "mixture" else "none"
    hints = "none" if hints == "mixture" else hints
    oracle = Oracle.build(target, PROMPTS, NEW, BLOCK,
                          retrace=rj.ReTraceConfig(slots=slots, fusion=fusion, hints=hints, mixture=mixture))
    for use_retrace in (True, False):
        check(rj.generate(target, PROMPTS, NEW, drafter=oracle.drafter, use_retrace=use_retrace), oracle)


def test_a_draft_vocabulary(target):
    """Proposals from a draft vocabulary that holds only part of the target's continuation: a proposal
    outside it is a miss the plan accounts for."""
    truth = rj.generate(target, PROMPTS, NEW + 2 * BLOCK).tokens
    seen = sorted({t for row in truth for t in row})
    vocab = sorted(set(seen[::2]) | set(range(0, 512, 7)))
    oracle = Oracle.build(target, PROMPTS, NEW, BLOCK, draft_vocab=vocab)
    out = rj.generate(target, PROMPTS, NEW, drafter=oracle.drafter)
    check(out, oracle)
    assert max(n for row in out.acceptance_lengths for n in row) > 2


def test_the_stepper_runs_the_planned_rounds(target, oracle):
    from retrace_jax.decoding.sampling import SamplingParams
    from retrace_jax.decoding.speculative import SpeculativeStepper

    prompt = PROMPTS[1]
    tokens = jnp.asarray([prompt + [0] * 3], jnp.int32)
    args = (tokens, jnp.asarray([len(prompt)], jnp.int32), jnp.ones((1,), bool), np.int32(NEW),
            jnp.full((8,), -1, jnp.int32), SamplingParams.make())
    one = Oracle.build(target, [prompt], NEW, BLOCK, schedule=lambda row: [4, 0, 3, 1, 2])
    stepper = SpeculativeStepper(target, one.drafter, capacity=32, block_size=BLOCK)
    stepper.init(*args)
    rounds = []
    while not stepper.done:
        rounds.append(int(stepper.step().accepted_b[0]) + 1)
    assert rounds == one.expected_acceptance()[0]
    assert stepper.carry.buf.tokens[0, : int(stepper.carry.buf.num[0])].tolist() == one.expected_tokens()[0]


def test_a_broken_verify_mask_is_caught(target, oracle, monkeypatch):
    """The control: in the verify pass, block slots 1.. no longer see their own key (a causal mask off by
    one inside the block). The oracle's output changes; a never-right drafter's does not, because only
    slot 0 of each verify pass reaches its output."""
    real = target_module.cached_attention

    def off_by_one(q, k, v, layer, limit_bt, *args, **kwargs):
        if q.shape[1] == BLOCK:  # the verify block (prompts are padded to other lengths)
            limit_bt = limit_bt - (jnp.arange(BLOCK) >= 1)[None, :]
        return real(q, k, v, layer, limit_bt, *args, **kwargs)

    want = oracle.expected_tokens()
    # never right by construction: it proposes only tokens that the target never emits here (a random
    # drafter proposes nearly the same token whatever its seed, which the target may emit)
    emitted = {t for row in want for t in row}
    never_right = rj.init_drafter(target.cfg, mask_token_id=511, num_layers=1, block_size=BLOCK,
                                  draft_vocab=[t for t in range(target.cfg.vocab_size) if t not in emitted])
    assert rj.generate(target, PROMPTS, NEW, drafter=never_right).tokens == want
    jax.clear_caches()
    monkeypatch.setattr(target_module, "cached_attention", off_by_one)
    try:
        broken = rj.generate(target, PROMPTS, NEW, drafter=oracle.drafter)
        assert broken.tokens != want
        random = rj.generate(target, PROMPTS, NEW, drafter=never_right)
        assert max(n for row in random.acceptance_lengths for n in row) == 1
        assert random.tokens == want  # the bug a never-right drafter cannot see
    finally:
        monkeypatch.undo()
        jax.clear_caches()


def test_what_auto_runs_on_a_gpu_is_lossless(monkeypatch):
    """``attention="auto"`` with a GPU's choices (dense decode, verify and draft calls; the prefill through
    the fresh kernel, here its XLA stand-in) gives the tokens of plain decoding with this machine's
    choices (chunked), and the calls went through those choices. The target has a size of its own, so
    that no program traced with this machine's choices is reused."""
    import dataclasses

    import retrace_jax.attention as attention_module
    from retrace_jax.models.tiny import TINY_QWEN3

    target = tiny_target(cfg=dataclasses.replace(TINY_QWEN3, num_layers=3))
    oracle = Oracle.build(target, PROMPTS, NEW, BLOCK)  # plain decoding, chunked
    real, taken = attention_module.auto_cached, []

    def on_gpu(b, t, h, s, backend=None):
        taken.append(real(b, t, h, s, backend="gpu"))
        return taken[-1]

    monkeypatch.setattr(attention_module, "auto_cached", on_gpu)
    monkeypatch.setattr(attention_module, "auto_fresh",
                        lambda dtype, d, backend=None: taken.append("fresh") or "xla")
    try:
        check(rj.generate(target, PROMPTS, NEW, drafter=oracle.drafter), oracle)
    finally:
        monkeypatch.undo()
        jax.clear_caches()  # no later test reuses a program traced with these choices
    assert {"dense", "fresh"} <= set(taken)
