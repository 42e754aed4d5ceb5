"""The schedule table: actions, the `Schedule` type, its validator and the lock-step packer.

Words used throughout jaxpipe:

- **F**: the forward of one stage on one micro-batch.
- **BW**: the full backward of one stage on one micro-batch (input and weight gradients).
- **B**: the input-gradient half of a split backward (the zero-bubble family's "B").
- **W**: the weight-gradient half of a split backward; it needs the B of the same stage and
  micro-batch first.
- **U**: an optimizer update of one stage's weights, at the end of its tick (asynchronous
  schedules such as PipeDream). It averages the weight gradients (from BW or W) of that stage
  made since the stage's previous U, in this tick included, and makes the stage's next
  weight version. A table without U's updates nowhere inside the pipeline: its gradients are
  summed over the step and returned (synchronous training). U is not a compute action:
  `Schedule.actions` and `Schedule.timed_actions` leave it out unless asked.
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

F, B, W, BW, U = "F", "B", "W", "BW", "U"
COMPUTE_OPS = (F, B, W, BW)
OPS = COMPUTE_OPS + (U,)
BACKWARD_OPS = (B, BW, W)
WEIGHT_GRADIENT_OPS = (BW, W)  # the actions that finish a stage's weight gradient


class Action(NamedTuple):
    """One unit of work: ``op`` of logical ``stage`` on ``microbatch``.

    ``version`` is the weight version of ``stage`` the action reads: for F, the number of U's
    of its stage in earlier ticks; for B, W and BW, the version their F read (weight
    stashing); 0 throughout in a table without U's. A ``U`` action has ``microbatch`` 0 and
    ``version`` the version it updates (its index among the stage's U's); it makes
    ``version + 1``.
    """

    op: str
    stage: int
    microbatch: int
    version: int = 0

    def label(self, stages_per_device: int = 1, num_stages: int = 1) -> str:
        """Short text: ``F3``, ``BW0``, ``U`` or, with several stages per device, ``F3:1``."""
        text = self.op if self.op == U else f"{self.op}{self.microbatch}"
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
      max_actions_per_tick: compute actions a cell may hold: 1, or 2 where a device may run
        one forward and one backward in the same tick (a fused cell, as in DualPipeV's
        overlapped pairs and ``1f1b(overlap=True)``). A cell may hold one ``U`` on top,
        last; it is not counted here.
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

    @property
    def has_updates(self) -> bool:
        """True if the table holds ``U`` actions: weights are updated inside the pipeline."""
        return any(a.op == U for row in self.ticks for cell in row for a in cell)

    def actions(self, include_updates: bool = False) -> Iterable[Action]:
        """Every compute action (F, B, W, BW) in tick order; with ``include_updates``, U's too."""
        for _, _, a in self.timed_actions(include_updates):
            yield a

    def timed_actions(self, include_updates: bool = False) -> Iterable[tuple[int, int, Action]]:
        """``(tick, device, action)`` for every compute action (F, B, W, BW) in the table;
        with ``include_updates``, the ``U`` actions too, where they stand in their cells."""
        for t, row in enumerate(self.ticks):
            for d, cell in enumerate(row):
                for a in cell:
                    if include_updates or a.op != U:
                        yield t, d, a

    def timed_updates(self) -> list[tuple[int, int, Action]]:
        """``(tick, device, action)`` for every ``U`` action, in tick order."""
        return [x for x in self.timed_actions(include_updates=True) if x[2].op == U]

    # ------------------------------------------------------------- analysis
    def validate(self, activation_limit: Sequence[int] | int | None = None) -> Schedule:
        """Checks the table; returns ``self`` or raises ``ValueError`` naming tick, device, rule.

        Rules: every stage lives on one device and every action runs there; each cell holds
        at most ``max_actions_per_tick`` compute actions (and, if two, one forward and one
        backward) and at most one ``U``, last; every (stage, micro-batch) has exactly one F
        and either one BW or one B and one W; F of stage k comes after F of stage k-1; a
        backward of stage k comes after its own F and after the backward (BW or B) of stage
        k+1; W comes after B. "After" means in a strictly later tick.

        Weight updates and versions: a ``U`` of stage s averages at least one weight
        gradient (a BW or W of s since its previous U, this tick included); if the table has
        U's, every weight gradient is taken by one. F of stage s reads the version equal to
        the number of U's of s in earlier ticks; B, W and BW read the version their F read;
        a U's version is its index among its stage's U's. Without U's every version is 0.

        If ``activation_limit`` is given (one int, or one per device), no device holds more
        live micro-batch activations than that.
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
        """Idle share of device-time at ``costs`` (default `Costs()`: F = B = W = 1, BW = 2).

        Returns ``(lockstep, ideal)``; ``lockstep`` is what the executor runs and what jaxpipe
        calls "the bubble" (see `jaxpipe.schedules.simulate`).
        """
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
        """The same placement and forward order with every backward and update dropped."""
        rows = []
        for row in self.ticks:
            new = tuple(tuple(a._replace(version=0) for a in cell if a.op == F) for cell in row)
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
            _check_cell(s, t, d, cell)
            for a in cell:
                if a.op == U:
                    continue
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
                if a.op == U:
                    continue
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
    _check_updates_and_versions(s)
    if activation_limit is not None:
        limits = (
            [activation_limit] * S if isinstance(activation_limit, int) else list(activation_limit)
        )
        live = s.live_activations()
        for d in range(S):
            for t, n in enumerate(live[d]):
                if n > limits[d]:
                    _fail(s, t, d, "buffer", f"{n} live activations, buffers hold {limits[d]}")


def _check_cell(s: Schedule, t: int, d: int, cell: Cell) -> None:
    """The rules of one cell: ops, ranges, placement, how many actions and of which kinds."""
    N, M = s.num_logical_stages, s.num_microbatches
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
    compute = [a for a in cell if a.op != U]
    updates = [a for a in cell if a.op == U]
    if len(compute) > s.max_actions_per_tick:
        _fail(
            s,
            t,
            d,
            "one slot",
            f"{len(compute)} actions {compute} in one tick; "
            f"this schedule allows {s.max_actions_per_tick}",
        )
    if len(compute) == 2 and sorted(a.op == F for a in compute) != [False, True]:
        _fail(
            s,
            t,
            d,
            "one slot",
            f"two actions {compute} in one tick must be one forward and one backward",
        )
    if updates and (len(updates) > 1 or cell[-1].op != U):
        _fail(s, t, d, "one slot", f"a cell holds at most one U, last; got {list(cell)}")
    if updates and updates[0].microbatch != 0:
        _fail(s, t, d, "in range", f"{updates[0]}: a U has micro-batch 0")


def _check_updates_and_versions(s: Schedule) -> None:
    """The weight-update and version rules of `Schedule.validate` (see there)."""
    N = s.num_logical_stages
    has_updates = s.has_updates
    updates = [0] * N  # U's of each stage in earlier ticks: the newest version
    pending = [0] * N  # weight gradients of each stage not yet taken by a U
    last_gradient: list[tuple[int, int] | None] = [None] * N  # (tick, device)
    read: dict[tuple[int, int], int] = {}  # (stage, micro-batch) -> version its F read
    for t, row in enumerate(s.ticks):
        made = []
        for d, cell in enumerate(row):
            for a in cell:
                key = (a.stage, a.microbatch)
                if a.op == F:
                    if a.version != updates[a.stage]:
                        _fail(
                            s,
                            t,
                            d,
                            "version",
                            f"{a} reads version {a.version}, but the newest version of stage "
                            f"{a.stage} at that tick is {updates[a.stage]} (the number of its "
                            "U's in earlier ticks); a forward must read the newest version",
                        )
                    read[key] = a.version
                elif a.op in BACKWARD_OPS:
                    if a.version != read[key]:
                        _fail(
                            s,
                            t,
                            d,
                            "version",
                            f"{a} reads version {a.version}, but its forward read version "
                            f"{read[key]}; a backward reads the version its forward read",
                        )
                    if a.op in WEIGHT_GRADIENT_OPS:
                        pending[a.stage] += 1
                        last_gradient[a.stage] = (t, d)
                else:  # U, last in its cell: this tick's gradients are in
                    if a.version != updates[a.stage]:
                        _fail(
                            s,
                            t,
                            d,
                            "version",
                            f"{a} updates version {a.version}, but stage {a.stage} has had "
                            f"{updates[a.stage]} U's before; a U's version is its index",
                        )
                    if not pending[a.stage]:
                        _fail(
                            s,
                            t,
                            d,
                            "update",
                            f"{a}: stage {a.stage} has no weight gradient (BW or W) since its "
                            "previous U; a U averages at least one",
                        )
                    pending[a.stage] = 0
                    made.append(a.stage)
        for stage in made:
            updates[stage] += 1
    if has_updates:
        for stage in range(N):
            if pending[stage]:
                t, d = last_gradient[stage]
                _fail(
                    s,
                    t,
                    d,
                    "update",
                    f"stage {stage} has {pending[stage]} weight gradient(s) after its last U; "
                    "in a table with U's every weight gradient is taken by a U",
                )


def _forward_only(s: Schedule) -> bool:
    return not any(a.op != F for a in s.actions(include_updates=True))


def update_points(schedule: Schedule) -> list[list[tuple[int, tuple[int, ...]]]]:
    """For each logical stage, its weight updates in tick order: ``(tick, micro-batches)``.

    An update runs at the end of ``tick`` (after the tick's actions) and applies the mean of
    the listed micro-batches' weight gradients of that stage. In a table with ``U`` actions
    there is one point per U: the micro-batches whose weight gradient (BW or W) of the stage
    ran after the stage's previous U and by the U's tick. A table without U's trains
    synchronously: one point per stage, at the tick of its last weight gradient, with every
    micro-batch (none for a stage without backwards, as in a forward-only table).
    """
    N = schedule.num_logical_stages
    gradients: list[list[tuple[int, int]]] = [[] for _ in range(N)]  # (tick, micro-batch)
    updates: list[list[int]] = [[] for _ in range(N)]
    for t, _, a in schedule.timed_actions(include_updates=True):
        if a.op in WEIGHT_GRADIENT_OPS:
            gradients[a.stage].append((t, a.microbatch))
        elif a.op == U:
            updates[a.stage].append(t)
    if not schedule.has_updates:
        return [
            [(max(t for t, _ in rows), tuple(sorted(m for _, m in rows)))] if rows else []
            for rows in gradients
        ]
    points = []
    for s in range(N):
        row, previous = [], -1
        for tick in updates[s]:
            group = tuple(sorted(m for t, m in gradients[s] if previous < t <= tick))
            row.append((tick, group))
            previous = tick
        points.append(row)
    return points


def stamp_versions(schedule: Schedule) -> Schedule:
    """The same table with every ``Action.version`` set from its U's (rules in `validate`)."""
    updates = [0] * schedule.num_logical_stages
    read: dict[tuple[int, int], int] = {}
    rows = []
    for row in schedule.ticks:
        cells, made = [], []
        for cell in row:
            new = []
            for a in cell:
                if a.op == F:
                    read[(a.stage, a.microbatch)] = updates[a.stage]
                    a = a._replace(version=updates[a.stage])
                elif a.op == U:
                    a = a._replace(version=updates[a.stage])
                    made.append(a.stage)
                else:
                    a = a._replace(version=read.get((a.stage, a.microbatch), 0))
                new.append(a)
            cells.append(tuple(new))
        for stage in made:
            updates[stage] += 1
        rows.append(tuple(cells))
    return dataclasses.replace(schedule, ticks=tuple(rows))


def add_updates(schedule: Schedule, every: int) -> Schedule:
    """The same table with a ``U`` after every ``every``-th weight gradient of each stage.

    For each stage, its weight gradients (BW or W) in tick order are cut into groups of
    ``every`` (the last may be shorter); each group's U goes at the end of the cell of its
    last gradient. Versions are then stamped (`stamp_versions`). ``every=1`` updates after
    every micro-batch (PipeDream); ``every=M`` once per step, after the stage's last backward.
    """
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"add_updates: every must be a positive int, got {every!r}")
    seen = [0] * schedule.num_logical_stages
    count = [0] * schedule.num_logical_stages
    for a in schedule.actions():
        if a.op in WEIGHT_GRADIENT_OPS:
            count[a.stage] += 1
    rows = []
    for row in schedule.ticks:
        cells = []
        for cell in row:
            cell = tuple(a for a in cell if a.op != U)
            extra = ()
            for a in cell:
                if a.op in WEIGHT_GRADIENT_OPS:
                    seen[a.stage] += 1
                    if seen[a.stage] % every == 0 or seen[a.stage] == count[a.stage]:
                        extra = (Action(U, a.stage, 0),)
            cells.append(cell + extra)
        rows.append(tuple(cells))
    return stamp_versions(dataclasses.replace(schedule, ticks=tuple(rows)))


def _dependencies(a: Action, num_logical_stages: int) -> list[tuple]:
    """What must have run, in an earlier tick, before ``a`` can run (nothing for a U)."""
    if a.op == U:
        return []
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

    ``orders[d]`` lists what device ``d`` runs, in order: each item a compute `Action`, or a
    tuple of two actions (one F, one backward) to run in the same tick. Add ``U`` actions to
    the packed table with `add_updates`. In each tick every device runs its next item if all
    of that item's dependencies ran in earlier ticks, and idles otherwise. Raises
    ``ValueError`` if the orders deadlock.
    """
    S = num_stages
    N = len(stage_device)
    if len(orders) != S:
        raise ValueError(f"expected one action order per device ({S}), got {len(orders)}")
    items = [[_as_cell(x) for x in order] for order in orders]
    if any(a.op == U for order in items for cell in order for a in cell):
        raise ValueError("pack takes compute actions only; add U's with add_updates")
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
