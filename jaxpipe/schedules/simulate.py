"""Timelines of a schedule table under per-action costs, and its bubble fraction.

The bubble is the idle share of device-time, ``1 - total busy / (S * makespan)``. What
jaxpipe prints and documents as "the bubble" is the lock-step figure, for the costs it
states (default `Costs()`: F = B = W = 1, a full backward BW = 2, no communication).

Three ways to run a table:

- ``"lockstep"``: as the executor runs it, one SPMD step per tick. A tick lasts as long as
  its slowest device's cell (a cell of two actions costs their sum, less the all-to-alls
  each hides behind the other: `Costs.of_cell`), plus ``communication``
  once if any action in the tick sends its result to another device.
- ``"neighbour"``: the same ticks, synchronised as a chip synchronises them: a tick ends
  with its ``ppermute``s, and a ``ppermute`` makes a device wait only for the devices it
  exchanges with (`partners`), not for every device. Device ``d``'s tick ``t`` starts when
  its tick ``t - 1`` ends and ends at the latest end of its own cell and its partners'
  cells in tick ``t``, plus ``communication`` if any action in the tick sends its result to
  another device.
- ``"ideal"``: each device runs its own actions in the table's order (tick by tick, and in
  cell order within a tick), each as soon as the device is free and the action's inputs have
  arrived: a dependency's end, plus ``communication`` if it ran on another device. A cell
  whose two actions hide each other's all-to-alls runs as one, once both can start.

The makespans are ordered, ideal <= neighbour <= lock-step, for any table and costs, by
induction over ticks: in neighbour mode a device's tick ends at the latest end of some of
the cells whose latest end closes the lock-step tick, so it starts each tick no later than
lock-step does; and an action's inputs come from its own device or from a partner whose
cell its device waited for (plus ``communication``), so in the ideal, where it waits for
nothing but its inputs and its device, it starts no later than in neighbour mode. Lock-step
is a step in which every tick waits for every device; on a chip a tick waits for what its
``ppermute``s pair, so a real step lands at or below lock-step, near neighbour mode where
the ``ppermute``s are the only synchronisation, and never below the ideal.

A ``U`` (weight update) costs 0: it is placed at the end of its tick (lock-step, neighbour)
or of its device's last action so far (ideal).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import NamedTuple

from jaxpipe.schedules.actions import BW, Action, B, F, U, W, dependencies, met_by
from jaxpipe.schedules.core import Schedule

MODES = ("lockstep", "neighbour", "ideal")


@dataclasses.dataclass(frozen=True)
class Costs:
    """Time of one action (any unit), and of sending a result to another device.

    ``forward`` to ``full_backward`` are an action's computation. A stage with expert
    parallelism also exchanges tokens with all-to-alls inside each action; the
    ``all_to_all_*`` fields are their time, which nothing in the action itself hides. An
    action alone in its tick takes its computation plus its all-to-alls (`of`); a tick
    that pairs a forward with a backward on one device runs each one's all-to-alls behind
    the other's computation: it takes the larger of the two sums, and no less than either
    action alone, whose own all-to-alls wait for its computation (`of_cell`).
    """

    forward: float = 1.0
    backward_input: float = 1.0  # B
    backward_weight: float = 1.0  # W
    full_backward: float | None = None  # BW; None means backward_input + backward_weight
    communication: float = 0.0  # latency added when a result crosses to another device
    all_to_all_forward: float = 0.0  # an F's all-to-alls
    all_to_all_backward: float = 0.0  # a B's or a BW's
    all_to_all_weight: float = 0.0  # a W's (with recomputation, the forward's again)

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None and field.name == "full_backward":  # BW = B + W
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"Costs.{field.name} must be a number >= 0, got {value!r}")
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"Costs.{field.name} must be finite and >= 0, got {value!r}")

    @classmethod
    def from_text(cls, text: str) -> Costs:
        """`Costs` from ``"F:B:W"`` or ``"F:B:W:communication"``, e.g. ``"1:2:0.5"``.

        Args:
          text: three or four numbers >= 0 separated by colons: the forward, the input
            gradient (B), the weight gradient (W), and optionally a transfer.

        Returns:
          The `Costs` (BW = B + W).

        Raises:
          ValueError: ``text`` is not of that form.
        """
        try:
            numbers = [float(x) for x in str(text).split(":")]
        except ValueError:
            numbers = []
        if len(numbers) not in (3, 4):
            raise ValueError(f"costs {text!r}: expected F:B:W or F:B:W:communication, e.g. 1:2:0.5")
        f, b, w, *rest = numbers
        return cls(forward=f, backward_input=b, backward_weight=w, communication=sum(rest))

    def of(self, action: Action) -> float:
        """The cost of ``action`` alone: its computation and its all-to-alls (0 for a
        ``U``).

        Args:
          action: the action.

        Returns:
          Its time.

        Raises:
          ValueError: for an unknown op.
        """
        return self.computation_of(action) + self.all_to_all_of(action)

    def all_to_all_of(self, action: Action) -> float:
        """The time of ``action``'s all-to-alls (0 for a ``U``).

        Args:
          action: the action.

        Returns:
          Its all-to-alls' time.

        Raises:
          ValueError: for an unknown op.
        """
        if action.op in (U, F, B, W, BW):
            return {
                U: 0.0,
                F: self.all_to_all_forward,
                B: self.all_to_all_backward,
                BW: self.all_to_all_backward,
                W: self.all_to_all_weight,
            }[action.op]
        raise ValueError(f"unknown op {action.op!r} in {action}; expected one of F, B, W, BW, U")

    def of_cell(self, actions: Sequence[Action]) -> float:
        """The time of one device's cell in a tick: its actions one after another, or, for
        a forward and a backward together, the largest of their computations' sum, their
        all-to-alls' sum (each one's all-to-alls behind the other's computation) and
        either action alone (its all-to-alls wait for its own computation).

        Args:
          actions: the cell's actions (``U``'s cost nothing).

        Returns:
          Its time.
        """
        actions = [a for a in actions if a.op != U]
        alone = sum(self.of(a) for a in actions)
        if len(actions) != 2 or sorted(a.op == F for a in actions) != [False, True]:
            return alone
        computation = sum(self.computation_of(a) for a in actions)
        exchange = sum(self.all_to_all_of(a) for a in actions)
        return min(alone, max(computation, exchange, *(self.of(a) for a in actions)))

    def computation_of(self, action: Action) -> float:
        """The time of ``action``'s computation (0 for a ``U``).

        Args:
          action: the action.

        Returns:
          Its computation's time.

        Raises:
          ValueError: for an unknown op.
        """
        if action.op == U:
            return 0.0
        if action.op == F:
            return self.forward
        if action.op == B:
            return self.backward_input
        if action.op == W:
            return self.backward_weight
        if action.op == BW:
            if self.full_backward is None:
                return self.backward_input + self.backward_weight
            return self.full_backward
        raise ValueError(f"unknown op {action.op!r} in {action}; expected one of F, B, W, BW, U")


class Event(NamedTuple):
    """One action placed in time: it runs on ``device`` from ``start`` to ``end``."""

    device: int
    start: float
    end: float
    action: Action
    tick: int


@dataclasses.dataclass(frozen=True)
class Timeline:
    """A simulated run: every compute action as an `Event`, the makespan and each device's
    busy time; ``updates`` holds the ``U`` actions as zero-length events."""

    schedule: Schedule
    costs: Costs
    mode: str
    events: tuple[Event, ...]
    makespan: float
    busy: tuple[float, ...]
    updates: tuple[Event, ...] = ()

    @property
    def bubble(self) -> float:
        """Idle share of device-time: ``1 - sum(busy) / (S * makespan)``."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


