"""Turns a `Schedule` into the integer tables the executor scans over (no JAX here).

For every tick and device the plan says which forward and which backward action runs, on
which local chunk and micro-batch, which buffer slot each input is read from and each result
is written to, and into which slot a value arriving over each ``ppermute`` channel goes.

Buffers and when they are read and written within a tick:

- ``activations``: stage inputs received from another device; read by the forward, written
  at the end of the tick by the receive (so a slot read in tick ``t`` may be refilled at the
  end of ``t``).
- ``cotangents``: gradients with respect to a stage's output; read by its backward (B or
  BW). Those received from another device are written at the end of the tick; the last
  stage's own (the loss gradient, computed by its forward) is written by the forward, before
  the tick's backward reads.
- ``residuals``: what a stage's forward keeps for its backward; written by the forward,
  read by B, BW and W.
- ``stash``: the cotangent a B keeps for its W (split backward).

Slots are assigned by interval colouring, separately per device; every device gets the
largest device's count (one SPMD program). Buffers written by a receive have one extra
*junk* slot (index ``size``) that receives land in when nothing arrives; the others are
written inside the action that produces them, so they need none.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from jaxpipe.schedules import BW, B, F, Schedule, W, update_points


class ForwardOp(enum.IntEnum):
    IDLE = 0
    STAGE = 1  # stage_fn on a stage that is not the last
    LAST = 2  # the last stage: stage_fn, then loss_fn and its gradient (or the output)


class BackwardOp(enum.IntEnum):
    IDLE = 0
    FULL = 1  # BW: input and weight gradients
    INPUT = 2  # B: input gradient only
    WEIGHT = 3  # W: weight gradient only


# Columns of `Plan.table`.
FIELDS = (
    "f_op",  # ForwardOp
    "f_chunk",  # local chunk index of the forward's stage
    "f_stage",  # logical stage
    "f_mb",  # micro-batch
    "f_from_input",  # 1 if the forward reads the model input (stage 0)
    "f_src",  # activation slot to read (junk if from input or idle)
    "f_res",  # residual slot to write
    "f_cot",  # cotangent slot the last stage's forward writes its loss gradient to
    "b_op",  # BackwardOp
    "b_chunk",
    "b_stage",
    "b_mb",
    "b_cot",  # cotangent slot to read (B or BW)
    "b_res",  # residual slot to read
    "b_stash",  # stash slot: B writes it (if a W follows), W reads it
    "b_to_input",  # 1 if the backward's input gradient is the model's (stage 0)
    # Weight versions (schedules that update weights inside the pipeline; 0 elsewhere):
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

    ``table[t, d, COLUMN[name]]``; ``act_recv[o][t, d]`` and ``cot_recv[o][t, d]`` are the
    slots into which the value sent on the channel with device offset ``o`` in tick ``t``
    is written (the junk slot if nothing arrives); it is read from tick ``t + 1`` on. (The
    executor writes an activation at the end of tick ``t`` and a cotangent during tick
    ``t + 1``'s forward, before its backward: `jaxpipe._executor.tick`.)
    """

    schedule: Schedule
    table: np.ndarray  # [T, S, len(FIELDS)] int32
    forward_offsets: tuple[int, ...]
    backward_offsets: tuple[int, ...]
    act_recv: np.ndarray  # [len(forward_offsets), T, S]
    cot_recv: np.ndarray  # [len(backward_offsets), T, S]
    num_act_slots: int  # plus one junk slot
    num_cot_slots: int  # plus one junk slot
    num_res_slots: int
    num_stash_slots: int
    has_backward: bool
    num_version_slots: int = 1  # weight buffers per device (versioned schedules)
    final_version: np.ndarray | None = None  # [S]: slot of each device's newest version

    @property
    def num_ticks(self) -> int:
        return self.table.shape[0]

    @property
    def updates_weights(self) -> bool:
        """True if the schedule updates weights inside the pipeline (weight versions)."""
        return bool(self.table[:, :, COLUMN["update"]].any())

    def rows(self) -> np.ndarray:
        """``[S, T, fields + channels]``: each device's rows, table and receive slots."""
        parts = [self.table, self.act_recv.transpose(1, 2, 0), self.cot_recv.transpose(1, 2, 0)]
        return np.ascontiguousarray(np.concatenate(parts, axis=2).transpose(1, 0, 2))


def allocate(intervals: list[tuple[object, int, int, bool]]) -> tuple[dict, int]:
    """Colours ``(key, write_tick, last_read_tick, early)`` intervals: key -> slot, count.

    A value occupies its slot from its write to its last read. A slot last read in tick
    ``r`` can take a value written in tick ``w > r``, or in ``w == r`` if that write comes
    after the tick's reads (``early`` False: a receive at the end of the tick).
    """
    free_from: list[int] = []  # per slot, the tick of its last read
    slot_of = {}
    for key, write, read, early in sorted(intervals, key=lambda x: (x[1], x[2])):
        free = [
            i for i, last in enumerate(free_from) if last < write or (last == write and not early)
        ]
        slot = free[0] if free else len(free_from)
        if not free:
            free_from.append(0)
        free_from[slot] = read
        slot_of[key] = slot
    return slot_of, len(free_from)


