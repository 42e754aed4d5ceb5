"""Turns a `Schedule` into the integer tables the executor scans over (no JAX here).

For every tick and device the plan says which forward and which backward action runs, on
which local chunk and micro-batch, which buffer slot each input is read from and each result
is written to, and into which slot a value arriving over each ``ppermute`` channel goes.

Buffer slots are assigned by interval colouring: a value occupies a slot from the end of the
tick that writes it to the start of the tick that last reads it, so a slot read in tick ``t``
can take a new value written at the end of tick ``t``. Every buffer has one extra *junk* slot
(index ``size``) that idle devices read and write, so the program never branches on whether
to write.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from jaxpipe.schedules.core import BW, B, F, Schedule, W


class ForwardOp(enum.IntEnum):
    IDLE = 0
    MID = 1  # stage_fn on a stage that is not the last
    LAST = 2  # the last stage: stage_fn, then loss_fn (or the output, in forward mode)


class BackwardOp(enum.IntEnum):
    IDLE = 0
    FULL_MID = 1
    FULL_LAST = 2
    INPUT_MID = 3  # B: input gradient only
    INPUT_LAST = 4
    WEIGHT_MID = 5  # W: weight gradient only
    WEIGHT_LAST = 6


# Columns of `Plan.table`.
FIELDS = (
    "f_op",  # ForwardOp
    "f_chunk",  # local chunk index of the forward's stage
    "f_stage",  # logical stage (for the trace)
    "f_mb",  # micro-batch
    "f_from_input",  # 1 if the forward reads the model input (stage 0)
    "f_src",  # activation slot to read (junk if from input or idle)
    "f_res",  # residual slot to write (written before this tick's backward reads)
    "b_op",  # BackwardOp
    "b_chunk",
    "b_stage",
    "b_mb",
    "b_src",  # gradient slot to read (mid-stage B or BW)
    "b_res",  # residual slot to read
    "b_dy_write",  # cotangent stash slot to write (mid B, for its later W)
    "b_dy_read",  # cotangent stash slot to read (mid W)
    "b_dx_row",  # row of the input-gradient buffer to write (stage 0 B/BW), else junk row M
    "out_row",  # row of the output / loss buffer the last-stage forward writes, else junk M
    # Weight versions (asynchronous schedules only; 0 elsewhere):
    "f_version",  # weight-version slot the forward reads
    "b_version",  # weight-version slot the backward reads (the one its forward read)
    "update",  # 1 if this device updates its stage's weights at the end of this tick
    "update_from",  # slot of the newest version, which the update starts from
    "update_to",  # slot the new version is written to
    "update_size",  # micro-batches whose gradients the update averages
)
COLUMN = {name: i for i, name in enumerate(FIELDS)}


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static tables and buffer sizes for one schedule (see module docstring).

    ``table[t, d, COLUMN[name]]``; ``act_recv[o][t, d]`` and ``grad_recv[o][t, d]`` are the
    slots into which the value arriving on the channel with device offset ``o`` is written
    at the end of tick ``t`` (junk slot if nothing arrives).
    """

    schedule: Schedule
    table: np.ndarray  # [T, S, len(FIELDS)] int32
    forward_offsets: tuple[int, ...]
    backward_offsets: tuple[int, ...]
    act_recv: np.ndarray  # [len(forward_offsets), T, S]
    grad_recv: np.ndarray  # [len(backward_offsets), T, S]
    num_act_slots: int
    num_grad_slots: int
    num_res_slots: int  # one pool for every stage's residuals (mid and last alike)
    num_dy_slots: int
    device_stages: np.ndarray  # [S, v]: logical stage of each local chunk
    has_backward: bool
    num_version_slots: int = 1  # weight buffers per device (asynchronous schedules)
    final_version: np.ndarray | None = None  # [S]: slot of each device's newest version


