"""Lock-step tables from per-device action orders: `pack`."""

from __future__ import annotations

from collections.abc import Sequence

from jaxpipe.schedules.actions import Cell, U, as_cell, dependencies, met_by
from jaxpipe.schedules.core import Schedule


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

    In each tick every device runs its next item if all of that item's dependencies ran in
    earlier ticks, and idles otherwise.

    Args:
      name: the table's name.
      num_stages: ``S``, the number of devices.
      num_microbatches: ``M``.
      stage_device: the device of each logical stage (length ``S * v``).
      orders: ``orders[d]`` lists what device ``d`` runs, in order: each item a compute
        `Action`, or a tuple of two actions (one F, one backward) to run in the same tick.
      max_actions_per_tick: compute actions a cell may hold; 2 if any item is a pair.
      options: the generator's options, kept on the table.

    Returns:
      The packed `Schedule` (not validated; add ``U`` actions with `add_updates`).

    Raises:
      ValueError: if the orders hold a ``U``, or deadlock (no device can run its next item).
    """
    S = num_stages
    N = len(stage_device)
    if len(orders) != S:
        raise ValueError(f"expected one action order per device ({S}), got {len(orders)}")
    items = [[as_cell(x) for x in order] for order in orders]
    if any(a.op == U for order in items for cell in order for a in cell):
        raise ValueError("pack takes compute actions only; add U's with add_updates")
    position = [0] * S
    done: set[tuple] = set()
    ticks: list[tuple[Cell, ...]] = []
    remaining = sum(len(x) for x in items)

    def needs(d: int) -> list[tuple] | None:  # device d's next item: what it waits for
        if position[d] == len(items[d]):
            return None
        return [tuple(met_by(dep)) for a in items[d][position[d]] for dep in dependencies(a, N)]

    waiting = [needs(d) for d in range(S)]  # a need met stays met: it is dropped when met
    while remaining:
        row: list[Cell] = []
        for d in range(S):
            cell: Cell = ()
            if waiting[d] is not None:
                waiting[d] = [keys for keys in waiting[d] if not any(k in done for k in keys)]
                if not waiting[d]:
                    cell = items[d][position[d]]
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
                waiting[d] = needs(d)
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
