"""The DFlash drafter: decoder layers that fill a block of mask tokens in one non-causal pass.

The target's features enter through every layer's keys and values ("KV injection"): the fused context
``hidden_norm(fc(features))`` is projected by each layer's own ``k_proj``/``v_proj`` and placed before the
block's keys. The drafter has no embedding and no LM head: the target's are passed in by the caller.
Its decoder blocks are the target's (``retrace_jax/models/layers.py``) with q/k norms and no MLP bias. See
``docs/dflash.md``; shape letters: ``retrace_jax/attention/``.
"""

from __future__ import annotations

import collections
import dataclasses
import numbers
import warnings
from typing import Annotated, Any

import jax.numpy as jnp
from flax import nnx
from pydantic import Field

from retrace_jax.attention import attention_beside_context, cached_attention
from retrace_jax.errors import ConfigError
from retrace_jax.models.config import DecoderShape, HFKeys, ModelConfig, ShapeKeys
from retrace_jax.models.draft_vocab import DraftVocab, check_ids
from retrace_jax.models.kv_cache import KVCache
from retrace_jax.models.layers import BlockSpec, DecoderBlock, RMSNorm, linear, rotary
from retrace_jax.models.retrace import Memory, ReTraceConfig, ReTraceFusion
from retrace_jax.validation import Bool, Int, NonNegativeInt, PositiveInt, config_dataclass, validated


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The official default: the middle layer for one, else evenly spread from layer 1 to L-3.

    Kept exactly, duplicates included: for a shallow target (``num_target_layers - 4`` smaller than
    ``num_draft_layers - 1``) ids repeat, e.g. ``(1, 1)`` for 4 target layers and 2 drafter layers. The
    drafter then reads the same feature twice; :class:`DrafterConfig` warns about it."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


def window_start(positions_bt, window: int):
    """The first context position that a sliding-attention query at ``positions`` sees: ``p - window + 1``.

    The rule is the official DFlash drafter's (z-lab/dflash ``dflash/model.py`` at 44947fb,
    ``Qwen3DFlashAttention``: line 209 sets ``self.sliding_window = config.sliding_window`` for a
    ``"sliding_attention"`` layer, line 250 passes it as ``sliding_window=`` to transformers' attention
    function over ``[context keys ; block keys]``, non-causal). transformers' flash-attention path turns it
    into flash-attn's ``window_size=(window - 1, window - 1)`` (``modeling_flash_attention_utils.py``,
    ``_process_flash_attention_kwargs``, 5.24), bottom-right aligned, and in ``dflash_generate`` the draft cache
    holds the context at positions ``0..anchor-1`` and the block follows at ``anchor..``, so key index is
    position. Hence: a query at position ``p`` sees a key at position ``k`` iff ``|p - k| < window``.
    Context keys lie before the anchor (``k < p``): visible iff ``k >= p - window + 1``, the last ``window``
    positions up to ``p`` as in transformers' Qwen3 sliding window. The block's own keys are within
    ``block_size - 1`` of every block query, so with ``window >= block_size`` (which :class:`DrafterConfig`
    requires) all of them stay visible. (The official code's eager and SDPA paths ignore ``sliding_window``
    since DFlash passes no mask; its flash-attention path, the one its benchmark uses, applies it.)"""
    return positions_bt - (window - 1)


BlockSize = Annotated[Int, Field(ge=2)]  # the anchor and at least one proposal
LAYER_TYPES = ("full_attention", "sliding_attention")  # the values of layer_types that are implemented
LayerIds = Annotated[tuple[NonNegativeInt, ...], Field(strict=False, min_length=1)]  # a list is taken too


class DFlashKeys(HFKeys):
    """``dflash_config`` in a drafter's ``config.json``."""

    mask_token_id: NonNegativeInt
    target_layer_ids: list[NonNegativeInt] | None = None  # None or empty: the official default


