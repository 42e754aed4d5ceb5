"""Schedules to and from CSV, and simulated timelines as Chrome / Perfetto traces.

CSV format: a header block of ``# key: value`` lines, then one row per action::

    # jaxpipe schedule
    # name: my_schedule
    # num_stages: 2
    # num_microbatches: 2
    # stage_device: 0 1
    tick,device,op,stage,microbatch,version
    0,0,F,0,0,0
    1,0,F,0,1,0
    1,1,F,1,0,0
    ...

Header keys: ``num_stages`` and ``num_microbatches`` (required); ``stage_device`` (the
device of each logical stage, space-separated; default ``0 1 .. S-1``); ``name`` (default
``custom``); ``max_actions_per_tick`` (default 1; 2 lets a cell hold one forward and one
backward); ``num_ticks`` (default: last tick + 1); ``options`` (a JSON object, default
``{}``, of numbers, strings, booleans, null and lists of them; lists are read as tuples).
Lines that are blank or start with ``#`` and hold no ``key: value`` are comments.

Columns: ``tick``, ``device``, ``op`` (F, B, W, BW or U), ``stage`` (logical stage) and
``microbatch`` are required, ``version`` (weight version, default 0) is optional; they may
come in any order. Rows may come in any order; two rows with the same tick and device form
one cell, in file order, except that a ``U`` row goes last in its cell wherever it stands.
A ``U`` row is a weight update of ``stage`` at the end of ``tick``, with micro-batch 0 and
``version`` the version it updates, e.g. ``5,0,U,0,0,2``; a PipeDream table keeps its
behaviour through CSV under any name. `from_csv` checks the result with
`jaxpipe.schedules.validate` (versions included).

Chrome trace: `to_chrome_trace` simulates the schedule (`jaxpipe.schedules.simulate`) and
returns a dict in the Trace Event Format: one thread per device, one complete event
(``"ph": "X"``) per compute action named like ``F3 s1`` (forward of micro-batch 3 on stage
1), and one instant event (``"ph": "i"``) per weight update named like ``U s1 v2``. One
cost unit is shown as one millisecond. Open the file in https://ui.perfetto.dev or
chrome://tracing.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re

from jaxpipe.schedules.actions import OPS, Action, U
from jaxpipe.schedules.core import Schedule
from jaxpipe.schedules.simulate import Costs, simulate
from jaxpipe.schedules.validation import validate

COLUMNS = ("tick", "device", "op", "stage", "microbatch", "version")
REQUIRED_COLUMNS = COLUMNS[:5]
HEADER_KEYS = (
    "name",
    "num_stages",
    "num_microbatches",
    "stage_device",
    "max_actions_per_tick",
    "num_ticks",
    "options",
)


def to_csv(schedule: Schedule, path: str | os.PathLike | None = None) -> str:
    """The schedule as CSV text (format in the module docstring); also written to ``path``.

    Args:
      schedule: the table.
      path: a file to write the text to, or None.

    Returns:
      The CSV text.
    """
    lines = [
        "# jaxpipe schedule",
        f"# name: {schedule.name}",
        f"# num_stages: {schedule.num_stages}",
        f"# num_microbatches: {schedule.num_microbatches}",
        f"# stage_device: {' '.join(map(str, schedule.stage_device))}",
        f"# max_actions_per_tick: {schedule.max_actions_per_tick}",
        f"# num_ticks: {schedule.num_ticks}",
        f"# options: {json.dumps(dict(schedule.options), sort_keys=True)}",
        ",".join(COLUMNS),
    ]
    for t, d, a in schedule.timed_actions(include_updates=True):
        lines.append(f"{t},{d},{a.op},{a.stage},{a.microbatch},{a.version}")
    text = "\n".join(lines) + "\n"
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return text


def from_csv(path: str | os.PathLike) -> Schedule:
    """Reads and validates a schedule written by `to_csv` or by hand (see module docstring).

    Args:
      path: the CSV file.

    Returns:
      The validated table.

    Raises:
      ValueError: naming the file and the line of a fault.
    """
    with open(path, encoding="utf-8") as f:
        return from_csv_text(f.read(), source=os.fspath(path))


def from_csv_text(text: str, source: str = "<csv>") -> Schedule:
    """Like `from_csv`, from CSV text.

    Args:
      text: the CSV text.
      source: what error messages call the text.

    Returns:
      The validated table.

    Raises:
      ValueError: naming ``source`` and the line of a fault.
    """
    header: dict[str, tuple[int, str]] = {}
    columns: list[str] | None = None
    rows: list[tuple[int, list[str]]] = []

    def fail(line: int, message: str):
        raise ValueError(f"{source}, line {line}: {message}")

    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            body = stripped.lstrip("#").strip()
            if ":" in body:
                key, value = (x.strip() for x in body.split(":", 1))
                if key not in HEADER_KEYS:
                    fail(
                        number, f"unknown header key {key!r}; known keys: {', '.join(HEADER_KEYS)}"
                    )
                if key in header:
                    fail(
                        number,
                        f"header key {key!r} given twice (line {header[key][0]}: "
                        f"{header[key][1]!r}, line {number}: {value!r}); keep one of the lines",
                    )
                header[key] = (number, value)
            continue
        fields = [x.strip() for x in next(csv.reader(io.StringIO(stripped)))]
        if columns is None:
            columns = fields
            unknown = [c for c in columns if c not in COLUMNS]
            missing = [c for c in REQUIRED_COLUMNS if c not in columns]
            if unknown or missing or len(set(columns)) != len(columns):
                fail(
                    number,
                    f"column header {','.join(columns)!r} is not valid (unknown: {unknown}, "
                    f"missing: {missing}); expected the columns {','.join(COLUMNS)} "
                    "(version optional)",
                )
            continue
        if len(fields) != len(columns):
            fail(number, f"expected {len(columns)} fields ({','.join(columns)}), got {len(fields)}")
        rows.append((number, fields))
    if columns is None:
        fail(1, f"no column header line; expected a line '{','.join(COLUMNS)}'")

    def header_int(key: str, default: int | None = None) -> int:
        if key not in header:
            if default is None:
                fail(1, f"missing header line '# {key}: <positive int>'")
            return default
        number, value = header[key]
        if _natural(value) is None or int(value) < 1:
            fail(number, f"header {key} must be a positive int, got {value!r}")
        return int(value)

    num_stages = header_int("num_stages")
    num_microbatches = header_int("num_microbatches")
    max_actions = header_int("max_actions_per_tick", 1)
    if max_actions > 2:
        fail(
            header["max_actions_per_tick"][0],
            f"max_actions_per_tick must be 1 or 2 (one forward and one backward in a cell), "
            f"got {max_actions}; spread the other actions of a cell over more ticks",
        )
    if "stage_device" in header:
        number, value = header["stage_device"]
        parts = value.replace(",", " ").split()
        if not parts or any(_natural(p) is None for p in parts):
            fail(number, f"stage_device must be space-separated device numbers, got {value!r}")
        stage_device = tuple(int(p) for p in parts)
    else:
        stage_device = tuple(range(num_stages))
    options: tuple = ()
    if "options" in header:
        number, value = header["options"]
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            fail(number, f"options must be a JSON object, got {value!r} ({e})")
        if not isinstance(parsed, dict):
            fail(number, f"options must be a JSON object, got {value!r}")
        nested = sorted(k for k, v in parsed.items() if _holds_dict(v))
        if nested:
            fail(
                number,
                f"options {', '.join(nested)} hold a JSON object; option values are numbers, "
                "strings, booleans, null or lists of them",
            )
        options = tuple(sorted((k, _frozen(v)) for k, v in parsed.items()))

    cells: dict[tuple[int, int], list[Action]] = {}
    lines: dict[tuple[int, int], list[int]] = {}  # (tick, device) -> line numbers
    last_tick = -1
    for number, fields in rows:
        record = dict(zip(columns, fields, strict=True))
        values = {}
        for key in ("tick", "device", "stage", "microbatch", "version"):
            values[key] = _natural(record.get(key, "0"))
            if values[key] is None:
                fail(number, f"{key} must be a non-negative integer, got {record[key]!r}")
        op = record["op"].upper()
        if op not in OPS:
            fail(number, f"unknown op {record['op']!r}; expected one of {', '.join(OPS)}")
        if values["device"] >= num_stages:
            fail(number, f"device {values['device']} outside [0, {num_stages}) (num_stages)")
        action = Action(op, values["stage"], values["microbatch"], values["version"])
        cells.setdefault((values["tick"], values["device"]), []).append(action)
        lines.setdefault((values["tick"], values["device"]), []).append(number)
        last_tick = max(last_tick, values["tick"])
    num_ticks = header_int("num_ticks", last_tick + 1)
    if num_ticks <= last_tick:
        fail(header["num_ticks"][0], f"num_ticks is {num_ticks} but a row uses tick {last_tick}")

    # a U runs at the end of its tick: last in its cell, wherever its row stands
    def cell(t: int, d: int) -> tuple[Action, ...]:
        return tuple(sorted(cells.get((t, d), ()), key=lambda a: a.op == U))

    ticks = tuple(tuple(cell(t, d) for d in range(num_stages)) for t in range(num_ticks))
    name = header["name"][1] if "name" in header else "custom"
    schedule = Schedule(
        name=name,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        stage_device=stage_device,
        ticks=ticks,
        max_actions_per_tick=max_actions,
        options=options,
    )
    try:
        return validate(schedule)
    except ValueError as error:
        where = re.search(r"at tick (\d+), device (\d+)", str(error))
        at = lines.get((int(where[1]), int(where[2])), []) if where else []
        note = f" (the marked cell is line {', '.join(map(str, at))})" if at else ""
        raise ValueError(f"{source}{note}: {error}") from None


def _holds_dict(value) -> bool:
    """True if a JSON value is, or holds, an object."""
    if isinstance(value, list):
        return any(_holds_dict(v) for v in value)
    return isinstance(value, dict)


def _frozen(value):
    """A JSON value with its lists as tuples, so that the `Schedule` stays hashable."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def _natural(text: str) -> int | None:
    """``int(text)`` if ``text`` is a plain non-negative integer (ASCII digits), else None."""
    return int(text) if text.isascii() and text.isdigit() else None


