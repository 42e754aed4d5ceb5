"""The schedule table: actions, the `Schedule` type, its validator and the lock-step packer.

Words used throughout jaxpipe:

- **F**: the forward of one stage on one micro-batch.
- **BW**: the full backward of one stage on one micro-batch (input and weight gradients).
- **B**: the input-gradient half of a split backward (the zero-bubble family's "B").
- **W**: the weight-gradient half of a split backward; it needs the B of the same stage and
  micro-batch first.
- **stage**: a logical pipeline stage, ``0 .. num_logical_stages - 1``, applied in order.
  With ``v`` stages per device (interleaved, circular, V placements) there are ``S * v``.
- **device**: a position on the pipe mesh axis, ``0 .. num_stages - 1`` (``S`` of them).
- **tick**: one lock-step slot. Every device advances one tick together, as in one SPMD
  program; what a device produces in tick ``t`` reaches its consumer for tick ``t + 1``.

Nothing in this package imports JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import NamedTuple

F, B, W, BW = "F", "B", "W", "BW"
OPS = (F, B, W, BW)
BACKWARD_OPS = (B, BW, W)


class Action(NamedTuple):
    """One unit of work: ``op`` of logical ``stage`` on ``microbatch``.

    ``version`` is the weight version the action reads (PipeDream family); 0 elsewhere.
    """

    op: str
    stage: int
    microbatch: int
    version: int = 0

    def label(self, stages_per_device: int = 1, num_stages: int = 1) -> str:
        """Short text such as ``F3``, ``BW0`` or, with several stages per device, ``F3:1``."""
        text = f"{self.op}{self.microbatch}"
        if stages_per_device > 1:
            text += f":{self.stage // num_stages}" if num_stages else ""
        return text


Cell = tuple[Action, ...]


def _as_cell(item) -> Cell:
    if item is None:
        return ()
    if isinstance(item, Action):
        return (item,)
    return tuple(item)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A static table of actions: ``ticks[t][d]`` is what device ``d`` runs in tick ``t``.

    Attributes:
      name: the generator's name (``"1f1b"``, ...) or ``"custom"``.
      num_stages: ``S``, the number of devices on the pipe axis.
      num_microbatches: ``M``.
      stage_device: for each logical stage, the device that holds it (length ``S * v``).
      ticks: the table, one tuple of cells per tick, one cell (a tuple of actions) per device.
      max_actions_per_tick: 1, or 2 where a device may run one forward and one backward in
        the same tick (DualPipeV's overlapped pairs).
      options: the generator's options, for display and for re-creating the schedule.
    """

    name: str
    num_stages: int
    num_microbatches: int
    stage_device: tuple[int, ...]
    ticks: tuple[tuple[Cell, ...], ...]
    max_actions_per_tick: int = 1
    options: tuple[tuple[str, object], ...] = ()

    # ----------------------------------------------------------------- shape
    @property
    def num_logical_stages(self) -> int:
        """``S * v``: how many stages the model is cut into."""
        return len(self.stage_device)

    @property
    def stages_per_device(self) -> int:
        """``v``: logical stages held by each device."""
        return self.num_logical_stages // self.num_stages

    @property
    def num_ticks(self) -> int:
        return len(self.ticks)

    def device_stages(self, device: int) -> tuple[int, ...]:
        """The logical stages held by ``device``, in increasing order (its local chunks)."""
        return tuple(s for s, d in enumerate(self.stage_device) if d == device)

    def chunk_of(self, stage: int) -> int:
        """The local index of ``stage`` among its device's stages."""
        return self.device_stages(self.stage_device[stage]).index(stage)

    @property
    def splits_backward(self) -> bool:
        """True if any backward is split into B and W."""
        return any(a.op == W for a in self.actions())

    def actions(self) -> Iterable[Action]:
        for row in self.ticks:
            for cell in row:
                yield from cell

    def timed_actions(self) -> Iterable[tuple[int, int, Action]]:
        """``(tick, device, action)`` for every action in the table."""
        for t, row in enumerate(self.ticks):
            for d, cell in enumerate(row):
                for a in cell:
                    yield t, d, a

    # ------------------------------------------------------------- analysis
    def validate(self, activation_limit: Sequence[int] | int | None = None) -> Schedule:
        """Checks the table; returns ``self`` or raises ``ValueError`` naming tick, device, rule.

        Rules: every stage lives on one device and every action runs there; each cell holds
        at most ``max_actions_per_tick`` actions (and, if two, one forward and one backward);
        every (stage, micro-batch) has exactly one F and either one BW or one B and one W;
        F of stage k comes after F of stage k-1; a backward of stage k comes after its own F
        and after the backward (BW or B) of stage k+1; W comes after B. "After" means in a
        strictly later tick. If ``activation_limit`` is given (one int, or one per device),
        no device holds more live micro-batch activations than that.
        """
        validate(self, activation_limit)
        return self

    def peak_activations(self) -> tuple[int, ...]:
        """Per device, the most micro-batch activations alive at once.

        A (stage, micro-batch) is alive on its device from the tick of its F to the tick of
        its last backward action (BW, or W for a split backward), both included.
        """
        return tuple(max(row) if row else 0 for row in self.live_activations())

    def live_activations(self) -> list[list[int]]:
        """``live[d][t]``: activations alive on device ``d`` during tick ``t``."""
        first: dict[tuple[int, int], int] = {}
        last: dict[tuple[int, int], int] = {}
        for t, _, a in self.timed_actions():
            key = (a.stage, a.microbatch)
            if a.op == F:
                first[key] = t
            else:
                last[key] = max(last.get(key, t), t)
        live = [[0] * self.num_ticks for _ in range(self.num_stages)]
        for key, start in first.items():
            end = last.get(key, self.num_ticks - 1)
            row = live[self.stage_device[key[0]]]
            for t in range(start, end + 1):
                row[t] += 1
        return live

    def bubble_fraction(self, costs=None):
        """Idle share of device-time, lock-step and ideal (`jaxpipe.schedules.simulate`)."""
        from jaxpipe.schedules.simulate import Costs, bubble_fraction

        return bubble_fraction(self, costs or Costs())

    def to_csv(self, path=None) -> str:
        """CSV text of the table (format in `jaxpipe.schedules.io`); also written to ``path``."""
        from jaxpipe.schedules.io import to_csv

        return to_csv(self, path)

    @staticmethod
    def from_csv(path) -> Schedule:
        """Reads and validates a CSV schedule (format in `jaxpipe.schedules.io`)."""
        from jaxpipe.schedules.io import from_csv

        return from_csv(path)

    def to_chrome_trace(self, path=None, costs=None, mode: str = "lockstep") -> dict:
        """The simulated timeline as a Chrome / Perfetto trace dict; also written to ``path``."""
        from jaxpipe.schedules.io import to_chrome_trace

        return to_chrome_trace(self, costs, mode, path)

    def forward_only(self) -> Schedule:
        """The same placement and forward order with every backward dropped (for inference)."""
        rows = []
        for row in self.ticks:
            new = tuple(tuple(a for a in cell if a.op == F) for cell in row)
            if any(new):
                rows.append(new)
        return dataclasses.replace(
            self, name=f"{self.name}/forward", ticks=tuple(rows), max_actions_per_tick=1
        )

    # --------------------------------------------------------------- display
    def to_text(self, start: int = 0, stop: int | None = None, mark: tuple | None = None) -> str:
        """The table as a text grid: one row per device, one column per tick.

        ``mark=(tick, device)`` puts ``>`` before that cell (used in error messages).
        """
        stop = self.num_ticks if stop is None else min(stop, self.num_ticks)
        v, S = self.stages_per_device, self.num_stages
        cells = [
            ["+".join(a.label(v, S) for a in self.ticks[t][d]) or "." for t in range(start, stop)]
            for d in range(S)
        ]
        if mark is not None:
            t, d = mark
            if start <= t < stop and 0 <= d < S:
                cells[d][t - start] = ">" + cells[d][t - start]
        width = max([len(c) for row in cells for c in row] + [len(str(stop))]) + 1
        header = "tick   " + "".join(str(t).rjust(width) for t in range(start, stop))
        lines = [header] + [
            f"dev {d:<3}" + "".join(c.rjust(width) for c in row) for d, row in enumerate(cells)
        ]
        return "\n".join(lines)

    def __str__(self) -> str:
        head = (
            f"Schedule {self.name!r}: S={self.num_stages} devices, "
            f"M={self.num_microbatches} micro-batches, v={self.stages_per_device}, "
            f"{self.num_ticks} ticks"
        )
        return head + "\n" + self.to_text()


