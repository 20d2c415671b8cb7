"""The decode loops update their KV caches in place and read only what they attend to: the compiled
while-loop bodies hold no copy or transpose of a cache-sized buffer and no result of any kind as large as
one layer of the cache, other than the in-place writes; the whole program holds no copy of a whole cache
(read from the optimised HLO, after XLA's copy insertion, at a small and a large buffer)."""

import os
import re

import jax
import numpy as np
import pytest
from flax import nnx

import retrace_jax as rj
from benchmarks.hlo import computations, loop_lines
from retrace_jax.decoding.buffers import empty_cache
from retrace_jax.decoding.plain import plain_generate
from retrace_jax.decoding.sampling import SamplingParams
from retrace_jax.decoding.speculative import speculative_generate
from retrace_jax.models.tiny import tiny_target


def loop_copies(hlo: str, min_elements: int) -> list[str]:
    """Copy and transpose instructions of at least ``min_elements`` inside the entry's while loops
    (and everything they call)."""
    found = []
    for _, line in loop_lines(hlo):
        op = re.search(r"= \w+\[([\d,]+)\]\{[^}]*\} (copy|transpose)\(", line)
        if op and np.prod([int(x) for x in op.group(1).split(",")]) >= min_elements:
            found.append(line.strip())
    return found


# Instructions that name buffers without computing them, and the cache writes (in place).
PASS_THROUGH = {"parameter", "get-tuple-element", "tuple", "bitcast", "while", "call", "conditional"}
WRITES = {"scatter", "dynamic-update-slice"}


def layer_sized(hlo: str, layer_elements: int, weight_shapes=()) -> list[str]:
    """Instructions inside the entry's while loops whose result (or any part of a tuple result) has at
    least ``layer_elements`` elements, whatever their opcode, except buffers passed through, the
    in-place cache writes (a scatter or dynamic-update-slice, alone or as the root of a fusion) and
    results shaped as one layer's weights (``weight_shapes``, leading 1s aside: the prefill's scan
    slices each layer's weights once per call, which ``test_the_unrolled_loop_holds_one_copy...`` and
    ``benchmarks.hlo.weight_copies`` look at)."""
    weights = {tuple(s) for s in weight_shapes}
    comps = computations(hlo)
    roots = {}
    for name, lines in comps.items():
        for line in lines:
            root = re.search(r"ROOT %?[\w.\-]+ = .*?\} ([\w\-]+)\(", line)
            if root:
                roots[name] = root.group(1)
    found = []
    for _, line in loop_lines(hlo):
        head = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (\(.*?\)|\w+\[[\d,]*\]\{[^}]*\}|\w+\[[\d,]*\]) ([\w\-]+)\(", line)
        if not head:
            continue
        shapes = [tuple(int(x) for x in dims.split(",") if x) for dims in re.findall(r"\w+\[([\d,]*)\]",
                                                                                    head.group(1))]
        if len(shapes) == 1 and _squeezed(shapes[0]) in weights:
            continue
        sizes = [np.prod(shape, dtype=np.int64) for shape in shapes]
        if not sizes or max(sizes) < layer_elements:
            continue
        opcode = head.group(2)
        called = re.search(r"calls=%?([\w.\-]+)", line)
        if opcode in PASS_THROUGH or opcode in WRITES or (opcode == "fusion" and called
                                                         and roots.get(called.group(1)) in WRITES):
            continue
        found.append(line.strip()[:300])
    return found


def _squeezed(shape):
    while shape and shape[0] == 1:
        shape = shape[1:]
    return tuple(shape)


def weight_shapes(target) -> set:
    """One layer's weight shapes, as stacked (leading layer axis dropped) and with the output axes of a
    kernel merged (how XLA may bitcast a slice: ``[d, K, R + 2, D]`` -> ``[d, K*(R+2)*D]``)."""
    import jax

    shapes = set()
    for x in jax.tree.leaves(nnx.state(target.layers)):
        one = tuple(x.shape[1:])
        shapes |= {one, (one[0], int(np.prod(one[1:])))} if len(one) >= 2 else {one}
    return shapes


def whole_copies(hlo: str, shape: tuple[int, ...]) -> list[str]:
    """Copy instructions anywhere in the program whose result has exactly ``shape`` (a whole cache: for
    example the one zero buffer that XLA makes for two identical caches, then copies for each)."""
    dims = ",".join(map(str, shape))
    return [line.strip() for line in hlo.splitlines() if re.search(rf"= \w+\[{dims}\]\{{[^}}]*\}} copy\(", line)]


def users_hlo(lowered) -> str:
    """The optimised HLO as users' programs compile it: ``tests/conftest.py`` turns XLA's fusion emitters
    off to compile faster, which changes how XLA fuses, so it is turned back on for this compilation."""
    if "--xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", ""):
        return lowered.compile({"xla_cpu_use_fusion_emitters": True}).as_text()
    return lowered.compile().as_text()


