"""``generate(..., slots=N, feature_layers=...)``: the target's features kept from the generation itself.

The kept features of a prompt and its new tokens must be the features a forward pass over that whole
text gives (to float32 rounding: the generation computes them a chunk or a token at a time), at every
position, whichever slot the prompt runs in, however it refills (one row or all of them), whether it
stops early, at its first token or at ``max_new_tokens``, and when its last step falls into the next
call; and the tokens must be those of the same stream without features.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import retrace_jax as rj
from retrace_jax.models.tiny import tiny_target
from tests.helpers import count_compiles


@pytest.fixture(scope="module")
def tiny():
    return tiny_target()


def prompts_of(lengths, seed=0, vocab=500):
    rng = np.random.RandomState(seed)
    return [rng.randint(0, vocab, (n,)).tolist() for n in lengths]


def forward_features(target, texts, layers):
    """The features of one forward pass over each text: the texts right-padded into one batch (a causal
    model's features at a text's positions do not see the padding after them)."""
    width = max(len(t) for t in texts)
    batch = jnp.asarray([t + [0] * (width - len(t)) for t in texts], jnp.int32)
    out = target(batch, target.init_cache(len(texts), width), feature_layers=layers, attention="chunked")
    return [np.asarray(f[: len(t)]) for f, t in zip(out.features, texts)]


def check_features(target, prompts, out, layers):
    assert len(out.features) == len(prompts)
    texts = [p + r for p, r in zip(prompts, out.tokens)]
    for text, f, ref in zip(texts, out.features, forward_features(target, texts, layers)):
        assert f.shape == (len(text), len(layers) * target.cfg.hidden_size)
        np.testing.assert_allclose(f, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))


@pytest.mark.parametrize("slots, rounds_per_call", [pytest.param(3, 64, marks=pytest.mark.slow), (4, 2)])
def test_kept_features_are_those_of_a_forward_pass(tiny, slots, rounds_per_call):
    """Prompts of one to several prefill passes (64 tokens a pass), stop tokens that end some responses
    early, refills of one row and of all rows; with two rounds a call, prompts finish in one call and
    write their last token's features in the next."""
    layers = (0, 1, tiny.cfg.num_layers - 1)
    prompts = prompts_of([5, 17, 70, 9, 33, 3, 130, 12, 1, 64, 65])
    free = rj.generate(tiny, prompts, 9, slots=slots).tokens
    stops = [free[0][3], free[2][1], free[5][0]]  # tokens that end some responses early (one at the first)
    kwargs = dict(slots=slots, stop_token_ids=stops, rounds_per_call=rounds_per_call)
    out = rj.generate(tiny, prompts, 9, feature_layers=layers, **kwargs)
    assert out.tokens == rj.generate(tiny, prompts, 9, **kwargs).tokens
    assert min(len(r) for r in out.tokens) == 1 and max(len(r) for r in out.tokens) == 9
    check_features(tiny, prompts, out, layers)


def test_kept_features_of_prompts_that_their_first_token_ends(tiny):
    """``max_new_tokens=1``: every prompt finishes at its refill; its one new token's features come from
    the step after."""
    layers = (1,)
    prompts = prompts_of([4, 20, 7, 66, 2], seed=1)
    out = rj.generate(tiny, prompts, 1, slots=2, feature_layers=layers)
    assert all(len(r) == 1 for r in out.tokens)
    check_features(tiny, prompts, out, layers)


@pytest.mark.slow  # about 15 s; greedy streams keep features in the default run
def test_sampled_tokens_are_the_same_with_kept_features(tiny):
    prompts = prompts_of([6, 30, 11, 50, 3, 19], seed=2)
    kwargs = dict(slots=2, temperature=0.9, top_k=40, seed=3)
    out = rj.generate(tiny, prompts, 12, feature_layers=(0,), **kwargs)
    assert out.tokens == rj.generate(tiny, prompts, 12, **kwargs).tokens
    check_features(tiny, prompts, out, (0,))


def test_a_second_stream_with_kept_features_compiles_nothing(tiny):
    layers = (0, 1)
    rj.generate(tiny, prompts_of([5, 20, 9], seed=4), 10, slots=2, feature_layers=layers)
    with count_compiles() as compiled:
        out = rj.generate(tiny, prompts_of([8, 3, 22, 14, 6], seed=5), 10, slots=2, feature_layers=layers)
    assert compiled == []
    assert len(out.features) == 5
    assert rj.generate(tiny, [[1, 2, 3]], 10, slots=2).features is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(feature_layers=(0,)), "pass slots="),
    (dict(slots=2, feature_layers=()), "non-empty list"),
    (dict(slots=2, feature_layers=5), "non-empty list"),
    (dict(slots=2, feature_layers=(0, 99)), r"layer indices in \[0, "),
    (dict(slots=2, feature_layers=(-1,)), r"layer indices in \[0, "),
    (dict(slots=2, feature_layers=(True,)), r"layer indices in \[0, "),
    (dict(slots=2, feature_layers=(1, 1)), "names a layer twice"),
])
def test_bad_feature_layers_are_refused(tiny, kwargs, message):
    with pytest.raises(ValueError, match=message):
        rj.generate(tiny, [[1, 2, 3]], 4, **kwargs)


def test_kept_features_need_plain_decoding(tiny):
    drafter = rj.init_drafter(tiny.cfg, mask_token_id=0, num_layers=1, block_size=4, target_layer_ids=(0, 1))
    with pytest.raises(ValueError, match="pass no drafter"):
        rj.generate(tiny, [[1, 2, 3]], 4, slots=2, drafter=drafter, feature_layers=(0,))
