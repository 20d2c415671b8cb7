"""A PyTorch DFlash drafter written from the spec (docs/dflash.md), in the official layout.

It is the tests' reference: the same module names, config fields and forward as the official
``DFlashDraftModel`` (``from_pretrained`` on a directory written by ``rj.save_drafter``), plus a plain
batch-of-one speculative loop that recomputes everything from scratch each round (no caches).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)


def _rope(x, cos, sin):  # x [B, H, T, D]; cos/sin [B, T, D]
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class RefAttention(nn.Module):
    """The official ``Qwen3DFlashAttention``: a ``"sliding_attention"`` layer gets ``config.sliding_window``
    (which transformers' Qwen3Config leaves None unless ``use_sliding_window``), applied as flash-attn's
    ``window_size=(w - 1, w - 1)`` over keys indexed by position: a query at ``p`` sees a key at ``k`` iff
    ``|p - k| < w``."""

    def __init__(self, config, layer_idx=0):
        super().__init__()
        types = getattr(config, "layer_types", None)
        self.window = config.sliding_window if types and types[layer_idx] == "sliding_attention" else None
        self.h, self.kv, self.d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.h * self.d, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.kv * self.d, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.kv * self.d, bias=bias)
        self.o_proj = nn.Linear(self.h * self.d, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.d, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.d, eps=config.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, positions):
        b, t, _ = x.shape
        s = ctx.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, t, self.h, self.d)).transpose(1, 2)
        k = torch.cat([self.k_proj(ctx), self.k_proj(x)], 1).view(b, s + t, self.kv, self.d)
        v = torch.cat([self.v_proj(ctx), self.v_proj(x)], 1).view(b, s + t, self.kv, self.d).transpose(1, 2)
        k = self.k_norm(k).transpose(1, 2)
        q, k = _rope(q, cos[:, -t:], sin[:, -t:]), _rope(k, cos, sin)
        rep = self.h // self.kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = (q @ k.transpose(-1, -2)).float() * self.d**-0.5  # not causal
        if self.window is not None:
            far = (positions[:, -t:, None] - positions[:, None, :]).abs() >= self.window  # [B, T, S + T]
            scores = scores.masked_fill(far[:, None], float("-inf"))
        probs = torch.softmax(scores, -1).to(v.dtype)
        return self.o_proj((probs @ v).transpose(1, 2).reshape(b, t, -1))


class RefLayer(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.self_attn = RefAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, positions):
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class RefDFlashDraftModel(Qwen3PreTrainedModel):
    config_class = Qwen3Config

    def __init__(self, config):
        super().__init__(config)
        self.layers = nn.ModuleList([RefLayer(config, i) for i in range(config.num_hidden_layers)])
        self.target_layer_ids = list(config.dflash_config["target_layer_ids"])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.block_size = config.block_size
        self.post_init()

    def forward(self, noise_embedding, target_hidden, position_ids):
        """``position_ids`` covers the context positions, then the block positions."""
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        h = noise_embedding
        for layer in self.layers:
            h = layer(h, ctx, cos, sin, position_ids)
        return self.norm(h)


def features(target, ids, layer_ids):
    with torch.no_grad():
        hs = target(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1] for i in layer_ids], -1)


@torch.no_grad()
def reference_spec_generate(target, drafter, prompt, max_new_tokens, block_size=None, stop_token_ids=()):
    """Greedy speculative decoding of one prompt from scratch each round; returns (tokens, acceptance)."""
    block_size = block_size or drafter.block_size
    mask_id = drafter.config.dflash_config["mask_token_id"]
    seq = list(prompt)
    seq.append(int(target(torch.tensor([seq])).logits[0, -1].argmax()))
    acceptance = []
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    while len(seq) - len(prompt) < max_new_tokens and not set(seq[len(prompt):]) & set(stop_token_ids):
        start = len(seq) - 1  # the anchor's position
        block = torch.tensor([[seq[start]] + [mask_id] * (block_size - 1)])
        positions = torch.arange(start + block_size)[None]
        hidden = drafter(embed(block), features(target, seq[:start], drafter.target_layer_ids), positions)
        proposals = head(hidden[0, 1:]).argmax(-1).tolist()
        choice = target(torch.tensor([seq + proposals])).logits[0, start:].argmax(-1).tolist()
        a = 0
        while a < len(proposals) and proposals[a] == choice[a]:
            a += 1
        seq = seq + proposals[:a] + [choice[a]]
        acceptance.append(a + 1)
    new = seq[len(prompt):][:max_new_tokens]
    for i, tok in enumerate(new):
        if tok in stop_token_ids:
            new = new[: i + 1]
            break
    return new, acceptance