def _allocate(intervals: list[tuple[object, int, int]], strict: bool = False) -> tuple[dict, int]:
    """Colours ``(key, write_tick, last_read_tick)`` intervals; returns key -> slot, count.

    A slot last read in tick ``r`` takes a value written in tick ``w >= r`` (the write comes
    after the reads of its tick), or ``w > r`` if ``strict`` (the write comes first).
    """
    free_from: list[int] = []  # per slot, the tick of its last read
    slot_of = {}
    for key, write, read in sorted(intervals, key=lambda x: (x[1], x[2])):
        free = [
            i
            for i, last_read in enumerate(free_from)
            if last_read < write or (last_read == write and not strict)
        ]
        if free:
            slot = free[0]
        else:
            slot = len(free_from)
            free_from.append(0)
        free_from[slot] = read
        slot_of[key] = slot
    return slot_of, len(free_from)


def make_plan(schedule: Schedule) -> Plan:
    """Builds the executor's tables for ``schedule`` (which must be valid)."""
    s = schedule
    S, M, N = s.num_stages, s.num_microbatches, s.num_logical_stages
    T = s.num_ticks
    device_stages = np.array([s.device_stages(d) for d in range(S)], dtype=np.int32)
    chunk = {int(st): c for d in range(S) for c, st in enumerate(device_stages[d])}
    dev = s.stage_device
    when: dict[tuple[str, int, int], int] = {}
    for t, _, a in s.timed_actions():
        when[(a.op, a.stage, a.microbatch)] = t

    def backward_tick(stage, m):
        return when.get((BW, stage, m), when.get((B, stage, m)))

    has_backward = any(a.op != F for a in s.actions())
    act_iv: dict[int, list] = {d: [] for d in range(S)}
    grad_iv: dict[int, list] = {d: [] for d in range(S)}
    res_iv: dict[int, list] = {d: [] for d in range(S)}
    dy_iv: dict[int, list] = {d: [] for d in range(S)}
    for (op, stage, m), t in when.items():
        d = dev[stage]
        if op == F and stage > 0:
            act_iv[d].append(((stage, m), when[(F, stage - 1, m)], t))
        if op == F and has_backward:
            last_read = when.get((W, stage, m), backward_tick(stage, m))
            res_iv[d].append(((stage, m), t, last_read))
        if op in (B, BW) and stage < N - 1:
            grad_iv[d].append(((stage, m), backward_tick(stage + 1, m), t))
        if op == B and stage < N - 1:
            dy_iv[d].append(((stage, m), t, when[(W, stage, m)]))

    def allocate(pools, strict=False):
        slots, size = {}, 0
        for d in range(S):
            slot_of, n = _allocate(pools[d], strict)
            slots.update({(d,) + k: v for k, v in slot_of.items()})
            size = max(size, n)
        return slots, size

    act_slot, n_act = allocate(act_iv)
    grad_slot, n_grad = allocate(grad_iv)
    # Residuals are written before the tick's backward reads them (no copy of the buffer).
    res_slot, n_res = allocate(res_iv, strict=True)
    dy_slot, n_dy = allocate(dy_iv)

    forward_offsets = sorted({(dev[st + 1] - dev[st]) % S for st in range(N - 1)}) or [0]
    backward_offsets = sorted({(dev[st - 1] - dev[st]) % S for st in range(1, N)}) or [0]
    if not has_backward:
        backward_offsets = []

    junk = {
        "f_src": n_act,
        "f_res": n_res,
        "b_src": n_grad,
        "b_res": n_res,
        "b_dy_write": n_dy,
        "b_dy_read": n_dy,
        "b_dx_row": M,
        "out_row": M,
    }
    table = np.zeros((T, S, len(FIELDS)), dtype=np.int32)
    for name, value in junk.items():
        table[:, :, COLUMN[name]] = value
    act_recv = np.full((len(forward_offsets), T, S), n_act, dtype=np.int32)
    grad_recv = np.full((len(backward_offsets), T, S), n_grad, dtype=np.int32)

    def put(t, d, **values):
        for name, value in values.items():
            table[t, d, COLUMN[name]] = value

    for t, d, a in s.timed_actions():
        last = a.stage == N - 1
        c = chunk[a.stage]
        m = a.microbatch
        if a.op == F:
            put(
                t,
                d,
                f_op=ForwardOp.LAST if last else ForwardOp.MID,
                f_chunk=c,
                f_stage=a.stage,
                f_mb=m,
            )
            if a.stage == 0:
                put(t, d, f_from_input=1)
            else:
                put(t, d, f_src=act_slot[(d, a.stage, m)])
                sender = dev[a.stage - 1]
                o = forward_offsets.index((d - sender) % S)
                act_recv[o, when[(F, a.stage - 1, m)], d] = act_slot[(d, a.stage, m)]
            if has_backward:
                put(t, d, f_res=res_slot[(d, a.stage, m)])
            if last:
                put(t, d, out_row=m)
            continue
        kind = {BW: BackwardOp.FULL_MID, B: BackwardOp.INPUT_MID, W: BackwardOp.WEIGHT_MID}
        op = kind[a.op] + (1 if last else 0)
        put(t, d, b_op=op, b_chunk=c, b_stage=a.stage, b_mb=m)
        put(t, d, b_res=res_slot[(d, a.stage, m)])
        if a.op in (B, BW):
            if not last:
                put(t, d, b_src=grad_slot[(d, a.stage, m)])
                tick_in = backward_tick(a.stage + 1, m)
                sender = dev[a.stage + 1]
                o = backward_offsets.index((d - sender) % S)
                grad_recv[o, tick_in, d] = grad_slot[(d, a.stage, m)]
            if a.stage == 0:
                put(t, d, b_dx_row=m)
            if a.op == B and not last:
                put(t, d, b_dy_write=dy_slot[(d, a.stage, m)])
        if a.op == W and not last:
            put(t, d, b_dy_read=dy_slot[(d, a.stage, m)])

    asynchronous = has_backward and any(a.version for a in s.actions())
    versions = _plan_versions(s, table) if asynchronous else {}
    return Plan(
        schedule=s,
        table=table,
        forward_offsets=tuple(forward_offsets),
        backward_offsets=tuple(backward_offsets),
        act_recv=act_recv,
        grad_recv=grad_recv,
        num_act_slots=n_act,
        num_grad_slots=n_grad,
        num_res_slots=n_res,
        num_dy_slots=n_dy,
        device_stages=device_stages,
        has_backward=has_backward,
        **versions,
    )


