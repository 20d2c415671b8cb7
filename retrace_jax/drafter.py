"""The DFlash drafter: decoder layers that fill a block of mask tokens in one non-causal pass.

The target's features enter through every layer's keys and values ("KV injection"): the fused context
``hidden_norm(fc(features))`` is projected by each layer's own ``k_proj``/``v_proj`` and placed before the
block's keys. The drafter has no embedding and no LM head: the target's are passed in by the caller.
See ``docs/dflash.md``.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jax.numpy as jnp
from flax import nnx

from retrace_jax.config import ConfigError, rope_theta
from retrace_jax.kv_cache import KVCache, write_rows
from retrace_jax.layers import MLP, RMSNorm, attention_beside_context, linear, rope
from retrace_jax.retrace import Memory, ReTraceConfig, ReTraceFusion


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The official default: the middle layer for one, else evenly spread from layer 1 to L-3."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    vocab_size: int
    attention_bias: bool = False
    retrace: ReTraceConfig | None = None  # set for a ReTrace drafter

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "DrafterConfig":
        dflash = hf.get("dflash_config")
        if not isinstance(dflash, dict) or "mask_token_id" not in dflash:
            raise ConfigError("not a DFlash drafter config: dflash_config.mask_token_id is missing")
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_target_layers", "block_size", "vocab_size"):
            if key not in hf:
                raise ConfigError(f"drafter config.json lacks {key!r}")
        heads = hf["num_attention_heads"]
        layer_ids = dflash.get("target_layer_ids") or default_target_layer_ids(
            hf["num_target_layers"], hf["num_hidden_layers"]
        )
        return cls(
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rope_theta=float(rope_theta(hf)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 40960)),
            block_size=int(hf["block_size"]),
            mask_token_id=int(dflash["mask_token_id"]),
            target_layer_ids=tuple(int(i) for i in layer_ids),
            num_target_layers=int(hf["num_target_layers"]),
            vocab_size=int(hf["vocab_size"]),
            attention_bias=bool(hf.get("attention_bias", False)),
            retrace=ReTraceConfig.from_hf(hf.get("retrace_config")),
        )

    def to_hf(self) -> dict[str, Any]:
        """The official DFlash ``config.json`` fields (loadable by ``DFlashDraftModel``)."""
        hf = {
            "architectures": ["DFlashDraftModel"],
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "num_hidden_layers": self.num_layers,
            "num_target_layers": self.num_target_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "layer_types": ["full_attention"] * self.num_layers,
            "tie_word_embeddings": False,
            "vocab_size": self.vocab_size,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
        }
        if self.retrace is not None:
            hf["retrace_config"] = self.retrace.to_hf()
        return hf


class DFlashAttention(nnx.Module):
    """Block queries attend, without a causal mask, to injected context keys and the block's own keys."""

    def __init__(self, cfg: DrafterConfig, dtype, rngs: nnx.Rngs):
        d, h, kv, hd, bias = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_bias
        self.q_proj = linear(d, h * hd, bias, dtype, rngs)
        self.k_proj = linear(d, kv * hd, bias, dtype, rngs)
        self.v_proj = linear(d, kv * hd, bias, dtype, rngs)
        self.o_proj = linear(h * hd, d, bias, dtype, rngs)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype)
        self.cfg = cfg

    def keys_values(self, x_btd, positions_bt):
        """Keys (normed, rotated) and values of ``x``: context rows or block rows alike."""
        cfg = self.cfg
        b, t, _ = x_btd.shape
        k = self.k_norm(self.k_proj(x_btd).reshape(b, t, cfg.num_kv_heads, cfg.head_dim))
        v = self.v_proj(x_btd).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        return rope(k, positions_bt, cfg.rope_theta), v

    def __call__(self, x_btd, positions_bt, ctx_k_bskd, ctx_v_bskd, mask_bt_st):
        """``mask[b, t, :S]`` covers the context keys, ``mask[b, t, S:]`` the block's own keys."""
        cfg = self.cfg
        b, t, _ = x_btd.shape
        q = self.q_norm(self.q_proj(x_btd).reshape(b, t, cfg.num_heads, cfg.head_dim))
        q = rope(q, positions_bt, cfg.rope_theta)
        k_blk, v_blk = self.keys_values(x_btd, positions_bt)
        out = attention_beside_context(q, k_blk, v_blk, ctx_k_bskd, ctx_v_bskd, mask_bt_st)
        return self.o_proj(out.reshape(b, t, -1))


