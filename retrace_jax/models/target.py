"""The target model: a Qwen3 / Qwen2 / Llama decoder in Flax NNX with a functional KV-cache forward.

The decoder blocks are stacked (every parameter has a leading layer axis ``L``) and run by one
``lax.scan``, so a program compiles one block whatever the depth. Shape letters: ``retrace_jax/attention/``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from retrace_jax.attention import (
    attention_beside_context,
    cached_attention,
    fresh_attention,
    fresh_kernel,
    reference_attention,
)
from retrace_jax.models.config import ModelConfig
from retrace_jax.models.kv_cache import KVCache
from retrace_jax.models.layers import DecoderBlock, RMSNorm, linear, rotary


def stack_modules(modules: Sequence[nnx.Module]) -> nnx.Module:
    """One module whose parameters stack those of ``modules`` (same structure) on a leading axis."""
    graphdef, _ = nnx.split(modules[0])
    states = [nnx.split(m)[1] for m in modules]
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


class ForwardOutput(NamedTuple):
    hidden: jax.Array  # [B, T, d] after the final norm (the LM head's input)
    cache: KVCache  # lengths advanced by T
    features: jax.Array | None  # [B, T, len(feature_layers) * d]: the chosen layers' features


class TargetModel(nnx.Module):
    """Decoder-only language model. The KV cache lives outside the module and is passed explicitly.

    ``layers`` is one :class:`~retrace_jax.models.layers.DecoderBlock` whose parameters carry a leading
    layer axis (``layers.self_attn.qkv_proj.kernel`` is ``[L, d, K, H/K + 2, D]``)."""

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
        self.layers = stack_modules([DecoderBlock(cfg.block_spec, dtype, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = linear(cfg.hidden_size, cfg.vocab_size, False, dtype, rngs)

    @property
    def dtype(self):
        return self.embed_tokens.embedding.dtype

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """An empty cache for ``max_len`` positions per row, in ``dtype`` (default: the model's)."""
        return KVCache.for_decoder(self.cfg, batch, max_len, dtype or self.dtype)

    def embed(self, tokens_bt):
        return self.embed_tokens(tokens_bt)

    def logits(self, hidden_btd):
        """LM head (tied to the embedding when the config says so). The tied head multiplies by a kept
        ``[d, V]`` copy of the embedding when it has one (:meth:`with_head_dv`), else contracts the
        embedding's ``d`` axis in place (``Embed.attend`` transposes it first, and on CPU XLA then copies
        the whole ``[V, d]`` embedding at every decode step)."""
        head_dv = getattr(self, "_head_dv", None)
        if head_dv is not None:
            return jnp.dot(hidden_btd.astype(head_dv.dtype), head_dv)
        if self.cfg.tie_word_embeddings:
            embedding = self.embed_tokens.embedding[...]
            return jnp.einsum("...d,vd->...v", hidden_btd.astype(embedding.dtype), embedding)
        return self.lm_head(hidden_btd)

    def head_weight(self):
        """The LM head's weight ``[V, d]`` (the embedding when tied)."""
        if self.cfg.tie_word_embeddings:
            return self.embed_tokens.embedding[...]
        return self.lm_head.kernel[...].T

    def layer_slices(self) -> list:
        """The stacked blocks' parameters sliced into one pytree per layer (copies, on CPU)."""
        _, params = nnx.split(self.layers)
        return [jax.tree.map(lambda a, i=i: layer_of(a, i), params) for i in range(self.cfg.num_layers)]

    def mlp_activity(self, tokens_bs, valid_bs, layer: int):
        """``[I]``: the mean absolute activation ``|silu(gate(u)) * up(u)|`` of each MLP neuron of ``layer``
        over the ``valid`` positions of ``tokens`` (:meth:`layer_statistics`' ``"mlp"``)."""
        return self.layer_statistics(tokens_bs, valid_bs, layer)["mlp"]

    def layer_statistics(self, tokens_bs, valid_bs, layer: int) -> dict:
        """Statistics of ``layer`` over the ``valid`` positions of ``tokens`` (causal attention within each
        row), e.g. to start drafter layers copied from it
        (:func:`~retrace_jax.models.drafter.init_layers_from_target`): ``"mlp"`` ``[I]`` the mean absolute
        activation ``|silu(gate(u)) * up(u)|`` of each MLP neuron; ``"q_rms"`` and ``"k_rms"`` the mean root
        mean square of a query and a key head vector as the layer's projections give them (biases included,
        before RoPE and any q/k norm)."""
        b, s = tokens_bs.shape
        if layer == 0:
            x = self.embed(tokens_bs)
        else:
            x = self(tokens_bs, self.init_cache(b, s), feature_layers=(layer - 1,), attention="chunked").features
        graphdef, params = nnx.split(self.layers)
        block = nnx.merge(graphdef, jax.tree.map(lambda a: layer_of(a, layer), params))
        positions = jnp.broadcast_to(jnp.arange(s), (b, s))
        mask = jnp.tril(jnp.ones((s, s), bool))[None] & valid_bs[:, None, :].astype(bool)

        def attend(q, k, v):
            return reference_attention(q, k, v, mask), None

        normed = block.input_layernorm(x)
        attn, _ = block.self_attn(normed, positions, attend)
        u = block.post_attention_layernorm(x + attn)
        act = jnp.abs(block.mlp.activations(u))  # [B, S, I]
        w = valid_bs.astype(jnp.float32)[:, :, None]
        count = jnp.maximum(jnp.sum(w), 1.0)
        qkv = block.self_attn.qkv_proj(normed).astype(jnp.float32)  # [B, S, K, R + 2, D]
        r = self.cfg.num_heads // self.cfg.num_kv_heads

        def head_rms(heads):  # [B, S, ..., D] -> the mean over valid positions and heads of each head's RMS
            rms = jnp.sqrt(jnp.mean(heads * heads, -1)).reshape(b, s, -1)
            return jnp.sum(rms.mean(-1, keepdims=True) * w) / count

        return {"mlp": jnp.sum(act * w.astype(act.dtype), (0, 1)) / count.astype(act.dtype),
                "q_rms": head_rms(qkv[..., :r, :]), "k_rms": head_rms(qkv[..., r, :])}

    def unroll_layers(self, slices: list | None = None) -> "TargetModel":
        """Slices the stacked blocks into separate per-layer arrays, once (call it inside a jitted program
        before its decode loop), or takes ``slices`` made earlier by :meth:`layer_slices`: later calls
        then run a Python loop over them instead of a ``lax.scan``.

        A scan slices each layer's weights out of the stacked arrays at every step, and on CPU that slice
        is a copy, which made batch-1 decoding of SmolLM2-135M (memory-bound) 1.6x slower; the unrolled
        loop avoids it at the price of per-layer arrays (views of the stacked ones' memory on one CPU
        device, else a second copy of the layer weights) and an XLA compile time that
        grows with depth (JAX traces the block once: see :meth:`run_layers`).
        ``generate(layer_loop="unrolled")`` uses it with the copies that
        :func:`~retrace_jax.decoding.layer_loop.decode_weights` keeps beside the target, so that its
        programs slice nothing (its prefill still scans: see :func:`prefill`)."""
        object.__setattr__(self, "_per_layer", self.layer_slices() if slices is None else list(slices))
        return self

    def unroll_in_place(self) -> "TargetModel":
        """Makes later calls run a Python loop over the layers that reads each layer's weights out of the
        stacked arrays where it runs (static indices, inside every step: one copy of the weights in memory,
        none made up front). Whether a compiler then reads them in place or copies each layer per step is
        its business: XLA's CPU backend copies them (so a CPU unrolls over views instead:
        :func:`~retrace_jax.decoding.layer_loop.decode_weights`); ``benchmarks/device_check.py`` counts
        the copies an accelerator's program makes."""
        object.__setattr__(self, "_per_layer", None)
        object.__setattr__(self, "_in_place", True)
        return self

    def with_head_dv(self, head_dv) -> "TargetModel":
        """Makes :meth:`logits` multiply by ``head_dv``, a ``[d, V]`` copy of the tied head (the decode
        programs' kept copy: :class:`~retrace_jax.decoding.layer_loop.DecodeWeights`); None: no change."""
        if head_dv is not None:
            object.__setattr__(self, "_head_dv", head_dv)
        return self

    def run_layers(self, x_btd, positions_bt, attend_at, carry, feature_layers: Sequence[int] = (),
                   scan_layers: bool = False):
        """Runs the stacked blocks with one ``lax.scan`` (or a Python loop after :meth:`unroll_layers`,
        unless ``scan_layers``).

        ``attend_at(layer, carry)`` returns the block's ``attend`` function for that layer (``layer`` is
        traced); its ``aux`` output is the next ``carry`` (the KV cache, or None). Returns the last
        block's output, the final carry and the features ``[B, T, n * d]`` of ``feature_layers``: the
        output of layer ``i`` (``hidden_states[i + 1]`` in transformers' terms, so the last layer's
        feature is the final-norm state, as transformers and the official DFlash code have it)."""
        num_layers = self.cfg.num_layers
        bad = [i for i in feature_layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"feature layers {bad} outside 0..{num_layers - 1}")
        kept = sorted(set(feature_layers) - {num_layers - 1})
        graphdef, params = nnx.split(self.layers)
        tables = rotary(positions_bt, self.cfg.head_dim, self.cfg.rope_theta)  # once, for every layer

        def block(x, carry, layer_params, layer):
            return nnx.merge(graphdef, layer_params)(x, tables, attend_at(layer, carry))

        per_layer = None if scan_layers else getattr(self, "_per_layer", None)
        if not scan_layers and getattr(self, "_in_place", False):  # static slices where each layer runs
            per_layer = [jax.tree.map(lambda a, i=i: a[i], params) for i in range(num_layers)]
        if per_layer is None:
            slot_of = jnp.asarray([kept.index(i) if i in kept else len(kept) for i in range(num_layers)], jnp.int32)

            def body(state, xs):
                x, carry, feats = state
                x, carry = block(x, carry, *xs)
                if feats is not None:  # the unused last slot takes the layers nobody asked for
                    feats = jax.lax.dynamic_update_index_in_dim(feats, x, slot_of[xs[1]], 0)
                return (x, carry, feats), None

            feats = jnp.zeros((len(kept) + 1,) + x_btd.shape, x_btd.dtype) if kept else None
            (x, carry, feats), _ = jax.lax.scan(body, (x_btd, carry, feats), (params, jnp.arange(num_layers)))
            outputs = {i: feats[kept.index(i)] for i in kept}
        else:  # separate arrays per layer (see unroll_layers): a Python loop, no weight slicing per call
            # Under a trace the block is one jitted function called once per layer: JAX traces and lowers
            # it once (same shapes; the layer index is an argument), and XLA inlines the calls. For
            # SmolLM2-135M's 30 layers this cut tracing plus lowering from about 2.1 to 0.8 s and XLA's compile
            # time from 10-11 to 7.2-7.4 s, with the same tokens and, within this machine's noise, the same
            # speed (docs/performance.md). The features are the chosen layers' outputs themselves (no
            # buffer updated layer by layer).
            traced = isinstance(x_btd, jax.core.Tracer)
            step = jax.jit(block) if traced else block
            x, outputs = x_btd, {}
            for i, layer_params in enumerate(per_layer):
                x, carry = step(x, carry, layer_params, jnp.int32(i) if traced else i)
                if i in kept:
                    outputs[i] = x
        hidden = self.norm(x)
        if not feature_layers:
            return hidden, carry, None
        features = [hidden if i == num_layers - 1 else outputs[i] for i in feature_layers]
        return hidden, carry, jnp.concatenate(features, -1)

    def __call__(self, tokens_bt, cache: KVCache, *, feature_layers: Sequence[int] = (),
                 attention: str = "auto", scan_layers: bool = False, fresh: bool = False) -> ForwardOutput:
        """Runs ``T`` new tokens per row at positions ``cache.lengths[b] + 0..T-1``.

        Each layer writes the new keys/values at those slots, then each query attends to the slots up to
        and including its own position: entries past a row's length are stale until overwritten here
        and are never read. ``feature_layers`` (static) selects layers whose features are returned
        concatenated; ``attention`` picks the implementation (see ``retrace_jax/attention/``);
        ``scan_layers`` runs the layers as one scan even after :meth:`unroll_layers`. ``fresh`` promises
        that the cache holds nothing yet (a prefill), so that ``attention="cudnn"`` or ``"pallas_tpu"`` can
        attend over the new tokens alone (:func:`~retrace_jax.attention.fresh_attention`)."""
        t = tokens_bt.shape[1]
        positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)  # [B, T]
        offsets = cache.lengths

        def attend_at(layer, cache):
            def attend(q, k, v):
                cache_ = cache.write(layer, k, v, offsets)
                kernel = fresh_kernel(attention, q.dtype, q.shape[-1])
                if fresh and kernel is not None:
                    return fresh_attention(q, k, v, kernel), cache_
                return cached_attention(q, cache_.k, cache_.v, layer, positions + 1, implementation=attention,
                                        first_row=cache_.first_row), cache_

            return attend

        hidden, cache, features = self.run_layers(self.embed(tokens_bt), positions, attend_at, cache, feature_layers,
                                                  scan_layers)
        return ForwardOutput(hidden, cache.replace(lengths=cache.lengths + t), features)