def _plan_versions(s: Schedule, table: np.ndarray) -> dict:
    """Weight-version slots for a schedule whose actions read versions (PipeDream family).

    Version ``k`` of a stage is written at the end of the tick of its update (version 0
    before the first tick) and lives until the last tick that reads it: an action reading
    it, the update that makes version ``k + 1`` from it, or, for the newest, the end.
    """
    from jaxpipe.schedules.pipedream import update_points

    if s.stages_per_device != 1:
        raise ValueError("weight versions are supported for one stage per device only")
    T, S = s.num_ticks, s.num_stages
    points = update_points(s)
    slot_of, size = {}, 0
    for d in range(S):
        (stage,) = s.device_stages(d)
        made = [-1] + [t for t, _ in points[stage]]  # made[k]: tick that wrote version k
        last_use = [made[k + 1] if k + 1 < len(made) else T for k in range(len(made))]
        for t, _, a in s.timed_actions():
            if a.stage == stage:
                last_use[a.version] = max(last_use[a.version], t)
        slots, n = _allocate([(k, made[k], last_use[k]) for k in range(len(made))])
        assert slots[0] == 0  # version 0 (the caller's weights) starts in slot 0
        slot_of[d] = slots
        size = max(size, n)
    for t, d, a in s.timed_actions():
        column = "f_version" if a.op == F else "b_version"
        table[t, d, COLUMN[column]] = slot_of[d][a.version]
    final = np.zeros(S, dtype=np.int32)
    for d in range(S):
        (stage,) = s.device_stages(d)
        for k, (tick, group) in enumerate(points[stage]):
            table[tick, d, COLUMN["update"]] = 1
            table[tick, d, COLUMN["update_from"]] = slot_of[d][k]
            table[tick, d, COLUMN["update_to"]] = slot_of[d][k + 1]
            table[tick, d, COLUMN["update_size"]] = len(group)
        final[d] = slot_of[d][len(points[stage])]
    return {"num_version_slots": size, "final_version": final}