class DrafterKeys(ShapeKeys):
    """A drafter's ``config.json``: the official DFlash keys, and this project's ``retrace_config`` and
    ``draft_vocab_size``."""

    block_size: BlockSize
    num_target_layers: PositiveInt
    dflash_config: DFlashKeys
    attention_bias: Bool | None = None
    retrace_config: dict | None = None  # checked by ReTraceConfig.from_hf
    draft_vocab_size: PositiveInt | None = None
    layer_types: list[str] | None = None  # None: every layer full attention (older configs)
    sliding_window: Int | None = None  # read only when a layer is "sliding_attention" (see DrafterConfig)
    use_sliding_window: Bool | None = None  # transformers' Qwen3Config drops sliding_window unless it is true


@config_dataclass(kw_only=True)
class DrafterConfig(DecoderShape):
    """A DFlash drafter: its decoder shape (the target's width and heads) and what makes it a drafter."""

    block_size: BlockSize
    mask_token_id: NonNegativeInt
    target_layer_ids: LayerIds
    num_target_layers: PositiveInt
    attention_bias: Bool = False
    retrace: ReTraceConfig | None = None  # set for a ReTrace drafter
    draft_vocab_size: PositiveInt | None = None  # U: proposals come from U token ids (retrace_jax/models/draft_vocab.py)
    # One of LAYER_TYPES per layer (None: all "full_attention"); "sliding_attention" layers see the context
    # through a window of sliding_window positions (see window_start). sliding_window None leaves them full,
    # as the official model does when config.json's use_sliding_window is not true (from_hf).
    layer_types: Annotated[tuple[str, ...], Field(strict=False)] | None = None
    sliding_window: PositiveInt | None = None

    def __post_init__(self):
        super().__post_init__()
        problems = []
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                problems.append(f"layer_types has {len(self.layer_types)} entries for num_hidden_layers "
                                f"{self.num_layers} (one per drafter layer)")
            problems += [f"layer_types[{i}]: {kind!r} is not implemented; retrace-jax implements "
                         f"{' and '.join(map(repr, LAYER_TYPES))}"
                         for i, kind in enumerate(self.layer_types) if kind not in LAYER_TYPES]
            sliding = [i for i, kind in enumerate(self.layer_types) if kind == "sliding_attention"]
            if sliding and self.sliding_window is not None and self.sliding_window < self.block_size:
                # The official window is symmetric (|query - key| < sliding_window, see window_start): one
                # smaller than the block would hide some of the block's own keys, which the decode path shows
                # to every block query.
                problems.append(f"sliding_window: {self.sliding_window} is smaller than block_size "
                                f"{self.block_size}; a sliding window must hold a whole block")
        if self.mask_token_id >= self.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} is not a token id of vocab_size {self.vocab_size}")
        bad = [i for i in self.target_layer_ids if i >= self.num_target_layers]
        if bad:
            problems.append(f"target_layer_ids {bad} are not layers of the target (num_target_layers "
                            f"{self.num_target_layers}: 0..{self.num_target_layers - 1})")
        if self.draft_vocab_size is not None and self.draft_vocab_size > self.vocab_size:
            problems.append(f"draft_vocab_size {self.draft_vocab_size} exceeds vocab_size {self.vocab_size}")
        if problems:
            raise ConfigError("; ".join(problems))
        repeated = sorted(i for i, n in collections.Counter(self.target_layer_ids).items() if n > 1)
        if repeated:
            warnings.warn(
                f"drafter target_layer_ids {list(self.target_layer_ids)} repeat layer(s) {repeated}: the drafter "
                f"reads the same target feature more than once. The official default formula gives such ids "
                f"when the target has few layers ({self.num_target_layers} here) for {self.num_layers} drafter "
                f"layers; they are kept as given, as the official DFlash code keeps them",
                UserWarning,
                stacklevel=4,  # the code that builds the config (past pydantic's __init__ and config_dataclass's)
            )

    @property
    def block_spec(self) -> BlockSpec:
        return self.block_spec_with(qkv_bias=self.attention_bias, o_bias=self.attention_bias, mlp_bias=False,
                                    qk_norm=True)

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    def window(self, layer: int) -> int | None:
        """The sliding window of drafter layer ``layer``; None for a full-attention layer."""
        if self.layer_types is None or self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "DrafterConfig":
        if not isinstance(hf.get("dflash_config"), dict):
            raise ConfigError("not a DFlash drafter config: it has no dflash_config object")
        keys = validated(DrafterKeys, hf)
        shape = keys.shape(max_position_embeddings=40960)
        layer_ids = keys.dflash_config.target_layer_ids or default_target_layer_ids(
            keys.num_target_layers, shape["num_layers"]
        )
        types = None if keys.layer_types is None else tuple(keys.layer_types)
        # as a config without the key (to_hf writes both); tested without building a tuple of num_layers
        # entries, which a hostile num_hidden_layers would make huge
        if types is not None and len(types) == shape["num_layers"] and set(types) == {"full_attention"}:
            types = None
        sliding = types is not None and "sliding_attention" in types
        window = None
        if sliding and keys.use_sliding_window:  # else the official model (Qwen3Config) has no window: full
            if keys.sliding_window is None or keys.sliding_window < 1:
                raise ConfigError(f"sliding_window: layer_types has sliding_attention layers and "
                                  f"use_sliding_window is true, which needs a positive integer sliding_window; "
                                  f"got {keys.sliding_window!r}")
            window = keys.sliding_window
        return cls(
            **shape,
            layer_types=types,
            sliding_window=window,  # unused (and unchecked) without a sliding layer
            block_size=keys.block_size,
            mask_token_id=keys.dflash_config.mask_token_id,
            target_layer_ids=tuple(layer_ids),
            num_target_layers=keys.num_target_layers,
            attention_bias=bool(keys.attention_bias),
            retrace=ReTraceConfig.from_hf(keys.retrace_config),
            draft_vocab_size=keys.draft_vocab_size,
        )

    def to_hf(self) -> dict[str, Any]:
        """The official DFlash ``config.json`` fields (loadable by ``DFlashDraftModel``)."""
        hf = {
            "architectures": ["DFlashDraftModel"],
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            **self.shape_to_hf(),
            "num_target_layers": self.num_target_layers,
            "layer_types": list(self.layer_types or ["full_attention"] * self.num_layers),
            "tie_word_embeddings": False,
            "attention_bias": self.attention_bias,
        }
        if self.retrace is not None:
            hf["retrace_config"] = self.retrace.to_hf()
        if self.draft_vocab_size is not None:  # its ids are in draft_vocab.safetensors
            hf["draft_vocab_size"] = self.draft_vocab_size
        if self.sliding_window is not None:
            hf["use_sliding_window"] = True  # else transformers' Qwen3Config drops sliding_window
            hf["sliding_window"] = self.sliding_window
        return hf