def abstract_target(cfg: ModelConfig, dtype=jnp.float32) -> TargetModel:
    """The structure of ``TargetModel(cfg, dtype=dtype)``: its parameters' shapes and dtypes, nothing
    allocated or initialised (a checkpoint's loader fills them).

    One decoder block is built, whatever the depth, and its parameters get the leading layer axis ``L``.
    Building all ``L`` blocks under ``nnx.eval_shape`` costs time quadratic in ``L``: every random draw
    stores the RNG count, whose sharding flax reads, and on a traced value JAX answers that with an error
    message that walks the whole trace built so far."""
    one = nnx.eval_shape(lambda: TargetModel(dataclasses.replace(cfg, num_layers=1), dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(one)
    state["layers"] = jax.tree.map(lambda x: jax.ShapeDtypeStruct((cfg.num_layers,) + x.shape[1:], x.dtype),
                                   state["layers"])
    model = nnx.merge(graphdef, state)
    model.cfg = cfg
    return model


@jax.jit
def layer_of(stacked, layer):
    """Layer ``layer`` of a stacked weight: called eagerly, one small program per weight shape whatever
    the layer; inside a jitted program, a slice."""
    return jax.lax.dynamic_index_in_dim(stacked, layer, keepdims=False)


def forward_beside_context(model: TargetModel, tokens_bt, positions_bt, ctx: KVCache, mask_bt_st,
                           feature_layers: Sequence[int] = ()):
    """Final-norm hidden states of tokens that attend to a fixed context cache (e.g. a teacher-forced
    sequence) and, as ``mask`` says, to each other; nothing is written to the cache. Training uses it to
    verify many drafted blocks of one sequence in one pass. With ``feature_layers``, returns
    ``(hidden, features)`` (see :meth:`TargetModel.run_layers`)."""

    def attend_at(layer, carry):
        def attend(q, k, v):
            ctx_k, ctx_v = (jax.lax.dynamic_index_in_dim(buf, layer, 0, keepdims=False).swapaxes(1, 2)  # [B, S, K, D]
                            for buf in (ctx.k, ctx.v))
            return attention_beside_context(q, k, v, ctx_k, ctx_v, mask_bt_st), carry

        return attend

    hidden, _, features = model.run_layers(model.embed(tokens_bt), positions_bt, attend_at, None, feature_layers)
    return (hidden, features) if feature_layers else hidden


def prefill(model: TargetModel, tokens_bp, prompt_lens_b, cache: KVCache, feature_layers=(), attention="auto"):
    """Runs right-padded prompts; returns the logits at each row's last prompt token, the cache with
    lengths set to the prompt lengths, and the features of all prompt positions (or None). The cache
    must be empty (its lengths 0), as the decode programs make it.

    The layers always run as one ``lax.scan`` here, also in an unrolled program: the prefill runs once
    per call, so slicing each layer's weights inside the scan costs one copy of the weights per call,
    which is small next to a prompt's compute, and the program compiles the prefill's layer once instead
    of once per layer (the decode steps, which run the weights once per token, stay unrolled)."""
    out = model(tokens_bp, cache, feature_layers=feature_layers, attention=attention, scan_layers=True, fresh=True)
    last_bd = jnp.take_along_axis(out.hidden, (prompt_lens_b - 1)[:, None, None], axis=1)[:, 0]
    return model.logits(last_bd), out.cache.replace(lengths=prompt_lens_b), out.features