class BubbleReport(NamedTuple):
    """Bubble fraction in each way of running a table (see module docstring); lock-step >=
    neighbour >= ideal."""

    lockstep: float
    ideal: float
    neighbour: float


def _sends_across(schedule: Schedule, action: Action) -> bool:
    """True if ``action``'s result is consumed by an action on another device."""
    placement, stage = schedule.stage_device, action.stage
    if action.op == F:
        consumer = stage + 1 if stage + 1 < len(placement) else None
    elif action.op in (B, BW):
        consumer = stage - 1 if stage > 0 else None
    else:
        consumer = None
    return consumer is not None and placement[consumer] != placement[stage]


def channel_offsets(schedule: Schedule) -> tuple[int, ...]:
    """The device offsets of the executor's ``ppermute`` channels.

    A stage's forward result goes from the device of stage ``s`` to that of ``s + 1``, and
    its input gradient back: each crossing is a channel with offset ``(to - from) mod S``,
    which pairs every device ``d`` with ``(d + offset) mod S`` as target and
    ``(d - offset) mod S`` as source in every tick.

    Args:
      schedule: the table (only its placement is read).

    Returns:
      The distinct non-zero offsets, sorted.
    """
    S, placement = schedule.num_stages, schedule.stage_device
    offsets = set()
    for here, there in zip(placement, placement[1:], strict=False):
        offsets |= {(there - here) % S, (here - there) % S}
    return tuple(sorted(offsets - {0}))


def partners(schedule: Schedule) -> tuple[tuple[int, ...], ...]:
    """Per device, the other devices it exchanges with in every tick's ``ppermute``s.

    Args:
      schedule: the table (only its placement is read).

    Returns:
      ``partners[d]``: the sources and targets of device ``d`` on every channel of
      `channel_offsets`, sorted, ``d`` left out.
    """
    S, offsets = schedule.num_stages, channel_offsets(schedule)
    return tuple(
        tuple(sorted({(d + o) % S for o in offsets} | {(d - o) % S for o in offsets} - {d}))
        for d in range(S)
    )


