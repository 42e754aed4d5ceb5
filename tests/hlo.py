"""What the tests read of a compiled program's HLO text, on top of `jaxpipe.analysis.hlo`.

``collectives(hlo_text, mesh)`` is the reader's list of collectives, strict about device
groups (a form the reader does not know fails the test instead of reading as no axis), with
each collective's mesh axes as a set; ``operand_types`` says what a collective's operands
hold where a compiler has flattened and concatenated them into one buffer.
``loop_dots_outside_branches`` finds the matmuls a pipeline's loop runs whichever branch its
devices take.
"""

from __future__ import annotations

import dataclasses

from jaxpipe.analysis import hlo as reader


def collectives(hlo_text: str, mesh) -> list[reader.Collective]:
    """`jaxpipe.analysis.hlo.collectives` of ``hlo_text`` (strict), each one's ``axes`` a
    frozenset of mesh axis names."""
    found = reader.collectives(hlo_text, mesh, strict=True)
    return [dataclasses.replace(c, axes=frozenset(c.axes)) for c in found]


def _flag_loop_bodies(computations) -> set[str]:
    """Bodies of the while loops guarded by a carried boolean (`reader.flag_loop`), as is
    that of a ``lax.while_loop`` of one trip or none: whether the body runs is data, as
    whether a branch does."""
    return {
        body
        for lines in computations.values()
        for line in lines
        if reader.opcode(line) == "while" and reader.flag_loop(line, computations)
        for body in reader.called(line, ("body",))
    }


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


class Definitions(dict):
    """Each instruction's name -> its line, over every computation of a program."""

    def __init__(self, hlo_text: str):
        self.computations, _ = reader.computations(hlo_text)
        for lines in self.computations.values():
            self.update(reader.definitions(lines))

    def roots(self, computation: str) -> list[str]:
        """The ROOT line of ``computation`` (a list: empty if there is none)."""
        return [line for line in self.computations.get(computation, []) if "ROOT" in line]


_MOVES = ("bitcast", "copy", "reshape", "concatenate")


def operand_types(line: str, definitions: Definitions, depth: int = 0) -> list[str]:
    """Type texts of what an instruction's operands hold: each operand's own type, or where
    it is a bitcast, copy, reshape or concatenation (also a fusion whose root concatenates,
    as the GPU compiler's ``wrapped_concatenate`` that packs the operands of several
    combined collectives into one flat buffer) the types of what it was made from."""
    if depth > 8:
        return []
    types = []
    for name in reader.operands(line):
        source = definitions.get(name)
        if source is None:
            continue
        op = reader.opcode(source)
        concatenates = op == "fusion" and any(
            reader.opcode(root) == "concatenate"
            for called in reader.called(source, ("calls",))
            for root in definitions.roots(called)
        )
        if op in _MOVES or concatenates:
            types += operand_types(source, definitions, depth + 1)
        else:
            types.append(reader.result_type(source))
    return types
