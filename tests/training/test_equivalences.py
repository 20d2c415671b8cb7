"""The training step's options change how it computes, not what it learns: remat equals no remat,
accumulating n micro-batches equals one batch of n, bfloat16 compute stays close to float32, and
precomputed target features equal live ones, each after several real updates."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import retrace_jax as rj
from retrace_jax.training.dflash_loss import features_fn
from retrace_jax.training.step import StepOptions, adamw, init_opt_state, make_train_step

BLOCK = 4
SEQ = 32
PROMPT = 6
# Every response position that can start a block is an anchor, so anchors do not depend on the step's key.
ALL_ANCHORS = SEQ - BLOCK + 1 - PROMPT


@pytest.fixture(scope="module")
def target(qwen3):
    return qwen3


@pytest.fixture(scope="module")
def batch():
    rng = np.random.RandomState(0)
    tokens = jnp.asarray(rng.randint(0, 127, (4, SEQ)), jnp.int32)
    mask = jnp.asarray(np.r_[np.zeros(PROMPT), np.ones(SEQ - PROMPT)][None].repeat(4, 0), jnp.int32)
    return tokens, mask


def train(target, batch, opts: StepOptions, steps: int, *, micro=1, retrace=False, features=None):
    """Drafter parameters and losses after ``steps`` optimizer updates of ``opts``; with ``micro > 1``
    each update accumulates that many micro-batches (the batch's rows split evenly)."""
    tokens, mask = batch
    drafter = rj.init_drafter(target.cfg, mask_token_id=127, num_layers=1, block_size=BLOCK, seed=1,
                              retrace=rj.ReTraceConfig() if retrace else None)
    optimizer = adamw(1e-2, 2 * steps * micro, warmup_frac=0.0, grad_accum=micro)
    (tdef, ts), (ddef, ds) = nnx.split(target), nnx.split(drafter)
    ds = jax.tree.map(jnp.copy, ds)
    step = make_train_step(tdef, ddef, optimizer, opts, precomputed_features=features is not None)
    opt_state = init_opt_state(optimizer, ds)
    rows = tokens.shape[0] // micro
    losses = []
    for i in range(steps * micro):
        part = slice((i % micro) * rows, (i % micro + 1) * rows)
        extra = () if features is None else (features[part],)
        ds, opt_state, metrics = step(ts, ds, opt_state, tokens[part], mask[part], jnp.int32(i), jnp.uint32(0),
                                      *extra)
        losses.append(float(metrics["loss"]))
    return jax.tree.map(np.asarray, ds), losses


def flat(state):
    return np.concatenate([x.ravel() for x in jax.tree.leaves(state)])


def assert_same_training(a, b, atol):
    (state_a, losses_a), (state_b, losses_b) = a, b
    np.testing.assert_allclose(losses_a, losses_b, rtol=1e-4)
    np.testing.assert_allclose(flat(state_a), flat(state_b), atol=atol)


@pytest.mark.parametrize("objective", ["dflash", "retrace"])
def test_remat_equals_no_remat(target, batch, objective):
    opts = StepOptions(objective=objective, num_anchors=ALL_ANCHORS, rounds=2)
    retrace = objective == "retrace"
    start = train(target, batch, opts, 0, retrace=retrace)[0]
    plain = train(target, batch, opts, 4, retrace=retrace)
    remat = train(target, batch, StepOptions(objective=objective, num_anchors=ALL_ANCHORS, rounds=2, remat=True), 4,
                  retrace=retrace)
    assert np.abs(flat(plain[0]) - flat(start)).max() > 1e-3  # the updates are real
    assert_same_training(plain, remat, atol=1e-5)


def test_accumulating_micro_batches_equals_one_batch(target, batch):
    whole = train(target, batch, StepOptions(num_anchors=ALL_ANCHORS), 3)
    accumulated = train(target, batch, StepOptions(num_anchors=ALL_ANCHORS, grad_accum=2), 3, micro=2)
    # Each update's loss is the mean over its micro-batches (equal sizes, equal numbers of weighted slots).
    halves = np.asarray(accumulated[1]).reshape(3, 2).mean(axis=1)
    np.testing.assert_allclose(whole[1], halves, rtol=1e-5)
    # Summation order differs; Adam's division by the root of the second moment magnifies that on the
    # few parameters whose gradients are near zero. 1e-4 is 1% of one update (lr 1e-2).
    np.testing.assert_allclose(flat(whole[0]), flat(accumulated[0]), atol=1e-4)


def test_bfloat16_compute_stays_close_to_float32(target, batch):
    opts = StepOptions(num_anchors=ALL_ANCHORS)
    start = flat(train(target, batch, opts, 0)[0])
    full = train(target, batch, opts, 5)
    half = train(target, batch, StepOptions(num_anchors=ALL_ANCHORS, compute_dtype="bfloat16"), 5)
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(half[0]))  # float32 master weights
    np.testing.assert_allclose(full[1], half[1], rtol=2e-2)
    move_full, move_half = flat(full[0]) - start, flat(half[0]) - start
    cosine = move_full @ move_half / (np.linalg.norm(move_full) * np.linalg.norm(move_half))
    assert cosine > 0.98, cosine
    assert np.linalg.norm(move_half - move_full) < 0.2 * np.linalg.norm(move_full)


def test_precomputed_features_equal_live_features(target, batch):
    """The feature store's path: the target's features computed once and fed to the step give the
    training that computes them inside the step."""
    tokens, _ = batch
    layer_ids = rj.init_drafter(target.cfg, mask_token_id=127, num_layers=1, block_size=BLOCK).cfg.target_layer_ids
    features = features_fn(target, layer_ids)(tokens)  # as the feature store computes them: one jitted program
    opts = StepOptions(num_anchors=ALL_ANCHORS)
    assert_same_training(train(target, batch, opts, 4), train(target, batch, opts, 4, features=features), atol=1e-5)
