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


def entry_loops(hlo: str) -> list[str]:
    """The body computations of the entry computation's while loops."""
    comps = computations(hlo)
    entry = re.search(r"^ENTRY %?([\w.\-]+) ", hlo, re.M).group(1)
    return [b for line in comps[entry] for b in re.findall(r"while\(.*body=%?([\w.\-]+)", line)]


def loop_lines(hlo: str) -> Iterator[tuple[str, str]]:
    """(computation, line) of every instruction inside the entry's while loops, at any depth (the loop
    bodies and everything they call: fusions, nested loops, branches)."""
    comps = computations(hlo)
    stack = entry_loops(hlo)
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
