"""The schedule table, `Schedule`: which device runs which actions in which tick.

A `Schedule` is plain data with the queries that read it (its shape, its actions in tick
order, the activations it keeps alive). Everything else about tables is a free function
over it, in its own module of this package: `validation` (the rules a table must keep),
`versions` (weight versions and update points), `packing` (per-device orders into
lock-step ticks), `display` (text grids), `simulate` (timelines and bubbles) and `io` (CSV
and Chrome traces). The words used throughout (F, B, W, BW, U, stage, device, tick) are
defined in `jaxpipe.schedules.actions`.

Nothing in this package imports JAX.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable

from jaxpipe.schedules.actions import Action, Cell, F, U, W
from jaxpipe.schedules.display import describe


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

    Building a `Schedule` checks nothing; `jaxpipe.schedules.validate` does.
    ``str(schedule)`` is a summary line above the table as a text grid.
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
        """The number of lock-step ticks in the table."""
        return len(self.ticks)

    def device_stages(self, device: int) -> tuple[int, ...]:
        """The logical stages a device holds.

        Args:
          device: the device.

        Returns:
          Its logical stages in increasing order (its local chunks).
        """
        return tuple(s for s, d in enumerate(self.stage_device) if d == device)

    def chunk_of(self, stage: int) -> int:
        """Where a stage sits among its device's stages.

        Args:
          stage: the logical stage.

        Returns:
          Its local index (chunk) on its device.
        """
        return self.device_stages(self.stage_device[stage]).index(stage)

    @property
    def splits_backward(self) -> bool:
        """True if any backward is split into B and W."""
        return any(a.op == W for a in self.actions())

    @property
    def has_updates(self) -> bool:
        """True if the table holds ``U`` actions: weights are updated inside the pipeline."""
        return any(a.op == U for row in self.ticks for cell in row for a in cell)

    # --------------------------------------------------------------- actions
    def actions(self, include_updates: bool = False) -> Iterable[Action]:
        """The table's actions in tick order.

        Args:
          include_updates: include the ``U`` actions too.

        Returns:
          An iterator over every compute action (F, B, W, BW), and U's if asked.
        """
        for _, _, a in self.timed_actions(include_updates):
            yield a

    def timed_actions(self, include_updates: bool = False) -> Iterable[tuple[int, int, Action]]:
        """The table's actions in tick order, with where they run.

        Args:
          include_updates: include the ``U`` actions too, where they stand in their cells.

        Returns:
          An iterator of ``(tick, device, action)`` for every compute action (F, B, W, BW),
          and U's if asked.
        """
        for t, row in enumerate(self.ticks):
            for d, cell in enumerate(row):
                for a in cell:
                    if include_updates or a.op != U:
                        yield t, d, a

    def timed_updates(self) -> list[tuple[int, int, Action]]:
        """``(tick, device, action)`` for every ``U`` action, in tick order."""
        return [x for x in self.timed_actions(include_updates=True) if x[2].op == U]

    # ----------------------------------------------------------- activations
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
        change = [[0] * (self.num_ticks + 1) for _ in range(self.num_stages)]
        for key, start in first.items():  # +1 where an activation is born, -1 after it dies
            row = change[self.stage_device[key[0]]]
            row[start] += 1
            row[last.get(key, self.num_ticks - 1) + 1] -= 1
        return [list(itertools.accumulate(row[:-1])) for row in change]

    # ------------------------------------------------------------- variants
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

    def __str__(self) -> str:
        return describe(self)
