"""Acceptance and commit arithmetic of a verification round, as properties over any inputs."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from retrace_jax.decoding.commit import OutputBuffer, commit
from retrace_jax.decoding.verify import accepted_count, committed_tokens, target_sample_match

VOCAB = 4  # small, so that proposals often agree with the target
BATCH = 4  # rows are independent; a fixed batch keeps one compiled program per block size
jit_accepted_count, jit_committed_tokens, jit_commit = (jax.jit(f) for f in (accepted_count, committed_tokens, commit))


@st.composite
def rounds(draw):
    block = draw(st.integers(2, 6))
    batch = BATCH
    proposals = draw(st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=block - 1, max_size=block - 1),
                              min_size=batch, max_size=batch))
    choice = draw(st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=block, max_size=block),
                           min_size=batch, max_size=batch))
    return np.array(proposals, np.int32), np.array(choice, np.int32)


@settings(max_examples=300, deadline=None)
@given(rounds())
def test_accepted_count_and_committed_tokens(case):
    proposals, choice = case
    a = np.asarray(jit_accepted_count(proposals, choice))
    tokens = np.asarray(jit_committed_tokens(proposals, choice, a))
    for b in range(len(proposals)):
        want = 0
        while want < proposals.shape[1] and proposals[b, want] == choice[b, want]:
            want += 1
        assert a[b] == want
        # The committed tokens are exactly what plain greedy decoding would produce: the target's choice
        # after each accepted slot, i.e. choice[:a + 1].
        assert tokens[b, : want + 1].tolist() == choice[b, : want + 1].tolist()


@settings(max_examples=300, deadline=None)
@given(rounds(), st.integers(1, 12), st.integers(0, VOCAB), st.integers(0, 10))
def test_round_commit_with_stop_and_limit(case, max_new, stop, already):
    """After a round, a row holds its old tokens plus the round's, cut at the first stop token and at
    ``max_new``; the position advance ``a + 1`` never exceeds the block."""
    proposals, choice = case
    batch, k = proposals.shape
    already = min(already, max_new - 1)
    a = jit_accepted_count(proposals, choice)
    new = jit_committed_tokens(proposals, choice, a)
    prior = np.full((batch, 16), 9, np.int32)
    buf = OutputBuffer(jnp.asarray(prior), jnp.full((batch,), already, jnp.int32), jnp.zeros((batch,), bool))
    stops = jnp.asarray([stop if stop < VOCAB else -1], jnp.int32)
    out = jit_commit(buf, new, a + 1, jnp.int32(max_new), stops)
    a, out_tokens, out_num, out_done = (np.asarray(x) for x in (a, out.tokens, out.num, out.done))
    for b in range(batch):
        assert 1 <= int(a[b]) + 1 <= k + 1
        offered = choice[b, : int(a[b]) + 1].tolist()
        kept = []
        for tok in offered:
            if already + len(kept) == max_new:
                break
            kept.append(tok)
            if tok == stop:
                break
        assert out_tokens[b, already : int(out_num[b])].tolist() == kept
        assert bool(out_done[b]) == (stop in kept or already + len(kept) >= max_new)


def test_official_rule_with_certain_target_is_greedy_match():
    """When the target puts all its mass on one token per slot, its samples are those tokens: the official
    rule accepts and commits exactly as the greedy match does (many random rounds, one shape)."""
    import jax

    rng = np.random.RandomState(0)
    proposals = rng.randint(0, VOCAB, (256, 4)).astype(np.int32)
    choice = rng.randint(0, VOCAB, (256, 5)).astype(np.int32)
    choice[::2, :4] = np.where(rng.rand(128, 4) < 0.8, proposals[::2], choice[::2, :4])  # long matches too
    logp = jnp.where(jax.nn.one_hot(jnp.asarray(choice), VOCAB) > 0, 0.0, -jnp.inf)
    a, tokens = target_sample_match(jax.random.split(jax.random.PRNGKey(3), 256), jnp.asarray(proposals), logp)
    want = accepted_count(jnp.asarray(proposals), jnp.asarray(choice))
    assert set(np.asarray(want).tolist()) == {0, 1, 2, 3, 4}
    np.testing.assert_array_equal(np.asarray(a), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(tokens),
                                  np.asarray(committed_tokens(jnp.asarray(proposals), jnp.asarray(choice), want)))
