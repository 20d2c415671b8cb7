"""Reading XLA's optimised HLO text: its computations and the instructions of its while loops."""

from __future__ import annotations

import re
from collections.abc import Iterator


def computations(hlo: str) -> dict[str, list[str]]:
    """The instruction lines of each computation, by name."""
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


def entry_loops(hlo: str, known_trip_count: bool | None = None) -> list[str]:
    """The body computations of the entry computation's while loops; ``known_trip_count`` True or False:
    only those whose trip count XLA knows (a scan), or only the others (a decode loop)."""
    comps = computations(hlo)
    entry = re.search(r"^ENTRY %?([\w.\-]+) ", hlo, re.M).group(1)
    return [b for line in comps[entry] for b in re.findall(r"while\(.*body=%?([\w.\-]+)", line)
            if known_trip_count is None or ("known_trip_count" in line) == known_trip_count]


def loop_lines(hlo: str, known_trip_count: bool | None = None) -> Iterator[tuple[str, str]]:
    """(computation, line) of every instruction inside the entry's while loops (``known_trip_count``: see
    :func:`entry_loops`), at any depth (the loop bodies and everything they call: fusions, nested loops,
    branches)."""
    comps = computations(hlo)
    stack = entry_loops(hlo, known_trip_count)
    assert stack, "no while loop in the entry computation"
    seen = set()
    while stack:
        name = stack.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            stack += re.findall(r"(?:calls|body|condition|to_apply)=%?([\w.\-]+)", line)
            for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                stack += [x.strip().lstrip("%") for x in group.split(",")]
            yield name, line


# Instructions that name buffers without computing them (a parameter, a tuple's element, a bitcast...).
PASS_THROUGH = {"parameter", "get-tuple-element", "tuple", "bitcast", "while", "call", "conditional"}
WRITES = {"scatter", "dynamic-update-slice"}  # in place (a KV cache's)


def weight_copies(hlo: str, elements: set[int], whole_program: bool = False) -> list[str]:
    """Instructions inside the entry's while loops of unknown trip count (the decode loop, not the prefill's
    scan over the layers, whose trip count XLA knows), at any depth, whose result has exactly as many
    elements as one of ``elements`` (one layer's weight matrices), other than buffers passed through and
    in-place writes (a cache's, alone or as a fusion's root): a
    layer's weights copied (or converted) at every step, where a program should read them in place. XLA's
    CPU backend copies a static slice of a stacked weight into a fusion of its own
    (``slice_bitcast_fusion``); a slice that the product reads in place leaves no such instruction.
    ``whole_program``: every computation's instructions instead (a program of one decode step)."""
    comps = computations(hlo)
    fused = {c for body in comps.values() for line in body if " fusion(" in line
             for c in re.findall(r"calls=%?([\w.\-]+)", line)}  # a fusion counts once, not its insides
    roots = {name: root.group(1) for name, body in comps.items() for line in body
             for root in [re.search(r"ROOT %?[\w.\-]+ = .*?\} ([\w\-]+)\(", line)] if root}
    found = []
    lines = ([(name, line) for name, body in comps.items() for line in body] if whole_program
             else loop_lines(hlo, known_trip_count=False))
    for name, line in lines:
        if name in fused:
            continue
        head = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (\w+)\[([\d,]*)\]\{?[^ ]* ([\w\-]+)\(", line)
        if not head or head.group(3) in PASS_THROUGH or head.group(3) in WRITES:
            continue
        called = re.search(r"calls=%?([\w.\-]+)", line)
        if head.group(3) == "fusion" and called and roots.get(called.group(1)) in WRITES:
            continue  # an in-place write into a cache (which may have a weight's element count)
        size = 1
        for dim in filter(None, head.group(2).split(",")):
            size *= int(dim)
        if size in elements:
            found.append(line.strip()[:200])
    return found


def layer_weight_elements(target) -> set[int]:
    """The element counts of one layer's weight matrices (every stacked parameter of two or more
    dimensions per layer) of a target."""
    import jax
    from flax import nnx

    return {int(x[0].size) for x in jax.tree.leaves(nnx.state(target.layers)) if x.ndim >= 3}