def to_chrome_trace(
    schedule: Schedule,
    costs: Costs | None = None,
    mode: str = "lockstep",
    path: str | os.PathLike | None = None,
) -> dict:
    """The simulated timeline in the Trace Event Format; also written as JSON to ``path``.

    Args:
      schedule: the table.
      costs: the costs to simulate at (default `Costs()`).
      mode: ``"lockstep"``, ``"neighbour"`` or ``"ideal"`` (`jaxpipe.schedules.simulate`).
      path: a file to write the trace to as JSON, or None.

    Returns:
      The trace, a dict with ``traceEvents`` (format in the module docstring).
    """
    timeline = simulate(schedule, costs or Costs(), mode)
    scale = 1000.0  # one cost unit shown as 1 ms; trace times are in microseconds
    events: list[dict] = [
        {"ph": "M", "pid": 0, "name": "process_name", "args": {"name": f"{schedule.name} ({mode})"}}
    ]
    for d in range(schedule.num_stages):
        events.append(
            {"ph": "M", "pid": 0, "tid": d, "name": "thread_name", "args": {"name": f"device {d}"}}
        )
    for e in timeline.events:
        a = e.action
        events.append(
            {
                "ph": "X",
                "pid": 0,
                "tid": e.device,
                "name": f"{a.op}{a.microbatch} s{a.stage}",
                "cat": a.op,
                "ts": e.start * scale,
                "dur": (e.end - e.start) * scale,
                "args": {"tick": e.tick, "version": a.version},
            }
        )
    for e in timeline.updates:
        a = e.action
        events.append(
            {
                "ph": "i",
                "s": "t",
                "pid": 0,
                "tid": e.device,
                "name": f"U s{a.stage} v{a.version}",
                "cat": a.op,
                "ts": e.start * scale,
                "args": {"tick": e.tick, "version": a.version},
            }
        )
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(trace, f)
    return trace
