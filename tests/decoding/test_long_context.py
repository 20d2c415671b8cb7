"""A 16K-token prompt: the chunked prefill and decoding give transformers' tokens (slow: about a minute
of CPU for each side)."""

import numpy as np
import pytest
import torch

import retrace_jax as rj
from tests.helpers import make_hf_model, save_hf_model


@pytest.mark.slow
def test_16k_prompt_matches_transformers(tmp_path):
    model = make_hf_model("qwen3", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=20000,
                          attn_implementation="sdpa")
    target = rj.load_target(save_hf_model(model, str(tmp_path / "m")), dtype="float32")
    prompt = np.random.default_rng(0).integers(3, 128, 16384).tolist()
    out = rj.generate(target, [prompt], 8)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    assert out.tokens[0] == ref[0, len(prompt):].tolist()
