"""PyTorch's pipeline schedules as jaxpipe tables: CSV fixtures for tests/test_pytorch_tables.py.

Builds the compute-only tables (``pipeline_order``) of ``torch.distributed.pipelining``'s
schedules (GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble,
DualPipeV) for a grid of (S, M, v), without a process group or stage modules: each schedule
object is created with ``cls.__new__`` and given the few attributes its table-building
method reads (the rank count, the micro-batch count, the number of local stages, and for
the interleaved ones PyTorch's rounds), then that method runs as in PyTorch. Where PyTorch's
constructor would refuse (its micro-batch rules), the grid point is skipped.

Ops are mapped one to one: PyTorch ``F`` -> ``F``, ``I`` (backward for the input) -> ``B``,
``W`` -> ``W``, ``B`` (full backward) -> ``BW``; an ``OVERLAP_F_B`` action (DualPipeV) is a
two-action cell; ``REDUCE_GRAD`` and communication actions are dropped (the jaxpipe executor
does its own). Logical stage = PyTorch's stage index; its device is PyTorch's rank (looped
placement ``s % S``, or the V placement for ZBV and DualPipeV).

Each fixture is the table jaxpipe runs for PyTorch's per-rank order: every rank's actions in
PyTorch's order, each in the first lock-step tick where its inputs exist (`jaxpipe.schedules
.pack`). PyTorch's own time steps (its ``None`` padding) are also checked with jaxpipe's
validator; the verdict is stored in the fixture's ``options`` header (``raw_valid``,
``raw_error``), with PyTorch's class name and version.

    pip install torch==2.13.0          # CPU build; not a jaxpipe dependency
    python benchmarks/pytorch_tables.py                 # writes tests/data/pytorch/*.csv
    python benchmarks/pytorch_tables.py --check         # compare, print a table, write nothing
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxpipe import schedules  # noqa: E402
from jaxpipe.schedules import BW, Action, B, F, Schedule, W, pack  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data")
OUT = os.path.join(OUT, "pytorch")

# PyTorch class -> (file prefix, stages per rank: None = from the grid, placement)
FAMILIES = {
    "ScheduleGPipe": ("gpipe", 1, "looped"),
    "Schedule1F1B": ("1f1b", 1, "looped"),
    "ScheduleInterleaved1F1B": ("interleaved1f1b", None, "looped"),
    "ScheduleLoopedBFS": ("loopedbfs", None, "looped"),
    "ScheduleInterleavedZeroBubble": ("interleavedzb", None, "looped"),
    "ScheduleZBVZeroBubble": ("zbv", 2, "v"),
    "ScheduleDualPipeV": ("dualpipev", 2, "v"),
}
STAGES = (2, 4, 8)
VIRTUAL = (2, 3, 4)


def microbatch_grid(S: int, v: int) -> list[int]:
    """M in {S, 2S, 4S} (and 8S for v <= 2), plus counts that are not multiples of S (and
    one below S)."""
    grid = {max(1, S - 1), S, S + 2, 2 * S, 3 * S + 1, 4 * S}
    return sorted(grid | ({8 * S} if v <= 2 else set()))


def placement(S: int, v: int, style: str) -> list[int]:
    if style == "v":
        return [s if s < S else 2 * S - 1 - s for s in range(2 * S)]
    return [s % S for s in range(S * v)]


def _action(a) -> Action:
    op = {"F": F, "I": B, "W": W, "B": BW}[a.computation_type.value]
    return Action(op, a.stage_index, a.microbatch_index)


def _item(a):
    """A jaxpipe order item for one PyTorch action: an Action, a pair, or None (dropped)."""
    if a is None:
        return None
    kind = a.computation_type.value
    if kind == "OVERLAP_F_B":
        return tuple(_action(x) for x in a.sub_actions)
    if kind in ("F", "I", "W", "B"):
        return _action(a)
    return None  # REDUCE_GRAD, SEND_*, RECV_*, UNSHARD, RESHARD


def pytorch_order(cls_name: str, S: int, M: int, v: int):
    """PyTorch's ``pipeline_order`` (rank -> list of actions or None), or None if refused."""
    from torch.distributed.pipelining import schedules as pt

    cls = getattr(pt, cls_name)
    obj = cls.__new__(cls)
    obj._n_microbatches = M
    obj._num_stages = S * v
    obj.pp_group_size = S
    obj.n_local_stages = v
    obj.num_stages = S * v
    obj._stages = [None] * v
    if cls_name == "ScheduleGPipe":
        return obj._get_pipeline_order()
    if cls_name == "Schedule1F1B":
        if M < S:
            return None  # PyTorch: "Number of microbatches ... must be greater than or equal"
        return _one_f_one_b_as_executed(pt, S, M)
    if cls_name in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"):
        obj.number_of_rounds = max(1, M // S)
        obj.microbatches_per_round = M // obj.number_of_rounds
        if M % obj.number_of_rounds:
            return None  # PyTorch: "requires the number of microbatches to be a multiple ..."
    if cls_name == "ScheduleDualPipeV" and S * v > M:
        return None  # PyTorch: "DualPipeV requires at least as many microbatches as stages"
    order = {rank: obj._calculate_single_rank_operations(rank) for rank in range(S)}
    if cls_name == "ScheduleInterleavedZeroBubble":
        obj.pipeline_order = order
        order = obj._add_bubbles_to_actions(S * v)
    return order


def _one_f_one_b_as_executed(pt, S: int, M: int):
    """The order ``Schedule1F1B._step_microbatches`` runs on each rank: ``min(M, S-r)``
    forwards, then backward and forward in turn, then the last backwards.

    Its ``_get_pipeline_order`` (the IR, used for display and export only) is off by one on
    the last rank in PyTorch 2.13 (it increments the forward index before its first use, so
    rank ``S-1`` runs ``F1, F2, ..``, never ``F0``, and ``F{M}`` is out of range), so it is
    not what PyTorch executes; `tables` records that table's fault in ``raw_error``.
    """
    order = {}
    for rank in range(S):
        warmup = min(M, S - rank)
        ops = [pt._Action(rank, pt.F, m) for m in range(warmup)]
        for m in range(M - warmup):
            ops += [pt._Action(rank, pt.B, m), pt._Action(rank, pt.F, warmup + m)]
        ops += [pt._Action(rank, pt.B, m) for m in range(M - warmup, M)]
        order[rank] = ops
    return order


def _ticks(items: list[list]) -> tuple:
    """PyTorch's time steps as jaxpipe ticks: step ``t`` of rank ``r`` is cell ``[t][r]``."""
    steps = max(len(r) for r in items)
    return tuple(
        tuple(
            () if t >= len(r) or r[t] is None else (r[t],) if isinstance(r[t], Action) else r[t]
            for r in items
        )
        for t in range(steps)
    )


def _ir_fault(cls_name: str, S: int, M: int) -> str:
    """What is wrong with PyTorch's IR where it is not what PyTorch runs (1F1B), else ''."""
    if cls_name != "Schedule1F1B":
        return ""
    from torch.distributed.pipelining import schedules as pt

    obj = pt.Schedule1F1B.__new__(pt.Schedule1F1B)
    obj._n_microbatches, obj._num_stages = M, S
    last = obj._get_pipeline_order()[S - 1]
    forwards = sorted(a.microbatch_index for a in last if a.computation_type == pt.F)
    if forwards != list(range(M)):
        return (
            f"Schedule1F1B._get_pipeline_order gives rank {S - 1} the forwards {forwards} "
            f"(expected 0..{M - 1}); the fixture uses the order _step_microbatches runs"
        )
    return ""


def tables(cls_name: str, S: int, M: int, v: int):
    """``(fixture, raw_error)``, or ``(None, None)`` where PyTorch refuses (S, M, v).

    The fixture is the faster, in lock-step at the default costs, of PyTorch's own time
    steps (where they pass jaxpipe's validator) and jaxpipe's packing of PyTorch's per-rank
    order (`pack`: each action in the first tick its inputs allow). ``raw_error`` says why
    PyTorch's time steps are not a valid table, or is None.
    """
    import torch

    order = pytorch_order(cls_name, S, M, v)
    if order is None:
        return None, None
    prefix, _, style = FAMILIES[cls_name]
    stage_device = tuple(placement(S, v, style))
    items = [[_item(a) for a in order[rank]] for rank in range(S)]
    pairs = any(isinstance(x, tuple) and not isinstance(x, Action) for r in items for x in r)
    width = 2 if pairs else 1
    options = {"pytorch_class": cls_name, "torch": torch.__version__, "virtual_stages": v}
    candidates = []
    raw_error = _ir_fault(cls_name, S, M)
    if not raw_error and not any(x is None for r in order.values() for x in r):
        raw_error = "PyTorch gives an order without time steps (no idle padding)"
    if not raw_error:
        raw = Schedule(f"pytorch_{prefix}", S, M, stage_device, _ticks(items), width)
        try:
            schedules.validate(raw)
            opts = {**options, "source": "PyTorch's time steps"}
            candidates.append(dataclasses.replace(raw, options=tuple(sorted(opts.items()))))
        except ValueError as error:
            raw_error = str(error).split("\n")[0].replace("'raw'", "")
    orders = [[x for x in r if x is not None] for r in items]
    opts = {**options, "source": "PyTorch's per-rank order, packed by jaxpipe"}
    candidates.append(pack(f"pytorch_{prefix}", S, M, stage_device, orders, width, opts))
    costs = schedules.Costs()
    best = min(candidates, key=lambda t: schedules.simulate(t, costs, "lockstep").makespan)
    note = {"raw_valid": not raw_error, "raw_error": raw_error or ""}
    merged = {**dict(best.options), **note}
    return schedules.validate(
        dataclasses.replace(best, options=tuple(sorted(merged.items())))
    ), raw_error


def grid():
    for cls_name, (_, fixed_v, _) in FAMILIES.items():
        for S in STAGES:
            for v in (fixed_v,) if fixed_v else VIRTUAL:
                for M in microbatch_grid(S, v):
                    yield cls_name, S, M, v


def fixture_name(cls_name: str, S: int, M: int, v: int) -> str:
    return f"{FAMILIES[cls_name][0]}_S{S}_M{M}_v{v}.csv"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--check", action="store_true", help="print only, write nothing")
    args = parser.parse_args()
    costs = schedules.Costs()
    written, refused, invalid = 0, [], []
    if not args.check:
        os.makedirs(args.out, exist_ok=True)
    for cls_name, S, M, v in grid():
        packed, raw_error = tables(cls_name, S, M, v)
        if packed is None:
            refused.append((cls_name, S, M, v))
            continue
        if raw_error:
            invalid.append((cls_name, S, M, v, raw_error))
        lockstep = schedules.simulate(packed, costs, "lockstep").makespan
        print(
            f"{cls_name:30} S={S} M={M:2} v={v}  lock-step {lockstep:6.1f}  "
            f"peak {max(packed.peak_activations()):3}  raw {'ok' if not raw_error else 'INVALID'}"
        )
        if not args.check:
            schedules.to_csv(packed, os.path.join(args.out, fixture_name(cls_name, S, M, v)))
            written += 1
    print(f"\n{written} fixtures written to {os.path.relpath(args.out)}" if written else "")
    print(f"refused by PyTorch ({len(refused)}): " + json.dumps(refused))
    print(f"PyTorch time steps invalid under jaxpipe's validator ({len(invalid)}):")
    for entry in invalid:
        print("  ", *entry)


if __name__ == "__main__":
    main()
