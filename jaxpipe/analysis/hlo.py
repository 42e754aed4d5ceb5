"""Reading a compiled program's HLO text (``compiled.as_text()``): types, collectives, loops.

The one reader of XLA's printed programs in jaxpipe: `jaxpipe.target` reports with it and
the tests read compiled steps with it. It reads what XLA prints, on CPU, TPU and GPU:

- a type's arrays and their bytes (`arrays`, `nbytes`), float8 types included;
- the collectives (`collectives`): kind, bytes of the result on one device, the mesh axes
  their device groups span (groups in a form it does not know read as every device, and
  the collective marked unread), whether they sit in a loop, and for an asynchronous pair
  (``-start`` and ``-done``) whether a computation is scheduled between the two. An async
  pair counts once, at its ``-start``, with the bytes of its results only (a start's type
  also lists its operands and context words);
- the instructions of a computation by name (`definitions`) and the names of an
  instruction's operands (`operands`);
- the computations and what calls what (`computations`, `called`, `reachable`), and which
  computations run inside a while loop (`loop_computations`), how many times a loop runs
  (`trip_count`), and which is the program's outermost loop (`outer_loop`);
- how many times each instruction runs along the heaviest path through the program
  (`heaviest_runs`): a loop's body its trip count times, of a conditional's branches the
  one that weighs most, and so of the loops of one trip or none guarded by a carried flag
  (`flag_loop`); and the loops whose trip count cannot be read (`uncounted_loops`).
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

__all__ = [
    "DTYPE_BYTES",
    "KINDS",
    "Collective",
    "arrays",
    "called",
    "collectives",
    "computations",
    "definitions",
    "device_groups",
    "flag_loop",
    "has_loop",
    "heaviest_runs",
    "loop_computations",
    "nbytes",
    "opcode",
    "operands",
    "outer_loop",
    "reachable",
    "result_type",
    "trip_count",
    "uncounted_loops",
]

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "bf16": 2, "f16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e3m4": 1, "f8e4m3": 1, "f8e4m3fn": 1, "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1,
    "f8e5m2": 1, "f8e5m2fnuz": 1, "f8e8m0fnu": 1,
}  # fmt: skip
# the attributes by which an instruction names the computations it runs
CALL_ATTRIBUTES = (
    "calls", "to_apply", "body", "condition", "true_computation", "false_computation",
    "branch_computations",
)  # fmt: skip

_DTYPES = "|".join(sorted(DTYPE_BYTES, key=len, reverse=True))
_ARRAY = re.compile(rf"\b({_DTYPES})\[([\d,]*)\]")
_LINE = re.compile(
    r"=\s*(?P<type>\(?[^=]*?\)?)\s+(?P<kind>" + "|".join(KINDS) + r")(?P<start>-start)?\("
    r"(?P<rest>.*)$"
)
_INDEX_COMMENT = re.compile(r"/\*index=\d+\*/")


# ----------------------------------------------------------------------------- types
def arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """The arrays of an HLO type, in order.

    Args:
        type_text: a type as HLO prints it: ``f32[8,16]{1,0}``, or a tuple of types.

    Returns:
        ``(dtype, dimensions)`` of every array in it (a scalar has no dimensions); types
        of no known size (tokens, sub-byte types) are left out.
    """
    return [
        (dtype, tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims in _ARRAY.findall(type_text)
    ]


def nbytes(type_text: str) -> int:
    """Bytes of every array of an HLO type (`arrays`)."""
    return sum(DTYPE_BYTES[dtype] * math.prod(dims) for dtype, dims in arrays(type_text))


def _elements(type_text: str) -> list[str]:
    """The top-level elements of a tuple type ``(a, (b, c), d)``: ``["a", "(b, c)", "d"]``."""
    elements, depth, begin = [], 0, 1
    for i, ch in enumerate(type_text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if (ch == "," and depth == 1) or depth == 0:
            elements.append(type_text[begin:i].strip())
            begin = i + 1
        if depth == 0:
            break
    return [e for e in elements if e]


def _result_bytes(kind: str, type_text: str, is_start: bool) -> int:
    """Bytes of a collective's results on one device. A synchronous collective's type is
    its results, as is an async ``-start``'s that is not a tuple. A tuple ``-start``
    prints ``((operands...), results..., context...)``, or on some compilers a flat
    ``(operands..., results..., context...)``: its results are the second element of the
    first form, and the second half of the arrays of the second, whose scalars are
    context words."""
    if not is_start or not type_text.startswith("("):
        return nbytes(type_text)
    nested = _elements(type_text) if type_text.startswith("((") else []
    if len(nested) > 1:  # the results, scalars included
        return int(sum(DTYPE_BYTES[d] * math.prod(dims) for d, dims in arrays(nested[1])))
    sizes = [DTYPE_BYTES[d] * math.prod(dims) for d, dims in arrays(type_text) if dims]
    if not nested and kind in ("collective-permute", "all-gather") and len(sizes) > 1:
        sizes = sizes[len(sizes) // 2 :]
    return int(sum(sizes))


# ----------------------------------------------------------------------------- computations
def computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    """The computations of an HLO module.

    Args:
        hlo_text: a module as ``compiled.as_text()`` prints it.

    Returns:
        ``(computations, entry)``: each computation's name -> its instruction lines (in the
        order printed, which in a scheduled module is the order they run), and the name of
        the entry computation (None if there is none).
    """
    found, name, entry = {}, None, None
    for line in hlo_text.splitlines():
        match = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if match:
            name = match.group(2)
            found[name] = []
            entry = name if match.group(1) else entry
        elif name and line.startswith(" "):
            found[name].append(line)
    return found, entry


_INSTRUCTION = re.compile(r"=\s*(?P<type>\(.*?\)|\S+)\s+(?P<opcode>[a-z][a-z\-]*)\(")


def opcode(line: str) -> str | None:
    """The opcode of an instruction line (``dot``, ``while``, ``all-reduce-start``), or
    None for a line that is not an instruction."""
    match = _INSTRUCTION.search(line)
    return match.group("opcode") if match else None


def result_type(line: str) -> str | None:
    """The type of an instruction's result as printed (``f32[8]{0}``, or a tuple type), or
    None for a line that is not an instruction."""
    match = _INSTRUCTION.search(line)
    return match.group("type") if match else None


def called(line: str, through: tuple[str, ...] = CALL_ATTRIBUTES) -> list[str]:
    """The computations an instruction runs.

    Args:
        line: an instruction line.
        through: which of its attributes to follow (`CALL_ATTRIBUTES` by default; leave
            out ``"branch_computations"``, say, to stay out of a conditional's branches).

    Returns:
        The names of the computations, in the order the line names them.
    """
    names = []
    single = [a for a in through if a != "branch_computations"]
    if single:
        names += re.findall(rf"\b(?:{'|'.join(single)})=%?([\w.\-]+)", line)
    if "branch_computations" in through:
        for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
            names += [n.strip().lstrip("%") for n in group.split(",")]
    return names


def reachable(
    comps: dict[str, list[str]],
    start,
    through: tuple[str, ...] = CALL_ATTRIBUTES,
    excluded=frozenset(),
) -> set[str]:
    """The computations ``start`` runs, directly or not, themselves included.

    Args:
        comps: `computations` of a module.
        start: names of computations to start from.
        through: the attributes to follow (see `called`).
        excluded: computations not to enter (nor what only they run).

    Returns:
        The names reached.
    """
    seen, stack = set(), list(start)
    while stack:
        name = stack.pop()
        if name in seen or name not in comps or name in excluded:
            continue
        seen.add(name)
        for line in comps[name]:
            stack += called(line, through)
    return seen


def loop_computations(comps: dict[str, list[str]]) -> set[str]:
    """The computations that run inside some while loop's body or condition."""
    loops = [
        name
        for lines in comps.values()
        for line in lines
        if has_loop(line)
        for name in called(line, ("body", "condition"))
    ]
    return reachable(comps, loops)


def has_loop(hlo_text: str) -> bool:
    """Whether a module runs a while loop."""
    return re.search(r"\swhile\(", hlo_text) is not None


_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_COMPARE = re.compile(r"\bcompare\(%?([\w.\-]+),\s*%?([\w.\-]+)\),\s*direction=(LT|GT)\b")
_FLAG_ROOT = re.compile(r"=\s*pred\[\](\{[^}]*\})?\s+get-tuple-element\(")
_DEFINED = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
# instructions that pass their one operand's value on unchanged
_PASSING = ("copy", "bitcast", "convert", "copy-start", "copy-done", "reshape")


def definitions(lines: list[str]) -> dict[str, str]:
    """Each instruction's name -> its line, in one computation (or in any list of
    instruction lines)."""
    found = {}
    for line in lines:
        match = _DEFINED.match(line)
        if match:
            found[match.group(1)] = line
    return found


def operands(line: str) -> list[str]:
    """The names of an instruction's operands (those of its first parenthesis), also where
    the compiler prints each operand's type before its name."""
    match = re.search(r"\s[a-z][a-z\-]*\((.*?)\)(?:,|$)", _INDEX_COMMENT.sub("", line))
    if not match:
        return []
    named = re.findall(r"%([\w.\-]+)", match.group(1))
    if named:  # a type's commas (f32[8,4]{1,0} %x) are not the operands'
        return named
    return [o.strip().split()[-1] for o in match.group(1).split(",") if o.strip()]


def _constant(name: str, defs: dict[str, str]) -> int | None:
    """The integer an instruction holds: a scalar ``constant``, through copies, bitcasts
    and conversions; None for anything else."""
    line = defs.get(_passed(name, defs), "")
    value = re.search(r"\bconstant\((-?\d+)\)", line) if opcode(line) == "constant" else None
    return int(value.group(1)) if value else None


def _passed(name: str, defs: dict[str, str]) -> str:
    """The instruction whose value ``name`` holds, through copies, bitcasts and conversions
    (the TPU compiler copies a loop's new counter before its body's result tuple)."""
    for _ in range(16):
        line = defs.get(name)
        if not line or opcode(line) not in _PASSING or not operands(line):
            return name
        name = operands(line)[0]
    return name


def _tuple_index(name: str, defs: dict[str, str]) -> int | None:
    """For ``get-tuple-element(parameter), index=k`` (through copies), k; else None."""
    line = defs.get(_passed(name, defs), "")
    if opcode(line) != "get-tuple-element" or not operands(line):
        return None
    index = re.search(r"\bindex=(\d+)", line)
    source = defs.get(operands(line)[0], "")
    return int(index.group(1)) if index and opcode(source) == "parameter" else None


def flag_loop(line: str, comps: dict[str, list[str]]) -> bool:
    """Whether the while loop of instruction ``line`` is guarded by a carried boolean (its
    condition's result is an element of its carry), as a ``lax.while_loop`` of one trip or
    none is: whether its body runs is data, as whether a conditional's branch runs."""
    condition = called(line, ("condition",))
    lines = comps.get(condition[0], []) if condition else []
    return any(x.lstrip().startswith("ROOT") and _FLAG_ROOT.search(x) for x in lines)


def trip_count(line: str, comps: dict[str, list[str]]) -> int | None:
    """How many times the while loop of instruction ``line`` runs its body.

    Read from the compiler's ``known_trip_count`` where it prints one (the GPU compiler),
    else from the program (the TPU compiler), as ``lax.scan`` and ``fori_loop`` lower: the
    condition ``counter < bound`` (or ``bound > counter``) with the counter an element of
    the carry and the bound a constant, the counter's start a constant in the loop's
    initial tuple, and the body's new counter the old one plus a positive constant (each
    read through copies, bitcasts and conversions). The count is then
    ``ceil((bound - start) / step)``, or 0.

    Args:
        line: a ``while`` instruction.
        comps: `computations` of its module.

    Returns:
        The trip count, or None where the program does not show each of these.
    """
    known = _KNOWN_TRIPS.search(line)
    if known:
        return int(known.group(1))
    condition, body = called(line, ("condition",)), called(line, ("body",))
    if not condition or not body:
        return None
    cond = definitions(comps.get(condition[0], []))
    roots = [x for x in comps.get(condition[0], []) if x.lstrip().startswith("ROOT")]
    compare = _COMPARE.search(roots[0]) if len(roots) == 1 else None
    if compare is None:
        return None
    counter, bound = compare.group(1), compare.group(2)
    if compare.group(3) == "GT":
        counter, bound = bound, counter
    index, end = _tuple_index(counter, cond), _constant(bound, cond)
    if index is None or end is None:
        return None
    caller = next((c for c in comps.values() if any(x.strip() == line.strip() for x in c)), [])
    callers, init = definitions(caller), operands(line)
    initial = callers.get(init[0], "") if len(init) == 1 else ""
    elements = operands(initial) if opcode(initial) == "tuple" else []
    start = _constant(elements[index], callers) if index < len(elements) else None
    lines = comps.get(body[0], [])
    defs = definitions(lines)
    root = [x for x in lines if x.lstrip().startswith("ROOT")]
    updated = operands(root[0]) if len(root) == 1 and opcode(root[0]) == "tuple" else []
    step = None
    new_counter = _passed(updated[index], defs) if index < len(updated) else ""
    if opcode(defs.get(new_counter, "")) == "add":
        terms = operands(defs[new_counter])
        for a, b in (terms, terms[::-1]) if len(terms) == 2 else ():
            if _tuple_index(a, defs) == index and _constant(b, defs) is not None:
                step = _constant(b, defs)
    if start is None or step is None or step <= 0:
        return None
    return max(0, -(-(end - start) // step))


def outer_loop(comps: dict[str, list[str]]) -> str | None:
    """The ``while`` instruction of the program's tick loop, or None: of the loops not
    inside another loop, those whose body chooses among actions (a ``conditional``, or
    loops guarded by a carried flag, `flag_loop`) first, a pipeline's tick loop being
    one; among them, the one with the most trips."""
    inside = loop_computations(comps)
    outer = [
        line
        for name, lines in comps.items()
        if name not in inside
        for line in lines
        if opcode(line) == "while"
    ]

    def chooses(line: str) -> bool:
        for name in reachable(comps, called(line, ("body",))):
            for inner in comps[name]:
                op = opcode(inner)
                if op == "conditional" or (op == "while" and flag_loop(inner, comps)):
                    return True
        return False

    return max(outer, key=lambda line: (chooses(line), trip_count(line, comps) or 0), default=None)


def heaviest_runs(
    comps: dict[str, list[str]], root: str, weight, skip: str | None = None
) -> tuple[float, dict[tuple[str, int], int]]:
    """How many times each weighed instruction runs along the heaviest path from ``root``.

    A while loop runs its body `trip_count` times (once where the count is unknown:
    `uncounted_loops` finds those); a conditional runs the one branch whose weight is
    largest; the loops of one computation guarded by a carried flag (`flag_loop`, loops of
    one trip or none) are alternatives too, of which the heaviest runs once, as a device
    runs one kind of action where they hold its actions (the GPU and CPU form of a tick);
    any other call runs what it calls. So a loop body whose conditional or flag loops hold
    a device's actions counts the heaviest action a device may run in one iteration.

    Args:
        comps: `computations` of a module.
        root: the computation to start from (the entry, or a loop's body).
        weight: ``weight(computation, index, line) -> float``, an instruction's own weight
            (0 for most).
        skip: a ``while`` instruction line not to enter (it and its body weigh 0).

    Returns:
        ``(total weight, {(computation, index): runs})`` of the instructions with a
        weight above 0 on the path.
    """
    memo: dict[str, tuple[float, dict]] = {}

    def visit(name: str, active: frozenset) -> tuple[float, dict]:
        if name in memo:
            return memo[name]
        total, runs, alternatives = 0.0, {}, []
        for i, line in enumerate(comps.get(name, [])):
            own = weight(name, i, line)
            if own > 0:
                total += own
                runs[(name, i)] = runs.get((name, i), 0) + 1
            op = opcode(line)
            if op is None or (skip is not None and line.strip() == skip.strip()):
                continue
            if op == "while" and flag_loop(line, comps):
                alternatives += [visit(b, active | {name}) for b in called(line, ("body",))
                                 if b not in active and b != name]  # fmt: skip
                continue
            if op == "while":
                trips = trip_count(line, comps)
                parts = [(called(line, ("body",)), 1 if trips is None else trips)]
            elif op == "conditional":
                branches = called(line, ("true_computation", "false_computation",
                                         "branch_computations"))  # fmt: skip
                taken = [visit(b, active | {name}) for b in branches if b not in active]
                if taken:
                    best = max(taken, key=lambda t: t[0])
                    total += best[0]
                    for key, n in best[1].items():
                        runs[key] = runs.get(key, 0) + n
                continue
            else:
                parts = [(called(line, ("calls", "to_apply")), 1)]
            for names, times in parts:
                for inner in names:
                    if inner in active or inner == name:
                        continue
                    sub_total, sub_runs = visit(inner, active | {name})
                    total += times * sub_total
                    for key, n in sub_runs.items():
                        runs[key] = runs.get(key, 0) + times * n
        if alternatives:  # a device runs one of its flag loops' bodies, or none
            best = max(alternatives, key=lambda t: t[0])
            total += best[0]
            for key, n in best[1].items():
                runs[key] = runs.get(key, 0) + n
        memo[name] = (total, runs)
        return memo[name]

    return visit(root, frozenset())


def uncounted_loops(
    comps: dict[str, list[str]], root: str, weight, skip: str | None = None
) -> list[str]:
    """The while loops reached from ``root`` whose trip count is not read (`trip_count`
    None; loops guarded by a carried flag aside) that hold an instruction of weight above
    0: `heaviest_runs` counts their bodies once, so it may count those instructions too
    few times.

    Args:
        comps, root, weight, skip: as for `heaviest_runs`.

    Returns:
        The ``while`` instruction lines, stripped, in the order found.
    """
    excluded = set(called(skip, ("body",))) if skip is not None else set()
    found = []
    for name in sorted(reachable(comps, [root], excluded=excluded)):
        for line in comps[name]:
            if opcode(line) != "while" or (skip is not None and line.strip() == skip.strip()):
                continue
            if flag_loop(line, comps) or trip_count(line, comps) is not None:
                continue
            inside = reachable(comps, called(line, ("body",)), excluded=excluded)
            if any(weight(c, i, x) > 0 for c in inside for i, x in enumerate(comps[c])):
                found.append(line.strip())
    return found


# ----------------------------------------------------------------------------- collectives
@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the compiled program.

    Attributes:
        kind: one of `KINDS`.
        nbytes: bytes of its result on one device (for an async ``-start``, of the result
            buffer, not the operand or the context words it also returns).
        axes: the mesh axes its device groups span (the devices of a group differ along them).
        in_loop: inside a ``while`` loop's body: it runs once per iteration, not once a step.
        line: the HLO instruction.
        hidden: for an asynchronous collective (a ``-start`` and its ``-done``), whether the
            compiler scheduled a computation between the two (a matrix product, or a
            ``conditional``, which is how jaxpipe runs a stage's actions), so that the
            transfer can run behind it; None for a synchronous one.
        groups: its device groups (`device_groups`), as positions in ``mesh.devices.flat``.
        unread: its device groups are printed in a form this reader does not know; it is
            then read as one group of every device of the mesh (the most traffic, and the
            slowest link a group can cross), not as free.
        computation: the name of the computation it is in; ``index``: its place there
            (`computations`), to find it again (`heaviest_runs`).
    """

    kind: str
    nbytes: int
    axes: tuple[str, ...]
    in_loop: bool
    line: str
    hidden: bool | None = None
    groups: tuple[tuple[int, ...], ...] = ()
    computation: str = ""
    index: int = -1
    unread: bool = False

    @property
    def group_size(self) -> int:
        """Devices in each of its groups (2 for a collective-permute's pairs)."""
        return max((len(g) for g in self.groups), default=1)

    @property
    def traffic(self) -> float:
        """Bytes one device sends for it by a ring algorithm over groups of n devices (the
        convention of nccl-tests' bus bandwidth): all-gather and all-to-all (n-1)/n of the
        result, reduce-scatter (n-1) results (its input is n results), all-reduce 2(n-1)/n
        of it, a collective-permute the result once."""
        n = self.group_size
        factor = {
            "all-gather": (n - 1) / n,
            "all-to-all": (n - 1) / n,
            "reduce-scatter": n - 1,
            "all-reduce": 2 * (n - 1) / n,
            "collective-permute": 1,
        }[self.kind]
        return self.nbytes * factor


def collectives(hlo_text: str, mesh, strict: bool = False) -> list[Collective]:
    """Every all-gather, all-reduce, reduce-scatter, all-to-all and collective-permute.

    Args:
        hlo_text: the program, ``compiled.as_text()``.
        mesh: the mesh it runs on. Device ids in device groups are positions in
            ``mesh.devices.flat``, as in the partitioned program.
        strict: raise on device groups in a form this reader does not know, instead of
            reading them as one group of every device and marking the collective
            `Collective.unread`.

    Returns:
        A `Collective` per instruction, in the order printed; an async pair counts once,
        at its ``-start``.

    Raises:
        ValueError: with ``strict``, device groups in an unknown form.
    """
    comps, _ = computations(hlo_text)
    loop = loop_computations(comps)
    steps = _fused_collective_steps(comps)
    out = []
    for name, lines in comps.items():
        if name in steps:  # a step of an asynchronous collective fusion, counted at its start
            continue
        for i, line in enumerate(lines):
            inner = _fused_collective(line, comps)
            if inner is not None:  # counted once, as the collective it runs
                m = _LINE.search(_INDEX_COMMENT.sub("", inner))
                kind = m.group("kind")
                groups, unread = _groups(kind, m.group("rest"), mesh, strict)
                out.append(
                    Collective(
                        kind=kind,
                        nbytes=_result_bytes(kind, m.group("type"), False),
                        axes=_axes(groups, mesh),
                        in_loop=name in loop,
                        line=line.strip(),
                        hidden=_hidden(lines, i, comps, _fusion_done),
                        groups=tuple(tuple(g) for g in groups),
                        computation=name,
                        index=i,
                        unread=unread,
                    )
                )
                continue
            m = _LINE.search(_INDEX_COMMENT.sub("", line))
            if not m:
                continue
            kind, is_start = m.group("kind"), m.group("start") is not None
            groups, unread = _groups(kind, m.group("rest"), mesh, strict)
            out.append(
                Collective(
                    kind=kind,
                    nbytes=_result_bytes(kind, m.group("type"), is_start),
                    axes=_axes(groups, mesh),
                    in_loop=name in loop,
                    line=line.strip(),
                    hidden=_hidden(lines, i, comps) if is_start else None,
                    groups=tuple(tuple(g) for g in groups),
                    computation=name,
                    index=i,
                    unread=unread,
                )
            )
    return out


def _groups(kind: str, rest: str, mesh, strict: bool) -> tuple[list[list], bool]:
    """A collective's device groups, and whether they are in a form not read: those are
    then one group of every device of the mesh (`Collective.unread`)."""
    try:
        return device_groups(kind, rest, mesh.devices.size, strict=True), False
    except ValueError:
        if strict:
            raise
        return [list(range(mesh.devices.size))], True


def device_groups(kind: str, rest: str, num_devices: int, strict: bool = False) -> list[list]:
    """The device groups of a collective.

    Args:
        kind: one of `KINDS`.
        rest: the instruction after its opcode's opening parenthesis.
        num_devices: devices of the program (the group of ``replica_groups={}``).
        strict: raise on replica groups (or source-target pairs) in a form this reader
            does not know.

    Returns:
        Each group's device ids (a collective-permute: each source and target pair); empty
        where the line names none, or, without ``strict``, names them in an unknown form.

    Raises:
        ValueError: with ``strict``, replica groups or pairs in an unknown form.
    """
    if kind == "collective-permute":
        pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}(?=[,\s]|$)", rest)
        if not pairs:
            if strict and "source_target_pairs=" in rest:
                raise ValueError(
                    f"source-target pairs in a form this reader does not know: {rest}; "
                    "teach jaxpipe.analysis.hlo.device_groups the form"
                )
            return []
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))]
    named = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}", rest
    )
    if named:
        # mesh['axis_0'=1,'axis_1'=4,...] {'axis_1'}: groups span the braced axes; with
        # device_ids=([4,2]T(1,0)) (an iota, transposed) or a list, the devices in mesh order
        axes = re.findall(r"'([^']+)'=(\d+)", named.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        spanned = [names.index(a) for a in re.findall(r"'([^']+)'", named.group(3))]
        ids = np.arange(math.prod(sizes))
        iota = re.fullmatch(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", named.group(2) or "")
        if iota:
            ids = ids.reshape([int(d) for d in iota.group(1).split(",")])
            if iota.group(2):
                ids = ids.transpose([int(p) for p in iota.group(2).split(",")])
        elif named.group(2):
            ids = np.array([int(i) for i in re.findall(r"\d+", named.group(2))])
        ids = ids.reshape(sizes)
        kept = [a for a in range(len(sizes)) if a not in spanned]
        size = math.prod(sizes[a] for a in spanned)
        return ids.transpose(kept + spanned).reshape(-1, size).tolist()
    iota = re.search(
        r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?(?=[,\s]|$)", rest
    )
    if iota:
        count, size = int(iota.group(1)), int(iota.group(2))
        dims = [int(d) for d in iota.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(4):
            ids = ids.transpose([int(p) for p in iota.group(4).split(",")])
        return ids.reshape(count, size).tolist()
    listed = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}(?=[,\s]|$)", rest)
    if not listed:
        if strict and "replica_groups=" in rest:
            raise ValueError(
                f"replica groups in a form this reader does not know: {rest}; teach "
                "jaxpipe.analysis.hlo.device_groups the form"
            )
        return []
    if not listed.group(1):  # {}: one group of every device
        return [list(range(num_devices))]
    return [
        [int(i) for i in g.split(",") if i] for g in re.findall(r"\{([\d,]*)\}", listed.group(1))
    ]


def _axes(groups: list[list[int]], mesh) -> tuple[str, ...]:
    """The mesh axes along which the devices of some group differ, in mesh order."""
    names, shape = tuple(mesh.axis_names), tuple(mesh.devices.shape)
    spanned = set()
    for group in groups:
        coords = np.array([np.unravel_index(i, shape) for i in group if i < math.prod(shape)])
        if len(coords) > 1:
            spanned |= {a for a in range(len(names)) if len(set(coords[:, a])) > 1}
    return tuple(names[a] for a in sorted(spanned))


# The TPU compiler's asynchronous collective fusions (with its
# ``xla_tpu_enable_async_collective_fusion*`` options): a collective split into steps, run
# inside the kernels of computations scheduled between a fusion named
# ``async-collective-start[.N]`` and one named ``async-collective-done[.N]``; the steps sit
# in the computations those fusions and the ``async_collective_fusion*`` ones call.
_FUSION_START = re.compile(r"\s*%?async-collective-start(\.\d+)? = .*\bfusion\(")
_FUSION_STEP = re.compile(
    r"^\s*%?async-collective-(start|done)(\.\d+)? = |calls=%?async_collective_fusion"
)


def _fusion_done(start_name: str) -> re.Pattern:
    """The line of the done of the asynchronous collective fusion ``start_name``."""
    suffix = start_name[len("async-collective-start") :]
    return re.compile(rf"^\s*%?async-collective-done{re.escape(suffix)} = ")


def _fused_collective_steps(comps) -> set[str]:
    """The computations holding steps of asynchronous collective fusions."""
    callers = [line for lines in comps.values() for line in lines if _FUSION_STEP.search(line)]
    return reachable(comps, [name for line in callers for name in called(line, ("calls",))])


def _fused_collective(line: str, comps) -> str | None:
    """For the start of an asynchronous collective fusion, the line of the collective it
    runs (in the computation it calls); else None."""
    if not _FUSION_START.match(line):
        return None
    for name in reachable(comps, called(line, ("calls",))):
        for inner in comps[name]:
            if _LINE.search(_INDEX_COMMENT.sub("", inner)):
                return inner
    return None


def _hidden(lines: list[str], start: int, comps, done_of=None) -> bool | None:
    """Whether a computation is scheduled between the ``-start`` at ``lines[start]`` and its
    ``-done`` (instructions of a scheduled program are listed in the order they run); None
    if the done is not in the same computation. ``done_of(start_name)`` gives the pattern
    of the done's line where it is not ``-done(start_name)``."""
    name = re.match(r"\s*%?([\w.\-]+) =", lines[start])
    if not name:
        return None
    if done_of is None:
        done = re.compile(rf"-done\(%?{re.escape(name.group(1))}[,)]")
    else:
        done = done_of(name.group(1))
    between = []
    for line in lines[start + 1 :]:
        if done.search(line):
            return any(_computes(b, comps) for b in between)
        between.append(line)
    return None


def _computes(line: str, comps, seen=None) -> bool:
    """Whether the instruction ``line`` runs a matrix product: a dot or convolution, a
    conditional, or a fusion or call whose computations hold one."""
    op = opcode(line)
    if op is None:
        return False
    if op in ("dot", "convolution", "conditional"):
        return True
    if op == "custom-call":
        return bool(re.search(r'custom_call_target="[^"]*(gemm|matmul|Matmul)', line))
    seen = set() if seen is None else seen
    for name in called(line):
        if name in seen or name not in comps:
            continue
        seen.add(name)
        if any(_computes(inner, comps, seen) for inner in comps[name]):
            return True
    return False
