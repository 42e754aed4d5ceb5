"""Lock-step tables fitted to the stage's costs: `fit`.

The executor runs a table in lock-step: a tick lasts as long as its slowest cell. A table
packed for equal costs (every generator's default) loses much of its advantage when F, B
and W differ, because ticks that hold a B next to ticks that hold an F last as long as the
B. `fit` packs the same work again, tick by tick, for the given costs:

- each device keeps its own order of forwards and backwards (F, B, BW) from the table
  (some of the packings tried let a ready forward or backward run ahead of the other
  kind); its W's, which nothing waits for, move later to fill time the device would idle;
- a cell is what the executor runs in a tick: at most one forward and one backward action
  (B, BW or W), each reading only what ran in earlier ticks;
- a forward waits while its device holds as many activations as it does at its peak in
  the given table (plus ``extra_live``), so the fitted table keeps no more forwards'
  residuals alive (than ``extra_live`` more). One more lets a device run a forward while a
  backward waits: where B and W cost more than F, the 1F1B family's lock-step tables come
  near their ideal bubble only so (1f1b, S = 4, M = 16 at F:B:W = 1:2:1: 22% shorter). It may
  hold more of the executor's other buffers: B's whose W moved later keep their stash
  longer (1f1b at F:B:W = 1:1.88:0.21, S = 4: two stash slots, not one; interleaved_1f1b
  at S = 4, M = 8: six), and a received input may wait longer for its forward.
  `jaxpipe.memory.predict` and the compiled program count them;
- each tick's length is chosen among the lengths its devices' next cells could take, the
  one after which the rest of the work, run without ticks (as `simulate`'s ``"ideal"``
  mode runs it), would end soonest, with the tick's own idle time counted against it
  with a weight (several weights are tried, and the fastest table kept).

A fitted table is kept only if its lock-step run at those costs is shorter than the given
table's and its neighbour-synchronised run (how a chip runs the ticks) no longer;
otherwise the given table is returned. Nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import deque

from jaxpipe.schedules.actions import BW, Action, B, F, W, dependencies, met_by
from jaxpipe.schedules.core import Schedule
from jaxpipe.schedules.simulate import Costs, bubble_fraction, simulate
from jaxpipe.schedules.validation import validate

_NEVER = float("inf")
_SLACK = 1e-9  # rounding allowance when a cell is checked against a tick's length
# Packings tried: how much a tick's idle device-time counts against it, beside the
# estimated end of the step (module docstring); the fastest table is kept.
_PACKINGS = [(w, r) for r in (False, True) for w in (0.0, 0.5, 2.0, 4.0)]


def fit(schedule: Schedule, costs: Costs, *, extra_live: int = 0) -> Schedule:
    """The table of ``schedule``'s work packed for ``costs`` (module docstring).

    Args:
      schedule: a valid table without weight updates (no ``U``).
      costs: the time of each action and of a transfer between devices.
      extra_live: how many more micro-batches' activations a device may hold than at its
        peak in ``schedule`` (each costs a stage's residuals of one micro-batch).

    Returns:
      A valid table with the same placement and actions, no more live activations on any
      device than ``schedule`` at its peak plus ``extra_live`` (though possibly more W
      stashes and received inputs waiting, module docstring), whose lock-step and
      neighbour-synchronised makespans at ``costs`` are at most ``schedule``'s: the fitted
      table where its lock-step run is shorter and its neighbour-synchronised run no
      longer, ``schedule`` itself otherwise.
      The fitted table's ``options`` add ``"costs"``, the costs it was fitted to, and
      ``"extra_live"`` where it is not 0.

    Raises:
      TypeError: ``costs`` is not a `Costs`.
      ValueError: ``schedule`` updates weights inside the pipeline (its ``U``'s fix where
        the forwards may run, so it is not repacked), or ``extra_live`` is not an int >= 0.
    """
    if not isinstance(costs, Costs):
        raise TypeError(
            "costs must be a jaxpipe.schedules.Costs(forward=..., backward_input=..., "
            f"backward_weight=...), got {type(costs).__name__}"
        )
    if schedule.has_updates:
        raise ValueError(
            f"schedule {schedule.name!r} updates weights inside the pipeline (U actions); "
            "fit repacks tables without U's only"
        )
    if not isinstance(extra_live, int) or extra_live < 0:
        raise ValueError(f"extra_live must be an int >= 0, got {extra_live!r}")
    return _fit(schedule, costs, extra_live)


@functools.lru_cache(maxsize=64)
def _fit(schedule: Schedule, costs: Costs, extra_live: int = 0) -> Schedule:
    options = dict(schedule.options, costs=describe_costs(costs))
    if extra_live:
        options["extra_live"] = extra_live
    options = tuple(sorted(options.items()))
    cap = tuple(peak + extra_live for peak in schedule.peak_activations())
    best = schedule
    for idle_weight, reorder in _PACKINGS:
        try:
            ticks = _Packer(schedule, costs, idle_weight, reorder, cap).run()
        except _Deadlock:
            continue
        fitted = dataclasses.replace(
            schedule,
            ticks=ticks,
            max_actions_per_tick=max(len(cell) for row in ticks for cell in row),
            options=options,
        )
        validate(fitted, cap)
        if _faster(fitted, best, costs):
            best = fitted
    return best


def _faster(table: Schedule, than: Schedule, costs: Costs) -> bool:
    """Shorter in lock-step and no longer neighbour-synchronised, at ``costs``."""
    shorter = _makespan(table, costs, "lockstep") < _makespan(than, costs, "lockstep")
    return shorter and _makespan(table, costs, "neighbour") <= _makespan(than, costs, "neighbour")


def _makespan(schedule: Schedule, costs: Costs, mode: str) -> float:
    return round(simulate(schedule, costs, mode).makespan, 9)


def describe_fit(table: Schedule, costs: Costs, default: Schedule | None = None) -> str:
    """One line: the costs, the table, and its predicted bubbles at those costs.

    Args:
      table: the table run (from `fit`, or any).
      costs: the costs it runs at.
      default: the table packed for equal costs, shown beside it (None: not shown).

    Returns:
      ``"costs F=1 B=1.88 W=0.21 BW=2.09 comm=0; table zbv, 66 ticks: bubble lock-step
      13.0%, neighbour 13.0%, ideal 9.5% (equal-cost table: 42.6%, 34.6%, 9.2%)"``.
    """

    def bubbles(schedule):
        report = bubble_fraction(schedule, costs)
        return report.lockstep, report.neighbour, report.ideal

    line = f"costs {describe_costs(costs)}; table {table.name}, {table.num_ticks} ticks: "
    line += "bubble lock-step {:.1%}, neighbour {:.1%}, ideal {:.1%}".format(*bubbles(table))
    if default is not None and default != table:
        line += " (equal-cost table: {:.1%}, {:.1%}, {:.1%})".format(*bubbles(default))
    elif default is not None:
        line += " (the equal-cost table: no packing found faster)"
    return line


def describe_costs(costs: Costs) -> str:
    """One line naming the costs, relative to F where F > 0.

    Args:
        costs: the `Costs` to describe.

    Returns:
        The actions' computations and a transfer, as ``"F=1 B=1.88 W=0.21 BW=2.09 comm=0"``,
        then the all-to-alls' times that are not 0, as ``"a2a_F=0.4 a2a_B=0.4"``.
    """
    unit = costs.forward if costs.forward > 0 else 1.0
    full = costs.computation_of(Action(BW, 0, 0))
    values = (costs.forward, costs.backward_input, costs.backward_weight, full)
    parts = [f"{k}={v / unit:.3g}" for k, v in zip(("F", "B", "W", "BW"), values, strict=True)]
    parts.append(f"comm={costs.communication / unit:.3g}")
    exchanges = {
        "a2a_F": costs.all_to_all_forward,
        "a2a_B": costs.all_to_all_backward,
        "a2a_W": costs.all_to_all_weight,
    }
    return " ".join(parts + [f"{k}={v / unit:.3g}" for k, v in exchanges.items() if v])


class _Deadlock(ValueError):
    """A packing in which no device can run anything (possible with ``reorder``)."""


class _Packer:
    """The state of one packing: what each device has left, what ran, and when. Actions
    are numbered (their index in ``self.actions``) so that a time estimate copies a list."""

    def __init__(
        self,
        schedule: Schedule,
        costs: Costs,
        idle_weight: float = 0.0,
        reorder: bool = False,
        cap: tuple[int, ...] | None = None,
    ):
        self.costs, self.idle_weight, self.reorder = costs, idle_weight, reorder
        self.S, self.N = schedule.num_stages, schedule.num_logical_stages
        self.cap = cap or schedule.peak_activations()
        self.actions = [a for _, _, a in schedule.timed_actions()]  # table order
        index = {(a.op, a.stage, a.microbatch): i for i, a in enumerate(self.actions)}
        device = schedule.stage_device
        self.device = [device[a.stage] for a in self.actions]
        self.cost = [costs.of(a) for a in self.actions]
        self.sends = [self._sends_across(a, device) for a in self.actions]
        self.inputs = [  # per action: (ids any of which meets the dependency, across)
            tuple(
                (
                    tuple(index[k] for k in met_by(dep) if k in index),
                    device[dep[1]] != device[a.stage],
                )
                for dep in dependencies(a, self.N)
            )
            for a in self.actions
        ]
        self.weight_of = {
            i: index[(W, a.stage, a.microbatch)] for i, a in enumerate(self.actions) if a.op == B
        }
        self.queue = [deque() for _ in range(self.S)]  # forwards and backwards, in order
        for i, a in enumerate(self.actions):
            if a.op != W:
                self.queue[self.device[i]].append(i)
        self.pool: list[list[int]] = [[] for _ in range(self.S)]  # W's whose B has run
        self.live = [0] * self.S
        self.end = [_NEVER] * len(self.actions)  # end of the tick each action ran in
        self.now = 0.0

    @staticmethod
    def _sends_across(a: Action, device) -> bool:
        consumer = a.stage + 1 if a.op == F else a.stage - 1 if a.op in (B, BW) else None
        return (
            consumer is not None
            and 0 <= consumer < len(device)
            and (device[consumer] != device[a.stage])
        )

    def run(self) -> tuple[tuple[tuple[Action, ...], ...], ...]:
        """Packs every tick; returns the table's ticks."""
        ticks = []
        while any(self.queue) or any(self.pool):
            row, length = self._best_tick()
            self._commit(row, length)
            ticks.append(tuple(tuple(self.actions[i] for i in cell) for cell in row))
        return tuple(ticks)

    def _ready(self, i: int) -> bool:
        return all(min(self.end[j] for j in ids) < _NEVER for ids, _ in self.inputs[i])

    def _is_forward(self, i: int) -> bool:
        return self.actions[i].op == F

    def _heads(self, d: int) -> list[int]:
        """The actions device ``d`` may run next, in order: its next two, or (``reorder``)
        its next forward and its next backward, whichever comes first first."""
        queue = self.queue[d]
        if not self.reorder:
            return list(queue)[:2]
        heads = []
        for wanted in (True, False):
            i = next((i for i in queue if self._is_forward(i) == wanted), None)
            if i is not None:
                heads.append(i)
        return sorted(heads, key=queue.index) if len(heads) == 2 else heads

    def _cell(self, d: int, length: float) -> tuple[int, ...]:
        """Device ``d``'s cell in a tick of ``length``: its next actions (`_heads`) while
        they are ready and fit (one forward, one backward at most; with ``reorder`` either
        may run without the other), then a W if there is room and no backward yet."""
        cell: list[int] = []
        used = 0.0
        for i in self._heads(d):
            forward = self._is_forward(i)
            fits = used + self.cost[i] <= length + _SLACK
            room = not forward or self.live[d] < self.cap[d]
            kind_free = all(self._is_forward(j) != forward for j in cell)
            if fits and room and kind_free and self._ready(i):
                cell.append(i)
                used += self.cost[i]
            elif not self.reorder:
                break
        if all(self._is_forward(j) for j in cell) and self.pool[d]:
            w = self.pool[d][0]
            if used + self.cost[w] <= length + _SLACK:
                cell.append(w)
        return tuple(cell)

    def _lengths(self) -> set[float]:
        """The tick lengths worth trying: what each device's next cells would take."""
        lengths = set()
        for d in range(self.S):
            heads = [self.cost[i] for i in self._heads(d)]
            weight = [self.cost[self.pool[d][0]]] if self.pool[d] else []
            lengths.update(heads + weight)
            if len(heads) == 2:
                lengths.add(heads[0] + heads[1])
            lengths.update(h + w for h in heads for w in weight)
        return {x for x in lengths if x > 0} or {0.0}

    def _tick_length(self, row) -> float:
        longest = max(sum(self.cost[i] for i in cell) for cell in row)
        crosses = any(self.sends[i] for cell in row for i in cell)
        return longest + (self.costs.communication if crosses else 0.0)

    def _best_tick(self):
        """The row whose tick, followed by the rest run without ticks, ends soonest."""
        best, seen = None, set()
        for length in sorted(self._lengths()):
            row = tuple(self._cell(d, length) for d in range(self.S))
            if row in seen or not any(row):
                continue
            seen.add(row)
            tick = self._tick_length(row)
            idle = sum(tick - sum(self.cost[i] for i in cell) for cell in row) / self.S
            estimate = self._finish_after(row, tick) + self.idle_weight * idle
            score = (round(estimate, 9), tick)
            if best is None or score < best[0]:
                best = (score, row, tick)
        if best is None:
            waiting = {d: self.actions[q[0]] for d, q in enumerate(self.queue) if q}
            raise _Deadlock(f"no device can run its next action; {waiting}")
        return best[1], best[2]

    def _finish_after(self, row, tick: float) -> float:
        """When the rest would end if ``row`` ran in a tick of ``tick`` and every action
        after it ran as soon as its device and inputs allow (W's right after their B), as
        `simulate`'s ``"ideal"`` mode runs a table."""
        end = self.now + tick
        finished = self.end.copy()
        taken = {i for cell in row for i in cell}
        for i in taken:
            finished[i] = end
        rest = []
        for d in range(self.S):
            pending = [w for w in self.pool[d] if w not in taken]
            for i in self.queue[d]:
                if i not in taken:
                    pending.append(i)
                    if i in self.weight_of:
                        pending.append(self.weight_of[i])
            rest.append(pending)
        return self._dataflow_end(rest, finished, end)

    def _dataflow_end(self, rest, finished: list, start: float) -> float:
        """The end of ``rest[d]`` (each device's actions, in order), from ``start``."""
        inputs, cost, communication = self.inputs, self.cost, self.costs.communication
        position = [0] * self.S
        free = [start] * self.S
        moved = True
        while moved:
            moved = False
            for d, actions in enumerate(rest):
                p, t = position[d], free[d]
                while p < len(actions):
                    i = actions[p]
                    begin = t
                    for ids, across in inputs[i]:
                        # most dependencies are met by one action: no generator for them
                        ready = (
                            finished[ids[0]]
                            if len(ids) == 1
                            else min(map(finished.__getitem__, ids))
                        )
                        if ready == _NEVER:
                            break
                        begin = max(begin, ready + communication if across else ready)
                    else:
                        t = finished[i] = begin + cost[i]
                        p += 1
                        continue
                    break
                moved |= p > position[d]
                position[d], free[d] = p, t
        if any(p < len(actions) for p, actions in zip(position, rest, strict=True)):
            return _NEVER
        return max(free)

    def _commit(self, row, length: float) -> None:
        self.now += length
        for d, cell in enumerate(row):
            for i in cell:
                if self.actions[i].op == W:
                    self.pool[d].remove(i)
                else:
                    self.queue[d].remove(i)
                self.live[d] += self._is_forward(i)
        for d, cell in enumerate(row):
            for i in cell:
                self.end[i] = self.now
                self.live[d] -= self.actions[i].op in (W, BW)
                if i in self.weight_of:
                    self.pool[d].append(self.weight_of[i])
            self.pool[d].sort()
