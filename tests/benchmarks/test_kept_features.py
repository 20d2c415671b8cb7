"""benchmarks/kept_features.py: its feature pass gives every sequence the features a forward pass over
that sequence alone gives, whatever batch and padding it lands in."""

import jax.numpy as jnp
import numpy as np

from benchmarks.kept_features import feature_pass
from retrace_jax.models.tiny import tiny_target
from retrace_jax.training.dflash_loss import features_fn


def test_the_feature_pass_gives_each_sequence_its_own_features():
    target = tiny_target()
    layers = (0, 2)
    rng = np.random.RandomState(0)
    seqs = [rng.randint(0, 500, (n,)).tolist() for n in (5, 40, 3, 17, 33)]
    got = feature_pass(features_fn(target, layers), seqs, batch_size=2)
    for s, f in zip(seqs, got):
        alone = target(jnp.asarray([s]), target.init_cache(1, len(s)), feature_layers=layers).features[0]
        assert f.shape == (len(s), 2 * target.cfg.hidden_size)
        np.testing.assert_allclose(f, np.asarray(alone), rtol=1e-4, atol=1e-4 * float(np.abs(alone).max()))