def _fail(schedule: Schedule, tick: int, device: int, rule: str, detail: str) -> None:
    lo, hi = max(0, tick - 4), tick + 5
    grid = schedule.to_text(lo, hi, mark=(tick, device))
    raise ValueError(
        f"Invalid schedule {schedule.name!r} at tick {tick}, device {device}: "
        f"rule '{rule}' violated: {detail}\nTicks {lo}..{min(hi, schedule.num_ticks) - 1} "
        f"(the offending cell is marked '>'):\n{grid}"
    )


def validate(schedule: Schedule, activation_limit: Sequence[int] | int | None = None) -> None:
    """See `Schedule.validate`."""
    s = schedule
    S, M, N = s.num_stages, s.num_microbatches, s.num_logical_stages
    if S < 1 or M < 1:
        raise ValueError(f"num_stages and num_microbatches must be >= 1, got S={S}, M={M}")
    if any(not 0 <= d < S for d in s.stage_device):
        raise ValueError(f"stage_device {s.stage_device} names a device outside [0, {S})")
    counts = [s.stage_device.count(d) for d in range(S)]
    if len(set(counts)) != 1:
        raise ValueError(f"stage_device {s.stage_device}: stages per device differ: {counts}")
    done: dict[tuple[str, int, int], int] = {}
    for t, row in enumerate(s.ticks):
        this_tick: dict[tuple[str, int, int], int] = {}
        if len(row) != S:
            raise ValueError(f"tick {t} has {len(row)} cells, expected one per device ({S})")
        for d, cell in enumerate(row):
            if len(cell) > s.max_actions_per_tick:
                _fail(
                    s,
                    t,
                    d,
                    "one slot",
                    f"{len(cell)} actions {list(cell)} in one tick; "
                    f"this schedule allows {s.max_actions_per_tick}",
                )
            if len(cell) == 2 and sorted(a.op == F for a in cell) != [False, True]:
                _fail(
                    s,
                    t,
                    d,
                    "one slot",
                    f"two actions {list(cell)} in one tick must be one forward and one backward",
                )
            for a in cell:
                if a.op not in OPS:
                    _fail(s, t, d, "known op", f"{a}: op must be one of {OPS}")
                if not (0 <= a.stage < N and 0 <= a.microbatch < M):
                    _fail(
                        s,
                        t,
                        d,
                        "in range",
                        f"{a}: stage must be in [0, {N}) and micro-batch in [0, {M})",
                    )
                if s.stage_device[a.stage] != d:
                    _fail(
                        s,
                        t,
                        d,
                        "placement",
                        f"{a} runs on device {d} but stage {a.stage} "
                        f"lives on device {s.stage_device[a.stage]}",
                    )
                key = (a.op, a.stage, a.microbatch)
                if key in done:
                    _fail(s, t, d, "exactly once", f"{a} already ran in tick {done[key]}")
                for dep in _dependencies(a, N):
                    if dep[0] == "B|BW":
                        when = [done[k] for k in ((B,) + dep[1:], (BW,) + dep[1:]) if k in done]
                        name = f"backward of stage {dep[1]}, micro-batch {dep[2]}"
                    else:
                        when = [done[dep]] if dep in done else []
                        name = f"{dep[0]} of stage {dep[1]}, micro-batch {dep[2]}"
                    if not when:
                        _fail(
                            s,
                            t,
                            d,
                            "dependency",
                            f"{a} needs the {name} in an earlier tick, which has not run",
                        )
                if a.op in (B, BW) and ((BW if a.op == B else B), a.stage, a.microbatch) in done:
                    _fail(
                        s,
                        t,
                        d,
                        "exactly once",
                        f"{a}: stage {a.stage} micro-batch {a.microbatch} already had a backward",
                    )
            for a in cell:
                key = (a.op, a.stage, a.microbatch)
                if key in this_tick:
                    _fail(s, t, d, "exactly once", f"{a} appears twice in tick {t}")
                this_tick[key] = t
        # A tick's results become visible to later ticks only.
        done.update(this_tick)
    forward_only = _forward_only(s)
    for stage in range(N):
        for m in range(M):
            dev = s.stage_device[stage]
            if (F, stage, m) not in done:
                _fail(
                    s, s.num_ticks - 1, dev, "complete", f"no F of stage {stage}, micro-batch {m}"
                )
            has_bw = (BW, stage, m) in done
            has_b, has_w = (B, stage, m) in done, (W, stage, m) in done
            if not has_bw and not (has_b and has_w) and (has_b or has_w or not forward_only):
                _fail(
                    s,
                    s.num_ticks - 1,
                    dev,
                    "complete",
                    f"stage {stage}, micro-batch {m} has no backward (BW, or B and W)",
                )
    if activation_limit is not None:
        limits = (
            [activation_limit] * S if isinstance(activation_limit, int) else list(activation_limit)
        )
        live = s.live_activations()
        for d in range(S):
            for t, n in enumerate(live[d]):
                if n > limits[d]:
                    _fail(s, t, d, "buffer", f"{n} live activations, buffers hold {limits[d]}")


