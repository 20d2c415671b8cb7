"""benchmarks/drafter_scales.py: the statistics behind its table, on arrays whose answers are known."""

import numpy as np

from benchmarks.drafter_scales import feature_statistics, logit_spread


def test_logit_spread_grows_with_the_norm_weight():
    head = np.random.default_rng(1).standard_normal((50, 8)).astype(np.float32)
    ones = logit_spread(head, np.ones(8, np.float32))
    assert np.isclose(logit_spread(head, np.full(8, 3.0, np.float32)), 3 * ones, rtol=1e-5)
    assert logit_spread(head, np.zeros(8, np.float32)) == 0.0


def test_feature_statistics_on_known_features():
    rng = np.random.default_rng(0)
    width = 16
    spread = rng.standard_normal((400, width)).astype(np.float32)  # zero-mean, energy in every channel
    spike = np.zeros((400, width), np.float32)
    spike[:, 3] = 20.0 + rng.standard_normal(400)  # one channel with a large mean
    stats = feature_statistics(np.concatenate([spread, spike], axis=1), width)
    assert stats["layer slot 0: energy in the channel means"] < 0.05
    assert 6 / 16 - 0.15 < stats["layer slot 0: energy in its 6 largest channels"] < 6 / 16 + 0.2
    assert stats["layer slot 1: energy in its 6 largest channels"] == 1.0
    assert stats["layer slot 1: energy in the channel means"] > 0.9
    # the shared channel dominates every position's context vector: positions look alike
    alike = stats["context vectors after a random projection: mean cosine of two positions"]
    different = feature_statistics(np.concatenate([spread, spread[::-1]], axis=1), width)[
        "context vectors after a random projection: mean cosine of two positions"]
    assert alike > 0.5 and abs(different) < 0.1


def test_data_floor():
    from benchmarks.drafter_scales import data_floor

    # 1 -> 2 always, 2 -> 3 twice and 2 -> 1 once; the first position of each is a prompt token
    seqs = [(np.array([0, 1, 2, 3]), np.array([0, 1, 1, 1])), (np.array([0, 2, 3, 0]), np.array([0, 1, 1, 0])),
            (np.array([5, 2, 1]), np.array([0, 1, 1]))]
    floor = data_floor(seqs)
    assert floor["labels"] == 4  # (1,2) (2,3) (2,3) (2,1)
    assert floor["first slot right by the data's own bigram table"] == 0.75
    assert floor["most frequent token's share"] == 0.5
    assert np.isclose(floor["unigram entropy (nats)"], -(0.5 * np.log(0.5) + 2 * 0.25 * np.log(0.25)), atol=1e-3)
