"""What the tests read of a compiled program's HLO text, on top of `jaxpipe.analysis.hlo`.

``collectives(hlo_text, mesh)`` is the reader's list of collectives, strict about device
groups (a form the reader does not know fails the test instead of reading as no axis), with
each collective's mesh axes as a set. ``loop_dots_outside_branches`` finds the matmuls a
pipeline's loop runs whichever branch its devices take.
"""

from __future__ import annotations

import dataclasses
import re

from jaxpipe.analysis import hlo as reader


def collectives(hlo_text: str, mesh) -> list[reader.Collective]:
    """`jaxpipe.analysis.hlo.collectives` of ``hlo_text`` (strict), each one's ``axes`` a
    frozenset of mesh axis names."""
    found = reader.collectives(hlo_text, mesh, strict=True)
    return [dataclasses.replace(c, axes=frozenset(c.axes)) for c in found]


def _flag_loop_bodies(computations) -> set[str]:
    """Bodies of the while loops whose condition is a carried boolean, as is that of a
    ``lax.while_loop`` of one trip or none: whether the body runs is data, as whether a
    branch does."""
    bodies = set()
    for lines in computations.values():
        for line in lines:
            if reader.opcode(line) != "while":
                continue
            condition, body = reader.called(line, ("condition",)), reader.called(line, ("body",))
            root = [c for c in computations.get(condition[0], []) if "ROOT" in c]
            if root and re.search(r"= pred\[\] get-tuple-element\(", root[0]):
                bodies.add(body[0])
    return bodies


def loop_dots_outside_branches(hlo_text: str) -> list[str]:
    """The matmuls (dot, convolution) that the program's outermost while loops run whatever
    branch a ``conditional`` takes: everything reachable from such a loop's body except
    through a conditional's branches or the body of a loop guarded by a carried flag (a
    loop of one trip or none). Empty when every matmul of the loop sits in such a branch,
    so that a device computes only the branch it takes."""
    computations, entry = reader.computations(hlo_text)
    outside_loops = reader.reachable(computations, [entry], ("calls", "to_apply"))
    bodies = [
        body
        for name in outside_loops
        for line in computations[name]
        if reader.opcode(line) == "while"
        for body in reader.called(line, ("body",))
    ]
    guarded = _flag_loop_bodies(computations) - set(bodies)
    through = ("calls", "to_apply", "body", "condition")
    loop = reader.reachable(computations, bodies, through, guarded)
    return [
        line.strip()
        for name in loop
        for line in computations[name]
        if reader.opcode(line) in ("dot", "convolution")
    ]