def _inputs():
    target = tiny_target()
    tokens = np.zeros((2, 16), np.int32)
    return target, (tokens, np.asarray([5, 9], np.int32), np.ones((2,), bool), np.int32(32),
                    np.full((8,), -1, np.int32), SamplingParams.make())


def _cache_shape(cfg, batch, slots):
    from retrace_jax.attention import cache_slots

    return (cfg.num_layers, batch, cfg.num_kv_heads, cache_slots(slots), cfg.head_dim)


def _one_layer_of_cache(cfg, batch, slots):
    return batch * slots * cfg.num_kv_heads * cfg.head_dim


# Buffers of 1,024, 4,608 and 512 slots (plain; 8 more speculative, within the same allocation): a few
# chunks, many, and small chunks (caches of up to 512 slots are walked in chunks of 128).
CAPACITIES = (512, 4096, 480)
_HLO: dict = {}


def program_hlo(program: str, layer_loop: str, capacity: int):
    """The users' optimised HLO of a decode program as ``generate`` calls it (decoding in donated spare
    caches: retrace_jax/decoding/buffers.py), the cache shapes and one layer's element count."""
    key = (program, layer_loop, capacity)
    if key not in _HLO:
        target, args = _inputs()
        tdef, tstate = nnx.split(target)
        if program == "plain":
            slots = 16 + capacity
            spare = empty_cache(target.cfg, 2, slots, target.dtype)
            lowered = plain_generate.lower(tdef, tstate, *args, capacity=capacity, layer_loop=layer_loop,
                                           spare=spare)
            shapes = [_cache_shape(target.cfg, 2, slots)]
        else:
            slots = 16 + capacity + 8
            retrace = rj.ReTraceConfig(hints="tokens", mixture="target") if program == "retrace" else None
            drafter = rj.init_drafter(target.cfg, mask_token_id=511, num_layers=2, block_size=8, retrace=retrace)
            ddef, dstate = nnx.split(drafter)
            spare = (empty_cache(target.cfg, 2, slots, target.dtype), empty_cache(drafter.cfg, 2, slots, drafter.dtype))
            lowered = speculative_generate.lower(tdef, tstate, ddef, dstate, *args, capacity=capacity, block_size=8,
                                                 layer_loop=layer_loop, spare=spare)
            shapes = [_cache_shape(target.cfg, 2, slots), _cache_shape(drafter.cfg, 2, slots)]
        from retrace_jax.attention import cache_slots
        layer = _one_layer_of_cache(target.cfg, 2, cache_slots(slots))
        _HLO[key] = (users_hlo(lowered), shapes, layer, weight_shapes(target))
    return _HLO[key]


# "retrace": a ReTrace drafter with every memory option that adds a buffer (token hints, the mixture)
CASES = [(p, loop, c) for p in ("plain", "speculative", "retrace") for loop in ("unrolled", "scan") for c in CAPACITIES]


def _in_default_suite(program, layer_loop, capacity):
    if program == "retrace":  # the same loop with the memory's buffers: one case by default
        return layer_loop == "unrolled" and capacity == CAPACITIES[0]
    return layer_loop == "unrolled" or capacity == CAPACITIES[0]


@pytest.mark.parametrize("program,layer_loop,capacity", [
    case if _in_default_suite(*case) else pytest.param(*case, marks=pytest.mark.slow) for case in CASES])
def test_loops_update_caches_in_place_and_read_no_whole_layer(program, layer_loop, capacity):
    hlo, shapes, layer, weights = program_hlo(program, layer_loop, capacity)
    found = loop_copies(hlo, layer) + [c for shape in shapes for c in whole_copies(hlo, shape)]
    found += head_copies(hlo)
    found += layer_sized(hlo, layer, weights)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("program", ["plain", "speculative", "plain-features"])