class DFlashLayer(nnx.Module):
    def __init__(self, cfg: DrafterConfig, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = DFlashAttention(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, False, dtype, rngs)

    def __call__(self, h_btd, positions_bt, ctx_k, ctx_v, mask):
        h_btd = h_btd + self.self_attn(self.input_layernorm(h_btd), positions_bt, ctx_k, ctx_v, mask)
        return h_btd + self.mlp(self.post_attention_layernorm(h_btd))


class DFlashDrafter(nnx.Module):
    """DFlash drafter. ``context_kv`` turns target features into per-layer keys/values; ``forward``
    drafts blocks of embedded tokens against them. With ``cfg.retrace`` it also owns the ReTrace
    fusion, applied to the block's embeddings when a memory is given."""

    def __init__(self, cfg: DrafterConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        d = cfg.hidden_size
        self.fc = linear(cfg.num_features * d, d, False, dtype, rngs)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.layers = nnx.List([DFlashLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        if cfg.retrace is not None:
            self.retrace = ReTraceFusion(cfg.retrace, d, d, dtype=dtype, rngs=rngs)

    @property
    def dtype(self):
        return self.fc.kernel.dtype

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        cfg = self.cfg
        return KVCache.zeros(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim, self.dtype)

    def context_kv(self, features_btf, positions_bt):
        """Per-layer ``(k, v)`` of the fused target features ``[B, T, n*d]`` at their positions."""
        ctx = self.hidden_norm(self.fc(features_btf.astype(self.dtype)))
        return [layer.self_attn.keys_values(ctx, positions_bt) for layer in self.layers]

    def extend_cache(self, features_btf, cache: KVCache) -> KVCache:
        """Appends the context keys/values of ``T`` positions at each row's length (lengths += T)."""
        t = features_btf.shape[1]
        positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)
        k, v = cache.k, cache.v
        for i, (k_new, v_new) in enumerate(self.context_kv(features_btf, positions)):
            k, v = write_rows(k, i, k_new, cache.lengths), write_rows(v, i, v_new, cache.lengths)
        return KVCache(k, v, cache.lengths + t)

    def forward(self, emb_btd, positions_bt, ctx_kv, mask_bt_st, remat: bool = False):
        """Final-norm hidden states (the LM head's input) of the block tokens ``[B, T, d]``.

        ``remat`` recomputes each layer's activations in the backward pass instead of storing them."""
        h = emb_btd.astype(self.dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            if remat:
                h = nnx.remat(lambda lyr, h, k, v: lyr(h, positions_bt, k, v, mask_bt_st))(layer, h, k, v)
            else:
                h = layer(h, positions_bt, k, v, mask_bt_st)
        return self.norm(h)

    def draft(self, emb_btd, cache: KVCache, memory: Memory | None = None, beta=1.0):
        """Drafts one block per row at positions ``cache.lengths[b] + 0..T-1``: every block token sees
        the row's committed context and the whole block. ``memory`` (ReTrace drafters) is fused into
        the block's embeddings first."""
        if memory is not None:
            emb_btd = self.retrace(emb_btd.astype(self.dtype), memory, beta)
        b, t, _ = emb_btd.shape
        positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)
        ctx_mask = jnp.arange(cache.max_len)[None, :] < cache.lengths[:, None]  # [B, S]
        mask = jnp.concatenate(
            [jnp.broadcast_to(ctx_mask[:, None, :], (b, t, cache.max_len)), jnp.ones((b, t, t), bool)], axis=-1
        )
        ctx_kv = [(cache.k[i], cache.v[i]) for i in range(self.cfg.num_layers)]
        return self.forward(emb_btd, positions, ctx_kv, mask)


def init_drafter(target_cfg, *, mask_token_id: int, num_layers: int = 1, block_size: int = 16,
                 target_layer_ids=None, intermediate_size=None, retrace: ReTraceConfig | None = None,
                 dtype=jnp.float32, seed: int = 0) -> DFlashDrafter:
    """A randomly initialised drafter shaped for ``target_cfg`` (a :class:`~retrace_jax.ModelConfig`):
    the target's width, heads and RoPE; features from ``target_layer_ids`` (official default if None).
    With ``retrace`` it is a ReTrace drafter whose fusion starts at zero (exactly DFlash)."""
    for name, value, low in (("num_layers", num_layers, 1), ("block_size", block_size, 2)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            raise ValueError(f"init_drafter: {name} must be an integer >= {low}, got {value!r}")
    if not isinstance(mask_token_id, numbers.Integral) or not 0 <= mask_token_id < target_cfg.vocab_size:
        raise ValueError(f"init_drafter: mask_token_id must be a token id in [0, {target_cfg.vocab_size}), "
                         f"got {mask_token_id!r}")
    cfg = DrafterConfig(
        hidden_size=target_cfg.hidden_size,
        intermediate_size=intermediate_size or target_cfg.intermediate_size,
        num_layers=num_layers,
        num_heads=target_cfg.num_heads,
        num_kv_heads=target_cfg.num_kv_heads,
        head_dim=target_cfg.head_dim,
        rope_theta=target_cfg.rope_theta,
        rms_norm_eps=target_cfg.rms_norm_eps,
        max_position_embeddings=target_cfg.max_position_embeddings,
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=tuple(target_layer_ids or default_target_layer_ids(target_cfg.num_layers, num_layers)),
        num_target_layers=target_cfg.num_layers,
        vocab_size=target_cfg.vocab_size,
        retrace=retrace,
    )
    return DFlashDrafter(cfg, dtype=dtype, rngs=nnx.Rngs(seed))