def simulate(schedule: Schedule, costs: Costs = Costs(), mode: str = "lockstep") -> Timeline:
    """Places every action of ``schedule`` in time, in one of the ways of running a table.

    Args:
      schedule: the table, valid (`jaxpipe.schedules.validate`; every generator's is): an
        invalid one is timed as given, its missing or late dependencies not waited for.
      costs: the time of each action and of a transfer.
      mode: ``"lockstep"``, ``"neighbour"`` or ``"ideal"`` (module docstring).

    Returns:
      The `Timeline`.

    Raises:
      TypeError: ``costs`` is not a `Costs`.
      ValueError: for an unknown ``mode``.
    """
    if not isinstance(costs, Costs):
        raise TypeError(
            "costs must be a jaxpipe.schedules.Costs(forward=..., backward_input=..., "
            f"backward_weight=...), got {type(costs).__name__} {costs!r}"
        )
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "ideal":
        return _simulate_ideal(schedule, costs)
    S = schedule.num_stages
    events: list[Event] = []
    updates: list[Event] = []
    busy = [0.0] * S
    everyone = tuple(tuple(range(S)) for _ in range(S))
    waits_for = everyone if mode == "lockstep" else partners(schedule)
    start = [0.0] * S  # when each device's current tick starts
    for t, row in enumerate(schedule.ticks):
        cell_end, crosses = list(start), False
        for d, cell in enumerate(row):
            scale = _overlap_scale(costs, cell)
            for a in cell:
                if a.op == U:
                    continue
                cost = costs.of(a) * scale
                events.append(Event(d, cell_end[d], cell_end[d] + cost, a, t))
                cell_end[d] += cost
                busy[d] += cost
                crosses = crosses or _sends_across(schedule, a)
        tick_end = [max([cell_end[d]] + [cell_end[p] for p in waits_for[d]]) for d in range(S)]
        for d, cell in enumerate(row):
            updates += [Event(d, tick_end[d], tick_end[d], a, t) for a in cell if a.op == U]
        start = [end + (costs.communication if crosses else 0.0) for end in tick_end]
    makespan = max(start, default=0.0)
    return Timeline(schedule, costs, mode, tuple(events), makespan, tuple(busy), tuple(updates))


def _simulate_ideal(schedule: Schedule, costs: Costs) -> Timeline:
    """Each device runs its actions in table order, each as soon as its inputs are there."""
    S = schedule.num_stages
    events: list[Event] = []
    updates: list[Event] = []
    busy = [0.0] * S
    free = [0.0] * S
    end: dict[tuple, tuple[float, int]] = {}  # (op, stage, microbatch) -> (end, device)

    def ready_of(a: Action, d: int) -> float:
        ready = free[d]
        for dep in dependencies(a, schedule.num_logical_stages):
            for key in met_by(dep):
                if key in end:
                    finish, where = end[key]
                    ready = max(ready, finish + (costs.communication if where != d else 0))
        return ready

    for t, row in enumerate(schedule.ticks):
        for d, cell in enumerate(row):
            scale = _overlap_scale(costs, cell)
            together = scale < 1.0  # overlapped all-to-alls: the pair runs as one
            ready = max([ready_of(a, d) for a in cell if a.op != U], default=0.0)
            for a in cell:
                if a.op == U:
                    updates.append(Event(d, free[d], free[d], a, t))
                    continue
                start = max(free[d], ready) if together else ready_of(a, d)
                cost = costs.of(a) * scale
                events.append(Event(d, start, start + cost, a, t))
                end[(a.op, a.stage, a.microbatch)] = (start + cost, d)
                free[d] = start + cost
                busy[d] += cost
    makespan = max(free, default=0.0)
    return Timeline(schedule, costs, "ideal", tuple(events), makespan, tuple(busy), tuple(updates))


def _overlap_scale(costs: Costs, cell) -> float:
    """How much shorter a cell is than its actions one after another (1 but where a
    forward and a backward hide each other's all-to-alls): each action's event lasts its
    cost times this, so that the cell lasts `Costs.of_cell`."""
    alone = sum(costs.of(a) for a in cell if a.op != U)
    return costs.of_cell(cell) / alone if alone > 0 else 1.0


def bubble_fraction(schedule: Schedule, costs: Costs = Costs()) -> BubbleReport:
    """Idle share of device-time, ``1 - total busy / (S * makespan)``, in every mode.

    ``lockstep`` is the bubble of the executor's program if every tick waits for every
    device; ``neighbour`` that of the same ticks when a tick waits only for the devices its
    ``ppermute``s pair; ``ideal`` the bound of the same order without ticks. A real step on
    a chip lands between ``lockstep`` and ``ideal`` (see the module docstring).

    Args:
      schedule: the table.
      costs: the time of each action and of a transfer.

    Returns:
      A `BubbleReport` ``(lockstep, ideal, neighbour)``.
    """
    return BubbleReport(
        lockstep=simulate(schedule, costs, "lockstep").bubble,
        ideal=simulate(schedule, costs, "ideal").bubble,
        neighbour=simulate(schedule, costs, "neighbour").bubble,
    )