def _forward_only(s: Schedule) -> bool:
    return not any(a.op != F for a in s.actions())


def _dependencies(a: Action, num_logical_stages: int) -> list[tuple]:
    """What must have run, in an earlier tick, before ``a`` can run."""
    if a.op == F:
        return [(F, a.stage - 1, a.microbatch)] if a.stage > 0 else []
    if a.op == W:
        return [(B, a.stage, a.microbatch)]
    deps: list[tuple] = [(F, a.stage, a.microbatch)]
    if a.stage < num_logical_stages - 1:
        deps.append(("B|BW", a.stage + 1, a.microbatch))
    return deps


def pack(
    name: str,
    num_stages: int,
    num_microbatches: int,
    stage_device: Sequence[int],
    orders: Sequence[Sequence],
    max_actions_per_tick: int = 1,
    options: dict | None = None,
) -> Schedule:
    """Builds a lock-step table from per-device action orders.

    ``orders[d]`` lists what device ``d`` runs, in order: each item an `Action`, or a tuple of
    two actions to run in the same tick. In each tick every device runs its next item if all
    of that item's dependencies ran in earlier ticks, and idles otherwise. Raises
    ``ValueError`` if the orders deadlock.
    """
    S = num_stages
    N = len(stage_device)
    if len(orders) != S:
        raise ValueError(f"expected one action order per device ({S}), got {len(orders)}")
    items = [[_as_cell(x) for x in order] for order in orders]
    position = [0] * S
    done: set[tuple] = set()
    ticks: list[tuple[Cell, ...]] = []
    remaining = sum(len(x) for x in items)
    while remaining:
        row: list[Cell] = []
        for d in range(S):
            cell: Cell = ()
            if position[d] < len(items[d]):
                candidate = items[d][position[d]]
                if all(_satisfied(dep, done) for a in candidate for dep in _dependencies(a, N)):
                    cell = candidate
            row.append(cell)
        if not any(row):
            stuck = {d: items[d][position[d]] for d in range(S) if position[d] < len(items[d])}
            raise ValueError(
                f"schedule {name!r} deadlocks at tick {len(ticks)}: no device can run its next "
                f"action; waiting: {stuck}"
            )
        for d, cell in enumerate(row):
            if cell:
                position[d] += 1
                remaining -= 1
        for cell in row:
            for a in cell:
                done.add((a.op, a.stage, a.microbatch))
        ticks.append(tuple(row))
    return Schedule(
        name=name,
        num_stages=S,
        num_microbatches=num_microbatches,
        stage_device=tuple(stage_device),
        ticks=tuple(ticks),
        max_actions_per_tick=max_actions_per_tick,
        options=tuple(sorted((options or {}).items())),
    )


def _satisfied(dep: tuple, done: set) -> bool:
    if dep[0] == "B|BW":
        return (B,) + dep[1:] in done or (BW,) + dep[1:] in done
    return dep in done
