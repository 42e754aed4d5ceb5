"""Asynchronous schedules: PipeDream (weight stashing) and PipeDream-2BW.

Both run the 1F1B order of `jaxpipe.schedules.basic` (device ``d`` runs ``min(S-d-1, M)``
warm-up forwards, then one forward and one backward in turn, then drains its backwards), but
without a flush: each stage updates its own weights while later micro-batches are still in
the pipeline (Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN
Training", SOSP 2019; "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021).

Weight versions. Each stage ``s`` starts the table with version 0 of its weights (the
parameters the caller passes in). Every update of stage ``s`` makes the next version
(1, 2, ...). ``Action.version`` is the version the action reads:

- ``F(s, m)`` reads the newest version of stage ``s`` at its tick, i.e. the number of updates
  of stage ``s`` applied in earlier ticks.
- the backward of ``(s, m)`` (``BW``, or ``B`` and ``W``) reads the version its ``F`` read
  (weight stashing), so the forward and the backward of a micro-batch see the same weights.

Update points. The micro-batches are cut, in index order, into groups of ``update_interval``
(``G``): group ``k`` is ``kG .. min((k+1)G, M) - 1``; the last group may be shorter. Stage
``s`` applies one update per group, at the end of the tick that runs the last backward
(``BW``, or ``W`` for a split backward) of stage ``s`` on a micro-batch of that group. The
update applies the optimizer to the newest version of stage ``s``, with the mean of the
group's per-micro-batch weight gradients of stage ``s``, each computed at the version that
micro-batch read. ``update_interval`` is 1 for ``pipedream``, the option of that name for
``pipedream_2bw`` and ``M`` (one update after the last backward of the step: synchronous
training) for every other schedule; see `update_points`.
"""

from __future__ import annotations

import dataclasses

from jaxpipe.schedules.basic import one_f_one_b_orders
from jaxpipe.schedules.core import BACKWARD_OPS, BW, Action, F, Schedule, W, pack
from jaxpipe.schedules.registry import register


@register("pipedream")
def pipedream(num_stages: int, num_microbatches: int) -> Schedule:
    """Asynchronous 1F1B with weight stashing (PipeDream, Narayanan et al., SOSP 2019).

    Stage ``s`` applies an optimizer update right after every backward, using that one
    micro-batch's gradient (``update_interval`` 1). ``F(s, m)`` reads version
    ``max(0, m - (S-s-1))``: the warm-up forwards read version 0, every later forward reads
    one version newer than the one before. Device ``d`` keeps ``S-d`` weight versions once
    ``M >= 2(S-d) - 1`` (the first stage the most, the last one), never more than
    ``min(S-d, M)``; see `weight_versions`. The order and the activations held are those of
    ``1f1b`` (at most ``min(S-d, M)`` on device ``d``).
    """
    S, M = num_stages, num_microbatches
    table = pack("pipedream", S, M, list(range(S)), one_f_one_b_orders(S, M))
    return stamp_versions(table)


@register("pipedream_2bw")
def pipedream_2bw(
    num_stages: int, num_microbatches: int, update_interval: int | None = None
) -> Schedule:
    """PipeDream-2BW: 1F1B without flush, double-buffered weights (Narayanan et al., ICML 2021).

    The micro-batches are cut into groups of ``update_interval`` (``G``, default ``S``):
    group ``k`` is ``kG .. min((k+1)G, M) - 1``. Stage ``s`` applies one update per group, at
    the end of the tick of the ``BW`` of the group's last micro-batch on stage ``s``; the
    update applies the optimizer to the newest version of stage ``s`` (version ``k``) with the
    mean of the group's weight gradients of stage ``s``, each computed at the version its
    micro-batch read. ``F(s, m)`` reads version ``floor(max(0, m - (S-s-1)) / G)``: every
    micro-batch of group ``k`` reads version ``k`` or ``k-1``, so the update is
    ``W(k+1) = W(k) - lr * mean(grad at W(k) or W(k-1))``: at most one version stale.

    ``G >= S`` is required: then, when stage ``s`` makes version ``k+1``, every micro-batch
    still in flight on it reads version ``k``, so version ``k-1`` is free and two weight
    buffers per stage suffice (`weight_versions` <= 2 on every device).
    """
    S, M = num_stages, num_microbatches
    G = S if update_interval is None else update_interval
    if not isinstance(G, int) or isinstance(G, bool) or G < S:
        raise ValueError(
            f"pipedream_2bw: update_interval={update_interval!r} with num_stages={S}; "
            f"update_interval must be an int >= num_stages ({S}), so that each stage needs "
            f"at most two weight versions. Pass update_interval >= {S}, or leave it out "
            f"(default {S})."
        )
    orders = one_f_one_b_orders(S, M)
    table = pack("pipedream_2bw", S, M, list(range(S)), orders, options={"update_interval": G})
    return stamp_versions(table)


