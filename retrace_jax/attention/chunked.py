"""The chunked walk over a KV cache with an online softmax (flash-decoding): the cost grows with the filled
length, not with the cache's size. Shape letters: :mod:`retrace_jax.attention`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

NEG = -1e30  # the running max starts here (finite): see online_update


def empty_state(shape, d: int):
    """An online softmax that has seen no key: running max NEG, sum 0 and weighted values 0, ``shape``
    (``[..., T]``) and ``shape + (D,)``, in float32."""
    return (jnp.full(shape, NEG, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, d), jnp.float32))


def _begin(q_btkgd, extra, extra_valid, lo_b, state=None):
    """What both walks start from: the queries head-major ``[B, K, G, T, D]`` (once, not in every chunk's
    product), the window's first slots ``[B, 1]`` or ``[B, T]`` (None without a window), and ``state``
    (empty by default) with the extra keys folded in."""
    b, t, kv, g, d = q_btkgd.shape
    q_bkgtd = q_btkgd.transpose(0, 2, 3, 1, 4)
    lo_bt = None if lo_b is None else (lo_b[:, None] if lo_b.ndim == 1 else lo_b)
    if state is None:
        state = empty_state((b, kv, g, t), d)
    if extra is not None:
        state = extra_update(state, q_bkgtd, extra, extra_valid)
    return q_bkgtd, lo_bt, state


def walk_cache(q_btkgd, limit_bt, *, k_lbksd, v_lbksd, layer, chunk, extra, extra_valid=None, lo_b=None, state=None,
               tail_chunk=None, first_row=None):
    """Online softmax over the extra keys, then over the cache chunks that hold visible slots: query
    ``(b, t)`` sees the slots ``lo[b] <= s < limit[b, t]`` (``lo`` 0 unless given; ``[B]``, or ``[B, T]``
    for a bound per query: a sliding window), so the walk covers chunks
    ``floor(min(lo) / C) .. ceil(max(limit) / C) - 1``. ``state`` continues a softmax already
    started (``(m, l, acc)``, ``[B, K, G, T]`` and ``[B, K, G, T, D]``; empty by default). Every query
    sees every extra key, or those where ``extra_valid`` (``[B, E]``) holds.

    With a smaller ``tail_chunk`` (a divisor of ``chunk``) the walk covers whole chunks of ``chunk``
    slots up to the last such boundary below ``max(limit)``, and the rest in chunks of ``tail_chunk``: a
    short filled length in a long cache then costs what it costs in a short one, while a long one is
    walked in few large chunks.

    ``first_row`` (traced, or None for 0): the queries' ``B`` rows are the cache's rows ``first_row ..
    first_row + B - 1`` (a row view: see :meth:`~retrace_jax.models.kv_cache.KVCache.row_view`)."""
    b, d = q_btkgd.shape[0], q_btkgd.shape[4]
    q_bkgtd, lo_bt, state = _begin(q_btkgd, extra, extra_valid, lo_b, state)

    def one_chunk(size, j, state):
        start = j * size
        k_c, v_c = (cache_chunk(buf, layer, start, size, first_row, b) for buf in (k_lbksd, v_lbksd))
        scores = jnp.einsum("bkgtd,bkcd->bkgtc", q_bkgtd, k_c.astype(q_btkgd.dtype),
                            preferred_element_type=jnp.float32) * d**-0.5
        slots = (start + jnp.arange(size))[None, None, :]
        visible = slots < limit_bt[:, :, None]  # [B, T, C]
        if lo_bt is not None:
            visible &= slots >= lo_bt[:, :, None]
        return online_update(state, scores, visible, v_c)

    top = jnp.max(limit_bt)
    # A window's first slot is negative near the sequence start: walking from a negative chunk would read
    # chunk 0 again (a dynamic slice clamps its start) and count its keys twice, under negative slot numbers.
    lo = 0 if lo_b is None else jnp.maximum(jnp.min(lo_b), 0)

    def bounds(size, start, end):  # the chunks of ``size`` from the one holding slot start to slot end
        first, last = start // size, (end + size - 1) // size
        if lo_b is not None:  # nothing left past lo (decode, draft): walk no chunk at all
            last = jnp.where(jnp.any(limit_bt > lo_bt), jnp.maximum(last, first), first)
        return first, last

    tail = chunk if tail_chunk is None else tail_chunk
    if chunk == k_lbksd.shape[3]:
        # A cache of one chunk is read whole, without a loop. In a loop of at most one iteration the read
        # was loop-invariant, and at batch 1 XLA's CPU backend then copied the whole stacked cache before
        # each layer's write (tests/decoding/test_inplace.py, a cache of one chunk).
        state = one_chunk(chunk, 0, state)
    elif tail == chunk:
        first, last = bounds(chunk, lo, top)
        state = jax.lax.fori_loop(first, last, functools.partial(one_chunk, chunk), state)
    else:
        # Whole chunks below split, small ones from there to top, in one loop: iteration i < n takes
        # large chunk first + i, the others small chunks. Two loops in a row cost a short text about a
        # fifth of a CPU decode step more (each loop sets up its state and bounds at every call).
        split = top // chunk * chunk
        first, last = bounds(chunk, lo, split)
        first_small, last_small = bounds(tail, jnp.maximum(split, lo), top)
        n = last - first

        def one(i, state):
            return jax.lax.cond(i < n, lambda s: one_chunk(chunk, first + i, s),
                                lambda s: one_chunk(tail, first_small + i - n, s), state)

        state = jax.lax.fori_loop(0, n + last_small - first_small, one, state)
    return finish(state)


def walk_rows(q_btkgd, limit_bt, *, k_lbksd, v_lbksd, layer, chunk, extra, extra_valid=None, lo_b=None):
    """:func:`walk_cache` where each row reads only its own chunks: query ``(b, t)`` sees the slots
    ``lo[b] <= s < limit[b, t]`` as there, but the walk visits row ``b``'s chunks
    ``floor(lo[b] / C) .. ceil(max_t limit[b, t] / C) - 1`` alone, ``B`` (row, chunk) pairs per step, so
    what it reads is the sum of the rows' filled lengths, not ``B`` times the longest. A batch whose rows
    hold texts of different lengths (a stream's slots, prompts of different lengths) then costs what its
    texts cost; :func:`walk_cache` reads every row up to the longest row's limit.

    Each step gathers the pairs' chunks ``[I, K, C, D]`` (``I = B`` lanes), takes each pair's partial
    softmax and folds it into its row's running one (two pairs of one row in a step are folded together).
    Every lane of a step does a whole chunk's work, the last step's spare ones too, so ``chunk`` is best
    small (the walk's small chunk): in chunks of 512 a batch with one long row cost as much as
    :func:`walk_cache`. ``chunk`` must tile the cache."""
    b, _, kv, _, d = q_btkgd.shape
    slots = k_lbksd.shape[3]
    q_bkgtd, lo_bt, state = _begin(q_btkgd, extra, extra_valid, lo_b)
    top_b = jnp.max(limit_bt, axis=1)
    # A window's first slot is negative near the sequence start (see walk_cache).
    first_b = jnp.zeros((b,), jnp.int32) if lo_b is None else jnp.maximum(jnp.min(lo_bt, axis=1), 0) // chunk
    count_b = jnp.maximum((top_b + chunk - 1) // chunk - first_b, 0)  # a row with nothing to see: no chunk
    if lo_bt is not None:
        count_b = jnp.where(jnp.any(limit_bt > lo_bt, axis=1), count_b, 0)
    end_b = jnp.cumsum(count_b)  # pairs of rows 0..b
    start_b = end_b - count_b
    total = end_b[-1]
    layer = jnp.asarray(layer, jnp.int32)
    zero = jnp.zeros((), jnp.int32)

    def read(buf, row, start):  # one chunk of one row: [K, C, D]
        return jax.lax.dynamic_slice(buf, (layer, row, zero, start, zero), (1, 1, kv, chunk, d))[0, 0]

    def one(step, state):
        pair_i = step * b + jnp.arange(b, dtype=jnp.int32)  # this step's pairs, one per lane
        # the last step's spare lanes read the last pair's chunk again, with nothing visible
        at_i = jnp.minimum(pair_i, total - 1)
        row_i = jnp.sum(end_b[None, :] <= at_i[:, None], axis=1, dtype=jnp.int32)  # searchsorted: a loop
        start_i = jnp.minimum(first_b[row_i] + at_i - start_b[row_i], slots // chunk - 1) * chunk
        k_i, v_i = (jax.vmap(functools.partial(read, buf))(row_i, start_i) for buf in (k_lbksd, v_lbksd))
        q_i = q_bkgtd[row_i]  # [I, K, G, T, D]
        scores = jnp.einsum("ikgtd,ikcd->ikgtc", q_i, k_i.astype(q_i.dtype),
                            preferred_element_type=jnp.float32) * d**-0.5
        slots_ic = start_i[:, None] + jnp.arange(chunk)
        visible = (slots_ic[:, None, :] < limit_bt[row_i][:, :, None]) & (pair_i < total)[:, None, None]
        if lo_bt is not None:
            visible &= slots_ic[:, None, :] >= lo_bt[row_i][:, :, None]
        part = online_update(empty_state(scores.shape[:-1], d), scores, visible, v_i)
        return fold_rows(state, row_i, part)

    state = jax.lax.fori_loop(0, (total + b - 1) // b, one, state)
    return finish(state)


def fold_rows(state, row_i, part):
    """Folds the finished partial softmaxes ``part`` of pairs ``i`` (``[I, K, G, T]`` and ``[I, K, G, T,
    D]``) into the running ones of their rows ``row[i]`` (``[B, ...]``); rows that no pair names are left
    as they are (their scale is exactly 1). A pair that saw no key has max NEG and sum 0: it adds 0."""
    m, l, acc = state
    m_i, l_i, acc_i = part
    m_new = m.at[row_i].max(m_i)
    scale = jnp.exp(m - m_new)
    scale_i = jnp.exp(m_i - m_new[row_i])
    l = (l * scale).at[row_i].add(l_i * scale_i)
    acc = (acc * scale[..., None]).at[row_i].add(acc_i * scale_i[..., None])
    return m_new, l, acc


def extra_update(state, q_bkgtd, extra, extra_valid=None):
    """Folds the ``E`` extra keys and values ``extra = (k [B, E, K, D], v [B, E, K, D])`` into the online
    softmax ``state``: every query sees every extra key, or those where ``extra_valid`` (``[B, E]``) holds."""
    b, _, _, t, d = q_bkgtd.shape
    k_e, v_e = extra
    scores = jnp.einsum("bkgtd,bekd->bkgte", q_bkgtd, k_e.astype(q_bkgtd.dtype),
                        preferred_element_type=jnp.float32) * d**-0.5
    visible = jnp.ones((b, t, k_e.shape[1]), bool) if extra_valid is None else jnp.broadcast_to(
        extra_valid[:, None, :], (b, t, k_e.shape[1]))
    return online_update(state, scores, visible, v_e.swapaxes(1, 2))


def finish(state):
    """The attention output ``[B, T, H, D]`` (float32) of a finished online softmax ``state`` (``[B, K, G,
    T]`` and ``[B, K, G, T, D]``); a query that saw no key gets zeros."""
    _, l, acc = state
    b, kv, g, t, d = acc.shape
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # [B, K, G, T, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, kv * g, d)


def cache_chunk(buf_lbksd, layer, start, chunk: int, first_row=None, rows: int | None = None):
    """Slots ``start .. start + C - 1`` of layer ``layer``, ``[B, K, C, D]``, read from the stacked cache
    in one slice (of ``rows`` rows from ``first_row``, when given: a row view's). Taking the layer first
    and then the chunk would give XLA a slice that does not depend on the chunk, which it hoists out of the
    walk: a copy of the whole layer at every call. The cache is head-major, so the chunk is already laid
    out as both products take it (no transpose per chunk)."""
    _, b, kv, _, d = buf_lbksd.shape
    zero = jnp.zeros((), jnp.int32)
    row = zero if first_row is None else jnp.asarray(first_row, jnp.int32)
    index = (jnp.asarray(layer, jnp.int32), row, zero, jnp.asarray(start, jnp.int32), zero)
    return jax.lax.dynamic_slice(buf_lbksd, index, (1, b if rows is None else rows, kv, chunk, d))[0]


def online_update(state, scores_bkgtc, visible_btc, v_bkcd):
    """One step of the online softmax: folds the visible scores of one chunk of keys and their values
    into ``state = (running max, running sum, weighted values)``."""
    return softmax_step(state, scores_bkgtc, visible_btc[:, None, None], lambda p: jnp.einsum(
        "bkgtc,bkcd->bkgtd", p.astype(v_bkcd.dtype), v_bkcd, preferred_element_type=jnp.float32))


def softmax_step(state, scores, visible, weighted_values):
    """:func:`online_update` for any layout (also inside a Pallas kernel): ``scores`` ``[..., C]`` of one
    block of keys, ``visible`` broadcast to them, ``weighted_values(p)`` the product of the probabilities
    ``p`` ``[..., C]`` with the block's values, in float32 (``[..., D]``); ``state``'s max and sum are
    ``[...]``, its weighted values ``[..., D]``."""
    m, l, acc = state
    # Hidden scores are -inf and the running max is at least the finite NEG, so exp(score - max) is
    # exactly 0 for them (no second mask) and nothing is ever -inf - -inf (NaN), also in a chunk or a
    # row where every slot is hidden.
    scores = jnp.where(visible, scores, -jnp.inf)
    m_new = jnp.maximum(jnp.maximum(m, jnp.max(scores, axis=-1)), NEG)
    p = jnp.exp(scores - m_new[..., None])
    scale = jnp.exp(m - m_new)
    l = l * scale + jnp.sum(p, axis=-1)
    return m_new, l, acc * scale[..., None] + weighted_values(p)
