"""Reading collectives off a compiled program's HLO text, by kind, size and mesh axes.

``collectives(compiled, mesh)`` lists every all-gather, all-reduce, all-to-all,
reduce-scatter and collective-permute with the bytes of its result and the mesh axes its
device groups span (a group's devices differ only along those axes). Device ids in the
groups are positions in ``mesh.devices.flat``, as in the partitioned program.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

KINDS = ("all-gather", "all-reduce", "all-to-all", "reduce-scatter", "collective-permute")
_LINE = re.compile(
    r"=\s*(?P<type>\(?[^=]*?\)?)\s+(?P<kind>" + "|".join(KINDS) + r")(?:-start)?\((?P<rest>.*)$"
)
_ARRAY = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|f16|f32|f64)\[([\d,]*)\]")
_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, shape) of each result array
    axes: frozenset[str]  # mesh axes the device groups span
    line: str

    @property
    def nbytes(self) -> int:
        return sum(_BYTES[d] * int(np.prod(s)) for d, s in self.shapes)


def collectives(hlo_text: str, mesh) -> list[Collective]:
    """Every collective in ``hlo_text`` (``compiled.as_text()``), for a program on ``mesh``."""
    out = []
    for line in hlo_text.splitlines():
        m = _LINE.search(line)
        if not m or "-done(" in line:
            continue
        shapes = tuple(
            (dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in _ARRAY.findall(m.group("type"))
        )
        groups = _groups(m.group("kind"), m.group("rest"), mesh.devices.size)
        out.append(Collective(m.group("kind"), shapes, _axes(groups, mesh), line.strip()))
    return out


def _groups(kind: str, rest: str, num_devices: int) -> list[list[int]]:
    if kind == "collective-permute":
        pairs = re.search(r"source_target_pairs=\{([^}]*(?:\}[^}]*)*?)\}\}", rest)
        if not pairs:
            return []
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(0))]
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
    if iota:
        count, size = int(iota.group(1)), int(iota.group(2))
        dims = [int(d) for d in iota.group(3).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if iota.group(4):
            ids = ids.transpose([int(p) for p in iota.group(4).split(",")])
        return ids.reshape(count, size).tolist()
    named = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", rest)
    if named:  # jax 0.12: mesh['pipe'=4,'fsdp'=2] {'fsdp'}, the axes each group spans
        return _mesh_groups(named.group(1), named.group(2))
    listed = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", rest)
    if not listed:
        if "replica_groups=" in rest:
            raise ValueError(f"replica groups in a form this reader does not know: {rest}")
        return []
    if not listed.group(1):  # {}: one group of every device
        return [list(range(num_devices))]
    return [
        [int(i) for i in g.split(",") if i] for g in re.findall(r"\{([\d,]*)\}", listed.group(1))
    ]


def _mesh_groups(mesh_text: str, axes_text: str) -> list[list[int]]:
    """Groups of ``mesh['a'=2,'b'=4] {'b'}``: devices (row-major over the mesh) that differ
    only along the axes in braces."""
    dims = re.findall(r"'([^']+)'=(\d+)", mesh_text)
    names, sizes = [n for n, _ in dims], [int(k) for _, k in dims]
    spanned = [names.index(n) for n in re.findall(r"'([^']+)'", axes_text)]
    kept = [a for a in range(len(names)) if a not in spanned]
    ids = np.arange(int(np.prod(sizes))).reshape(sizes).transpose(kept + spanned)
    return ids.reshape(-1, int(np.prod([sizes[a] for a in spanned]))).tolist()


def _axes(groups: list[list[int]], mesh) -> frozenset[str]:
    """The mesh axes along which devices of one group differ."""
    names = tuple(mesh.axis_names)
    shape = tuple(mesh.devices.shape)
    spanned = set()
    for group in groups:
        coords = np.array([np.unravel_index(i, shape) for i in group])
        if len(coords) > 1:
            spanned |= {names[a] for a in range(len(names)) if len(set(coords[:, a])) > 1}
    return frozenset(spanned)


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """Computation name -> its instruction lines, and the entry computation's name."""
    computations, name, entry = {}, None, None
    for line in hlo_text.splitlines():
        match = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if match:
            name = match.group(2)
            computations[name] = []
            entry = name if match.group(1) else entry
        elif name and line.startswith(" "):
            computations[name].append(line)
    return computations, entry


def _reachable(computations, start, edges: str, guarded=frozenset()):
    """Computations reachable from ``start`` through the attributes named in ``edges``, but
    not into the ``guarded`` ones."""
    seen, stack = set(), list(start)
    while stack:
        name = stack.pop()
        if name in seen or name not in computations or name in guarded:
            continue
        seen.add(name)
        for line in computations[name]:
            stack += re.findall(rf"\b(?:{edges})=%?([\w.\-]+)", line)
    return seen


def _flag_loop_bodies(computations) -> set[str]:
    """Bodies of the while loops whose condition is a carried boolean, as is that of a
    ``lax.while_loop`` of one trip or none: whether the body runs is data, as whether a
    branch does."""
    bodies = set()
    for lines in computations.values():
        for line in lines:
            match = re.search(r"\bwhile\(.*\bcondition=%?([\w.\-]+), body=%?([\w.\-]+)", line)
            if not match:
                continue
            root = [c for c in computations.get(match.group(1), []) if "ROOT" in c]
            if root and re.search(r"= pred\[\] get-tuple-element\(", root[0]):
                bodies.add(match.group(2))
    return bodies


def loop_dots_outside_branches(hlo_text: str) -> list[str]:
    """The matmuls (dot, convolution) that the program's outermost while loops run whatever
    branch a ``conditional`` takes: everything reachable from such a loop's body except
    through a conditional's branches or the body of a loop guarded by a carried flag (a
    loop of one trip or none). Empty when every matmul of the loop sits in such a branch,
    so that a device computes only the branch it takes."""
    computations, entry = _computations(hlo_text)
    outside_loops = _reachable(computations, [entry], "calls|to_apply")
    bodies = [
        body
        for name in outside_loops
        for line in computations[name]
        for body in re.findall(r"\bwhile\(.*\bbody=%?([\w.\-]+)", line)
    ]
    guarded = _flag_loop_bodies(computations) - set(bodies)
    loop = _reachable(computations, bodies, "calls|to_apply|body|condition", guarded)
    return [
        line.strip()
        for name in loop
        for line in computations[name]
        if re.search(r"\s(dot|convolution)\(", line)
    ]
