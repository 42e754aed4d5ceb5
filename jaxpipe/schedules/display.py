"""A schedule table as text: one row per device, one column per tick.

The functions read a table's fields (``ticks``, ``num_stages``, ``stages_per_device``,
``num_ticks``, ``name``, ``num_microbatches``) and nothing else, so `Schedule` prints
itself through them without this module importing it.
"""

from __future__ import annotations

from jaxpipe.schedules.actions import Action, U


def label(action: Action, stages_per_device: int = 1, num_stages: int = 1) -> str:
    """Short text for one action.

    Args:
      action: the action.
      stages_per_device: ``v``; above 1 the action's chunk is appended.
      num_stages: ``S``, to find the chunk (``stage // S``).

    Returns:
      ``F3``, ``BW0``, ``U``, or with several stages per device ``F3:1`` (chunk 1).
    """
    text = action.op if action.op == U else f"{action.op}{action.microbatch}"
    if stages_per_device > 1:
        text += f":{action.stage // num_stages}" if num_stages else ""
    return text


def to_text(schedule, start: int = 0, stop: int | None = None, mark: tuple | None = None) -> str:
    """The table as a text grid: one row per device, one column per tick.

    Args:
      schedule: a `jaxpipe.schedules.Schedule`.
      start: the first tick shown.
      stop: one past the last tick shown (default: the end of the table).
      mark: ``(tick, device)`` of a cell to prefix with ``>`` (as error messages do).

    Returns:
      The grid, a header line of tick numbers then one line per device; cells joined with
      ``+`` where a device runs several actions in a tick, ``.`` where it idles.
    """
    stop = schedule.num_ticks if stop is None else min(stop, schedule.num_ticks)
    v, S = schedule.stages_per_device, schedule.num_stages
    cells = [
        ["+".join(label(a, v, S) for a in schedule.ticks[t][d]) or "." for t in range(start, stop)]
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


def describe(schedule) -> str:
    """A one-line summary of ``schedule`` (name, S, M, v, ticks) above its `to_text` grid."""
    head = (
        f"Schedule {schedule.name!r}: S={schedule.num_stages} devices, "
        f"M={schedule.num_microbatches} micro-batches, v={schedule.stages_per_device}, "
        f"{schedule.num_ticks} ticks"
    )
    return head + "\n" + to_text(schedule)
