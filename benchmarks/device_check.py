"""The accelerator check: ``rj.generate`` end to end (plain and speculative), decode speed against the
memory roofline, round cost, prefill, compile times, kernel parity and plain against speculative tokens,
on Qwen3-4B- and Qwen3-8B-shaped random weights with the published 5-layer, block-16 drafter; and the
variants of issue 57 side by side, a row each: the layer loops (a scan, the unrolled loop over one copy of
the weights, the unrolled loop over a second, per-layer copy) under XLA's default options and the option
sets of ``VARIANT_OPTIONS``, each with the weight-sized instructions its decode step runs
(``weight_copies``: a layer's weights copied per step) and the bytes it keeps beside the target; and the
projection products joined (q/k/v, gate/up: one product each, the layout of the parameters) against
separate; and the attention rows: decode attention alone over a stacked cache of the presets' shape at 1K,
8K and 32K contexts (decode at batch 1 and 8, a 16-query verify pass at batch 1) and whole plain decode
steps at 8K and 32K, through ``"dense"`` (what ``"auto"`` runs on a GPU) and the decode kernels
(``"pallas_gpu"``, ``"split_gpu"``). Run through ``scripts/device_check.sh``, which writes
``device_check.json`` and ``device_check.md``.

    python benchmarks/device_check.py --out-dir results/        # on a GPU or TPU (bf16)
    python benchmarks/device_check.py --smoke --out-dir /tmp/x   # any machine: tiny shapes, a few minutes

Random weights time the work as well as real ones (it does not depend on the values). The speedup it
implies for a τ (tokens per round) is ``τ * plain_step / round``; the break-even τ is ``round / plain_step``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import retrace_jax as rj  # noqa: E402
from benchmarks.hlo import layer_weight_elements, weight_copies  # noqa: E402
from benchmarks.report import median_ms_from  # noqa: E402
from retrace_jax.attention import (  # noqa: E402
    PALLAS_GPU_MAX_T,
    auto_cached,
    cached_attention,
    fresh_attention,
    reference_attention,
)
from retrace_jax.attention.kernels import interpreting, pallas_interpret  # noqa: E402
from retrace_jax.decoding.layer_loop import decode_weights, merge_target  # noqa: E402
from retrace_jax.decoding.plain import plain_init, plain_step  # noqa: E402
from retrace_jax.decoding.programs import compile_seconds  # noqa: E402
from retrace_jax.decoding.sampling import SamplingParams  # noqa: E402
from retrace_jax.decoding.speculative import SpeculativeStepper  # noqa: E402
from retrace_jax.models.target import prefill  # noqa: E402
from retrace_jax.models.tiny import TINY_QWEN3, tiny_target  # noqa: E402

QWEN3_COMMON = dict(num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, vocab_size=151936,
                    rope_theta=1000000.0, max_position_embeddings=40960)
PRESETS = {  # config, drafter layers, block size
    "qwen3-4b": (dataclasses.replace(TINY_QWEN3, hidden_size=2560, intermediate_size=9728, **QWEN3_COMMON), 5, 16),
    "qwen3-8b": (dataclasses.replace(TINY_QWEN3, hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False,
                                     **QWEN3_COMMON), 5, 16),
    "smoke": (dataclasses.replace(TINY_QWEN3, max_position_embeddings=8192), 1, 8),
}
HBM_GB_S = {"H200": 4800, "H100": 3350, "A100": 2039, "L4": 300, "TPU v5 lite": 819, "TPU v5": 2765, "TPU v4": 1200,
            "TPU v6 lite": 1640}
PUBLISHED_TAU = 6.5  # DFlash-b16 on Qwen3 (greedy), the paper's headline acceptance length


def block(x):
    return jax.block_until_ready(x)


def compile_s(fn) -> float:
    """Seconds JAX spends tracing, lowering and compiling in ``fn()`` (as JAX times those stages)."""
    with compile_seconds() as stages:
        block(fn())
    return sum(stages.values())


def bandwidth(device) -> float | None:
    kind = getattr(device, "device_kind", "")
    for name, gbs in sorted(HBM_GB_S.items(), key=lambda kv: -len(kv[0])):
        if name.lower() in kind.lower():
            return gbs
    return None


def weight_bytes(module) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


def plain_step_program(tdef, tstate, batch, context, steps, attention="auto", layer_loop="scan",
                       compiler_options=None, per_layer_copies=False):
    """The jitted ``plain_init`` and ``plain_step`` (donating its carry) of ``batch`` rows of ``context``
    tokens with room for ``steps`` steps, and what they take besides the target's state: ``(init, step,
    kept, tokens)``, called as ``init(tstate, kept, tokens)`` and ``step(tstate, kept, consts, carry)``.
    ``layer_loop="unrolled"`` runs the layers unrolled as ``generate`` does (off a single CPU device: static
    slices of the stacked weights; ``per_layer_copies``: over a second, per-layer copy of them instead);
    ``compiler_options`` go to the step's ``jax.jit``."""
    kept = decode_weights(nnx.merge(tdef, tstate), layer_loop, tstate, per_layer_copies=per_layer_copies)
    sampling = SamplingParams.make()
    stops = jnp.full((8,), -1, jnp.int32)
    tokens = jnp.ones((batch, context), jnp.int32)
    lens, live = jnp.full((batch,), context, jnp.int32), jnp.ones((batch,), bool)
    # cache slots (context + capacity) a multiple of 64, so that "pallas_gpu" runs its kernel rather than
    # falling back to chunked (its blocks tile the slots) also at the smoke run's small sizes
    capacity = -(-(context + 4 * steps + 64) // 64) * 64 - context
    init = jax.jit(lambda s, kept, t: plain_init(merge_target(tdef, s, layer_loop, kept), t, lens, live, 10**6, stops,
                                                 sampling, capacity=capacity, attention=attention))
    step = jax.jit(lambda s, kept, consts, c: plain_step(merge_target(tdef, s, layer_loop, kept), consts, c),
                   donate_argnums=3, compiler_options=compiler_options)
    return init, step, kept, tokens


def plain_step_ms(tdef, tstate, batch, context, steps, attention="auto", layer_loop="scan"):
    """Milliseconds per plain decode step at ``batch`` rows of ``context`` tokens, and the compile time
    (:func:`plain_step_program`)."""
    init, step, kept, tokens = plain_step_program(tdef, tstate, batch, context, steps, attention, layer_loop)
    c_init = compile_s(lambda: init(tstate, kept, tokens))
    consts, carry = init(tstate, kept, tokens)
    with compile_seconds() as stages:  # the first call compiles the step
        ms = median_ms_from(lambda c: step(tstate, kept, consts, c), carry, steps)
    return ms, c_init + sum(stages.values())


# XLA option sets compared side by side in variant_rows (as ``benchmarks/step_profile.py --options`` takes
# them): a GPU's cuBLAS products reading a (dynamic-)slice of a stacked weight in place instead of a copy of
# it; CUDA graphs off (one launch per kernel), and CUDA graphs that also take while loops and conditionals
# (with the library calls), against XLA's default; XLA's dot merger off (it concatenates products that
# share an operand, e.g. gate and up weights, at every step); the products through cuBLAS instead of
# Triton.
VARIANT_OPTIONS = {"gpu": ("xla_gpu_enable_dynamic_slice_fusion=true", "xla_gpu_enable_command_buffer=",
                           "xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE",
                           "xla_gpu_dot_merger_threshold_mb=0", "xla_gpu_enable_triton_gemm=false")}
LOOP_VARIANTS = (("scan", "scan", False), ("unrolled, one copy", "unrolled", False),
                 ("unrolled, per-layer copies", "unrolled", True))


def variant_rows(name, target, context, steps, gbs, budget_left):
    """A plain decode step (batch 1, ``context`` tokens) per layer loop of :data:`LOOP_VARIANTS` and XLA
    option set (``VARIANT_OPTIONS`` of the backend; the defaults first), with the weight-sized
    instructions its loop runs per step (``weight_copies``, from the compiled HLO) and the bytes kept
    beside the target (``kept_bytes``); then the projection products joined against separate
    (:func:`projection_rows`). ``budget_left()``: seconds left; what does not fit is skipped."""
    from benchmarks.step_profile import parse_options

    rows = []
    tdef, tstate = nnx.split(target)
    sizes = layer_weight_elements(target)
    wbytes = weight_bytes(target)
    roof_ms = None if gbs is None else 1e3 * wbytes / (gbs * 1e9)
    option_sets = ("",) + VARIANT_OPTIONS.get(jax.default_backend(), ())
    for options in option_sets:
        for label, loop, copies in LOOP_VARIANTS:
            what = f"plain decode step ({label})"
            if budget_left() < 0:
                rows.append({"model": name, "what": what, "options": options or "default", "skipped": "time"})
                continue
            try:
                init, step, kept, tokens = plain_step_program(tdef, tstate, 1, context, steps, "auto", loop,
                                                              parse_options(options) or None, copies)
                c_init = compile_s(lambda init=init, kept=kept, tokens=tokens: init(tstate, kept, tokens))
                consts, carry = init(tstate, kept, tokens)
                start = time.perf_counter()
                hlo = step.lower(tstate, kept, consts, carry).compile().as_text()
                c_step = time.perf_counter() - start
                ms = median_ms_from(lambda c, step=step, kept=kept, consts=consts: step(tstate, kept, consts, c),
                                    carry, steps)
            except Exception as e:  # noqa: BLE001  (an option a backend refuses is a result to report)
                rows.append({"model": name, "what": what, "options": options or "default", "error": failure(e)})
                continue
            rows.append({"model": name, "what": what, "options": options or "default", "batch": 1,
                         "context": context, "ms": round(ms, 3), "tokens_per_s": round(1e3 / ms, 1),
                         "of_roofline": None if roof_ms is None else round(roof_ms / ms, 2),
                         "weight_copies": len(weight_copies(hlo, sizes, whole_program=True)),
                         "kept_bytes": kept_bytes(kept, tstate),
                         "compile_s": round(c_init + c_step, 1)})
    if budget_left() > 0:
        rows += projection_rows(name, target, steps)
    return rows


def kept_bytes(kept, state) -> int:
    """Bytes of the arrays in ``kept`` (``decode_weights``) that are not views of the target's own arrays
    (``state``): the memory that a layer loop adds beside the weights."""
    def span(x):
        try:
            return x.unsafe_buffer_pointer(), x.nbytes
        except Exception:  # noqa: BLE001  (a sharded array: no single buffer, counted whole)
            return None

    own = [s for s in map(span, jax.tree.leaves(state)) if s is not None]
    total = 0
    for x in jax.tree.leaves(kept):
        where = span(x)
        if where is None or not any(a <= where[0] < a + n for a, n in own):
            total += x.nbytes
    return total


def projection_rows(name, target, steps):
    """The decoder's projection products alone, batch 1, every layer unrolled over static slices of
    stacked weights, in a loop of ``steps`` steps: q/k/v and gate/up joined (one product each, the
    parameters' layout) against the same weights as five separate products (the layout before issue
    57; the separate weights made here, for this measurement only). Milliseconds per step."""
    cfg = target.cfg
    layers = nnx.state(target.layers)
    qkv = layers["self_attn"]["qkv_proj"]["kernel"].get_value()  # [L, d, K, R + 2, D]
    gate_up = layers["mlp"]["gate_up_proj"]["kernel"].get_value()  # [L, d, 2, I]
    d = cfg.hidden_size
    joined = (qkv.reshape(cfg.num_layers, d, -1), gate_up.reshape(cfg.num_layers, d, -1))
    r = cfg.num_heads // cfg.num_kv_heads
    separate = tuple(jax.block_until_ready(x) for x in (
        qkv[:, :, :, :r].reshape(cfg.num_layers, d, -1), qkv[:, :, :, r].reshape(cfg.num_layers, d, -1),
        qkv[:, :, :, r + 1].reshape(cfg.num_layers, d, -1), gate_up[:, :, 0], gate_up[:, :, 1]))

    @jax.jit
    def run(weights, x):
        def body(_, x):
            y = x
            for layer in range(cfg.num_layers):
                outs = [jnp.dot(y, w[layer]) for w in weights]
                y = y + sum(jnp.sum(o, -1, keepdims=True).astype(y.dtype) for o in outs) * 1e-3  # each layer needs the last
            return y
        return jax.lax.fori_loop(0, 8, body, x)

    x = jnp.ones((1, d), target.dtype)
    rows = []
    for label, weights in (("joined", joined), ("separate", separate)):
        c = compile_s(lambda weights=weights: run(weights, x))
        ms = median_ms_from(lambda _, weights=weights: run(weights, x), (), steps) / 8
        rows.append({"model": name, "what": f"projection products ({label})", "batch": 1, "ms": round(ms, 3),
                     "compile_s": round(c, 1)})
    rows[-1]["vs_joined"] = round(rows[-1]["ms"] / rows[0]["ms"], 2)
    del separate
    return rows


def decode_rows(name, target, drafter, block_size, batches, context, steps, dtype, gbs):
    rows = []
    tdef, tstate = nnx.split(target)
    sampling = SamplingParams.make()
    stops = jnp.full((8,), -1, jnp.int32)
    wbytes = weight_bytes(target)
    for batch in batches:
        ms, compile_time = plain_step_ms(tdef, tstate, batch, context, steps)
        roof_ms = None if gbs is None else 1e3 * wbytes / (gbs * 1e9)
        rows.append({"model": name, "what": "plain decode step", "batch": batch, "context": context,
                     "ms": round(ms, 3), "tokens_per_s": round(1e3 * batch / ms, 1),
                     "roofline_ms": None if roof_ms is None else round(roof_ms, 3),
                     "of_roofline": None if roof_ms is None else round(roof_ms / ms, 2),
                     "compile_s": round(compile_time, 1)})
    plain_ms = rows[0]["ms"]
    # verify pass and full round at batch 1
    ids = drafter.cfg.target_layer_ids
    cache = target.init_cache(1, context + 2 * block_size, dtype).replace(lengths=jnp.full((1,), context, jnp.int32))
    verify = jax.jit(lambda s, c, b, attention="auto": nnx.merge(tdef, s)(b, c, feature_layers=ids,
                                                                         attention=attention).hidden,
                     static_argnames="attention")
    blk = jnp.ones((1, block_size), jnp.int32)
    c_verify = compile_s(lambda: verify(tstate, cache, blk))
    verify_ms = median_ms_from(lambda _: verify(tstate, cache, blk), (), steps)
    stepper = SpeculativeStepper(target, drafter, capacity=4 * steps + 64, block_size=block_size)
    tokens = jnp.ones((1, context), jnp.int32)
    c_round = compile_s(lambda: stepper.init(tokens, jnp.full((1,), context, jnp.int32), jnp.ones((1,), bool),
                                             10**6, stops, sampling).buf.num)
    first = stepper.carry

    def one_round(state):
        stepper.carry = state
        return stepper.step().accepted_b

    with compile_seconds() as stages:  # the first call compiles the round
        round_ms = median_ms_from(one_round, first, steps)
    c_round += sum(stages.values())
    rows.append({"model": name, "what": f"verify pass ({block_size} tokens)", "batch": 1, "context": context,
                 "ms": round(verify_ms, 3), "vs_plain_step": round(verify_ms / plain_ms, 2),
                 "compile_s": round(c_verify, 1)})
    rows.append({"model": name, "what": "speculative round", "batch": 1, "context": context, "ms": round(round_ms, 3),
                 "vs_plain_step": round(round_ms / plain_ms, 2), "compile_s": round(c_round, 1),
                 "break_even_tau": round(round_ms / plain_ms, 2),
                 f"speedup_at_tau_{PUBLISHED_TAU}": round(PUBLISHED_TAU * plain_ms / round_ms, 2)})
    ms, compile_time = plain_step_ms(tdef, tstate, 1, context, steps, layer_loop="unrolled")
    rows.append({"model": name, "what": "plain decode step (unrolled layers)", "batch": 1, "context": context,
                 "ms": round(ms, 3), "tokens_per_s": round(1e3 / ms, 1), "vs_auto": round(ms / plain_ms, 2),
                 "compile_s": round(compile_time, 1)})
    for attention in decode_alternatives():  # other decode paths against the default ("auto") rows above
        for row in [r for r in rows if r["what"] == "plain decode step" and r["batch"] in (1, 8)]:
            what = f"plain decode step ({attention})"
            try:
                ms, compile_time = plain_step_ms(tdef, tstate, row["batch"], context, steps, attention)
            except Exception as e:  # noqa: BLE001  (a kernel that fails here is a result to report)
                rows.append({"model": name, "what": what, "batch": row["batch"], "error": failure(e)})
                continue
            rows.append({"model": name, "what": what, "batch": row["batch"], "context": context, "ms": round(ms, 3),
                         "tokens_per_s": round(1e3 * row["batch"] / ms, 1), "vs_auto": round(ms / row["ms"], 2),
                         "compile_s": round(compile_time, 1)})
        what = f"verify pass ({block_size} tokens, {attention})"
        try:
            c_kernel = compile_s(lambda attention=attention: verify(tstate, cache, blk, attention))
            ms = median_ms_from(lambda _, attention=attention: verify(tstate, cache, blk, attention), (), steps)
        except Exception as e:  # noqa: BLE001
            rows.append({"model": name, "what": what, "batch": 1, "error": failure(e)})
            continue
        rows.append({"model": name, "what": what, "batch": 1, "context": context, "ms": round(ms, 3),
                     "vs_auto": round(ms / verify_ms, 2), "compile_s": round(c_kernel, 1)})
    return rows


def failure(e: Exception) -> str:
    """One line naming an exception, for a table cell (a kernel that fails on a device is a result)."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def kernels(kind: str = "prefill") -> tuple[str, ...]:
    """The attention implementations to time here, the chunked JAX path first. Prefill: cuDNN's flash
    attention on NVIDIA GPUs, Pallas splash attention on TPUs. Decode: the Pallas GPU decode kernels on
    GPUs (JAX's, ``"pallas_gpu"``, and this library's in-place flash-decoding kernel, ``"split_gpu"``)."""
    decode = ("pallas_gpu", "split_gpu")
    if interpreting():  # --pallas-interpret: the Pallas kernels, interpreted, anywhere
        return ("chunked",) + {"prefill": ("pallas_tpu",), "decode": decode}[kind]
    chosen = {("prefill", "gpu"): ("cudnn",), ("prefill", "tpu"): ("pallas_tpu",),
              ("decode", "gpu"): decode}.get((kind, jax.default_backend()), ())
    return ("chunked",) + chosen


def decode_alternatives() -> tuple[str, ...]:
    """The decode paths timed against ``"auto"``: the chunked walk where ``"auto"`` is not it (a GPU), then
    the decode kernels."""
    walk = ("chunked",) if auto_cached(1, 1, 1, 1) != "chunked" else ()
    return walk + kernels("decode")[1:]


def attention_implementations() -> tuple[str, ...]:
    """The implementations of the attention rows: dense (``"auto"``'s decode path on a GPU) and the decode
    kernels; the chunked walk besides, where no kernel runs (a CPU without ``--pallas-interpret``)."""
    alternatives = kernels("decode")[1:]
    return ("dense",) + (alternatives or ("chunked",))


def attention_rows(name, cfg, contexts, steps, dtype, gbs, budget_left):
    """Decode attention alone at each context of ``contexts`` (the text's length; the cache holds a few
    more slots, a multiple of 64): one jitted call that runs ``cached_attention`` for every layer of a
    stacked ``[L, B, K, S, D]`` cache of ``cfg``'s shape in a ``lax.scan`` (the layer index traced, as the
    scanned layer loop passes it), for decode (1 query per row, batch 1 and 8) and a verify pass (16
    queries with causal limits, batch 1), per implementation of :func:`attention_implementations`:
    milliseconds per call (the attention share of a step), the filled cache's bytes read per second and
    the time against dense. ``budget_left()``: seconds left; what does not fit is skipped."""
    rows = []
    layers, kv, d, h = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
    for context in contexts:
        slots = -(-(context + 64) // 64) * 64
        for what, batch, t in (("decode attention", 1, 1), ("decode attention", 8, 1), ("verify attention", 1, 16)):
            base = {"model": f"{name} attention", "what": what, "batch": batch, "context": context}
            if budget_left() < 0:
                rows.append({**base, "skipped": "time"})
                continue
            keys = jnp.full((layers, batch, kv, slots, d), 0.01, dtype)  # the values do not change the time
            q = jnp.full((batch, t, h, d), 0.01, dtype)
            limit = jnp.broadcast_to(context - t + 1 + jnp.arange(t, dtype=jnp.int32), (batch, t))
            read_gb = 2 * layers * batch * kv * context * d * jnp.dtype(dtype).itemsize / 1e9
            dense_ms = None
            for attention in attention_implementations():
                def all_layers(q, k, v, lim, attention=attention):
                    def one(x, layer):
                        return x + cached_attention(q, k, v, layer, lim, implementation=attention), None
                    return jax.lax.scan(one, jnp.zeros(q.shape, q.dtype), jnp.arange(layers))[0]

                args = (q, keys, keys, limit)
                fn = jax.jit(all_layers)
                try:
                    c = compile_s(lambda fn=fn, args=args: fn(*args))
                    ms = median_ms_from(lambda _, fn=fn, args=args: fn(*args), (), steps)
                except Exception as e:  # noqa: BLE001  (a kernel that fails here is a result to report)
                    rows.append({**base, "attention": attention, "error": failure(e)})
                    continue
                dense_ms = ms if attention == "dense" else dense_ms
                rows.append({**base, "attention": attention, "layers": layers, "ms": round(ms, 3),
                             "cache_gb_s": round(read_gb / (ms / 1e3), 1),
                             "of_bandwidth": None if gbs is None else round(read_gb / (ms / 1e3) / gbs, 2),
                             "vs_dense": None if dense_ms is None else round(ms / dense_ms, 2),
                             "compile_s": round(c, 1)})
    return rows


def model_step_rows(name, target, contexts, steps, budget_left):
    """A whole plain decode step (batch 1) per implementation of :func:`attention_implementations` at each
    context of ``contexts`` (:func:`decode_rows` times the first attention context already)."""
    rows = []
    tdef, tstate = nnx.split(target)
    for context in contexts:
        for attention in attention_implementations():
            base = {"model": name, "what": f"plain decode step ({attention})", "batch": 1, "context": context}
            if budget_left() < 0:
                rows.append({**base, "skipped": "time"})
                continue
            try:
                ms, compile_time = plain_step_ms(tdef, tstate, 1, context, steps, attention)
            except Exception as e:  # noqa: BLE001  (a kernel that fails here is a result to report)
                rows.append({**base, "error": failure(e)})
                continue
            rows.append({**base, "ms": round(ms, 3), "tokens_per_s": round(1e3 / ms, 1),
                         "compile_s": round(compile_time, 1)})
    return rows


def generate_rows(name, target, drafter, context, new_tokens, repeats):
    """``rj.generate`` as users call it (one program; every choice ``"auto"``), plain and speculative, batch
    1: milliseconds per new token, the median of ``repeats`` calls after a compiling one. The drafter's
    weights are random, so nearly every round commits one token: the speculative row is what a round
    costs against a plain step."""
    prompt = [[(7 * i) % min(1000, target.cfg.vocab_size - 1) + 1 for i in range(context)]]
    rows, outputs = [], {}
    for kind, d in (("plain", None), ("speculative", drafter)):
        def run(_, kind=kind, d=d):
            outputs[kind] = rj.generate(target, prompt, new_tokens, drafter=d)
            return outputs[kind].tokens

        with compile_seconds() as stages:  # the first call compiles the program
            ms = median_ms_from(run, (), repeats) / new_tokens
        c = sum(stages.values())
        rounds = sum(len(a) for a in outputs[kind].acceptance_lengths) or new_tokens
        rows.append({"model": name, "what": f"generate ({kind}), {new_tokens} new tokens", "batch": 1,
                     "context": context, "ms": round(ms, 3), "tokens_per_s": round(1e3 / ms, 1),
                     "ms_per_round": round(ms * new_tokens / rounds, 3), "compile_s": round(c, 1)})
    rows[-1]["vs_plain_step"] = round(rows[-1]["ms_per_round"] / rows[0]["ms"], 2)
    rows[-1]["same_tokens"] = outputs["speculative"].tokens == outputs["plain"].tokens
    return rows


def lossless_rows(name, cfg, block_size, new_tokens):
    """Greedy speculative decoding against plain decoding, token for token, on a 4-layer model of the
    preset's shape with random weights, through ``"auto"`` and ``"chunked"``: in float32 at JAX's default
    matmul precision, in float32 at ``"highest"`` (through ``"auto"`` only), and in bfloat16. Only full
    float32 products must agree on every path: a GPU's default float32 matmul is TF32, and it, like
    bfloat16, rounds a verify pass of ``block_size`` rows and one-row steps differently, which decides
    near-ties of the logits apart. At ``"highest"``, ``"split_gpu"`` too where its kernel runs (a GPU, or
    ``--pallas-interpret``)."""
    cfg = dataclasses.replace(cfg, num_layers=4)
    prompt = [[(7 * i) % 1000 + 1 for i in range(64)], [(11 * i) % 997 + 3 for i in range(40)]]
    rows = []
    for dtype, precision in ((jnp.float32, None), (jnp.float32, "highest"), (jnp.bfloat16, None)):
        target = tiny_target(cfg=cfg, dtype=dtype)
        drafter = rj.init_drafter(cfg, mask_token_id=cfg.vocab_size - 1, num_layers=1, block_size=block_size,
                                  dtype=dtype)
        # "highest": the default path, and the in-place decode kernel where it runs (its float32 products
        # are full there)
        split = ("split_gpu",) if "split_gpu" in kernels("decode") else ()
        for attention in ("auto",) + split if precision else ("auto", "chunked"):
            base = {"model": f"{name}, 4 layers", "what": f"lossless ({attention})", "dtype": jnp.dtype(dtype).name,
                    "precision": precision or "default", "batch": 2}
            try:
                with jax.default_matmul_precision(precision):
                    plain = rj.generate(target, prompt, new_tokens, attention=attention).tokens
                    spec = rj.generate(target, prompt, new_tokens, drafter=drafter, attention=attention).tokens
            except Exception as e:  # noqa: BLE001  (a kernel that fails here is a result to report)
                if attention in ("auto", "chunked"):
                    raise
                rows.append({**base, "error": failure(e)})
                continue
            pairs = zip(plain[0] + plain[1], spec[0] + spec[1])
            first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
            rows.append({**base, "same_tokens": plain == spec, "first_difference": first})
    return rows


def prefill_rows(name, target, lengths, repeats):
    rows = []
    tdef, tstate = nnx.split(target)
    for length in lengths:
        for attention in kernels("prefill"):
            fn = jax.jit(lambda s, t, attention=attention: prefill(
                nnx.merge(tdef, s), t, jnp.full((1,), length, jnp.int32), nnx.merge(tdef, s).init_cache(1, length),
                attention=attention)[0])
            tokens = jnp.ones((1, length), jnp.int32)
            try:
                c = compile_s(lambda: fn(tstate, tokens))
                ms = median_ms_from(lambda _: fn(tstate, tokens), (), repeats)
            except Exception as e:  # noqa: BLE001  (a kernel that fails here is a result to report)
                rows.append({"model": name, "what": f"prefill ({attention})", "batch": 1, "context": length,
                             "error": failure(e)})
                continue
            rows.append({"model": name, "what": f"prefill ({attention})", "batch": 1, "context": length,
                         "ms": round(ms, 1), "tokens_per_s": round(1e3 * length / ms), "compile_s": round(c, 1)})
    return rows


def parity_rows(dtype):
    """The default attention path and the kernels against the dense reference, on this device, in
    ``dtype``: a decode step, a verify-like block (each query one slot further) and a prefill."""
    rows = []
    rng = np.random.default_rng(0)
    for t, s, limit in ((1, 4096, 3000), (16, 4096, 1500), (512, 2048, None)):
        k = jnp.asarray(rng.standard_normal((1, 2, 8, s, 128)), dtype)  # a one-layer cache [L, B, K, S, D]
        v = jnp.asarray(rng.standard_normal((1, 2, 8, s, 128)), dtype)
        q = jnp.asarray(rng.standard_normal((2, t, 32, 128)), dtype)
        lim = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + (limit or 1), (2, t))
        mask = jnp.arange(s)[None, None, :] < lim[:, :, None]
        k_bskd, v_bskd = (x[0].swapaxes(1, 2).astype(jnp.float32) for x in (k, v))
        want = reference_attention(q.astype(jnp.float32), k_bskd, v_bskd, mask)
        for attention in ("auto",) + (kernels("decode")[1:] if t <= PALLAS_GPU_MAX_T else ()):
            try:
                got = jax.jit(lambda q, k, v, lim, attention=attention: cached_attention(
                    q, k, v, 0, lim, implementation=attention))(q, k, v, lim)
                err = f"{float(jnp.max(jnp.abs(got.astype(jnp.float32) - want))):.2e}"
            except Exception as e:  # noqa: BLE001  (a kernel that fails here is a result to report)
                err = failure(e)
            rows.append({"model": "attention", "what": f"{attention} vs reference, {t} queries, {s} slots",
                         "dtype": jnp.dtype(dtype).name, "max_abs_err": err})
    for attention in kernels("prefill")[1:]:  # the prefill kernels against the reference with a causal mask
        t = 2048
        q = jnp.asarray(rng.standard_normal((2, t, 32, 128)), dtype)
        k = jnp.asarray(rng.standard_normal((2, t, 8, 128)), dtype)
        v = jnp.asarray(rng.standard_normal((2, t, 8, 128)), dtype)
        causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (2, t, t))
        want = reference_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), causal)
        try:
            got = jax.jit(lambda q, k, v, attention=attention: fresh_attention(q, k, v, attention))(q, k, v)
            err = f"{float(jnp.max(jnp.abs(got.astype(jnp.float32) - want))):.2e}"
        except Exception as e:  # noqa: BLE001
            err = failure(e)
        rows.append({"model": "attention", "what": f"{attention} prefill vs reference, {t} queries", "dtype":
                     jnp.dtype(dtype).name, "max_abs_err": err})
    return rows


def markdown(rows, header) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = [header, "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join("" if r.get(k) is None else str(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on any device (minutes on a CPU)")
    p.add_argument("--presets", default="qwen3-4b,qwen3-8b")
    p.add_argument("--out-dir", default=".")
    p.add_argument("--pallas-interpret", action="store_true",
                   help="add the Pallas kernels' rows in Pallas' interpret mode on any backend (slow; checks this "
                        "script's kernel rows on a CPU before a device runs them)")
    p.add_argument("--budget-s", type=float, default=420, help="skip what is left after this many seconds")
    p.add_argument("--batches", default=None, help="plain decode batch sizes (default 1,8,32; smoke: 1,4)")
    p.add_argument("--prefill-lengths", default=None, help="prompt lengths of the prefill rows (default "
                   "8192,32768; smoke: 512,2048)")
    p.add_argument("--lossless-only", action="store_true", help="only the lossless rows (plain against "
                   "speculative tokens in float32, at the default and the highest matmul precision, and "
                   "bfloat16) of each preset")
    p.add_argument("--skip-variants", action="store_true", help="leave out the layer-loop, XLA-option and "
                   "projection variants (variant_rows; they run last, in the time left)")
    p.add_argument("--only-variants", action="store_true", help="only the variants, for every preset")
    p.add_argument("--skip-attention", action="store_true", help="leave out the attention rows (attention_rows; "
                   "they run after the variants, in the time left)")
    p.add_argument("--only-attention", action="store_true", help="only the attention rows: decode attention "
                   "alone per implementation at each attention context, then a plain decode step per "
                   "implementation at the longer contexts, for every preset")
    p.add_argument("--attention-contexts", default=None, help="contexts of the attention rows (default "
                   "1024,8192,32768; smoke: 64,256)")
    p.add_argument("--generate-contexts", default=None, help="prompt lengths of the rj.generate rows (default "
                   "1024,8192; smoke: 64,256)")
    args = p.parse_args()
    stack = contextlib.ExitStack()  # held until main returns
    if args.pallas_interpret:
        stack.enter_context(pallas_interpret())
    start = time.perf_counter()
    device = jax.devices()[0]
    dtype = jnp.float32 if args.smoke or device.platform == "cpu" else jnp.bfloat16
    presets = ["smoke"] if args.smoke else args.presets.split(",")
    batches, context, steps, new_tokens = ((1, 4), 64, 5, 24) if args.smoke else ((1, 8, 32), 1024, 20, 128)
    lengths = (512, 2048) if args.smoke else (8192, 32768)
    batches = batches if args.batches is None else tuple(int(x) for x in args.batches.split(","))
    generate_contexts = (context, 256) if args.smoke else (context, 8192)
    if args.generate_contexts is not None:
        generate_contexts = tuple(int(x) for x in args.generate_contexts.split(","))
    lengths = lengths if args.prefill_lengths is None else tuple(int(x) for x in args.prefill_lengths.split(","))
    attention_contexts = (context, 256) if args.smoke else (context, 8192, 32768)
    if args.attention_contexts is not None:
        attention_contexts = tuple(int(x) for x in args.attention_contexts.split(","))
    gbs = bandwidth(device)
    rows, skipped = [], []

    def write(final=False):  # after every stage, so that a check stopped by its time limit keeps its rows
        header = (f"Device check on {device.device_kind} ({device.platform}), {jnp.dtype(dtype).name}, jax "
                  f"{jax.__version__}; HBM {gbs or 'unknown'} GB/s; {time.perf_counter() - start:.0f} s"
                  + (f"; skipped (time budget): {', '.join(skipped)}" if skipped else "")
                  + ("" if final else "; unfinished"))
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "device_check.json"), "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=2)
        text = markdown(rows, header)
        with open(os.path.join(args.out_dir, "device_check.md"), "w") as f:
            f.write(text)
        return text

    def variants():  # after the rest (or alone, --only-variants), in the time left
        for name in presets:
            cfg = PRESETS[name][0]
            target = tiny_target(cfg=cfg, dtype=dtype)
            rows.extend(variant_rows(name, target, context, steps, gbs,
                                     lambda: args.budget_s - (time.perf_counter() - start)))
            del target
            write()

    def attention():  # after the variants (or alone, --only-attention), in the time left
        def left():
            return args.budget_s - (time.perf_counter() - start)

        timed = set()  # Qwen3-4B and 8B share their attention shape: its rows once
        for name in presets:
            cfg = PRESETS[name][0]
            shape = (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
            if shape not in timed:
                timed.add(shape)
                rows.extend(attention_rows(name, cfg, attention_contexts, steps, dtype, gbs, left))
                write()
            target = tiny_target(cfg=cfg, dtype=dtype)
            rows.extend(model_step_rows(name, target, attention_contexts[1:], steps, left))
            del target
            write()

    if args.only_variants or args.only_attention:
        if args.only_variants:
            variants()
        if args.only_attention:
            attention()
        print(write(final=True))
        return
    if not args.lossless_only:
        rows += parity_rows(jnp.float32 if args.smoke else dtype)
        write()
    for name in presets:
        if time.perf_counter() - start > args.budget_s:
            skipped.append(name)
            continue
        cfg, drafter_layers, block_size = PRESETS[name]
        if args.lossless_only:
            rows += lossless_rows(name, cfg, block_size, new_tokens // 2)
            continue
        target = tiny_target(cfg=cfg, dtype=dtype)
        drafter = rj.init_drafter(cfg, mask_token_id=cfg.vocab_size - 1, num_layers=drafter_layers,
                                  block_size=block_size, dtype=dtype)
        for length in generate_contexts:  # rj.generate per token at a short and a long prompt
            if length != generate_contexts[0] and time.perf_counter() - start > args.budget_s:
                skipped.append(f"{name} generate at {length}")
                continue
            rows += generate_rows(name, target, drafter, length, new_tokens, 3)
        write()
        rows += decode_rows(name, target, drafter, block_size, batches, context, steps, dtype, gbs)
        write()
        rows += prefill_rows(name, target, lengths, 3)
        write()
        del target, drafter
        if time.perf_counter() - start > args.budget_s:  # again: the lossless rows compile 10 programs
            skipped.append(f"{name} lossless rows")
            continue
        rows += lossless_rows(name, cfg, block_size, new_tokens // 2)
        write()
    if not (args.lossless_only or args.skip_variants):
        variants()
    if not (args.lossless_only or args.skip_attention):
        attention()
    print(write(final=True))


if __name__ == "__main__":
    main()
