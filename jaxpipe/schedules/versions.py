"""Weight versions of tables with ``U`` actions: where each stage updates, which version
each action reads, and how many versions a device keeps.

Each stage ``s`` starts the table with version 0 of its weights. Every ``U`` of stage ``s``
makes the next version (1, 2, ...). ``Action.version`` is the version an action reads: an F
reads the number of U's of its stage in earlier ticks (the newest version), and the backward
of a micro-batch (BW, or B and W) reads the version its F read (weight stashing). A table
without U's trains synchronously: one update per stage after its last weight gradient, and
every version is 0.
"""

from __future__ import annotations

import dataclasses

from jaxpipe.schedules.actions import WEIGHT_GRADIENT_OPS, Action, F, U
from jaxpipe.schedules.core import Schedule


def update_points(schedule: Schedule) -> list[list[tuple[int, tuple[int, ...]]]]:
    """Where each stage updates its weights, and with which micro-batches' gradients.

    An update runs at the end of its tick (after the tick's actions) and applies the mean of
    the listed micro-batches' weight gradients of that stage. In a table with ``U`` actions
    there is one point per U: the micro-batches whose weight gradient (BW or W) of the stage
    ran after the stage's previous U and by the U's tick. A table without U's trains
    synchronously: one point per stage, at the tick of its last weight gradient, with every
    micro-batch (none for a stage without backwards, as in a forward-only table).

    Args:
      schedule: the table.

    Returns:
      For each logical stage, its updates in tick order as ``(tick, micro-batches)``.
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
    """Sets every action's version from the table's U's (module docstring).

    Args:
      schedule: the table, with any versions.

    Returns:
      The same table with each ``Action.version`` stamped.
    """
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
    """Adds a ``U`` after every ``every``-th weight gradient of each stage.

    For each stage, its weight gradients (BW or W) in tick order are cut into groups of
    ``every`` (the last may be shorter); each group's U goes at the end of the cell of its
    last gradient. Versions are then stamped (`stamp_versions`).

    Args:
      schedule: a table; any ``U`` actions in it are dropped first.
      every: the group size: 1 updates after every micro-batch (PipeDream), ``M`` once per
        step, after the stage's last backward.

    Returns:
      The table with its U's, versions stamped.

    Raises:
      ValueError: if ``every`` is not a positive int.
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


def weight_versions(schedule: Schedule) -> tuple[int, ...]:
    """The weight buffers each device needs: the most versions it keeps alive at once.

    Counted between ticks (and before the first): for each stage of the device, the
    versions read by micro-batches in flight on it (``F`` done, last backward not yet), plus
    the newest version. Inside a tick an update may overwrite the version that the tick's
    backward read, after reading it, so no extra buffer is needed for the update itself.
    ``pipedream``: ``S-d`` on device ``d`` once ``M >= 2(S-d) - 1``, at most ``min(S-d, M)``;
    ``pipedream_2bw``: at most 2; schedules with one update per step: 1.

    Args:
      schedule: the table.

    Returns:
      One count per device.
    """
    N, T = schedule.num_logical_stages, schedule.num_ticks
    updates_done = [[0] * T for _ in range(N)]  # updates_done[s][t]: updates in ticks <= t
    for s, row in enumerate(update_points(schedule)):
        for tick, _ in row:
            for t in range(tick, T):
                updates_done[s][t] += 1
    first: dict[tuple[int, int], tuple[int, int]] = {}  # (s, m) -> (tick of F, version)
    last: dict[tuple[int, int], int] = {}  # (s, m) -> tick of its last backward action
    for t, _, a in schedule.timed_actions():
        key = (a.stage, a.microbatch)
        if a.op == F:
            first[key] = (t, a.version)
        else:
            last[key] = max(last.get(key, t), t)
    result = []
    for d in range(schedule.num_stages):
        most = len(schedule.device_stages(d))  # before tick 0: version 0 of each stage
        for t in range(T):
            alive = 0
            for s in schedule.device_stages(d):
                versions = {updates_done[s][t]}
                for m in range(schedule.num_microbatches):
                    if (s, m) in first and first[(s, m)][0] <= t < last.get((s, m), T):
                        versions.add(first[(s, m)][1])
                alive += len(versions)
            most = max(most, alive)
        result.append(most)
    return tuple(result)
