"""Tiny random Hugging Face models saved as checkpoint directories (the tests' reference models)."""

from __future__ import annotations

import os

import torch
import transformers

VOCAB = 128

FAMILIES = {
    # GQA, head_dim (32) != hidden / heads (16), untied head.
    "qwen3": dict(cls="Qwen3", tie_word_embeddings=False, head_dim=32),
    # Biases on q/k/v, tied embeddings.
    "qwen2": dict(cls="Qwen2", tie_word_embeddings=True),
    # Neither; untied.
    "llama": dict(cls="Llama", tie_word_embeddings=False),
}


def hf_config(family: str, **overrides):
    spec = dict(FAMILIES[family])
    cls = spec.pop("cls")
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kwargs.update(spec)
    kwargs.update(overrides)
    return getattr(transformers, f"{cls}Config")(**kwargs)


def make_hf_model(family: str, seed: int = 0, **overrides):
    """A random float32 causal LM with larger-than-default weights, so its greedy outputs vary."""
    torch.manual_seed(seed)
    config = hf_config(family, **overrides)
    model = getattr(transformers, f"{FAMILIES[family]['cls']}ForCausalLM")(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.05)
    return model.eval()


def save_hf_model(model, directory: str, **kwargs) -> str:
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return directory


def save_word_tokenizer(directory: str, vocab_size: int = VOCAB) -> None:
    """A whitespace word-level tokenizer over ``w0 .. w{vocab-1}`` (no download needed)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w2", pad_token="w0").save_pretrained(directory)
