"""The greedy choice: the two-level argmax equals ``jnp.argmax`` and the two-level top-k equals
``lax.top_k``, and non-finite logits are reported instead of becoming a token."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import retrace_jax as rj
from retrace_jax.decoding.sampling import ARGMAX_BLOCK, argmax, largest_k
from retrace_jax.models.tiny import TINY_QWEN3, tiny_target


@pytest.mark.parametrize("vocab", [7, 2 * ARGMAX_BLOCK, 4096, 1000, 3 * ARGMAX_BLOCK + 1])
def test_argmax_is_the_first_index_of_the_largest_value(vocab):
    rng = np.random.default_rng(vocab)
    rows = [rng.integers(-3, 3, size=vocab),  # many ties, some across blocks
            rng.normal(size=vocab),
            np.full(vocab, -np.inf),  # all -inf: index 0, as jnp.argmax gives
            np.where(np.arange(vocab) == vocab - 1, np.inf, rng.normal(size=vocab)),  # the last entry
            np.where(np.arange(vocab) % 2 == 1, 5.0, -5.0)]  # ties everywhere: index 1
    x = jnp.asarray(np.stack(rows).astype(np.float32))
    expected = np.asarray(jnp.argmax(x, -1))
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(x)), expected)
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(x.reshape(5, 1, vocab)))[:, 0], expected)
    assert argmax(x).dtype == jnp.int32


def test_argmax_control_a_one_level_block_choice_would_differ():
    """Control: the largest value of a later block wins over an earlier block's ties of a smaller value
    (a version that took the first block's argmax would fail the test above)."""
    x = np.zeros((1, 4 * ARGMAX_BLOCK), np.float32)
    x[0, 3 * ARGMAX_BLOCK + 5] = 1.0
    assert int(argmax(jnp.asarray(x))[0]) == 3 * ARGMAX_BLOCK + 5


@pytest.mark.parametrize("vocab", [7, 2 * ARGMAX_BLOCK, 4096, 1000, 3 * ARGMAX_BLOCK + 1])
@pytest.mark.parametrize("k", [1, 2, 8])
def test_largest_k_equals_lax_top_k(vocab, k):
    rng = np.random.default_rng(vocab + k)
    k = min(k, vocab)
    blocky = np.repeat(rng.integers(-2, 2, size=-(-vocab // ARGMAX_BLOCK)), ARGMAX_BLOCK)[:vocab]
    rows = [rng.integers(-3, 3, size=vocab),  # many ties, some across blocks
            rng.normal(size=vocab),
            blocky.astype(float),  # whole blocks tie: the lower blocks' entries first
            np.full(vocab, -np.inf),  # all -inf: the first k indices, never a pad entry
            np.where(np.arange(vocab) >= vocab - k, np.inf, rng.normal(size=vocab)),  # the last entries
            np.where(np.arange(vocab) % 2 == 1, 5.0, -5.0)]  # ties everywhere: the first odd indices
    x = jnp.asarray(np.stack(rows).astype(np.float32))
    values, ids = jax.lax.top_k(x, k)
    for shaped in (x, x.reshape(len(rows), 1, vocab)):
        got_values, got_ids = jax.jit(largest_k, static_argnums=1)(shaped, k)
        np.testing.assert_array_equal(np.asarray(got_values).reshape(values.shape), np.asarray(values))
        np.testing.assert_array_equal(np.asarray(got_ids).reshape(ids.shape), np.asarray(ids))
        assert got_ids.dtype == jnp.int32


def test_largest_k_control_the_top_entries_sit_in_one_block():
    """Control: all the top entries in one late block, behind earlier blocks' larger-than-the-rest maxima
    (a version that took one entry per block would fail)."""
    x = np.zeros((1, 16 * ARGMAX_BLOCK), np.float32)
    x[0, 10 * ARGMAX_BLOCK:10 * ARGMAX_BLOCK + 8] = np.arange(8, 0, -1)
    x[0, 5] = 0.5
    _, ids = largest_k(jnp.asarray(x), 9)
    assert np.asarray(ids)[0].tolist() == [10 * ARGMAX_BLOCK + i for i in range(8)] + [5]


@pytest.fixture(scope="module")
def broken():
    """A tiny target whose final norm makes every logit NaN, and one whose head is NaN for one token."""
    everywhere = tiny_target()
    everywhere.norm.weight.set_value(jnp.full_like(everywhere.norm.weight[...], jnp.nan))
    one_token = tiny_target()
    one_token.embed_tokens.embedding.set_value(one_token.embed_tokens.embedding[...].at[7].set(jnp.nan))
    return everywhere, one_token


@pytest.mark.parametrize("speculative", [False, True])
def test_non_finite_logits_raise_instead_of_returning_tokens(broken, speculative):
    for target in broken:
        kwargs = {}
        if speculative:
            kwargs = {"drafter": rj.init_drafter(target.cfg, mask_token_id=3, block_size=4)}
        with pytest.raises(FloatingPointError, match=r"NaN or infinite for prompt\(s\) \[0, 1\]"):
            rj.generate(target, [[5, 6, 7], [9, 10]], 6, **kwargs)


def test_non_finite_logits_are_reported_for_their_row_only():
    """A row whose logits stay finite is not blamed: the prompt that meets the NaN is named."""
    target = tiny_target(cfg=dataclasses.replace(TINY_QWEN3, tie_word_embeddings=False))
    # the NaN enters through the embedding of token 9, which only the second prompt holds (the head is
    # untied, so the other row's logits stay finite)
    target.embed_tokens.embedding.set_value(target.embed_tokens.embedding[...].at[9].set(jnp.nan))
    with pytest.raises(FloatingPointError, match=r"prompt\(s\) \[1\]"):
        rj.generate(target, [[5, 6, 7], [9, 10]], 4, layer_loop="scan")