def make_plan(schedule: Schedule) -> Plan:
    """Builds the executor's tables for ``schedule`` (which must be valid)."""
    s = schedule
    S, N = s.num_stages, s.num_logical_stages
    T = s.num_ticks
    chunk = {st: c for d in range(S) for c, st in enumerate(s.device_stages(d))}
    dev = s.stage_device
    when: dict[tuple[str, int, int], int] = {}
    for t, _, a in s.timed_actions():
        when[(a.op, a.stage, a.microbatch)] = t

    def backward_tick(stage, m):
        return when.get((BW, stage, m), when.get((B, stage, m)))

    has_backward = any(a.op != F for a in s.actions())
    pools = {name: {d: [] for d in range(S)} for name in ("act", "cot", "res", "stash")}
    for (op, stage, m), t in when.items():
        d = dev[stage]
        key = (stage, m)
        if op == F and stage > 0:
            pools["act"][d].append((key, when[(F, stage - 1, m)], t, False))
        if op == F and has_backward:
            last_read = when.get((W, stage, m), backward_tick(stage, m))
            pools["res"][d].append((key, t, last_read, True))
            if stage == N - 1:  # the loss gradient, written by the forward itself
                pools["cot"][d].append((key, t, backward_tick(stage, m), True))
        if op in (B, BW) and stage < N - 1:
            pools["cot"][d].append((key, backward_tick(stage + 1, m), t, False))
        if op == B:
            pools["stash"][d].append((key, t, when[(W, stage, m)], True))

    slots, sizes = {}, {}
    for name, per_device in pools.items():
        slots[name], sizes[name] = {}, 0
        for d in range(S):
            slot_of, n = allocate(per_device[d])
            slots[name].update({(d, *k): v for k, v in slot_of.items()})
            sizes[name] = max(sizes[name], n)

    forward_offsets = sorted({(dev[st + 1] - dev[st]) % S for st in range(N - 1)}) or [0]
    backward_offsets = sorted({(dev[st - 1] - dev[st]) % S for st in range(1, N)}) or [0]
    if not has_backward:
        backward_offsets = []

    table = np.zeros((T, S, len(FIELDS)), dtype=np.int32)
    table[:, :, COLUMN["f_src"]] = sizes["act"]  # junk: idle and first-stage forwards
    table[:, :, COLUMN["b_cot"]] = sizes["cot"]
    table[:, :, COLUMN["f_cot"]] = sizes["cot"]  # junk
    act_recv = np.full((len(forward_offsets), T, S), sizes["act"], dtype=np.int32)
    cot_recv = np.full((len(backward_offsets), T, S), sizes["cot"], dtype=np.int32)

    def put(t, d, **values):
        for name, value in values.items():
            table[t, d, COLUMN[name]] = value

    for t, d, a in s.timed_actions():
        m, key = a.microbatch, (d, a.stage, a.microbatch)
        last = a.stage == N - 1
        if a.op == F:
            op = ForwardOp.LAST if last else ForwardOp.STAGE
            put(t, d, f_op=op, f_chunk=chunk[a.stage], f_stage=a.stage, f_mb=m)
            if a.stage == 0:
                put(t, d, f_from_input=1)
            else:
                put(t, d, f_src=slots["act"][key])
                o = forward_offsets.index((d - dev[a.stage - 1]) % S)
                act_recv[o, when[(F, a.stage - 1, m)], d] = slots["act"][key]
            if has_backward:
                put(t, d, f_res=slots["res"][key])
                if last:
                    put(t, d, f_cot=slots["cot"][key])
            continue
        op = {BW: BackwardOp.FULL, B: BackwardOp.INPUT, W: BackwardOp.WEIGHT}[a.op]
        put(t, d, b_op=op, b_chunk=chunk[a.stage], b_stage=a.stage, b_mb=m)
        put(t, d, b_res=slots["res"][key], b_to_input=int(a.stage == 0))
        if a.op in (B, BW):
            put(t, d, b_cot=slots["cot"][key])
            if not last:
                o = backward_offsets.index((d - dev[a.stage + 1]) % S)
                cot_recv[o, backward_tick(a.stage + 1, m), d] = slots["cot"][key]
        if a.op in (B, W):
            put(t, d, b_stash=slots["stash"][key])

    versions = _plan_versions(s, table) if has_backward and s.has_updates else {}
    return Plan(
        schedule=s,
        table=table,
        forward_offsets=tuple(forward_offsets),
        backward_offsets=tuple(backward_offsets),
        act_recv=act_recv,
        cot_recv=cot_recv,
        num_act_slots=sizes["act"],
        num_cot_slots=sizes["cot"],
        num_res_slots=sizes["res"],
        num_stash_slots=sizes["stash"],
        has_backward=has_backward,
        **versions,
    )


def _plan_versions(s: Schedule, table: np.ndarray) -> dict:
    """Weight-version slots for a schedule that updates weights inside the pipeline (one
    with ``U`` actions: `jaxpipe.schedules.update_points`).

    Version ``k`` of a stage is written at the end of the tick of its ``k``-th update
    (version 0 before the first tick) and lives until the last tick that reads it: an
    action reading it, the update that makes version ``k + 1`` from it, or, for the newest,
    the end.
    """
    if s.stages_per_device != 1:
        raise ValueError(
            f"schedule {s.name!r} updates weights inside the pipeline with "
            f"{s.stages_per_device} stages per device; weight versions are supported for one "
            "stage per device only"
        )
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
        slots, n = allocate([(k, made[k], last_use[k], False) for k in range(len(made))])
        slot_of[d] = slots  # version 0 (the caller's weights) is the first interval: slot 0
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
