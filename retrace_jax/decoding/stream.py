"""Continuous batching inside the compiled loop: ``slots`` rows decode a stream of any number of prompts,
and a row that finishes takes the next waiting prompt at once, inside the same ``lax.while_loop``.

A static batch is as slow as its longest response: every row waits for it. Here a slot whose prompt
stops (stop token or ``max_new_tokens``) is emptied into a *harvest* buffer and prefilled with the next
prompt in the same loop iteration, so the rows stay busy until the stream runs dry. The per-round work is
the plain or speculative decoding's own (:func:`~retrace_jax.decoding.plain.plain_step`,
:func:`~retrace_jax.decoding.speculative.speculative_round`), run over all slots as a batch; only what a
slot holds changes.

The host drives the stream in calls of one compiled program (:func:`stream_chunk`), each running up to a
given number of rounds: it hands the program a *queue* (the next ``Q`` waiting prompts, padded to one
fixed shape) and takes back the harvest (at most ``F`` finished prompts), so device memory is bounded by
the slots, whatever the number of prompts, and a second call compiles nothing. The carry
(:class:`StreamCarry`: the slots' caches, outputs and sampling state) is donated from call to call.

**Refill.** The free slots take the next waiting prompts, in slot order, through a prefill of
fixed-shape passes of ``chunk`` tokens (``ceil(length / chunk)`` of them for the longest: the cost grows
with the prompts, not with their bucket) over a view of the batch's caches
(:meth:`~retrace_jax.models.kv_cache.KVCache.row_view`, :func:`prefill_rows`): when at least
:func:`refill_together` slots refill at once (the start of a stream, rows that stop together), all of them
in one pass over the whole batch, the other rows running padding past their own text; otherwise the first
free slot alone over its own row, and the next in the loop's next iteration. The target writes its keys
and values into the refilled rows in place and, for speculative decoding, the drafter's context cache is
filled from the target's features of the prompts, as the batch prefill fills it. Then each refilled slot's
output, acceptance record, ReTrace memory and random stream start afresh, and its first token is chosen
from its prompt's last logits, as in the batch prefill.

**Random streams.** Slot ``b`` holding prompt ``i`` draws with ``fold_in(PRNGKey(seed), i)`` (folded with
its own step counter, which starts at 0 with the prompt), the key row ``i`` of a static batch uses. So a
prompt's samples do not depend on the slot it lands in or on the round it starts in, and a stream gives
the tokens of ``generate`` over the same prompts without ``slots``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from retrace_jax.decoding.buffers import spare_or_new
from retrace_jax.decoding.commit import OutputBuffer, commit, stop_non_finite
from retrace_jax.decoding.layer_loop import merge_target
from retrace_jax.decoding.plain import PlainCarry, StepConstants, plain_step
from retrace_jax.decoding.programs import DecodeProgram
from retrace_jax.decoding.sampling import SamplingMode, SamplingParams, step_keys
from retrace_jax.decoding.speculative import RoundConstants, SpecCarry, empty_memory, speculative_round
from retrace_jax.models.draft_vocab import draft_head

# Prompt tokens per prefill pass of a refilled slot (the last pass is padded). On two CPU cores a one-row
# pass of 64 tokens cost 1.6 passes of 32 (docs/performance.md, "Streams against static batches"): fewer
# passes for the same prompt, whose padding costs less than the passes saved on prompts of 40-200 tokens.
PREFILL_CHUNK = 64
# Free slots refill in one prefill over the whole batch when at least this fraction of the slots (and at
# least 2) refill at once, as at the start of a stream; fewer refill one row at a time, each over its own
# row. On two CPU cores a pass over 8 rows cost 5-7 one-row passes (docs/performance.md, "Streams against
# static batches"): compute-bound prefills gain from batching only when nearly every row needs one.
REFILL_TOGETHER = 0.75


def prefill_chunk(prompt_len: int) -> int:
    """The tokens per prefill pass for prompts padded to ``prompt_len``: :data:`PREFILL_CHUNK`, or the
    padded length itself when it is shorter."""
    return min(PREFILL_CHUNK, prompt_len)


def refill_together(slots: int) -> int:
    """How many free slots refill in one pass over the whole batch (see :data:`REFILL_TOGETHER`)."""
    return max(2, math.ceil(REFILL_TOGETHER * slots))


@struct.dataclass
class Harvest:
    """The prompts that finished during one call, in the order they finished (``count`` entries)."""

    prompt_y: jax.Array  # [Y] the prompt's index (-1: an unused entry)
    tokens_yo: jax.Array  # [Y, O] its new tokens; entries >= num are padding
    num_y: jax.Array  # [Y] tokens committed
    non_finite_y: jax.Array  # [Y] the target's logits were NaN or infinite (the row stopped there)
    accept_yo: jax.Array | None  # [Y, O] a + 1 of each round (speculative decoding), else None
    rounds_y: jax.Array | None  # [Y] rounds run
    count: jax.Array  # int32 scalar
    features_ysf: jax.Array | None = None  # [Y, S, F] the kept features of each prompt's positions, else None

    @classmethod
    def empty(cls, size: int, capacity: int, speculative: bool, features_bsf=None):
        """An empty harvest; ``features_bsf`` (the carry's, or None) gives the kept features' shape."""
        zeros = jnp.zeros((size, capacity), jnp.int32)
        features = None if features_bsf is None else jnp.zeros((size,) + features_bsf.shape[1:], features_bsf.dtype)
        return cls(jnp.full((size,), -1, jnp.int32), zeros, jnp.zeros((size,), jnp.int32), jnp.zeros((size,), bool),
                   zeros if speculative else None, jnp.zeros((size,), jnp.int32) if speculative else None,
                   jnp.zeros((), jnp.int32), features)


@struct.dataclass
class StreamCarry:
    """What the stream carries from round to round and from call to call."""

    step: PlainCarry | SpecCarry  # the slots as one batch: caches, outputs, anchors, ReTrace memory
    keys_b: jax.Array  # [B, 2] the random stream of the prompt each slot holds
    prompt_b: jax.Array  # [B] int32: the prompt a slot holds, -1 for a free slot
    next_prompt: jax.Array  # int32 scalar: the first prompt not started yet
    rounds: jax.Array  # int32 scalar: rounds run since the stream began
    # Kept features (``feature_layers``; plain decoding only), else None. features_bsf[b, s] is the target's
    # features of the token at position s of slot b's text; tail_b: the slot's prompt has finished and the
    # step after its last token has fed that token (so its features are there too), which a finished prompt
    # waits for before its harvest.
    features_bsf: jax.Array | None = None  # [B, S, F]
    tail_b: jax.Array | None = None  # [B] bool


def _merge_rows(tree, first, refill_b, rows_tree):
    """Every leaf of ``tree`` (batch-major) with its rows ``first .. first + len(refill) - 1`` taken from
    ``rows_tree`` (a row view's ``B`` rows, as :meth:`~retrace_jax.models.kv_cache.KVCache.row_view` names
    them) where ``refill`` holds, the others as they were."""
    rows = refill_b.shape[0]

    def merge(x, new):
        old = jax.lax.dynamic_slice_in_dim(x, first, rows, 0)
        mask = refill_b.reshape((rows,) + (1,) * (x.ndim - 1))
        return jax.lax.dynamic_update_slice_in_dim(x, jnp.where(mask, new.astype(x.dtype), old), first, 0)

    return jax.tree.map(merge, tree, rows_tree)


def prefill_rows(target, drafter, target_cache, draft_cache, first, refill_b, tokens_bp, lengths_b, chunk: int,
                 attention="auto", keep=None):
    """Prefills the rows ``first + b`` (``first`` may be traced) where ``refill[b]`` holds with
    ``tokens[b, :lengths[b]]``, all of them together in passes of ``chunk`` tokens over a view of
    ``len(refill)`` rows of the caches (the ``B`` rows of a
    :meth:`~retrace_jax.models.kv_cache.KVCache.row_view`: the whole batch, or one row of it), as many
    passes as the longest prompt needs. Pass ``i`` runs each refilled row's tokens ``i * chunk ..`` at
    their positions (a row's last pass padded); a row whose prompt is done, and a row of the view that is
    not refilled, runs padding past its own length, where nothing reads it and the next write overwrites
    it, and keeps its length: its text is untouched (the caches hold ``chunk`` positions past the longest
    text for this: :func:`spare_max_len`). Returns the caches (a refilled row of length ``lengths[b]``)
    and the final-norm state of each refilled row's last prompt token ``[B, d]`` (zeros for the others).
    ``drafter`` (or None): its context cache takes the target's features of every prompt position, as
    :func:`~retrace_jax.decoding.speculative.speculative_init` fills it. ``keep`` (or None):
    ``(features_bsf, feature_layers)``, the whole batch's kept features (``StreamCarry.features_bsf``), into
    which each refilled row's pass writes the target's features of ``feature_layers`` at its positions
    (plain decoding only); then the buffer is returned as a fourth value."""
    rows = refill_b.shape[0]
    layer_ids = () if drafter is None else drafter.cfg.target_layer_ids
    if keep is not None:
        if drafter is not None:
            raise ValueError("prefill_rows: kept features are for plain decoding (no drafter)")
        features_bsf, layer_ids = keep
        slots = features_bsf.shape[0]
    old_t = jax.lax.dynamic_slice_in_dim(target_cache.lengths, first, rows)
    old_d = None if drafter is None else jax.lax.dynamic_slice_in_dim(draft_cache.lengths, first, rows)
    passes = jnp.max(jnp.where(refill_b, (lengths_b + chunk - 1) // chunk, 0))
    last_pass_b = (lengths_b - 1) // chunk

    def offsets(i, old_b):  # where each row of the view writes in pass i
        return jnp.where(refill_b, jnp.minimum(i * chunk, lengths_b), old_b)

    def one(i, state):
        view_t, view_d, last, kept = state
        tokens = jax.lax.dynamic_slice_in_dim(tokens_bp, i * chunk, chunk, 1)  # [B, chunk]
        at_b = offsets(i, old_t)
        out = target(tokens, view_t.replace(lengths=at_b), feature_layers=layer_ids, attention=attention)
        if drafter is not None:
            view_d = drafter.extend_cache(out.features, view_d.replace(lengths=offsets(i, old_d)))
        if kept is not None:  # refilled rows only (the others' index is out of range: dropped)
            row_b = jnp.where(refill_b, first + jnp.arange(rows), slots)
            kept = kept.at[row_b[:, None], at_b[:, None] + jnp.arange(chunk)].set(out.features.astype(kept.dtype),
                                                                                   mode="drop")
        at = jnp.clip(lengths_b - 1 - i * chunk, 0, chunk - 1)
        here = jnp.take_along_axis(out.hidden, at[:, None, None], 1)[:, 0]  # [B, d]
        mine = (refill_b & (last_pass_b == i))[:, None]
        return out.cache, view_d, jnp.where(mine, here.astype(last.dtype), last), kept

    views = (target_cache.row_view(first, old_t), None if drafter is None else draft_cache.row_view(first, old_d),
             jnp.zeros((rows, target.cfg.hidden_size), target.dtype), None if keep is None else features_bsf)
    view_t, view_d, last, kept = jax.lax.fori_loop(0, passes, one, views)

    def lengths(cache, old_b):
        return jax.lax.dynamic_update_slice_in_dim(cache.lengths, jnp.where(refill_b, lengths_b, old_b), first, 0)

    target_cache = view_t.whole(lengths(target_cache, old_t))
    if drafter is not None:
        draft_cache = view_d.whole(lengths(draft_cache, old_d))
    return (target_cache, draft_cache, last) if keep is None else (target_cache, draft_cache, last, kept)


def _start_rows(models, consts, step, first, refill_b, tokens_bp, lengths_b, keys_b, chunk, keep=None):
    """The rows ``first + b`` of the step carry where ``refill[b]`` holds taken over by new prompts
    (:func:`prefill_rows`): their output, acceptance record and ReTrace memory reset, and each first
    token (key step 0) committed; the other rows as they were. With ``keep`` (:func:`prefill_rows`)
    returns ``(step, features_bsf)``."""
    target, drafter = models
    speculative = isinstance(step, SpecCarry)
    rows = refill_b.shape[0]
    target_cache = step.target_cache if speculative else step.cache
    filled = prefill_rows(target, drafter, target_cache, step.draft_cache if speculative else None, first, refill_b,
                          tokens_bp, lengths_b, chunk, consts.attention, keep)
    target_cache, draft_cache, last_bd = filled[:3]
    logits_bv = target.logits(last_bd)
    token_b = consts.sampling.choose(step_keys(keys_b, jnp.zeros((rows,), jnp.int32)), logits_bv, consts.mode)
    capacity = step.buf.tokens.shape[1]
    buf = stop_non_finite(OutputBuffer.empty(rows, capacity), logits_bv)
    buf = commit(buf, token_b[:, None], jnp.ones((rows,), jnp.int32), consts.max_new, consts.stop_ids)
    merge = functools.partial(_merge_rows, first=first, refill_b=refill_b)
    buf = merge(step.buf, rows_tree=buf)
    zeros = jnp.zeros((rows,), jnp.int32)
    if not speculative:
        step = PlainCarry(target_cache.constrain(consts.mesh), buf, merge(step.last_b, rows_tree=token_b))
        return step if keep is None else (step, filled[3])
    memory = step.memory
    if memory is not None:  # the empty memory of a new prompt, as speculative_init makes it
        memory = merge(memory, rows_tree=empty_memory(models, rows, memory.valid.shape[1]))
    return SpecCarry(
        target_cache=target_cache.constrain(consts.mesh),
        draft_cache=draft_cache.constrain(consts.mesh),
        buf=buf,
        anchor_b=merge(step.anchor_b, rows_tree=token_b),
        accept_br=merge(step.accept_br, rows_tree=jnp.zeros((rows, step.accept_br.shape[1]), jnp.int32)),
        rounds_b=merge(step.rounds_b, rows_tree=zeros),
        memory=memory,
    )


def _run_if(pred, fn, x):
    """``fn(x)`` where the traced ``pred`` holds, else ``x``: a while loop of zero or one iteration, where
    ``lax.cond(pred, fn, lambda x: x, x)`` would be the plain spelling. XLA updates a while loop's carry
    in place, but around a ``conditional`` whose branches write the caches (a refill's prefill) it copies
    every cache whole, three times per refill (the optimised HLO of ``stream_chunk``;
    ``tests/decoding/test_inplace.py``)."""
    return jax.lax.fori_loop(0, pred.astype(jnp.int32), lambda _, y: fn(y), x)


def _copy_rows(dst_ysf, src_bsf, finished_b, first):
    """``dst`` with the rows of ``src`` where ``finished`` holds written, in slot order, at entries
    ``first, first + 1, ...``: one dynamic slice per finished row (a round finishes a few), not a
    scatter of every slot's whole row."""
    order = jnp.nonzero(finished_b, size=finished_b.shape[0], fill_value=0)[0]

    def one(k, dst):
        row = jax.lax.dynamic_slice_in_dim(src_bsf, order[k], 1, 0)
        return jax.lax.dynamic_update_slice_in_dim(dst, row.astype(dst.dtype), first + k, 0)

    return jax.lax.fori_loop(0, jnp.sum(finished_b, dtype=jnp.int32), one, dst_ysf)


def _harvest(c: StreamCarry, h: Harvest) -> tuple[StreamCarry, Harvest]:
    """Moves every slot whose prompt has finished into the harvest and frees the slot. With kept
    features a finished prompt waits for the step that feeds its last token (``tail_b``)."""
    buf = c.step.buf
    finished = (c.prompt_b >= 0) & buf.done
    if c.tail_b is not None:
        finished &= c.tail_b
    size = h.prompt_y.shape[0]
    at = jnp.where(finished, h.count + jnp.cumsum(finished) - 1, size)  # out of range: dropped

    def put(dst, src):
        return dst.at[at].set(src.astype(dst.dtype), mode="drop")

    speculative = isinstance(c.step, SpecCarry)
    h = Harvest(
        prompt_y=put(h.prompt_y, c.prompt_b),
        tokens_yo=put(h.tokens_yo, buf.tokens),
        num_y=put(h.num_y, buf.num),
        non_finite_y=put(h.non_finite_y, buf.non_finite),
        accept_yo=put(h.accept_yo, c.step.accept_br) if speculative else None,
        rounds_y=put(h.rounds_y, c.step.rounds_b) if speculative else None,
        count=h.count + jnp.sum(finished, dtype=jnp.int32),
        features_ysf=None if h.features_ysf is None else _copy_rows(h.features_ysf, c.features_bsf, finished,
                                                                     h.count),
    )
    tail_b = None if c.tail_b is None else c.tail_b & ~finished
    return c.replace(prompt_b=jnp.where(finished, -1, c.prompt_b), tail_b=tail_b), h


def _stream_loop(models, consts, carry: StreamCarry, queue_tokens_qp, queue_lens_q, queue_first, num_prompts,
                 max_rounds, *, harvest_size: int, chunk: int, round_fn, feature_layers=()):
    """Iterations of refill (free slots take waiting prompts), one round over all slots, harvest, until
    ``max_rounds`` rounds, until no slot holds a prompt and none can start, until the harvest might not
    hold another round's finishes, or until a free slot waits for a prompt past the queue (the host then
    hands over the next queue). The refill sits inside the loop, before the round, so that the program
    traces (and XLA compiles) the slot prefill once. With kept features (``carry.features_bsf``) the
    prefill and every round write the target's features of ``feature_layers`` (``round_fn`` returns them
    beside the step carry), and a finished prompt leaves one round later, once its last token's features
    are written."""
    batch = carry.prompt_b.shape[0]
    queued = queue_tokens_qp.shape[0]
    base = jax.random.PRNGKey(consts.sampling.seed)
    together = refill_together(batch)

    def waiting(c):
        return c.next_prompt < num_prompts

    def in_queue(c):
        return c.next_prompt - queue_first < queued

    def can_refill(state):
        # Room for a whole round's finishes after these prompts' (the round that follows may finish every slot).
        c, h = state
        return jnp.any(c.prompt_b < 0) & waiting(c) & in_queue(c) & (h.count < harvest_size - batch)

    def refill(state):
        # The free slots take the next waiting prompts in slot order: all of them in one prefill over the
        # whole batch when at least `together` refill at once, else the first one over its own row.
        c, h = state
        free = c.prompt_b < 0
        room = jnp.minimum(jnp.minimum(num_prompts, queue_first + queued) - c.next_prompt,
                           harvest_size - batch - h.count)
        n = jnp.minimum(jnp.sum(free, dtype=jnp.int32), room)
        whole = n >= together
        rank = jnp.cumsum(free, dtype=jnp.int32) - 1
        refill_b = free & (rank < jnp.where(whole, n, 1))
        prompt_b = c.next_prompt + rank
        q_b = jnp.clip(prompt_b - queue_first, 0, queued - 1)
        tokens_bp, lens_b = queue_tokens_qp[q_b], queue_lens_q[q_b]
        # each prompt's stream, wherever it runs (module docstring)
        keys_b = jnp.where(refill_b[:, None], jax.vmap(jax.random.fold_in, (None, 0))(base, prompt_b), c.keys_b)
        slot = jnp.argmax(free).astype(jnp.int32)

        def start(x, first, refill, tokens, lens, keys):
            step, features = x
            if features is None:
                return _start_rows(models, consts, step, first, refill, tokens, lens, keys, chunk), None
            return _start_rows(models, consts, step, first, refill, tokens, lens, keys, chunk,
                               keep=(features, feature_layers))

        def all_rows(x):
            return start(x, 0, refill_b, tokens_bp, lens_b, keys_b)

        def one_row(x):
            return start(x, slot, jnp.ones((1,), bool), tokens_bp[slot][None], lens_b[slot][None],
                         keys_b[slot][None])

        step, features = _run_if(~whole, one_row, _run_if(whole, all_rows, (c.step, c.features_bsf)))
        c = c.replace(step=step, keys_b=keys_b, prompt_b=jnp.where(refill_b, prompt_b, c.prompt_b),
                      next_prompt=c.next_prompt + jnp.sum(refill_b, dtype=jnp.int32), features_bsf=features,
                      tail_b=None if c.tail_b is None else c.tail_b & ~refill_b)
        return _harvest(c, h)  # a prompt that its first token ends (a stop token, max_new_tokens 1) leaves at once

    def go_on(state):
        (c, h), n = state
        starved = jnp.any(c.prompt_b < 0) & waiting(c) & ~in_queue(c)
        work = jnp.any(c.prompt_b >= 0) | can_refill((c, h))
        return (n < max_rounds) & work & (h.count <= harvest_size - batch) & ~starved

    def keep_features(c, step, features_bf):
        # Each slot fed one token at its cache length: a live prompt's next position, or for a prompt that
        # had finished before the step its last token (its tail); a finished prompt whose tail is written,
        # and a free slot, write nothing.
        live_b = c.prompt_b >= 0
        done_b = c.step.buf.done
        row_b = jnp.where(live_b & ~(done_b & c.tail_b), jnp.arange(batch), batch)  # out of range: dropped
        at_b = c.step.cache.lengths
        features = c.features_bsf.at[row_b, at_b].set(features_bf.astype(c.features_bsf.dtype), mode="drop")
        return c.replace(step=step, features_bsf=features, tail_b=c.tail_b | (live_b & done_b))

    def one_round(state):
        (c, h), n = state
        c, h = jax.lax.while_loop(can_refill, refill, (c, h))
        step = round_fn(consts.replace(keys_b=c.keys_b), c.step)
        c = c.replace(step=step) if c.features_bsf is None else keep_features(c, *step)
        c, h = _harvest(c.replace(rounds=c.rounds + 1), h)
        return (c, h), n + 1

    capacity = carry.step.buf.tokens.shape[1]
    state = (carry, Harvest.empty(harvest_size, capacity, isinstance(carry.step, SpecCarry), carry.features_bsf))
    (carry, harvest), _ = jax.lax.while_loop(go_on, one_round, (state, jnp.zeros((), jnp.int32)))
    in_flight = jnp.sum(jnp.where(carry.prompt_b >= 0, carry.step.buf.num, 0))
    return carry, harvest, in_flight


def _models(target_def, target_state, drafter_def, drafter_state, layer_loop, kept):
    target = merge_target(target_def, target_state, layer_loop, kept)
    return target, None if drafter_def is None else nnx.merge(drafter_def, drafter_state)


def _constants(models, max_new, stop_ids, sampling, batch, *, mode, mesh, attention, block_size):
    target, drafter = models
    keys = jnp.zeros((batch, 2), jnp.uint32)  # replaced by each slot's own before every round
    if drafter is None:
        return StepConstants(keys, jnp.asarray(max_new, jnp.int32), stop_ids, sampling, mode=mode, mesh=mesh,
                             attention=attention)
    return RoundConstants(keys, jnp.asarray(max_new, jnp.int32), stop_ids, sampling, block_size=block_size, mode=mode,
                          mesh=mesh, attention=attention, draft_head=draft_head(target, drafter))


STATIC = ("target_def", "drafter_def", "slots", "max_len", "capacity", "block_size", "use_retrace", "mode", "mesh",
          "cache_dtype", "attention", "layer_loop", "feature_layers")


@functools.partial(DecodeProgram, static_argnames=STATIC, donate_argnames=("spare",))
def stream_init(target_def, target_state, drafter_def, drafter_state, *, slots, max_len, capacity, block_size=0,
                use_retrace=True, mode: SamplingMode = SamplingMode(), mesh=None, cache_dtype=None, attention="auto",
                layer_loop="auto", feature_layers=(), kept=None, spare=None) -> StreamCarry:
    """The carry of a stream whose ``slots`` are all free: caches for ``max_len`` positions per slot (the
    ``spare`` ones when given, donated: see ``retrace_jax/decoding/buffers.py``), empty outputs, and with
    ``feature_layers`` (plain decoding) a buffer of the kept features of ``max_len`` positions per slot."""
    target, drafter = _models(target_def, target_state, drafter_def, drafter_state, layer_loop, kept)
    spare = (None, None) if spare is None else spare
    cache = spare_or_new(target, slots, max_len, cache_dtype, spare[0], "the target's cache").constrain(mesh)
    buf = OutputBuffer.empty(slots, capacity, jnp.ones((slots,), bool))  # a free slot is a finished row
    zeros = jnp.zeros((slots,), jnp.int32)
    if drafter is None:
        step = PlainCarry(cache, buf, zeros)
    else:
        draft_cache = spare_or_new(drafter, slots, max_len, cache_dtype, spare[1], "the drafter's cache").constrain(mesh)
        memory = empty_memory((target, drafter), slots, block_size) if use_retrace else None
        step = SpecCarry(cache, draft_cache, buf, zeros, jnp.zeros((slots, capacity), jnp.int32), zeros, memory)
    features = tail = None
    if feature_layers:
        if drafter is not None:
            raise ValueError("stream_init: kept features are for plain decoding (no drafter)")
        features = jnp.zeros((slots, max_len, len(feature_layers) * target.cfg.hidden_size), target.dtype)
        tail = jnp.zeros((slots,), bool)
    return StreamCarry(step, jnp.zeros((slots, 2), jnp.uint32), jnp.full((slots,), -1, jnp.int32),
                       jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32), features, tail)


@functools.partial(DecodeProgram, static_argnames=STATIC + ("harvest_size", "chunk"), donate_argnames=("carry",))
def stream_chunk(target_def, target_state, drafter_def, drafter_state, carry: StreamCarry, queue_tokens_qp,
                 queue_lens_q, queue_first, num_prompts, max_rounds, max_new, stop_ids, sampling: SamplingParams, *,
                 slots, max_len, capacity, harvest_size, chunk, block_size=0, use_retrace=True,
                 mode: SamplingMode = SamplingMode(), mesh=None, cache_dtype=None, attention="auto",
                 layer_loop="auto", feature_layers=(), kept=None):
    """One call of a stream: up to ``max_rounds`` rounds over the slots of ``carry`` (donated), refilling
    free slots from the queue (``queue_tokens[q, :queue_lens[q]]`` is prompt ``queue_first + q``; prompts
    from ``num_prompts`` on do not exist). Returns the carry, the :class:`Harvest` of the prompts that
    finished, and the tokens committed so far by the prompts still in their slots. ``slots``, ``max_len``,
    ``cache_dtype`` and ``use_retrace`` only name the carry's shapes (they are those of
    :func:`stream_init`)."""
    del max_len, cache_dtype, use_retrace
    models = _models(target_def, target_state, drafter_def, drafter_state, layer_loop, kept)
    consts = _constants(models, max_new, stop_ids, sampling, slots, mode=mode, mesh=mesh, attention=attention,
                        block_size=block_size)
    if models[1] is None:
        round_fn = functools.partial(plain_step, models[0], feature_layers=feature_layers)
    else:
        round_fn = lambda consts, step: speculative_round(models, consts, step)[0]  # noqa: E731
    return _stream_loop(models, consts, carry, queue_tokens_qp, queue_lens_q, queue_first, num_prompts, max_rounds,
                        harvest_size=harvest_size, chunk=chunk, round_fn=round_fn, feature_layers=feature_layers)


@dataclasses.dataclass(frozen=True)
class StreamProgress:
    """Where a stream stands after one call (``generate(..., slots=N, progress=fn)`` calls ``fn`` with it)."""

    prompts_done: int  # prompts finished
    prompts_total: int
    tokens_done: int  # new tokens of the finished prompts and those committed so far by prompts in flight
    rounds: int  # rounds (plain: steps) run over the slots
    calls: int  # calls of the compiled program so far
    seconds: float  # since the stream began


@dataclasses.dataclass
class StreamResult:
    tokens: list[list[int]]  # in prompt order
    acceptance_lengths: list[list[int]] | None  # speculative decoding: a + 1 of each round, per prompt
    rounds: int
    calls: int
    features: list[np.ndarray] | None = None  # kept features, per prompt [len(prompt) + len(tokens), F]


def run_stream(target_def, target_state, drafter_def, drafter_state, prompts, *, slots: int, prompt_len: int,
               max_new, stop_ids, sampling: SamplingParams, capacity: int, block_size: int = 0,
               use_retrace: bool = True, mode: SamplingMode = SamplingMode(), mesh=None, cache_dtype=None,
               attention="auto", layer_loop="auto", feature_layers=(), kept=None, spare=None,
               rounds_per_call: int = 64, progress=None, fetch=jax.device_get, products=None):
    """Decodes ``prompts`` (token-id lists of at most ``prompt_len`` tokens, a multiple of
    :func:`prefill_chunk`) through ``slots`` rows, one :func:`stream_chunk` call after another, and
    returns the :class:`StreamResult` and the caches (to keep for the next call: ``spare``).

    The host hands each call the next ``2 * slots`` waiting prompts and takes back what finished; the
    call returns after ``rounds_per_call`` rounds, or earlier once more than ``slots`` prompts have
    finished in it (its harvest of ``2 * slots`` entries might not hold another round's finishes) or when
    a free slot waits for a prompt past the queue. ``progress`` (a callable,
    or None) receives a :class:`StreamProgress` after every call. ``feature_layers`` (plain decoding)
    keeps the target's features of those layers at every position of each prompt and its new tokens
    (``StreamResult.features``), as the generation computes them: no second pass over the text.
    Raises ``FloatingPointError`` for prompts whose target logits were not finite (the stream stops
    there; its caches are not kept). ``products``: the extra CPU compiler options that the chunk program
    compiles with (``retrace_jax.decoding.programs.cpu_products_options``; None: its own)."""
    queued = harvest_size = 2 * slots
    chunk = prefill_chunk(prompt_len)
    static = dict(slots=slots, max_len=spare_max_len(prompt_len, capacity, block_size, chunk), capacity=capacity,
                  block_size=block_size, use_retrace=use_retrace, mode=mode, mesh=mesh, cache_dtype=cache_dtype,
                  attention=attention, layer_loop=layer_loop, feature_layers=tuple(feature_layers))
    carry = stream_init(target_def, target_state, drafter_def, drafter_state, kept=kept, spare=spare, **static)
    total = len(prompts)
    tokens: list = [None] * total
    accept: list | None = None if drafter_def is None else [None] * total
    features: list | None = [None] * total if feature_layers else None
    start, first, done, calls, rounds, tokens_done = time.perf_counter(), 0, 0, 0, 0, 0
    while done < total:
        queue_tokens = np.zeros((queued, prompt_len), np.int32)
        queue_lens = np.ones((queued,), np.int32)
        for q, p in enumerate(prompts[first:first + queued]):
            queue_tokens[q, :len(p)] = p
            queue_lens[q] = len(p)
        carry, harvest, in_flight = stream_chunk.with_cpu_options(products)(
            target_def, target_state, drafter_def, drafter_state, carry, queue_tokens, queue_lens, np.int32(first),
            np.int32(total), np.int32(rounds_per_call), max_new, stop_ids, sampling, harvest_size=harvest_size,
            chunk=chunk, kept=kept, **static)
        h, next_prompt, now_rounds, in_flight = fetch((harvest, carry.next_prompt, carry.rounds, in_flight))
        calls += 1
        count = int(h.count)
        if count == 0 and int(next_prompt) == first and int(now_rounds) == rounds:
            raise RuntimeError("generate: a stream call finished no prompt, started none and ran no round")  # a bug
        first, rounds = int(next_prompt), int(now_rounds)
        bad = sorted(int(i) for i in h.prompt_y[:count][h.non_finite_y[:count]])
        if bad:
            raise FloatingPointError(non_finite_message(bad))
        for f in range(count):
            i, n = int(h.prompt_y[f]), int(h.num_y[f])
            tokens[i] = h.tokens_yo[f, :n].tolist()
            tokens_done += n
            if accept is not None:
                accept[i] = h.accept_yo[f, :int(h.rounds_y[f])].tolist()
            if features is not None:
                features[i] = np.array(h.features_ysf[f, :len(prompts[i]) + n])
        done += count
        if progress is not None:
            progress(StreamProgress(done, total, tokens_done + int(in_flight), rounds, calls,
                                    time.perf_counter() - start))
    step = carry.step
    caches = (step.cache,) if drafter_def is None else (step.target_cache, step.draft_cache)
    return StreamResult(tokens, accept, rounds, calls, features), caches


def spare_max_len(prompt_len: int, capacity: int, block_size: int, chunk: int) -> int:
    """Positions per slot: the padded prompt, the output capacity and room past the last kept token for
    a verify pass's block (speculative decoding) or a prefill pass's ``chunk`` tokens (a refill over the
    whole batch runs one over every row: :func:`prefill_rows`)."""
    return prompt_len + capacity + max(block_size, chunk)


def non_finite_message(prompts: list[int]) -> str:
    return (f"the target's logits were NaN or infinite for prompt(s) {prompts}: its weights or its config (e.g. "
            f"rms_norm_eps, rope_theta) make the forward pass overflow or divide by zero; no tokens are "
            f"returned, since a greedy choice among NaNs would be an arbitrary token")