class DFlashDrafter(nnx.Module):
    """DFlash drafter. ``context_kv`` turns target features into per-layer keys/values; ``forward``
    drafts blocks of embedded tokens against them. With ``cfg.retrace`` it also owns the ReTrace
    fusion, applied to the block's embeddings when a memory is given."""

    def __init__(self, cfg: DrafterConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        d = cfg.hidden_size
        self.fc = linear(cfg.num_features * d, d, False, dtype, rngs)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.layers = nnx.List([DecoderBlock(cfg.block_spec, dtype, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        if cfg.retrace is not None and cfg.retrace.fusion == "embedding":  # "keys" has no parameters
            self.retrace = ReTraceFusion(cfg.retrace, d, d, dtype=dtype, rngs=rngs)
        if cfg.draft_vocab_size is not None:  # ids 0..U-1 until init_drafter, with_draft_vocab or a
            # checkpoint sets them
            self.draft_vocab = DraftVocab(jnp.arange(cfg.draft_vocab_size, dtype=jnp.int32))

    @property
    def dtype(self):
        return self.fc.kernel.dtype

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        return KVCache.for_decoder(self.cfg, batch, max_len, dtype or self.dtype)

    def context_kv(self, features_btf, positions_bt):
        """Per-layer ``(k, v)`` of the fused target features ``[B, T, n*d]`` at their positions."""
        ctx = self.hidden_norm(self.fc(features_btf.astype(self.dtype)))
        tables = rotary(positions_bt, self.cfg.head_dim, self.cfg.rope_theta)  # once, for every layer
        return [layer.self_attn.keys_values(ctx, tables) for layer in self.layers]

    def extend_cache(self, features_btf, cache: KVCache) -> KVCache:
        """Appends the context keys/values of ``T`` positions at each row's length (lengths += T)."""
        t = features_btf.shape[1]
        positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)
        for i, (k_new, v_new) in enumerate(self.context_kv(features_btf, positions)):
            cache = cache.write(i, k_new, v_new, cache.lengths)
        return cache.replace(lengths=cache.lengths + t)

    def run_layers(self, emb_btd, positions_bt, attend_at, remat: bool = False):
        """Final-norm hidden states (the LM head's input) of the block tokens ``[B, T, d]``; layer ``i``
        attends through ``attend_at(i)`` (see ``layers.Attend``).

        ``remat`` recomputes each layer's activations in the backward pass instead of storing them."""
        h = emb_btd.astype(self.dtype)
        tables = rotary(positions_bt, self.cfg.head_dim, self.cfg.rope_theta)  # once, for every layer
        for i, layer in enumerate(self.layers):
            attend = attend_at(i)
            if remat:
                h = nnx.remat(lambda lyr, h: lyr(h, tables, attend)[0])(layer, h)
            else:
                h = layer(h, tables, attend)[0]
        return self.norm(h)

    def forward(self, emb_btd, positions_bt, ctx_kv, mask_bt_st, remat: bool = False, memory_kv=None,
                memory_positions_be=None):
        """Block states against explicit per-layer context ``(k, v)`` and a mask ``[B, T, S + T]``
        (``mask[:, :, :S]`` covers the context, the rest the block's own keys): training's path.

        The context keys are those of positions ``0..S-1`` (as ``sequence_context`` makes them). A
        sliding-attention layer also hides every key more than its window away from the query
        (:func:`window_start`), the block's own keys at ``positions`` included. ``memory_kv`` (ReTrace's
        "keys" fusion): per-layer ``(k, v)`` of ``E`` more keys at ``memory_positions``, after the
        block's own; the mask is then ``[B, T, S + T + E]``."""
        s = ctx_kv[0][0].shape[1]
        key_positions = [jnp.broadcast_to(jnp.arange(s, dtype=positions_bt.dtype), (positions_bt.shape[0], s)),
                         positions_bt]
        if memory_kv is not None:
            key_positions.append(memory_positions_be.astype(positions_bt.dtype))
        distance = jnp.abs(positions_bt[:, :, None] - jnp.concatenate(key_positions, 1)[:, None, :])

        def attend_at(i):
            ctx_k, ctx_v = ctx_kv[i]
            window = self.cfg.window(i)
            mask = mask_bt_st if window is None else mask_bt_st & (distance < window)

            def attend(q, k, v):
                k, v = with_memory(k, v, memory_kv, i)
                return attention_beside_context(q, k, v, ctx_k, ctx_v, mask), None

            return attend

        return self.run_layers(emb_btd, positions_bt, attend_at, remat)

    def memory_kv(self, memory: Memory, block_positions_bt):
        """ReTrace's "keys" fusion: per-layer keys and values of the memory's target features, each slot
        ``j`` at the position of the verify slot it came from, ``block_positions[:, j] - 1``, and those
        positions ``[B, W]`` (the drafter's own context projections, as for committed positions)."""
        positions = block_positions_bt - 1
        return self.context_kv(memory.mem_t, positions), positions

    def draft(self, emb_btd, cache: KVCache, memory: Memory | None = None, beta=1.0, attention: str = "auto"):
        """Drafts one block per row at positions ``cache.lengths[b] + 0..T-1``: every block token sees
        the row's committed context (the cache below its length; in a sliding-attention layer only from
        :func:`window_start` on) and the whole block. ``memory`` (ReTrace drafters) is fused into the
        block's embeddings first (fusion "embedding"), or its target features become extra keys of
        the block (fusion "keys": see :meth:`memory_kv`)."""
        keys_fusion = memory is not None and self.cfg.retrace.fusion == "keys"
        if memory is not None and not keys_fusion:
            emb_btd = self.retrace(emb_btd.astype(self.dtype), memory, beta)
        b, t, _ = emb_btd.shape
        positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)
        limit = jnp.broadcast_to(cache.lengths[:, None], (b, t))
        mem_kv = valid = None
        if keys_fusion:
            mem_kv, _ = self.memory_kv(memory, positions)
            valid = jnp.concatenate([jnp.ones((b, t), bool), memory.valid], 1)  # the block's keys, then the memory's

        def attend_at(i):
            window = self.cfg.window(i)
            start = None if window is None else window_start(positions, window)

            def attend(q, k, v):
                k, v = with_memory(k, v, mem_kv, i)
                return cached_attention(q, cache.k, cache.v, i, limit, k, v, start_bt=start, extra_valid_be=valid,
                                        implementation=attention, first_row=cache.first_row), None

            return attend

        return self.run_layers(emb_btd, positions, attend_at)


def with_memory(k_btkd, v_btkd, memory_kv, layer: int):
    """The block's keys and values, followed by the memory's of ``layer`` when there is a memory (ReTrace's
    "keys" fusion: :meth:`DFlashDrafter.memory_kv`)."""
    if memory_kv is None:
        return k_btkd, v_btkd
    mem_k, mem_v = memory_kv[layer]
    return (jnp.concatenate([k_btkd, mem_k.astype(k_btkd.dtype)], 1),
            jnp.concatenate([v_btkd, mem_v.astype(v_btkd.dtype)], 1))


def drafter_config(target_cfg, *, mask_token_id: int, num_layers: int = 1, block_size: int = 16,
                   target_layer_ids=None, intermediate_size=None, retrace: ReTraceConfig | None = None,
                   draft_vocab_size: int | None = None, attention_bias: bool = False) -> DrafterConfig:
    """The config of a new drafter for ``target_cfg`` (see :func:`init_drafter`): checked, with nothing
    allocated, so a training run can refuse a bad one before it does any work."""
    return DrafterConfig(
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
        draft_vocab_size=draft_vocab_size,
        attention_bias=attention_bias,
    )


def init_drafter(target_cfg, *, mask_token_id: int, num_layers: int = 1, block_size: int = 16,
                 target_layer_ids=None, intermediate_size=None, retrace: ReTraceConfig | None = None,
                 dtype=jnp.float32, seed: int = 0, draft_vocab=None, attention_bias: bool = False) -> DFlashDrafter:
    """A randomly initialised drafter shaped for ``target_cfg`` (a :class:`~retrace_jax.ModelConfig`):
    the target's width, heads and RoPE; features from ``target_layer_ids`` (official default if None).
    With ``retrace`` it is a ReTrace drafter whose fusion starts at zero (exactly DFlash). ``draft_vocab``
    (ascending token ids, e.g. from :func:`~retrace_jax.models.draft_vocab.frequent_tokens`) limits its
    proposals to those tokens; None: the whole vocabulary. ``attention_bias``: biases on the attention
    projections (q, k, v and o, as the official layout's ``attention_bias`` means), e.g. to keep those of a
    Qwen2 target's layers copied by :func:`init_layers_from_target`."""
    for name, value, low in (("num_layers", num_layers, 1), ("block_size", block_size, 2)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            raise ValueError(f"init_drafter: {name} must be an integer >= {low}, got {value!r}")
    if not isinstance(mask_token_id, numbers.Integral) or not 0 <= mask_token_id < target_cfg.vocab_size:
        raise ValueError(f"init_drafter: mask_token_id must be a token id in [0, {target_cfg.vocab_size}), "
                         f"got {mask_token_id!r}")
    ids = None if draft_vocab is None else check_ids(draft_vocab, target_cfg.vocab_size, "init_drafter: draft_vocab")
    cfg = drafter_config(target_cfg, mask_token_id=mask_token_id, num_layers=num_layers, block_size=block_size,
                         target_layer_ids=target_layer_ids, intermediate_size=intermediate_size, retrace=retrace,
                         draft_vocab_size=None if ids is None else len(ids), attention_bias=bool(attention_bias))
    drafter = DFlashDrafter(cfg, dtype=dtype, rngs=nnx.Rngs(seed))
    if ids is not None:
        drafter.draft_vocab.set_value(jnp.asarray(ids))
    return drafter


def with_draft_vocab(drafter: DFlashDrafter, ids) -> DFlashDrafter:
    """A copy of the drafter (sharing its weights) that proposes only from ``ids`` (ascending token ids);
    ``ids=None``: over the whole vocabulary."""
    graphdef, state = nnx.split(drafter)
    new = nnx.merge(graphdef, state)
    if ids is None:
        if hasattr(new, "draft_vocab"):
            del new.draft_vocab
        new.cfg = dataclasses.replace(drafter.cfg, draft_vocab_size=None)
        return new
    ids = check_ids(ids, drafter.cfg.vocab_size, "with_draft_vocab: ids")
    new.cfg = dataclasses.replace(drafter.cfg, draft_vocab_size=len(ids))
    new.draft_vocab = DraftVocab(jnp.asarray(ids))
    return new


def init_layers_from_target(drafter: DFlashDrafter, target, layer_ids, neurons=None, qk_scales=None) -> DFlashDrafter:
    """A copy of the drafter whose decoder layer ``i`` starts from target layer ``layer_ids[i]``: every
    weight the two blocks share (attention projections, MLP, norms) is copied. What only the drafter
    has keeps its value: the q/k norms when the target has none (Llama, Qwen2), the feature projection
    ``fc`` and the norms around it; target biases the drafter lacks are left out. A drafter with a
    narrower MLP (``intermediate_size``) takes the target MLP's first ``intermediate_size`` neurons (their
    rows of the gate and up projections, their columns of the down projection), or with ``neurons`` (one
    ``[I_target]`` score per drafter layer, e.g. :meth:`TargetModel.mlp_activity`) the highest-scoring
    ones, in their order in the target. ``qk_scales`` (one ``(q, k)`` pair per drafter layer, e.g.
    :meth:`TargetModel.layer_statistics`' ``q_rms`` and ``k_rms``) start the q/k norms that a target
    without them lacks at those values instead of ones, so that the normed queries and keys have the
    scale of the target layer's own (RMSNorm gives each head vector an RMS of 1 times its weight: at ones
    the attention logits are a fraction of the target's, and attention much flatter)."""
    ids = [int(i) for i in layer_ids]
    if len(ids) != drafter.cfg.num_layers:
        raise ValueError(f"init_layers_from_target: {len(ids)} layer ids for a drafter of {drafter.cfg.num_layers} "
                         f"layers")
    slices = target.layer_slices()
    bad = [i for i in ids if not 0 <= i < len(slices)]
    if bad:
        raise ValueError(f"init_layers_from_target: layers {bad} are not among the target's 0..{len(slices) - 1}")
    if neurons is not None and len(neurons) != len(ids):
        raise ValueError(f"init_layers_from_target: {len(neurons)} neuron scores for {len(ids)} layers")
    if qk_scales is not None:
        if len(qk_scales) != len(ids):
            raise ValueError(f"init_layers_from_target: {len(qk_scales)} q/k scales for {len(ids)} layers")
        if any(tuple(path[:2]) == ("self_attn", "q_norm") for path, _ in nnx.to_flat_state(slices[ids[0]])):
            raise ValueError("init_layers_from_target: the target's layers have q/k norms of their own, which are "
                             "copied; q/k scales serve targets without them")
    drafter = nnx.clone(drafter)  # its own variables: the caller's drafter stays as it was
    flat = dict(nnx.to_flat_state(nnx.state(drafter)))
    width = drafter.cfg.intermediate_size
    for i, layer in enumerate(ids):
        keep = None  # the target neurons a narrower MLP keeps: the first ones, or the highest-scoring
        if neurons is not None:
            score = jnp.asarray(neurons[i])
            if score.shape != (target.cfg.intermediate_size,):
                raise ValueError(f"init_layers_from_target: neuron scores of shape {score.shape} for an MLP of "
                                 f"{target.cfg.intermediate_size}")
            keep = jnp.sort(jnp.argsort(-score, stable=True)[:width])
        for path, var in nnx.to_flat_state(slices[layer]):
            mine = flat.get(("layers", i) + tuple(path))
            if mine is None:
                continue
            value = var.get_value()
            want = mine.get_value().shape
            narrower = path[0] == "mlp" and len(want) == value.ndim and all(w <= v for w, v in zip(want, value.shape))
            if value.shape != want and narrower and keep is not None:  # the chosen neurons of a wider MLP
                axis = next(a for a, (w, v) in enumerate(zip(want, value.shape)) if w != v)
                value = jnp.take(value, keep, axis=axis)
            elif value.shape != want and narrower:  # the first neurons of a wider MLP
                value = value[tuple(slice(0, w) for w in want)]
            if value.shape != want:
                raise ValueError(f"init_layers_from_target: target layer {layer} {'.'.join(map(str, path))} has "
                                 f"shape {value.shape}, the drafter's {mine.get_value().shape}")
            mine.set_value(jnp.asarray(value, mine.get_value().dtype))
        if qk_scales is not None:
            attn = drafter.layers[i].self_attn
            for norm, scale in ((attn.q_norm, qk_scales[i][0]), (attn.k_norm, qk_scales[i][1])):
                norm.weight.set_value(jnp.full_like(norm.weight.get_value(), scale))
    return drafter


INIT_FC = ("random", "mean")


def init_around_layers(drafter: DFlashDrafter, target, final_norm: bool = False, fc: str = "random") -> DFlashDrafter:
    """A copy of the drafter whose parts around its layers start from the target: with ``final_norm`` the
    final norm is the target's (whose LM head the drafter's output feeds); with ``fc="mean"`` the feature
    projection starts as the mean of the target layers' features (one identity block per layer, each
    divided by their number), so the context the drafter reads starts as a residual stream of the
    target's instead of a random mixture. ``fc="random"`` keeps the projection as it is."""
    if fc not in INIT_FC:
        raise ValueError(f"fc must be one of {INIT_FC}, got {fc!r}")
    drafter = nnx.clone(drafter)
    if final_norm:
        # a copy: training donates the drafter's buffers, which must not be the target's
        drafter.norm.weight.set_value(jnp.array(target.norm.weight.get_value(), drafter.norm.weight.get_value().dtype,
                                                copy=True))
    if fc == "mean":
        d, n = drafter.cfg.hidden_size, drafter.cfg.num_features
        kernel = jnp.concatenate([jnp.eye(d)] * n, axis=0) / n  # [n*d, d], stored [in, out]
        drafter.fc.kernel.set_value(kernel.astype(drafter.fc.kernel.get_value().dtype))
    return drafter


def check_drafter_matches(cfg: DrafterConfig, target_cfg: ModelConfig) -> None:
    """Raises ``ConfigError`` listing every way a drafter does not fit a target."""
    problems = []
    if cfg.hidden_size != target_cfg.hidden_size:
        problems.append(f"hidden_size {cfg.hidden_size} != target hidden_size {target_cfg.hidden_size}")
    if cfg.num_target_layers != target_cfg.num_layers:
        problems.append(f"num_target_layers {cfg.num_target_layers} != target num_hidden_layers "
                        f"{target_cfg.num_layers}")
    if cfg.vocab_size != target_cfg.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} != target vocab_size {target_cfg.vocab_size}")
    if not 0 <= cfg.mask_token_id < target_cfg.vocab_size:
        problems.append(f"mask_token_id {cfg.mask_token_id} outside the target vocabulary [0, {target_cfg.vocab_size})")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target_cfg.num_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} outside the target's layers 0..{target_cfg.num_layers - 1}")
    if problems:
        raise ConfigError("drafter does not match the target: " + "; ".join(problems))
