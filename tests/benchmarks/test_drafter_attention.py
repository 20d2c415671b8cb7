"""benchmarks/drafter_attention.py: the readout of block attention, on probabilities whose answers are known."""

import numpy as np

from benchmarks.drafter_attention import slot_readout


def test_slot_readout_of_flat_and_pointed_attention():
    seq_len, block, anchors = 10, 4, np.array([[3, 6]])
    valid = np.array([[True, True]])
    probs = np.zeros((1, 2, 2 * block, seq_len + 2 * block))  # [B, H, A*W, S + A*W]
    for i, a in enumerate(anchors[0]):
        for slot in range(block):
            t = i * block + slot
            if slot == 1:  # all on the last context position
                probs[0, :, t, a - 1] = 1.0
            else:  # flat over what the slot sees: the context before its anchor and its own block
                probs[0, :, t, :a] = 1.0
                probs[0, :, t, seq_len + i * block: seq_len + (i + 1) * block] = 1.0
                probs[0, :, t] /= a + block
    out = slot_readout(probs, anchors, valid, seq_len, block, slots=(0, 1))
    assert out["slot 1"] == {"on p-1": 1.0, "on slot 0": 0.0, "on the context": 1.0, "entropy / max": 0.0}
    flat = out["slot 0"]
    assert np.isclose(flat["entropy / max"], 1.0, atol=1e-3)
    assert np.isclose(flat["on p-1"], np.mean([1 / 7, 1 / 10]), atol=1e-3)
    assert np.isclose(flat["on the context"], np.mean([3 / 7, 6 / 10]), atol=1e-3)
    # an anchor that is not valid does not count
    out = slot_readout(probs, anchors, np.array([[True, False]]), seq_len, block, slots=(0,))
    assert np.isclose(out["slot 0"]["on p-1"], 1 / 7, atol=1e-3)