def test_a_stream_refills_its_slots_without_copying_the_caches(program):
    """``generate(..., slots=N)``'s program (:func:`~retrace_jax.decoding.stream.stream_chunk`): a refill
    prefills the new prompt into the slots' caches in place. Behind a ``lax.cond`` between a one-row and a
    whole-batch refill, XLA copied every cache whole three times per refill (``stream._run_if``). With kept
    features (``feature_layers``) neither the slots' feature buffer nor the harvest's is copied either."""
    from retrace_jax.decoding.stream import prefill_chunk, spare_max_len, stream_chunk, stream_init

    target = tiny_target()
    tdef, tstate = nnx.split(target)
    ddef = dstate = None
    block = 0
    if program == "speculative":
        ddef, dstate = nnx.split(rj.init_drafter(target.cfg, mask_token_id=511, num_layers=2, block_size=8))
        block = 8
    slots, prompt_len, capacity = 4, 64, 512
    chunk = prefill_chunk(prompt_len)
    static = dict(slots=slots, max_len=spare_max_len(prompt_len, capacity, block, chunk), capacity=capacity,
                  block_size=block, feature_layers=(0, 1) if program == "plain-features" else ())
    carry = stream_init(tdef, tstate, ddef, dstate, **static)
    queue = 2 * slots
    args = (carry, np.zeros((queue, prompt_len), np.int32), np.ones((queue,), np.int32), np.int32(0), np.int32(10),
            np.int32(64), np.int32(32), np.full((8,), -1, np.int32), SamplingParams.make())
    hlo = users_hlo(stream_chunk.lower(tdef, tstate, ddef, dstate, *args, harvest_size=queue, chunk=chunk, **static))
    shapes = [leaf.shape for leaf in jax.tree.leaves(carry.step) if leaf.ndim == 5]  # the target's, the drafter's
    assert len(shapes) == (4 if program == "speculative" else 2)
    if program == "plain-features":
        shapes += [carry.features_bsf.shape, (queue,) + carry.features_bsf.shape[1:]]  # the slots', the harvest's
    from retrace_jax.attention import cache_slots

    layer = _one_layer_of_cache(target.cfg, slots, cache_slots(static["max_len"]))
    found = loop_copies(hlo, layer) + [c for shape in set(shapes) for c in whole_copies(hlo, shape)]
    assert not found, "\n".join(found)


def head_copies(hlo: str) -> list[str]:
    """Copies or transposes of the tiny target's whole (tied) LM head inside the loops."""
    cfg = tiny_target().cfg
    head = {f"{cfg.vocab_size},{cfg.hidden_size}", f"{cfg.hidden_size},{cfg.vocab_size}"}
    return [c for c in loop_copies(hlo, 1) if re.search(r"\[([\d,]+)\]", c).group(1) in head]


def test_a_batch_of_one_does_not_copy_the_tied_head_per_step():
    """At batch 1, ``jnp.dot(h, embedding.T)`` made XLA's CPU backend transpose the whole embedding at
    every step; the head contracts the embedding in place."""
    target = tiny_target()
    tdef, tstate = nnx.split(target)
    args = (np.zeros((1, 16), np.int32), np.asarray([5], np.int32), np.ones((1,), bool), np.int32(32),
            np.full((8,), -1, np.int32), SamplingParams.make())
    hlo = users_hlo(plain_generate.lower(tdef, tstate, *args, capacity=512, layer_loop="unrolled"))
    assert not head_copies(hlo)


@pytest.mark.parametrize("program", ["plain", "speculative"])
def test_a_cache_of_one_chunk_is_not_copied_per_layer(program):
    """A cache of up to one small chunk (a short text) is read whole. Read in a walk of at most one
    chunk, the read was loop-invariant; at batch 1 XLA then copied the whole stacked cache before each
    layer's write: L copies of L layers at every step."""
    target = tiny_target()
    tdef, tstate = nnx.split(target)
    args = (np.zeros((1, 16), np.int32), np.asarray([5], np.int32), np.ones((1,), bool), np.int32(48),
            np.full((8,), -1, np.int32), SamplingParams.make())
    if program == "plain":
        slots = 16 + 48
        spare = empty_cache(target.cfg, 1, slots, target.dtype)
        lowered = plain_generate.lower(tdef, tstate, *args, capacity=48, layer_loop="unrolled", spare=spare)
        shapes = [_cache_shape(target.cfg, 1, slots)]
    else:
        slots = 16 + 48 + 8
        drafter = rj.init_drafter(target.cfg, mask_token_id=511, num_layers=2, block_size=8)
        ddef, dstate = nnx.split(drafter)
        spare = (empty_cache(target.cfg, 1, slots, target.dtype), empty_cache(drafter.cfg, 1, slots, drafter.dtype))
        lowered = speculative_generate.lower(tdef, tstate, ddef, dstate, *args, capacity=48, block_size=8,
                                             layer_loop="unrolled", spare=spare)
        shapes = [_cache_shape(target.cfg, 1, slots), _cache_shape(drafter.cfg, 1, slots)]
    hlo = users_hlo(lowered)
    found = [c for shape in shapes for c in whole_copies(hlo, shape)]
    assert not found, "\n".join(found)


