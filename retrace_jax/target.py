"""The target model: a Qwen3 / Qwen2 / Llama decoder in Flax NNX with a functional KV-cache forward."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from retrace_jax.config import ModelConfig
from retrace_jax.kv_cache import KVCache, write_rows
from retrace_jax.layers import MLP, RMSNorm, attention, attention_beside_context, linear, rope


class Attention(nnx.Module):
    """Causal grouped-query self-attention over a KV cache."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = linear(d, h * hd, cfg.qkv_bias, dtype, rngs)
        self.k_proj = linear(d, kv * hd, cfg.qkv_bias, dtype, rngs)
        self.v_proj = linear(d, kv * hd, cfg.qkv_bias, dtype, rngs)
        self.o_proj = linear(h * hd, d, cfg.o_bias, dtype, rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype)
        self.cfg = cfg

    def qkv(self, x_btd, positions_bt):
        """Queries, keys (both normed if the model has q/k norms, and rotated) and values."""
        cfg = self.cfg
        b, t, _ = x_btd.shape
        q = self.q_proj(x_btd).reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x_btd).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x_btd).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return rope(q, positions_bt, cfg.rope_theta), rope(k, positions_bt, cfg.rope_theta), v

    def __call__(self, x_btd, positions_bt, cache: KVCache, layer: int, mask_bts):
        """Writes this layer's new keys/values into ``cache`` and attends over it."""
        b, t, _ = x_btd.shape
        q, k, v = self.qkv(x_btd, positions_bt)
        cache = cache.replace(
            k=write_rows(cache.k, layer, k, cache.lengths), v=write_rows(cache.v, layer, v, cache.lengths)
        )
        out = attention(q, cache.k[layer], cache.v[layer], mask_bts)
        return self.o_proj(out.reshape(b, t, -1)), cache

    def beside_context(self, x_btd, positions_bt, ctx_k_bskd, ctx_v_bskd, mask_bt_st):
        """Attention of new tokens over a fixed context (not written to) followed by their own keys;
        ``mask[:, :, :S]`` covers the context, ``mask[:, :, S:]`` the new tokens."""
        b, t, _ = x_btd.shape
        q, k, v = self.qkv(x_btd, positions_bt)
        out = attention_beside_context(q, k, v, ctx_k_bskd, ctx_v_bskd, mask_bt_st)
        return self.o_proj(out.reshape(b, t, -1))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype, rngs)

    def __call__(self, x_btd, positions_bt, cache: KVCache, layer: int, mask_bts):
        attn, cache = self.self_attn(self.input_layernorm(x_btd), positions_bt, cache, layer, mask_bts)
        x_btd = x_btd + attn
        x_btd = x_btd + self.mlp(self.post_attention_layernorm(x_btd))
        return x_btd, cache

    def beside_context(self, x_btd, positions_bt, ctx_k, ctx_v, mask):
        x_btd = x_btd + self.self_attn.beside_context(self.input_layernorm(x_btd), positions_bt, ctx_k, ctx_v, mask)
        return x_btd + self.mlp(self.post_attention_layernorm(x_btd))


class ForwardOutput(NamedTuple):
    hidden: jax.Array  # [B, T, D] after the final norm (the LM head's input)
    cache: KVCache  # lengths advanced by T
    features: jax.Array | None  # [B, T, len(feature_layers) * D]: outputs of the chosen layers


class TargetModel(nnx.Module):
    """Decoder-only language model. The KV cache lives outside the module and is passed explicitly."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=dtype,
            param_dtype=dtype,
            embedding_init=nnx.initializers.normal(0.02),
            rngs=rngs,
        )
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = linear(cfg.hidden_size, cfg.vocab_size, False, dtype, rngs)

    @property
    def dtype(self):
        return self.embed_tokens.embedding.dtype

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        cfg = self.cfg
        return KVCache.zeros(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim, self.dtype)

    def embed(self, tokens_bt):
        return self.embed_tokens(tokens_bt)

    def logits(self, hidden_btd):
        """LM head (tied to the embedding when the config says so)."""
        if self.cfg.tie_word_embeddings:
            return self.embed_tokens.attend(hidden_btd)
        return self.lm_head(hidden_btd)

    def __call__(
        self, tokens_bt, cache: KVCache, *, feature_layers: Sequence[int] = ()
    ) -> ForwardOutput:
        """Runs ``T`` new tokens per row at positions ``cache.lengths[b] + 0..T-1``.

        Each query sees the cache up to and including its own position; entries past a row's length
        are stale until overwritten here, so a causal mask on absolute positions is all that is needed.
        ``feature_layers`` (static) selects layers whose outputs are returned concatenated.
        """
        t = tokens_bt.shape[1]
        positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)  # [B, T]
        mask = jnp.arange(cache.max_len)[None, None, :] <= positions[:, :, None]  # [B, T, S]
        bad = [i for i in feature_layers if not 0 <= i < len(self.layers)]
        if bad:
            raise ValueError(f"feature layers {bad} outside 0..{len(self.layers) - 1}")
        x = self.embed(tokens_bt)
        outputs = {}
        for i, layer in enumerate(self.layers):
            x, cache = layer(x, positions, cache, i, mask)
            outputs[i] = x
        features = jnp.concatenate([outputs[i] for i in feature_layers], -1) if feature_layers else None
        return ForwardOutput(self.norm(x), cache.replace(lengths=cache.lengths + t), features)


def forward_beside_context(model: TargetModel, tokens_bt, positions_bt, ctx: KVCache, mask_bt_st):
    """Final-norm hidden states of tokens that attend to a fixed context cache (e.g. a teacher-forced
    sequence) and, as ``mask`` says, to each other; nothing is written to the cache. Training uses it to
    verify many drafted blocks of one sequence in one pass."""
    x = model.embed(tokens_bt)
    for i, layer in enumerate(model.layers):
        x = layer.beside_context(x, positions_bt, ctx.k[i], ctx.v[i], mask_bt_st)
    return model.norm(x)


def prefill(model: TargetModel, tokens_bp, prompt_lens_b, cache: KVCache, feature_layers=()):
    """Runs right-padded prompts; returns the logits at each row's last prompt token, the cache with
    lengths set to the prompt lengths, and the features of all prompt positions (or None)."""
    out = model(tokens_bp, cache, feature_layers=feature_layers)
    last_bd = jnp.take_along_axis(out.hidden, (prompt_lens_b - 1)[:, None, None], axis=1)[:, 0]
    return model.logits(last_bd), out.cache.replace(lengths=prompt_lens_b), out.features
