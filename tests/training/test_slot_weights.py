"""The DFlash loss's slot-weight rules and the constant learning-rate schedule."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import retrace_jax as rj
from retrace_jax.errors import ConfigError
from retrace_jax.training.config import load_config
from retrace_jax.training.dflash_loss import adaptive_weights, dflash_loss, sample_anchors, slot_loss
from retrace_jax.training.step import StepOptions, lr_schedule


def _case(seed=0, b=2, a=3, j=4, v=6):
    rng = np.random.RandomState(seed)
    logits = jnp.asarray(rng.randn(b, a, j, v) * 2, jnp.float32)
    labels = jnp.asarray(rng.randint(0, v, (b, a, j)), jnp.int32)
    return logits, labels


def test_reach_weights_are_the_probability_of_reaching_each_slot():
    logits, labels = _case()
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    counted = jnp.ones(labels.shape, bool).at[0, 0, 2].set(False)
    w = np.asarray(adaptive_weights(ce, counted, "reach"))
    p = np.exp(-np.asarray(ce)) * np.asarray(counted)
    np.testing.assert_allclose(w[..., 0], 1.0)
    np.testing.assert_allclose(w[..., 2], p[..., 0] * p[..., 1] * np.asarray(counted)[..., 2], rtol=1e-6)
    assert w[0, 0, 2] == 0 and w[0, 0, 3] == 0  # not counted, and unreachable past it


def test_expected_length_weights_give_the_gradient_of_log_expected_length():
    logits, labels = _case(1)
    weights = jnp.ones(labels.shape)

    def log_expected(lg):
        p = jnp.exp(-optax.softmax_cross_entropy_with_integer_labels(lg, labels))
        return jnp.sum(jnp.log(jnp.sum(jnp.cumprod(p, -1), -1)))

    def weighted(lg):
        ce = optax.softmax_cross_entropy_with_integer_labels(lg, labels)
        return jnp.sum(jax.lax.stop_gradient(adaptive_weights(ce, weights > 0, "expected_length")) * ce)

    np.testing.assert_allclose(jax.grad(weighted)(logits), -jax.grad(log_expected)(logits), rtol=1e-5, atol=1e-6)
    # slot_loss normalises by the weights' sum: the same direction
    m = slot_loss(logits, labels, weights, "expected_length")
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    w = adaptive_weights(ce, weights > 0, "expected_length")
    np.testing.assert_allclose(m.loss, jnp.sum(w * ce) / jnp.sum(w), rtol=1e-6)


def test_every_rule_trains_through_the_dflash_loss(qwen3):
    drafter = rj.init_drafter(qwen3.cfg, mask_token_id=127, num_layers=1, block_size=4, seed=0)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 120, (2, 24)), jnp.int32)
    mask = jnp.ones_like(tokens).at[:, :6].set(0)
    anchors, valid = sample_anchors(jax.random.PRNGKey(0), mask, 4, 4)
    losses = {rule: float(dflash_loss(drafter, qwen3, tokens, mask, anchors, valid, slot_weights=rule).loss)
              for rule in ("gamma", "uniform", "reach", "expected_length")}
    assert all(np.isfinite(v) for v in losses.values()) and len(set(losses.values())) == 4, losses
    with pytest.raises(ValueError, match="slot_weights must be one of"):
        dflash_loss(drafter, qwen3, tokens, mask, anchors, valid, slot_weights="focal")
    with pytest.raises(ValueError, match="serves the dflash objective only"):
        StepOptions(objective="retrace", slot_weights="reach")
    with pytest.raises(ConfigError, match="train.slot_weights: reach serves the dflash objective only"):
        load_config(None, ["train.objective=retrace", "train.slot_weights=reach"])


def test_constant_schedule_holds_the_peak_then_decays_linearly():
    f = lr_schedule(1e-3, 100, 0.02, "constant", 0.2)
    rates = np.array([float(f(i)) for i in range(101)])
    assert rates[0] == 0 and rates[2] == pytest.approx(1e-3)
    np.testing.assert_allclose(rates[2:80], 1e-3)
    assert np.all(np.diff(rates[80:]) < 0) and rates[100] == pytest.approx(0.0, abs=1e-12)
    cosine = lr_schedule(1e-3, 100, 0.02)
    assert float(cosine(50)) < 1e-3 * 0.75  # the default decays from the warm-up on
    with pytest.raises(ValueError, match="schedule must be one of"):
        lr_schedule(1e-3, 100, 0.02, "linear")


def test_expected_length_weights_do_not_vanish_when_the_first_slot_is_unlikely():
    """S_k / S_1 does not depend on p_1: a first slot far from its label (ce 80, p_1 underflows) leaves
    the later slots' weights as they are at ce 60."""
    counted = jnp.ones((1, 1, 4), bool)
    far = adaptive_weights(jnp.asarray([[[80.0, 0.1, 0.1, 0.1]]]), counted, "expected_length")
    near = adaptive_weights(jnp.asarray([[[60.0, 0.1, 0.1, 0.1]]]), counted, "expected_length")
    np.testing.assert_allclose(far, near, rtol=1e-6)
    assert float(far[0, 0, 3]) > 0.2
    first_out = counted.at[0, 0, 0].set(False)
    assert float(jnp.sum(adaptive_weights(jnp.zeros((1, 1, 4)), first_out, "expected_length"))) == 0.0