# ------------------------------------------------------------------ versions and updates
def update_interval(schedule: Schedule) -> int:
    """Micro-batches per weight update: 1 for ``pipedream``, the ``update_interval`` option
    where the schedule has one (``pipedream_2bw``), else ``M`` (synchronous training)."""
    options = dict(schedule.options)
    if "update_interval" in options:
        return int(options["update_interval"])
    if schedule.name == "pipedream":
        return 1
    return schedule.num_microbatches


def update_points(schedule: Schedule) -> list[list[tuple[int, tuple[int, ...]]]]:
    """For each logical stage, its updates in tick order: ``(tick, micro-batches)``.

    An update runs at the end of ``tick`` (after the tick's actions) and applies the mean of
    the listed micro-batches' weight gradients of that stage. Group ``k`` is micro-batches
    ``kG .. min((k+1)G, M) - 1`` with ``G = update_interval(schedule)``; its update runs in
    the tick of the last backward (``BW``, or ``W``) of the stage on one of them. A group
    with no backward on the stage (a forward-only table) makes no update.
    """
    G = update_interval(schedule)
    M = schedule.num_microbatches
    last_backward: dict[tuple[int, int], int] = {}
    for t, _, a in schedule.timed_actions():
        if a.op in (BW, W):
            last_backward[(a.stage, a.microbatch)] = t
    points = []
    for s in range(schedule.num_logical_stages):
        row = []
        for start in range(0, M, G):
            group = tuple(range(start, min(start + G, M)))
            ticks = [last_backward[(s, m)] for m in group if (s, m) in last_backward]
            if len(ticks) == len(group):
                row.append((max(ticks), group))
        points.append(sorted(row))
    return points


def stamp_versions(schedule: Schedule) -> Schedule:
    """The same table with each ``Action.version`` set by the rules in the module docstring."""
    update_ticks = [[t for t, _ in row] for row in update_points(schedule)]
    read: dict[tuple[int, int], int] = {}
    for t, _, a in schedule.timed_actions():
        if a.op == F:
            read[(a.stage, a.microbatch)] = sum(u < t for u in update_ticks[a.stage])

    def stamp(a: Action) -> Action:
        return a._replace(version=read[(a.stage, a.microbatch)])

    ticks = tuple(tuple(tuple(stamp(a) for a in cell) for cell in row) for row in schedule.ticks)
    return dataclasses.replace(schedule, ticks=ticks)


def validate_versions(schedule: Schedule) -> Schedule:
    """Checks the version fields; returns ``schedule`` or raises ``ValueError``.

    Rules: ``F(s, m)`` reads the number of updates of stage ``s`` (from `update_points`) in
    earlier ticks; every backward action of ``(s, m)`` reads the version its ``F`` read.
    """
    update_ticks = [[t for t, _ in row] for row in update_points(schedule)]
    read: dict[tuple[int, int], int] = {}
    for t, d, a in schedule.timed_actions():
        key = (a.stage, a.microbatch)
        if a.op == F:
            newest = sum(u < t for u in update_ticks[a.stage])
            if a.version != newest:
                raise ValueError(
                    f"schedule {schedule.name!r}, tick {t}, device {d}: {a} reads version "
                    f"{a.version}, but the newest version of stage {a.stage} at that tick is "
                    f"{newest}; a forward must read the newest version "
                    f"(use stamp_versions to set the versions)"
                )
            read[key] = a.version
        elif a.op in BACKWARD_OPS and a.version != read.get(key, a.version):
            raise ValueError(
                f"schedule {schedule.name!r}, tick {t}, device {d}: {a} reads version "
                f"{a.version}, but its forward read version {read[key]}; a backward must "
                f"read the version its forward used (use stamp_versions to set the versions)"
            )
    return schedule


def weight_versions(schedule: Schedule) -> tuple[int, ...]:
    """Per device, the most weight versions alive at once (the weight buffers it needs).

    Counted between ticks (and before the first): for each stage of the device, the
    versions read by micro-batches in flight on it (``F`` done, last backward not yet), plus
    the newest version. Inside a tick an update may overwrite the version that the tick's
    backward read, after reading it, so no extra buffer is needed for the update itself.
    ``pipedream``: ``S-d`` on device ``d`` once ``M >= 2(S-d) - 1``, at most ``min(S-d, M)``;
    ``pipedream_2bw``: at most 2; schedules with one update per step: 1.
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
