"""The KV caches that ``generate`` keeps between calls (retrace_jax/decoding/buffers.py): a second call of
the same sizes decodes in the first call's buffers (donated, not copied), what they hold from earlier
calls changes no token, and the pool stays bounded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import retrace_jax as rj
from retrace_jax.decoding import buffers
from retrace_jax.models.tiny import tiny_target
from tests.oracle import Oracle

PROMPTS = [[5, 9, 2, 7, 1], [3, 3, 8]]


@pytest.fixture(autouse=True)
def _empty_pool():
    rj.clear_decode_buffers()
    yield
    rj.clear_decode_buffers()


def pooled():
    """The caches in the pool, by key."""
    return dict(buffers.POOL._items)


def pointers(caches):
    return [x.unsafe_buffer_pointer() for c in caches for x in (c.k, c.v)]


@pytest.mark.parametrize("speculative", [False, True])
def test_a_second_call_decodes_in_the_first_calls_buffers(speculative):
    target = tiny_target()
    kwargs = {"drafter": rj.init_drafter(target.cfg, mask_token_id=511, num_layers=1, block_size=4)} if speculative else {}
    first = rj.generate(target, PROMPTS, 20, **kwargs)
    (key, caches), = pooled().items()
    assert len(caches) == (2 if speculative else 1)
    before = pointers(caches)
    again = rj.generate(target, [[11, 12], [4]], 17, **kwargs)  # other prompts, the same buckets
    (key_again, caches_again), = pooled().items()
    assert key_again == key
    assert all(c.k.is_deleted() for c in caches)  # donated to the second call
    assert pointers(caches_again) == before  # and written in place: the same memory came back
    assert again.tokens == rj.generate(target, [[11, 12], [4]], 17).tokens
    assert first.tokens == rj.generate(target, PROMPTS, 20).tokens


def test_stale_contents_change_no_token():
    """Caches full of large finite garbage (stale slots of an earlier call are finite) give the tokens
    and acceptance lengths of fresh caches: stale slots get exactly zero weight. The oracle drafter makes
    rounds accept 0..block tokens, so verify blocks and rejected drafts leave stale slots behind."""
    target = tiny_target()
    oracle = Oracle.build(target, PROMPTS, max_new_tokens=24, block_size=5)
    fresh = rj.generate(target, PROMPTS, 24, drafter=oracle.drafter)
    assert fresh.tokens == oracle.expected_tokens()
    plain_fresh = rj.generate(target, PROMPTS, 24)
    rng = np.random.default_rng(0)
    for key, caches in pooled().items():
        buffers.POOL.put(key, tuple(c.replace(k=jnp.asarray(rng.normal(0, 1e3, c.k.shape), c.k.dtype),
                                              v=jnp.asarray(rng.normal(0, 1e3, c.v.shape), c.v.dtype))
                                    for c in caches))
    assert len(pooled()) >= 2  # at least the two calls above (building the oracle may add one)
    out = rj.generate(target, PROMPTS, 24, drafter=oracle.drafter)
    assert out.tokens == oracle.expected_tokens()
    assert out.acceptance_lengths == oracle.expected_acceptance()
    assert rj.generate(target, PROMPTS, 24).tokens == plain_fresh.tokens


def test_the_pool_keeps_the_last_sizes_and_clears():
    target = tiny_target()
    sizes = [10, 40, 100, 200, 300]  # capacity buckets 16, 64, 128, 256, 512
    for n in sizes:
        rj.generate(target, [[1, 2]], n)
    assert len(pooled()) == buffers.KEEP == 4
    capacities = [key[0][0][2] for key in pooled()]  # the cache sizes' max_len: prompt bucket + capacity
    assert capacities == [16 + 64, 16 + 128, 16 + 256, 16 + 512]  # the most recent four, oldest first
    rj.generate(target, [[3]], 40)  # a kept size is taken and put back as the most recent
    assert [key[0][0][2] for key in pooled()] == [16 + 128, 16 + 256, 16 + 512, 16 + 64]
    rj.clear_decode_buffers()
    assert pooled() == {}
    rj.generate(target, [[1, 2]], 10)  # and decoding goes on with new buffers
    assert len(pooled()) == 1


def test_a_failed_call_keeps_no_buffers():
    """Caches of a call whose logits were not finite may hold NaN, which a zero weight does not cancel:
    they are dropped."""
    target = tiny_target()
    state = jax.tree.map(lambda x: x, target.embed_tokens.embedding[...])
    target.embed_tokens.embedding[...] = jnp.full_like(state, jnp.nan)
    with pytest.raises(FloatingPointError):
        rj.generate(target, PROMPTS, 8)
    assert pooled() == {}


def test_a_spare_of_the_wrong_shape_is_refused():
    from flax import nnx

    from retrace_jax.decoding.plain import plain_generate
    from retrace_jax.decoding.sampling import SamplingParams

    target = tiny_target()
    tdef, tstate = nnx.split(target)
    wrong = target.init_cache(2, 16 + 64, None)
    args = (np.zeros((2, 16), np.int32), np.asarray([3, 4], np.int32), np.ones((2,), bool), np.int32(8),
            np.full((8,), -1, np.int32), SamplingParams.make())
    with pytest.raises(ValueError, match="spare cache has shapes"):
        plain_generate(tdef, tstate, *args, capacity=32, spare=wrong)
