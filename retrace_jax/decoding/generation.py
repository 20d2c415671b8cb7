"""``generate``: the public entry point. Validates and pads the batch, runs one compiled program."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from retrace_jax.attention import IMPLEMENTATIONS
from retrace_jax.decoding.buffers import POOL, take_spare
from retrace_jax.decoding.layer_loop import decode_weights, resolve_layer_loop
from retrace_jax.decoding.plain import plain_generate
from retrace_jax.decoding.programs import cpu_products_options
from retrace_jax.decoding.sampling import SamplingMode, SamplingParams
from retrace_jax.decoding.speculative import speculative_generate
from retrace_jax.decoding.stream import non_finite_message, prefill_chunk, run_stream, spare_max_len
from retrace_jax.io.checkpoints import resolve_dtype
from retrace_jax.models.drafter import DFlashDrafter, check_drafter_matches
from retrace_jax.models.target import TargetModel
from retrace_jax.parallel.placement import shard_model
from retrace_jax.parallel.sharding import axis_size, batch_sharding
from retrace_jax.validation import MAX_BLOCK_SIZE, generate_arguments, short_repr, token_ids

MIN_BUCKET = 16
STOP_BUCKET = 8
DRAFT_RULES = ("argmax", "target_sample", "sample")  # speculative sampling at T > 0 (see generate)


STOP_REASONS = ("stop", "length")  # a stop token ended the prompt's output / max_new_tokens did


@dataclasses.dataclass
class GenerateOutput:
    tokens: list[list[int]]  # the new tokens of each prompt (up to and including a stop token)
    acceptance_lengths: list[list[int]]  # per prompt, tokens committed per round
    stop_reasons: list[str] | None = None  # per prompt, one of STOP_REASONS
    # generate(..., feature_layers=...): per prompt, the target's features [len(prompt) + len(tokens), F]
    features: list[np.ndarray] | None = None

    def tau(self) -> float:
        """Mean acceptance length: the mean over prompts of each prompt's mean over rounds."""
        per_prompt = [np.mean(a) for a in self.acceptance_lengths if a]
        return float(np.mean(per_prompt)) if per_prompt else float("nan")

    def tau_pooled(self) -> float:
        """Mean acceptance length pooled over all rounds of all prompts."""
        rounds = [x for a in self.acceptance_lengths for x in a]
        return float(np.mean(rounds)) if rounds else float("nan")


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """The padded size for ``n``: the next power of two, at least ``minimum``."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def prompt_bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """The padded prompt length for a longest prompt of ``n`` tokens: the next power of two or one and a
    half times a power of two (16, 24, 32, 48, 64, 96, 128, 192, ...), at least ``minimum``. The prefill
    computes every padded position, so at most a third of it is padding (half with powers of two
    alone, e.g. 96 tokens padded to 128), for twice as many prompt sizes that compile."""
    power = bucket(n, minimum)
    return max(minimum, power * 3 // 4) if n <= power * 3 // 4 else power


def generate(
    target: TargetModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 64,
    *,
    drafter: DFlashDrafter | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_token_ids: Sequence[int] = (),
    seed: int = 0,
    block_size: int | None = None,
    use_retrace: bool = True,
    draft_rule: str = "argmax",
    mesh=None,
    cache_dtype=None,
    attention: str = "auto",
    layer_loop: str = "auto",
    slots: int | None = None,
    progress=None,
    rounds_per_call: int = 64,
    feature_layers: Sequence[int] | None = None,
    cpu_products: str = "auto",
) -> GenerateOutput:
    """Generates up to ``max_new_tokens`` for each prompt (token ids) in one compiled program.

    ``prompts`` is a list of prompts, each a list (or 1-D integer array) of token ids in the target's
    vocabulary; ``stop_token_ids`` is a list or set of such ids. A bool, a float or a nested list is not a
    token id, and the error names the prompt and the position at fault.

    With a ``drafter``, decoding is speculative (lossless: the same tokens as without it); the block
    size is the drafter's unless ``block_size`` overrides it. A block is at most
    ``retrace_jax.validation.MAX_BLOCK_SIZE`` (256) tokens, no more than the drafter's
    ``max_position_embeddings`` and, for a drafter with sliding-attention layers, its ``sliding_window``;
    a larger one is refused before anything is compiled. A block longer than ``max_new_tokens + 1`` is
    run as given, not shortened: the tokens are the same for every block size, and the proposals past
    the budget are computed and dropped, whereas a shorter block would change the drafter's proposals
    (the positions of a block attend to each other) and so the acceptance lengths reported. A ReTrace
    drafter runs with its memory unless ``use_retrace=False`` (an ablation: then it drafts exactly as a
    DFlash drafter).

    ``temperature`` is 0 (greedy) or between ``MIN_TEMPERATURE`` (1e-6) and ``MAX_TEMPERATURE`` (1e6) of
    ``retrace_jax.validation``: the logits are divided by it in float32, where a smaller one is greedy
    decoding in all but name and, further down, overflows, and a larger one is uniform sampling.
    ``temperature > 0`` samples from the target's distribution after temperature, top-k (0: off) and
    top-p (1.0: off); speculative sampling keeps that distribution exactly, by one of three rules:
    ``draft_rule="argmax"`` proposes the drafter's argmax and verifies by rejection sampling with a
    one-hot draft distribution; ``"target_sample"`` (the official DFlash loop's rule) proposes the
    argmax, lets the target draw its own token at every slot and accepts while they match; ``"sample"``
    draws proposals from the drafter's own filtered distribution q (rejection sampling with q). The
    first two give the same distribution of tokens and of acceptance lengths (only the use of the random
    stream differs). Each row has its own random stream; ``seed`` makes runs reproducible.

    With a ``mesh`` (see ``rj.make_mesh``) the same program runs sharded: parameters by the
    logical-axis rules (placed there if they are not yet), caches and batch over the data axis, heads
    over the tensor axis; the batch is padded to a multiple of the data axis. The batch, prompt length
    (:func:`prompt_bucket`), ``max_new_tokens`` and stop list are padded to buckets, so calls whose sizes
    fall into the same buckets reuse the compiled program.

    ``cache_dtype`` ("float32" or "bfloat16"; default: the target's dtype) stores both KV caches in that
    type. ``attention`` chooses the attention implementation ("auto", "chunked", "dense", "cudnn",
    "pallas_gpu", "split_gpu" or "pallas_tpu"; see ``retrace_jax/attention/``): the default walks the caches only up to
    the filled length, except on a GPU, where decode, verify and draft calls run dense (no loop or
    branch, each of which costs a host round trip there) and a bfloat16 prefill runs through cuDNN.
    ``layer_loop`` runs the target's layers with one ``lax.scan`` ("scan": compile time independent of
    depth) or as a Python loop over per-layer weights ("unrolled": faster steps on CPU, where a scan
    copies each layer's weights at every step; compile time grows with depth); "auto" is "unrolled" on
    CPU and "scan" on accelerators. The unrolled loop's per-layer weights are made on the first call and
    kept while the target lives: on one CPU device views of the stacked arrays' memory, elsewhere a copy
    (twice the layer weights in memory), and a tied LM head once more as a copy; see
    ``retrace_jax.decoding.layer_loop.decode_weights``.

    ``slots=N`` decodes the prompts as a stream through ``N`` rows (continuous batching, see
    ``retrace_jax/decoding/stream.py``): any number of prompts, ``N`` at a time, and a row whose prompt
    stops takes the next waiting prompt at once, inside the same compiled loop, so that no row waits for
    the slowest one. Caches are those of ``N`` rows whatever the number of prompts (with a ``mesh``,
    ``N`` is rounded up to a multiple of its batch axes). The tokens are those of a call without
    ``slots``: each prompt keeps its own random stream, that of its index. The host drives the stream in
    calls of one compiled program of up to ``rounds_per_call`` rounds each (the program returns earlier
    once more than ``N`` prompts have finished in it) and, between calls, collects the finished prompts and calls
    ``progress`` (a callable, or None) with a :class:`~retrace_jax.decoding.stream.StreamProgress`.

    ``feature_layers`` (a list of layer indices, with ``slots`` and without a drafter) keeps the target's
    features of those layers (each layer's output, the last one's after the final norm, concatenated:
    ``TargetModel.run_layers``) at every position of each prompt and its new tokens, as the decoding
    computes them: ``GenerateOutput.features[i]`` is ``[len(prompts[i]) + len(tokens[i]), F]``, the text a
    drafter trains on, with no second forward pass. The last new token's features take one more step of
    its slot (the step that feeds it); the tokens are the same as without. Memory: a buffer of
    ``slots x positions x F`` and one of ``2 * slots`` entries of the same size for the finished prompts.

    ``cpu_products`` says how a speculative program's products of several rows (the verify pass and the
    drafted block) compile on CPU: "ynnpack" (XLA's default), "eigen", or "auto" (the default): "eigen"
    for targets whose largest weight matrix of a layer holds at least 16 MiB, where it measured faster
    (``retrace_jax.decoding.programs.resolve_cpu_products``). The tokens are the same either way; other
    backends ignore it.

    The KV caches of a call are kept for the next call of the same sizes (those of the last four
    distinct sizes and methods; ``rj.clear_decode_buffers()`` frees them), so that a call does not
    allocate and first-touch caches of its whole capacity; see ``retrace_jax/decoding/buffers.py``.
    """
    if not isinstance(target, TargetModel):
        raise TypeError(f"generate: target must be a TargetModel (rj.load_target, rj.tiny.tiny_target), got "
                        f"{type(target).__name__}")
    if drafter is not None and not isinstance(drafter, DFlashDrafter):
        raise TypeError(f"generate: drafter must be a DFlashDrafter (rj.load_drafter, rj.init_drafter) or None, got "
                        f"{type(drafter).__name__}")
    args = generate_arguments(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                              seed=seed, block_size=block_size, use_retrace=use_retrace, slots=slots,
                              rounds_per_call=rounds_per_call)
    max_new_tokens, temperature, top_k, top_p = args.max_new_tokens, args.temperature, args.top_k, args.top_p
    seed, block_size, use_retrace = args.seed, args.block_size, args.use_retrace
    slots, rounds_per_call = args.slots, args.rounds_per_call
    if progress is not None and not callable(progress):
        raise TypeError(f"generate: progress must be a callable or None, got {type(progress).__name__} "
                        f"{short_repr(progress)}")
    if progress is not None and slots is None:
        raise ValueError("generate: progress is reported by a stream: pass slots= with it")
    feature_layers = _feature_layers(feature_layers, target, drafter, slots)
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (e.g. rj.make_mesh({mesh!r}) for a string) or None, "
                        f"got {type(mesh).__name__} {mesh!r}")
    mode = _sampling_mode(temperature, top_k, top_p, draft_rule)
    if attention not in IMPLEMENTATIONS:
        raise ValueError(f"attention must be one of {IMPLEMENTATIONS}, got {attention!r}")
    layer_loop = resolve_layer_loop(layer_loop)
    products = cpu_products_options(target.cfg, target.dtype.itemsize, cpu_products)
    cache_dtype = None if cache_dtype is None else resolve_dtype(cache_dtype)
    sampling = SamplingParams.make(temperature, top_k, top_p, seed)
    batch = _check_prompts(target, prompts, max_new_tokens)
    stops = _pad_stops(stop_token_ids, target.cfg.vocab_size)
    if drafter is not None:
        check_drafter_matches(drafter.cfg, target.cfg)
        _check_block_size(drafter.cfg.block_size if block_size is None else block_size, drafter.cfg,
                          given=block_size is not None)
    capacity = bucket(max_new_tokens)
    rows = bucket(batch, 1) if slots is None else slots
    if mesh is not None:
        data = axis_size(mesh, "batch")
        rows = -(-rows // data) * data
        target = shard_model(target, mesh)
        drafter = None if drafter is None else shard_model(drafter, mesh)
    if slots is not None:
        return _generate_stream(target, drafter, prompts, rows, capacity, np.int32(max_new_tokens), stops, sampling,
                                stop_token_ids=stop_token_ids, block_size=block_size, use_retrace=use_retrace,
                                mode=mode, mesh=mesh, cache_dtype=cache_dtype, attention=attention,
                                layer_loop=layer_loop, rounds_per_call=rounds_per_call, progress=progress,
                                feature_layers=feature_layers, products=products)
    tokens, lens, live = _pad_prompts(prompts, rows, prompt_bucket(max(map(len, prompts))))
    if mesh is not None:
        tokens, lens, live = (jax.device_put(x, batch_sharding(mesh, x.ndim)) for x in (tokens, lens, live))
    target_def, target_state = nnx.split(target)
    kept = decode_weights(target, layer_loop, target_state)
    max_new = np.int32(max_new_tokens)
    prompt_len = tokens.shape[1]

    def cache_of(model, max_len):  # what fixes a cache's shape, dtype and placement
        return model.cfg, rows, max_len, model.dtype if cache_dtype is None else cache_dtype, mesh

    if drafter is None:
        key, spare = take_spare([cache_of(target, prompt_len + capacity)])
        buf, spare = plain_generate(target_def, target_state, tokens, lens, live, max_new, stops, sampling,
                                    capacity=capacity, mode=mode, mesh=mesh, cache_dtype=cache_dtype,
                                    attention=attention, layer_loop=layer_loop, kept=kept, spare=spare[0])
        out_tokens, num, non_finite = _fetch((buf.tokens, buf.num, buf.non_finite))
        _check_finite(non_finite[:batch])  # caches that may hold non-finite values are not kept
        POOL.put(key, (spare,))
        new = [out_tokens[b, : num[b]].tolist() for b in range(batch)]
        return GenerateOutput(tokens=new, acceptance_lengths=[[1] * len(t) for t in new],
                              stop_reasons=_stop_reasons(new, stop_token_ids))

    block_size = drafter.cfg.block_size if block_size is None else block_size
    drafter_def, drafter_state = nnx.split(drafter)
    max_len = prompt_len + capacity + block_size
    key, spare = take_spare([cache_of(target, max_len), cache_of(drafter, max_len)])
    buf, accept, rounds, spare = speculative_generate.with_cpu_options(products)(
        target_def, target_state, drafter_def, drafter_state, tokens, lens, live, max_new, stops, sampling,
        capacity=capacity, block_size=block_size, use_retrace=use_retrace, mode=mode, mesh=mesh,
        cache_dtype=cache_dtype, attention=attention, layer_loop=layer_loop, kept=kept, spare=spare,
    )
    out_tokens, num, accept, rounds, non_finite = _fetch((buf.tokens, buf.num, accept, rounds, buf.non_finite))
    _check_finite(non_finite[:batch])
    POOL.put(key, spare)
    new = [out_tokens[b, : num[b]].tolist() for b in range(batch)]
    return GenerateOutput(tokens=new, acceptance_lengths=[accept[b, : rounds[b]].tolist() for b in range(batch)],
                          stop_reasons=_stop_reasons(new, stop_token_ids))


def _generate_stream(target, drafter, prompts, slots, capacity, max_new, stops, sampling, *, stop_token_ids,
                     block_size, use_retrace, mode, mesh, cache_dtype, attention, layer_loop, rounds_per_call,
                     progress, feature_layers=(), products=None) -> GenerateOutput:
    """``generate(..., slots=N)``: the prompts as a stream through ``slots`` rows (see ``stream.py``)."""
    longest = prompt_bucket(max(map(len, prompts)))
    chunk = prefill_chunk(longest)
    prompt_len = -(-longest // chunk) * chunk  # whole prefill passes
    target_def, target_state = nnx.split(target)
    kept = decode_weights(target, layer_loop, target_state)
    drafter_def = drafter_state = None
    models = [target]
    if drafter is not None:
        block_size = drafter.cfg.block_size if block_size is None else block_size
        drafter_def, drafter_state = nnx.split(drafter)
        models.append(drafter)
    else:
        block_size = 0
    max_len = spare_max_len(prompt_len, capacity, block_size, chunk)
    key, spare = take_spare([(m.cfg, slots, max_len, m.dtype if cache_dtype is None else cache_dtype, mesh)
                             for m in models])
    result, spare = run_stream(target_def, target_state, drafter_def, drafter_state, prompts, slots=slots,
                               prompt_len=prompt_len, max_new=max_new, stop_ids=stops, sampling=sampling,
                               capacity=capacity, block_size=block_size, use_retrace=use_retrace, mode=mode, mesh=mesh,
                               cache_dtype=cache_dtype, attention=attention, layer_loop=layer_loop, kept=kept,
                               spare=spare, rounds_per_call=rounds_per_call, progress=progress, fetch=_fetch,
                               feature_layers=feature_layers, products=products if drafter is not None else None)
    POOL.put(key, spare)
    accept = result.acceptance_lengths or [[1] * len(t) for t in result.tokens]
    return GenerateOutput(tokens=result.tokens, acceptance_lengths=accept,
                          stop_reasons=_stop_reasons(result.tokens, stop_token_ids), features=result.features)


def _feature_layers(layers, target: TargetModel, drafter, slots) -> tuple[int, ...]:
    """``generate``'s ``feature_layers`` checked: a non-empty list of distinct layer indices of the
    target, with ``slots`` and without a drafter; () for None."""
    if layers is None:
        return ()
    if isinstance(layers, (int, np.integer, str, bytes)) or not hasattr(layers, "__len__") or not len(layers):
        raise ValueError(f"generate: feature_layers must be a non-empty list of layer indices, got "
                         f"{short_repr(layers)}")
    depth = target.cfg.num_layers
    bad = [x for x in layers if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or not 0 <= x < depth]
    if bad:
        raise ValueError(f"generate: feature_layers must be layer indices in [0, {depth}) of the target, got "
                         f"{short_repr(bad[0])}")
    if len(set(int(x) for x in layers)) != len(layers):
        raise ValueError(f"generate: feature_layers names a layer twice: {short_repr(list(layers))}")
    if slots is None:
        raise ValueError("generate: feature_layers are kept by a stream: pass slots= with them")
    if drafter is not None:
        raise ValueError("generate: feature_layers are kept by plain decoding: pass no drafter with them")
    return tuple(int(x) for x in layers)


def _stop_reasons(tokens: list[list[int]], stop_token_ids) -> list[str]:
    """Why each output ended: ``"stop"`` with a stop token, else ``"length"`` (``max_new_tokens``)."""
    stops = {int(t) for t in stop_token_ids}
    return ["stop" if t and t[-1] in stops else "length" for t in tokens]


def _check_finite(non_finite_b) -> None:
    rows = [int(b) for b in np.flatnonzero(non_finite_b)]
    if rows:
        raise FloatingPointError(non_finite_message(rows))


def _fetch(tree):
    """Host copies of the outputs. On a mesh that spans processes every process gathers the whole
    batch (all of them run this same call, as multi-process JAX requires)."""
    if all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(tree)):
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def _sampling_mode(temperature, top_k, top_p, draft_rule) -> SamplingMode:
    if draft_rule not in DRAFT_RULES:
        raise ValueError(f"draft_rule must be one of {', '.join(map(repr, DRAFT_RULES))}, got {draft_rule!r}")
    if temperature == 0:  # greedy: the filters keep the argmax, so they change nothing
        return SamplingMode()
    return SamplingMode(sample=True, top_k=top_k > 0, top_p=top_p < 1, draft_rule=draft_rule)


def _check_prompts(target: TargetModel, prompts, max_new_tokens: int) -> int:
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or not len(prompts):
        raise ValueError(f"prompts must be a non-empty list of token-id lists, got {short_repr(prompts)}")
    if any(isinstance(p, (int, np.integer)) for p in prompts):
        raise TypeError(f"prompts must be a list of token-id lists, one per prompt, got a flat list of ints "
                        f"{short_repr(prompts)}; for a single prompt pass [ids]")
    cfg = target.cfg
    for i, p in enumerate(prompts):
        if not isinstance(p, (str, bytes)) and hasattr(p, "__len__") and not len(p):
            raise ValueError(f"prompt {i} must be a non-empty list of token ids")
        token_ids(p, cfg.vocab_size, f"prompt {i}")
        if len(p) + max_new_tokens > cfg.max_position_embeddings:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it needs "
                f"{len(p) + max_new_tokens} positions, more than the model's "
                f"max_position_embeddings={cfg.max_position_embeddings}"
            )
    return len(prompts)


def _check_block_size(block_size: int, drafter_cfg, given: bool) -> None:
    """Refuses a block that the drafter cannot run, before anything is compiled (see ``generate``)."""
    what = f"block_size {block_size}" if given else f"the drafter's block_size {block_size}"
    if block_size > MAX_BLOCK_SIZE:  # a given one is bounded already (generate_arguments); the drafter's own here
        raise ValueError(f"generate: {what} exceeds {MAX_BLOCK_SIZE}, the largest block generate runs; pass "
                         f"block_size= to run this drafter with a smaller block")
    if block_size > drafter_cfg.max_position_embeddings:
        raise ValueError(f"generate: {what} needs {block_size} positions in one block, more than the drafter's "
                         f"max_position_embeddings={drafter_cfg.max_position_embeddings}")
    windows = [w for w in map(drafter_cfg.window, range(drafter_cfg.num_layers)) if w is not None]
    if windows and block_size > min(windows):
        raise ValueError(f"generate: {what} is larger than the drafter's sliding_window {min(windows)}: its "
                         f"sliding-attention layers would not see the whole block")


def _pad_prompts(prompts, batch: int, length: int):
    """Right-pads prompts to ``[batch, length]``; extra rows are dead (one token, never generated)."""
    tokens = np.zeros((batch, length), np.int32)
    lens = np.ones((batch,), np.int32)
    live = np.zeros((batch,), bool)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
        lens[b], live[b] = len(p), True
    return tokens, lens, live


def _pad_stops(stop_token_ids, vocab_size: int):
    if isinstance(stop_token_ids, (int, np.integer)):
        raise TypeError(f"stop_token_ids must be a list of token ids, got {type(stop_token_ids).__name__} "
                        f"{stop_token_ids!r}" + ("" if isinstance(stop_token_ids, bool) else f"; write [{stop_token_ids}]"))
    stops = token_ids(stop_token_ids, vocab_size, "stop_token_ids", "entry {}", allow_set=True)
    padded = np.full((bucket(len(stops), STOP_BUCKET),), -1, np.int32)
    padded[: len(stops)] = stops
    return padded
