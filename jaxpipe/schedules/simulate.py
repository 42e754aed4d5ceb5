"""Timelines of a schedule table under per-action costs, and its bubble fraction.

The bubble is the idle share of device-time, ``1 - total busy / (S * makespan)``. What
jaxpipe prints and documents as "the bubble" is the lock-step figure, for the costs it
states (default `Costs()`: F = B = W = 1, a full backward BW = 2, no communication).

Two ways to run a table:

- ``"lockstep"``: as the executor runs it, one SPMD step per tick. A tick lasts as long as
  its slowest device's cell (a cell of two actions costs their sum), plus ``communication``
  once if any action in the tick sends its result to another device.
- ``"ideal"``: each device runs its own actions in the table's order (tick by tick, and in
  cell order within a tick), each as soon as the device is free and the action's inputs have
  arrived: a dependency's end, plus ``communication`` if it ran on another device.

Every action starts in the ideal no later than in lock-step, so the ideal makespan is never
longer; the difference is the price of lock-step. A ``U`` (weight update) costs 0: it is
placed at the end of its tick (lock-step) or of its device's last action so far (ideal).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from jaxpipe.schedules.actions import BW, Action, B, F, U, W, dependencies, met_by
from jaxpipe.schedules.core import Schedule

MODES = ("lockstep", "ideal")


@dataclasses.dataclass(frozen=True)
class Costs:
    """Time of one action (any unit), and of sending a result to another device."""

    forward: float = 1.0
    backward_input: float = 1.0  # B
    backward_weight: float = 1.0  # W
    full_backward: float | None = None  # BW; None means backward_input + backward_weight
    communication: float = 0.0  # latency added when a result crosses to another device

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and not value >= 0:
                raise ValueError(f"Costs.{field.name} must be >= 0, got {value!r}")

    def of(self, action: Action) -> float:
        """The cost of ``action`` (0 for a ``U``).

        Args:
          action: the action.

        Returns:
          Its time.

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
    """Bubble fraction when run in lock-step and in the ideal (see module docstring)."""

    lockstep: float
    ideal: float


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


def simulate(schedule: Schedule, costs: Costs = Costs(), mode: str = "lockstep") -> Timeline:
    """Places every action of ``schedule`` in time; ``mode`` is ``"lockstep"`` or ``"ideal"``.

    Args:
      schedule: the table.
      costs: the time of each action and of a transfer.
      mode: ``"lockstep"`` or ``"ideal"`` (module docstring).

    Returns:
      The `Timeline`.

    Raises:
      ValueError: for an unknown ``mode``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    S = schedule.num_stages
    events: list[Event] = []
    updates: list[Event] = []
    busy = [0.0] * S
    if mode == "lockstep":
        now = 0.0
        for t, row in enumerate(schedule.ticks):
            longest, crosses = 0.0, False
            for d, cell in enumerate(row):
                clock = now
                for a in cell:
                    if a.op == U:
                        continue
                    cost = costs.of(a)
                    events.append(Event(d, clock, clock + cost, a, t))
                    clock += cost
                    busy[d] += cost
                    crosses = crosses or _sends_across(schedule, a)
                longest = max(longest, clock - now)
            for d, cell in enumerate(row):
                updates += [Event(d, now + longest, now + longest, a, t) for a in cell if a.op == U]
            now += longest + (costs.communication if crosses else 0.0)
        makespan = now
    else:
        free = [0.0] * S
        end: dict[tuple, tuple[float, int]] = {}  # (op, stage, microbatch) -> (end, device)
        for t, d, a in schedule.timed_actions(include_updates=True):
            if a.op == U:
                updates.append(Event(d, free[d], free[d], a, t))
                continue
            ready = free[d]
            for dep in dependencies(a, schedule.num_logical_stages):
                for key in met_by(dep):
                    if key in end:
                        finish, where = end[key]
                        ready = max(ready, finish + (costs.communication if where != d else 0))
            cost = costs.of(a)
            events.append(Event(d, ready, ready + cost, a, t))
            end[(a.op, a.stage, a.microbatch)] = (ready + cost, d)
            free[d] = ready + cost
            busy[d] += cost
        makespan = max(free, default=0.0)
    return Timeline(schedule, costs, mode, tuple(events), makespan, tuple(busy), tuple(updates))


def bubble_fraction(schedule: Schedule, costs: Costs = Costs()) -> BubbleReport:
    """Idle share of device-time, ``1 - total busy / (S * makespan)``, in both modes.

    ``lockstep`` is the bubble the executor runs with at these costs; ``ideal`` is the
    bound of the same order without lock-step ticks (see the module docstring).

    Args:
      schedule: the table.
      costs: the time of each action and of a transfer.

    Returns:
      A `BubbleReport` ``(lockstep, ideal)``.
    """
    return BubbleReport(
        lockstep=simulate(schedule, costs, "lockstep").bubble,
        ideal=simulate(schedule, costs, "ideal").bubble,
    )
