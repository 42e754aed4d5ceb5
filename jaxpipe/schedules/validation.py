"""The rules every schedule table keeps, checked by `validate`.

Rules: every stage lives on one device and every action runs there; each cell holds at most
``max_actions_per_tick`` (1 or 2) compute actions (and, if two, one forward and one
backward) and at most one ``U``, last; every (stage, micro-batch) has exactly one F and
either one BW or one B and one W; F of stage k comes after F of stage k-1; a backward of
stage k comes after its own F and after the backward (BW or B) of stage k+1; W comes after
B. "After" means in a strictly later tick. A table of forwards alone (no B, W, BW or U at
all) is valid too: it gives losses and outputs, and the executor refuses to take gradients
with it.

Weight updates and versions: a ``U`` of stage s averages at least one weight gradient (a BW
or W of s since its previous U, this tick included); if the table has U's, every weight
gradient is taken by one. F of stage s reads the version equal to the number of U's of s in
earlier ticks; B, W and BW read the version their F read; a U's version is its index among
its stage's U's. Without U's every version is 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxpipe.schedules.actions import (
    BACKWARD_OPS,
    BW,
    OPS,
    WEIGHT_GRADIENT_OPS,
    Action,
    B,
    Cell,
    F,
    U,
    W,
    dependencies,
    met_by,
)
from jaxpipe.schedules.core import Schedule
from jaxpipe.schedules.display import to_text


def validate(schedule: Schedule, activation_limit: Sequence[int] | int | None = None) -> Schedule:
    """Checks a table against the rules of this module.

    Args:
      schedule: the table.
      activation_limit: if given (one int, or one per device), no device may hold more live
        micro-batch activations than that (`Schedule.live_activations`).

    Returns:
      ``schedule`` itself, so that ``validate(pack(...))`` reads as one step.

    Raises:
      ValueError: naming the tick, the device and the rule broken, with the table around
        the offending cell.
    """
    s = schedule
    S, M, N = s.num_stages, s.num_microbatches, s.num_logical_stages
    if S < 1 or M < 1:
        raise ValueError(f"num_stages and num_microbatches must be >= 1, got S={S}, M={M}")
    if s.max_actions_per_tick not in (1, 2):
        raise ValueError(
            f"schedule {s.name!r} has max_actions_per_tick={s.max_actions_per_tick!r}, but a "
            "cell runs one action, or one forward and one backward together: use 1, or 2 for "
            "fused forward-backward cells, and spread the other actions over more ticks"
        )
    if any(not 0 <= d < S for d in s.stage_device):
        raise ValueError(f"stage_device {s.stage_device} names a device outside [0, {S})")
    counts = [s.stage_device.count(d) for d in range(S)]
    if not s.stage_device:
        raise ValueError(
            f"schedule {s.name!r} has stage_device=(), no logical stages; give the device of "
            f"each stage, e.g. {tuple(range(S))} for one stage per device"
        )
    if len(set(counts)) != 1:
        raise ValueError(f"stage_device {s.stage_device}: stages per device differ: {counts}")
    done: dict[tuple[str, int, int], int] = {}
    for t, row in enumerate(s.ticks):
        this_tick: dict[tuple[str, int, int], int] = {}
        if len(row) != S:
            raise ValueError(f"tick {t} has {len(row)} cells, expected one per device ({S})")
        for d, cell in enumerate(row):
            if isinstance(cell, Action) or not all(isinstance(a, Action) for a in cell):
                raise ValueError(
                    f"schedule {s.name!r}: the cell of tick {t}, device {d} is {cell!r}, not a "
                    "tuple of Actions; write (action,) for one action, () for none, or build "
                    "the cells with jaxpipe.schedules.actions.as_cell"
                )
        for d, cell in enumerate(row):
            if not cell:  # an empty cell breaks no rule
                continue
            _check_cell(s, t, d, cell)
            for a in cell:
                if a.op == U:
                    continue
                key = (a.op, a.stage, a.microbatch)
                if key in done:
                    _fail(s, t, d, "exactly once", f"{a} already ran in tick {done[key]}")
                for dep in dependencies(a, N):
                    if not any(k in done for k in met_by(dep)):
                        what = "backward" if len(met_by(dep)) > 1 else dep[0]
                        _fail(
                            s,
                            t,
                            d,
                            "dependency",
                            f"{a} needs the {what} of stage {dep[1]}, micro-batch {dep[2]} in "
                            "an earlier tick, which has not run",
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
    forward_only = not any(a.op != F for a in s.actions(include_updates=True))
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
        if len(limits) != S:
            raise ValueError(
                f"activation_limit {activation_limit!r} has {len(limits)} entries, but "
                f"schedule {s.name!r} has {S} devices; give one int, or one per device"
            )
        live = s.live_activations()
        for d in range(S):
            for t, n in enumerate(live[d]):
                if n > limits[d]:
                    _fail(s, t, d, "buffer", f"{n} live activations, buffers hold {limits[d]}")
    return schedule


def _fail(schedule: Schedule, tick: int, device: int, rule: str, detail: str) -> None:
    lo, hi = max(0, tick - 4), tick + 5
    grid = to_text(schedule, lo, hi, mark=(tick, device))
    raise ValueError(
        f"Invalid schedule {schedule.name!r} at tick {tick}, device {device}: "
        f"rule '{rule}' violated: {detail}\nTicks {lo}..{min(hi, schedule.num_ticks) - 1} "
        f"(the offending cell is marked '>'):\n{grid}"
    )


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
    """The weight-update and version rules (module docstring)."""
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
