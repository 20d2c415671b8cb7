"""Top-k / top-p thresholds found among lax.top_k candidates equal those of sorting the whole vocabulary,
on the fast path and on the fallback (k above the cap, or a top-p mass that the candidates do not reach)."""

import jax.numpy as jnp
import numpy as np
import pytest

from retrace_jax.decoding import sampling
from retrace_jax.decoding.sampling import SamplingMode, filtered_logprobs


def sorted_reference(x, top_k, top_p):
    """The filters written out with a full sort (float64), keeping every token tied with the last kept one."""
    x = x.astype(np.float64)
    out = x.copy()
    if top_k:
        kth = np.sort(x)[::-1][min(top_k, x.size) - 1]
        out = np.where(x >= kth, x, -np.inf)
    if top_p < 1:
        desc = np.sort(out)[::-1]
        p = np.exp(desc - np.logaddexp.reduce(out))
        keep = (np.cumsum(p) - p) < top_p
        out = np.where(out >= desc[keep].min(), out, -np.inf)
    return out - np.logaddexp.reduce(out)


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (300, 1.0), (0, 0.5), (0, 0.999), (40, 0.9), (400, 0.99)])
@pytest.mark.parametrize("scale", [0.5, 4.0])  # flat (top-p needs many candidates) and peaked logits
def test_filters_match_full_sort(top_k, top_p, scale):
    rng = np.random.default_rng(int(scale * 10) + top_k)
    logits = (rng.standard_normal((4, 1000)) * scale).astype(np.float32)
    logits[0, :3] = logits[0, 10]  # ties at the top
    mode = SamplingMode(sample=True, top_k=top_k > 0, top_p=top_p < 1)
    got = np.asarray(filtered_logprobs(jnp.asarray(logits), jnp.float32(1.0), jnp.int32(top_k), jnp.float32(top_p),
                                       mode))
    for row in range(4):
        want = sorted_reference(logits[row], top_k, top_p)
        np.testing.assert_array_equal(np.isfinite(got[row]), np.isfinite(want))
        kept = np.isfinite(want)
        np.testing.assert_allclose(got[row][kept], want[kept], atol=1e-5)


def test_cap_is_below_the_test_vocabulary():
    """The cases above exercise both paths only while the cap is smaller than their vocabulary."""
    assert sampling.TOP_CAP < 300 < 1000


TINY_TOP_P = [1e-40, 1e-38, 1e-45, 5e-324]  # below float32's smallest normal number, or 0 once rounded to it


@pytest.mark.parametrize("top_p", TINY_TOP_P + [1e-8])
@pytest.mark.parametrize("top_k", [0, 5])
def test_a_tiny_top_p_keeps_only_the_most_likely_token(top_p, top_k):
    """top_p=1e-40 kept no token at all: float32 flushed it to 0, and every log-probability was NaN."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 1000)).astype(np.float32)
    logits[2, [7, 300]] = logits[2].max() + 1  # a tie at the top: both are kept
    mode = SamplingMode(sample=True, top_k=top_k > 0, top_p=True)
    got = np.asarray(filtered_logprobs(jnp.asarray(logits), jnp.float32(1.0), jnp.int32(top_k), jnp.float32(top_p),
                                       mode))
    for row in range(3):
        top = np.flatnonzero(logits[row] == logits[row].max())
        assert np.flatnonzero(np.isfinite(got[row])).tolist() == top.tolist()
        np.testing.assert_allclose(got[row][top], -np.log(top.size), atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_a_tiny_top_p_samples_as_greedy_decoding(dtype):
    """rj.generate(..., temperature=1.0, top_p=1e-40) returned token 0 everywhere. A tiny top_p keeps the
    tokens of the largest logit, as top_k=1 does: the same tokens for the same seed. That is greedy
    decoding wherever the largest logit is one token's; in bfloat16 the tiny target's second row meets an
    exact tie (tokens 313 and 463 at its ninth step), and both filters keep both tokens."""
    import retrace_jax as rj

    target = rj.tiny.tiny_target(dtype=dtype)
    drafter = rj.init_drafter(target.cfg, mask_token_id=511, num_layers=1, block_size=4, dtype=dtype)
    prompts = [[1, 2, 3], [4, 5]]
    greedy = rj.generate(target, prompts, 16).tokens
    top_1 = rj.generate(target, prompts, 16, temperature=1.0, top_k=1, seed=0).tokens
    assert top_1 == greedy or dtype == "bfloat16"
    assert top_1[0] == greedy[0]
    for top_p in TINY_TOP_P:
        assert rj.generate(target, prompts, 16, temperature=1.0, top_p=top_p, seed=0).tokens == top_1, top_p
    speculative = dict(drafter=drafter, temperature=1.0, seed=0)
    spec_top_1 = rj.generate(target, prompts, 16, top_k=1, **speculative).tokens
    assert spec_top_1[0] == greedy[0] and (spec_top_1 == greedy or dtype == "bfloat16")
    assert rj.generate(target, prompts, 16, top_p=1e-40, **speculative).tokens == spec_top_1
