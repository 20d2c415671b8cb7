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
