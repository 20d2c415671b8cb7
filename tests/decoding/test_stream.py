"""``generate(..., slots=N)``: a stream of prompts through N rows that refill inside the compiled loop.

Every prompt's output must be what decoding it without slots gives (greedy: alone, or in one static
batch; sampled: the static batch's, since a prompt keeps the random stream of its index), whichever slot
it lands in and whenever it starts, with refills after every position of a round.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import retrace_jax as rj
from retrace_jax.models.tiny import TINY_QWEN3, tiny_target
from tests.helpers import count_compiles


def mixed_prompts(n: int, seed: int = 0, vocab: int = 127, longest: int = 40) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    return [rng.randint(0, vocab, (rng.randint(1, longest),)).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def tiny():
    return tiny_target()


def test_a_row_view_reads_and_writes_one_row_of_the_batch(tiny):
    """A forward pass over one row of a batch's cache is the forward pass of that row alone, and leaves
    every other row of the buffers as it was (the refill's prefill relies on both)."""
    cache = tiny(jnp.asarray(mixed_prompts(3, longest=11)[0][:1] * 30, jnp.int32).reshape(3, 10),
                 tiny.init_cache(3, 64)).cache
    new = jnp.asarray([[7, 8, 9, 10, 11]], jnp.int32)
    for attention in ("chunked", "dense"):
        viewed = tiny(new, cache.row_view(1, jnp.zeros((1,), jnp.int32)), attention=attention)
        alone = tiny(new, tiny.init_cache(1, 64), attention=attention)
        np.testing.assert_array_equal(viewed.hidden, alone.hidden)
        back = viewed.cache.whole(cache.lengths)
        for buf, before, one in ((back.k, cache.k, alone.cache.k), (back.v, cache.v, alone.cache.v)):
            np.testing.assert_array_equal(buf[:, 0], before[:, 0])
            np.testing.assert_array_equal(buf[:, 2], before[:, 2])
            np.testing.assert_array_equal(buf[:, 1, :, :5], one[:, 0, :, :5])


def test_prefill_rows_fills_several_rows_each_as_alone(tiny):
    """One prefill over the whole batch for rows 0, 2 and 3 with prompts of 40 (two passes of 32), 1 and
    7 tokens, and over a one-row view for row 1 alone: each refilled row holds its prompt's keys and
    values and gives its last token's state as the prompt alone does; a row not refilled keeps its text
    and its length."""
    from retrace_jax.decoding.stream import prefill_rows

    before = tiny(jnp.asarray(mixed_prompts(1, seed=9, vocab=500, longest=2)[0][:1] * 40, jnp.int32).reshape(4, 10),
                  tiny.init_cache(4, 128)).cache
    prompts = [list(range(3, 43)), [17], list(range(50, 57))]
    tokens = np.zeros((4, 64), np.int32)
    lengths = np.ones((4,), np.int32)
    for r, p in zip((0, 2, 3), prompts):
        tokens[r, :len(p)], lengths[r] = p, len(p)
    refill = jnp.asarray([True, False, True, True])
    cache, _, last = prefill_rows(tiny, None, before, None, 0, refill, jnp.asarray(tokens), jnp.asarray(lengths), 32)
    np.testing.assert_array_equal(cache.lengths, [40, 10, 1, 7])
    np.testing.assert_array_equal(cache.k[:, 1, :, :10], before.k[:, 1, :, :10])
    np.testing.assert_array_equal(cache.v[:, 1, :, :10], before.v[:, 1, :, :10])
    np.testing.assert_array_equal(last[1], 0)
    for r, p in zip((0, 2, 3), prompts):
        alone = tiny(jnp.asarray([p], jnp.int32), tiny.init_cache(1, 64))
        np.testing.assert_allclose(last[r], alone.hidden[0, -1], rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(cache.k[:, r, :, :len(p)], alone.cache.k[:, 0, :, :len(p)], rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(cache.v[:, r, :, :len(p)], alone.cache.v[:, 0, :, :len(p)], rtol=1e-3, atol=1e-3)
    one, _, last_one = prefill_rows(tiny, None, cache, None, 1, jnp.ones((1,), bool), jnp.asarray(tokens[:1]),
                                    jnp.asarray(lengths[:1]), 32)
    np.testing.assert_array_equal(one.lengths, [40, 40, 1, 7])
    np.testing.assert_allclose(last_one[0], last[0], rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(one.k[:, 0], cache.k[:, 0])
    np.testing.assert_array_equal(one.k[:, 2:], cache.k[:, 2:])


def test_slots_refilled_together_with_prompts_of_different_lengths(tiny):
    """Several free slots refill in one pass: the 4 slots at the start (prompts of 70, 1, 33 and 5
    tokens: the longest takes two passes of 64), and 2 slots whose identical prompts stop in the same
    round (then prompts of 70 and 1 tokens take them together). Greedy and sampled: the static batch's
    tokens and stop reasons (each row of which is the prompt's own output alone: the next test)."""
    long, other = list(range(3, 73)), mixed_prompts(6, seed=10, vocab=500)
    prompts = [long, [17], list(range(60, 93)), other[0][:5], *other[1:]]
    assert rj.generate(tiny, prompts, 14, slots=4).tokens == rj.generate(tiny, prompts, 14).tokens
    pair = other[2]
    stop = rj.generate(tiny, [pair], 20).tokens[0][4]
    prompts = [pair, pair, long, [17], other[3], other[4], [5]]
    out = rj.generate(tiny, prompts, 20, slots=2, stop_token_ids=[stop])
    assert out.tokens[0] == out.tokens[1] and out.stop_reasons[0] == "stop"
    static = rj.generate(tiny, prompts, 20, stop_token_ids=[stop])
    assert (out.tokens, out.stop_reasons) == (static.tokens, static.stop_reasons)
    sampled = dict(temperature=1.0, seed=4)
    assert (rj.generate(tiny, prompts, 20, slots=2, stop_token_ids=[stop], **sampled).tokens
            == rj.generate(tiny, prompts, 20, stop_token_ids=[stop], **sampled).tokens)


def test_plain_greedy_equals_each_prompt_alone(tiny):
    """Prompts of 1 to 79 tokens (prefill passes of 64: one or two each), some stopped early by stop
    tokens, through 3 slots: each output is the prompt's own, and so are the stop reasons."""
    prompts = mixed_prompts(9, vocab=500, longest=80)
    free = rj.generate(tiny, prompts, 20).tokens
    stops = [free[0][3], free[4][9]]
    out = rj.generate(tiny, prompts, 20, slots=3, stop_token_ids=stops, rounds_per_call=7)
    alone = [rj.generate(tiny, [p], 20, stop_token_ids=stops) for p in prompts]
    assert out.tokens == [a.tokens[0] for a in alone]
    assert out.stop_reasons == [a.stop_reasons[0] for a in alone]
    assert {"stop", "length"} == set(out.stop_reasons)
    assert out.acceptance_lengths == [[1] * len(t) for t in out.tokens]


@pytest.mark.parametrize("settings", [dict(temperature=1.0, seed=5),
                                      pytest.param(dict(temperature=0.7, top_k=20, top_p=0.9, seed=1),
                                                   marks=pytest.mark.slow)])
def test_plain_sampling_keeps_each_prompts_stream_whatever_its_slot(tiny, settings):
    """Sampled tokens are those of the static batch (row i's stream is prompt i's), for every number of
    slots: a prompt draws the same samples in whichever slot and round it starts."""
    prompts = mixed_prompts(7, seed=1, vocab=500)
    static = rj.generate(tiny, prompts, 16, **settings).tokens
    for slots in (3, 8):
        assert rj.generate(tiny, prompts, 16, slots=slots, **settings).tokens == static


def test_the_same_prompt_in_any_slot_and_round_gives_the_same_output(tiny):
    """Slot independence: one prompt repeated through the stream, landing in different slots at
    different rounds beside different neighbours, greedy."""
    others = mixed_prompts(6, seed=2, vocab=500)
    prompt = [11, 12, 13, 14]
    stream = [prompt, *others[:3], prompt, others[3], prompt, *others[4:], prompt]
    out = rj.generate(tiny, stream, 24, slots=3, stop_token_ids=[rj.generate(tiny, [others[1]], 24).tokens[0][5]])
    repeated = [t for p, t in zip(stream, out.tokens) if p == prompt]
    assert len(repeated) == 4 and all(t == repeated[0] for t in repeated)
    assert repeated[0] == rj.generate(tiny, [prompt], 24).tokens[0]


def test_more_slots_than_prompts_and_one_token_outputs(tiny):
    prompts = mixed_prompts(3, seed=3, vocab=500)
    assert rj.generate(tiny, prompts, 12, slots=8).tokens == rj.generate(tiny, prompts, 12).tokens
    # max_new_tokens 1: each prompt ends in its prefill, and its slot takes the next prompt at once
    assert rj.generate(tiny, prompts * 3, 1, slots=2).tokens == rj.generate(tiny, prompts * 3, 1).tokens


def test_speculative_greedy_refills_after_every_position_of_a_round(qwen3, trained_drafter):
    """A trained drafter (block 4) accepts 0 to 3 proposals a round, so prompts stop at every position of
    their last round (inside an accepted block too); two identical prompts started together stop in the
    same round and both slots refill at once. Tokens and acceptance lengths are each prompt's alone."""
    drafter, train_prompts = trained_drafter
    prompts = [p + train_prompts[(i + 5) % 64][: i % 5] for i, p in enumerate(train_prompts[:14])]
    prompts = [prompts[0], prompts[0], *prompts[1:]]  # two rows that stop in the same round
    positions, cut_inside = set(), 0
    for new in (11, 13):
        out = rj.generate(qwen3, prompts, new, drafter=drafter, slots=3, rounds_per_call=5)
        for i, p in enumerate(prompts):
            alone = rj.generate(qwen3, [p], new, drafter=drafter)
            assert (out.tokens[i], out.acceptance_lengths[i]) == (alone.tokens[0], alone.acceptance_lengths[0])
        for tokens, rounds in zip(out.tokens, out.acceptance_lengths):
            last = len(tokens) - 1 - sum(rounds[:-1])  # tokens the last round kept
            positions.add(last)
            cut_inside += last < rounds[-1]
    assert positions == {1, 2, 3, 4} and cut_inside > 0


@pytest.mark.parametrize("settings", [dict(), dict(temperature=1.0, seed=2),
                                      pytest.param(dict(temperature=1.0, seed=2, draft_rule="sample"),
                                                   marks=pytest.mark.slow)])
def test_speculative_stream_equals_the_static_batch(qwen3, trained_drafter, settings):
    """Greedy and sampled speculative decoding through 2 and 5 slots: the static batch's tokens and
    acceptance lengths, prompt by prompt (the last prompt included), with stop tokens."""
    drafter, _ = trained_drafter
    prompts = mixed_prompts(9, seed=4, longest=20)
    static = rj.generate(qwen3, prompts, 14, drafter=drafter, stop_token_ids=[5, 9], **settings)
    for slots in (2, 5):
        out = rj.generate(qwen3, prompts, 14, drafter=drafter, stop_token_ids=[5, 9], slots=slots, **settings)
        assert (out.tokens, out.acceptance_lengths) == (static.tokens, static.acceptance_lengths)


def test_a_retrace_drafter_starts_each_prompt_with_an_empty_memory(qwen3, trained_drafter, tmp_path):
    """A ReTrace module whose fusion is on (not the zero start) changes the proposals through the memory,
    which a refilled slot must clear: the stream's rounds are those of the static batch."""
    drafter, _ = trained_drafter
    rj.save_drafter(drafter, str(tmp_path / "drafter"))
    retrace = rj.load_drafter(str(tmp_path / "drafter"), qwen3, retrace=True, seed=3)
    retrace.retrace.value.full.kernel.set_value(0.5 * jax.random.normal(jax.random.PRNGKey(0),
                                                                        retrace.retrace.value.full.kernel.shape))
    prompts = mixed_prompts(7, seed=5, longest=12)
    static = rj.generate(qwen3, prompts, 16, drafter=retrace)
    off = rj.generate(qwen3, prompts, 16, drafter=retrace, use_retrace=False)
    assert static.acceptance_lengths != off.acceptance_lengths  # the memory matters
    out = rj.generate(qwen3, prompts, 16, drafter=retrace, slots=2)
    assert (out.tokens, out.acceptance_lengths) == (static.tokens, static.acceptance_lengths)


def test_one_program_for_the_whole_stream(tiny):
    """Every call of a stream runs the program compiled once: another stream of a different number of
    prompts, lengths in the same bucket and another rounds_per_call compiles nothing."""
    rj.generate(tiny, mixed_prompts(5, seed=6, vocab=500, longest=30), 12, slots=2, rounds_per_call=4)
    calls = []
    with count_compiles() as compiled:
        out = rj.generate(tiny, mixed_prompts(11, seed=7, vocab=500, longest=30), 10, slots=2, rounds_per_call=3,
                          progress=calls.append, stop_token_ids=[1, 2, 3])
    assert compiled == []
    assert len(calls) > 3 and calls[-1].prompts_done == 11 and calls[-1].calls == len(calls)
    assert calls[-1].tokens_done == sum(map(len, out.tokens))
    assert [c.prompts_done for c in calls] == sorted(c.prompts_done for c in calls)


def test_progress_reports_each_call(tiny):
    seen = []
    out = rj.generate(tiny, mixed_prompts(6, seed=8, vocab=500), 16, slots=2, rounds_per_call=4, progress=seen.append)
    assert all(s.rounds <= 4 * s.calls for s in seen)
    assert seen[-1].prompts_total == 6 and seen[-1].prompts_done == 6
    assert seen[-1].tokens_done == sum(map(len, out.tokens)) == 6 * 16


def test_bad_stream_arguments(tiny):
    for bad in (0, -1):
        with pytest.raises(ValueError, match="slots"):
            rj.generate(tiny, [[1, 2]], 4, slots=bad)
    for bad in (2.0, True, "2"):
        with pytest.raises(TypeError, match="slots"):
            rj.generate(tiny, [[1, 2]], 4, slots=bad)
    with pytest.raises(ValueError, match="rounds_per_call"):
        rj.generate(tiny, [[1, 2]], 4, slots=2, rounds_per_call=0)
    with pytest.raises(ValueError, match="progress.*slots"):
        rj.generate(tiny, [[1, 2]], 4, progress=print)
    with pytest.raises(TypeError, match="progress"):
        rj.generate(tiny, [[1, 2]], 4, slots=2, progress="yes")


def test_non_finite_logits_name_the_prompt():
    target = tiny_target(cfg=dataclasses.replace(TINY_QWEN3, tie_word_embeddings=False))
    target.embed_tokens.embedding.set_value(target.embed_tokens.embedding[...].at[9].set(jnp.nan))
    with pytest.raises(FloatingPointError, match=r"prompt\(s\) \[3\]"):
        rj.generate(target, [[5, 6, 7], [4], [8, 8], [9, 10], [5]], 4, slots=2)