def test_detector_finds_a_hoisted_layer_slice():
    """The control: unrolled layers that each write their layer, then walk it in chunks, slicing the
    layer first and the chunk second. The layer's slice does not depend on the chunk, so XLA moves it out
    of the walk: a whole layer read out at every step, which the check finds."""
    import jax
    import jax.numpy as jnp

    def steps(buf, n):
        def step(carry):
            i, buf, acc = carry
            for layer in range(buf.shape[0]):  # constant layer indices, as in the unrolled programs
                buf = buf.at[layer, :, i].set(acc)

                def chunk(j, acc, layer=layer, buf=buf):
                    one_layer = jax.lax.dynamic_index_in_dim(buf, layer, 0, keepdims=False)
                    return acc + jax.lax.dynamic_slice_in_dim(one_layer, j * 64, 64, axis=1).sum()

                acc = jax.lax.fori_loop(0, n, chunk, acc)
            return i + 1, buf, acc

        return jax.lax.while_loop(lambda c: c[0] < 3, step, (0, buf, 0.0))[2]

    hlo = jax.jit(steps).lower(jnp.zeros((4, 2, 512, 2, 32)), 8).compile().as_text()
    assert layer_sized(hlo, 2 * 512 * 2 * 32)


def test_detector_finds_a_copy():
    """The check can fail: a loop that transposes its carry is caught."""
    import jax
    import jax.numpy as jnp

    def loop(x):
        return jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (jnp.swapaxes(c[0], 0, 1) + 1, c[1] + 1), (x, 0))[0]

    hlo = jax.jit(loop).lower(jnp.zeros((64, 64))).compile().as_text()
    assert loop_copies(hlo, 64 * 64)


def test_detector_finds_a_shared_zero_buffer():
    """Two identical zero caches, each updated in place, become one broadcast and two copies."""
    import jax
    import jax.numpy as jnp

    def two(x, i):
        a, b = jnp.zeros((4, 512, 64)), jnp.zeros((4, 512, 64))
        return a.at[0, i].set(x), b.at[1, i].set(x)

    hlo = jax.jit(two).lower(jnp.ones((64,)), 3).compile().as_text()
    assert whole_copies(hlo, (4, 512, 64))


def test_the_unrolled_loop_holds_one_copy_of_the_weights_and_cpu_programs_read_it_in_place(monkeypatch):
    """The unrolled layer loop holds one copy of the weights: on one CPU device views of the stacked
    arrays (no weight-sized instruction in the loop), elsewhere the stacked arrays themselves, which the
    program indexes statically where each layer runs (nothing kept beside the target). XLA's CPU backend
    copies such a static slice at every step, which ``weight_copies`` finds (so a CPU keeps the views);
    ``benchmarks/device_check.py`` counts them on an accelerator. All three give the same tokens."""
    import jax

    from benchmarks.hlo import layer_weight_elements, weight_copies
    from retrace_jax.decoding import layer_loop

    target, args = _inputs()
    tdef, tstate = nnx.split(target)
    sizes = layer_weight_elements(target)
    views = layer_loop.decode_weights(target, "unrolled", tstate)
    assert views.layers is not None
    hlo = users_hlo(plain_generate.lower(tdef, tstate, *args, capacity=64, layer_loop="unrolled", kept=views))
    assert weight_copies(hlo, sizes) == []

    monkeypatch.setattr(layer_loop, "_layer_views", lambda target: None)  # as on an accelerator
    other = rj.tiny.tiny_target()  # a new target: decode_weights keeps one set per target
    odef, ostate = nnx.split(other)
    in_place = layer_loop.decode_weights(other, "unrolled", ostate)
    assert in_place.layers is None  # nothing beside the target but the tied head's [d, V] copy
    assert [x.nbytes for x in jax.tree.leaves(in_place)] == [other.embed_tokens.embedding[...].nbytes]
    hlo = users_hlo(plain_generate.lower(odef, ostate, *args, capacity=64, layer_loop="unrolled", kept=in_place))
    assert len(weight_copies(hlo, sizes)) >= other.cfg.num_layers  # XLA:CPU copies each layer's slices
    copies = layer_loop.decode_weights(other, "unrolled", ostate, per_layer_copies=True)
    assert len(copies.layers) == other.cfg.num_layers

    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    want = rj.generate(target, prompts, 10, layer_loop="scan").tokens
    assert rj.generate(other, prompts, 10, layer_loop="unrolled").tokens == want
    monkeypatch.undo()
    assert rj.generate(target, prompts, 10, layer_loop="unrolled").tokens == want
