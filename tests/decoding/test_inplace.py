"""The decode loops update their KV caches in place: the compiled while-loop bodies hold no copy or
transpose of a cache-sized buffer, and the whole program holds no copy of a whole cache (read from the
optimised HLO, after XLA's copy insertion)."""

import os
import re

import numpy as np
import pytest
from flax import nnx

import retrace_jax as rj
from retrace_jax.decoding.plain import plain_generate
from retrace_jax.decoding.sampling import SamplingParams
from retrace_jax.decoding.speculative import speculative_generate
from retrace_jax.models.tiny import tiny_target


def _computations(hlo: str) -> dict[str, list[str]]:
    comps, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            name = head.group(1)
            comps[name] = []
        elif line.startswith("}"):
            name = None
        elif name:
            comps[name].append(line)
    return comps


def loop_copies(hlo: str, min_elements: int) -> list[str]:
    """Copy and transpose instructions of at least ``min_elements`` inside the entry's while loops
    (and everything they call)."""
    comps = _computations(hlo)
    entry = re.search(r"^ENTRY %?([\w.\-]+) ", hlo, re.M).group(1)
    stack = [b for line in comps[entry] for b in re.findall(r"while\(.*body=%?([\w.\-]+)", line)]
    assert stack, "no while loop in the entry computation"
    seen, found = set(), []
    while stack:
        name = stack.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            stack += re.findall(r"(?:calls|body|condition|to_apply)=%?([\w.\-]+)", line)
            for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                stack += [x.strip().lstrip("%") for x in group.split(",")]
            op = re.search(r"= \w+\[([\d,]+)\]\{[^}]*\} (copy|transpose)\(", line)
            if op and np.prod([int(x) for x in op.group(1).split(",")]) >= min_elements:
                found.append(line.strip())
    return found


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

    return (cfg.num_layers, batch, cache_slots(slots), cfg.num_kv_heads, cfg.head_dim)


def _one_layer_of_cache(cfg, batch, slots):
    return batch * slots * cfg.num_kv_heads * cfg.head_dim


@pytest.mark.parametrize("layer_loop", ["scan", "unrolled"])
def test_plain_loop_updates_cache_in_place(layer_loop):
    target, args = _inputs()
    graphdef, state = nnx.split(target)
    hlo = users_hlo(plain_generate.lower(graphdef, state, *args, capacity=512, layer_loop=layer_loop))
    copies = loop_copies(hlo, _one_layer_of_cache(target.cfg, 2, 16 + 512))
    copies += whole_copies(hlo, _cache_shape(target.cfg, 2, 16 + 512))
    assert not copies, "\n".join(copies)


@pytest.mark.parametrize("layer_loop", ["scan", "unrolled"])
def test_speculative_loop_updates_both_caches_in_place(layer_loop):
    target, args = _inputs()
    drafter = rj.init_drafter(target.cfg, mask_token_id=511, num_layers=2, block_size=8)
    (tdef, tstate), (ddef, dstate) = nnx.split(target), nnx.split(drafter)
    hlo = users_hlo(speculative_generate.lower(tdef, tstate, ddef, dstate, *args, capacity=512, block_size=8,
                                               layer_loop=layer_loop))
    copies = loop_copies(hlo, _one_layer_of_cache(target.cfg, 2, 16 + 512 + 8))
    copies += whole_copies(hlo, _cache_shape(target.cfg, 2, 16 + 512 + 8))
    copies += whole_copies(hlo, _cache_shape(drafter.cfg, 2, 16 + 512 + 8))
    assert not copies, "\n".join(copies)


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
