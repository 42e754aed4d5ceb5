"""Lock-step tables packed for given F:B:W costs: how close they come to the ideal bubble.

For each schedule's default table and each cost ratio, a greedy lock-step list scheduler
packs the same per-device work again, tick by tick, so that a tick's cells last about as
long as each other at those costs. Each device keeps the order of its forwards and
backwards (F, B, BW) from the default table; its W's (which nothing waits for) run when they
fill time the device would otherwise idle. In a tick of a given length every device fills a
cell: its next forward or backward if its inputs ran in earlier ticks and it fits, then W's
whose B ran earlier (oldest first), then its next forward. A forward waits while the device
holds its activation limit (the default table's peak per device, times ``memory``). The
tick's length comes from a policy (`policies`): the candidate length with the least idle
time (``adaptive``: among those that run every ready backward; ``delay``: among all), or
one fixed length wherever something fits in it. The best table over the policies is kept.

Variants (what a cell may hold, how activations are counted):

- ``executor``: the executor's cells (at most one F and one backward action: B, W or BW),
  the default table's peak activations. Every such table passes `validate` with that limit.
- ``+w-first``: as ``executor``, but a W frees its activation before the F of its cell
  starts (the executor runs F first today, so the two are alive at once).
- ``relaxed``: cells of any number of W pieces, W beside B or BW, each W in 4 equal pieces.
- ``relaxed+w-first``, ``executor x2``, ``relaxed+w-first x2``: as named; ``x2`` allows
  twice the default table's peak activations.

The gap reported is the lock-step bubble of the packed table minus the ideal (dataflow)
bubble of the default table at the same costs; ``default`` is the default table's own
lock-step bubble minus its ideal. No communication cost. Pure Python, no JAX; the full
grid takes several minutes.

    python benchmarks/costed_tables.py
    python benchmarks/costed_tables.py --stages 4 --multiples 4 --schedules zbv
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from collections import deque

import common

from jaxpipe import schedules
from jaxpipe.schedules import BW, Action, B, Costs, F, Schedule, W, simulate, validate
from jaxpipe.schedules.actions import dependencies, met_by

SCHEDULES = {
    "1f1b": {},
    "zb_h1": {},
    "zb_h2": {},
    "zbv": {},
    "interleaved_1f1b": {"virtual_stages": 2},
    "interleaved_zb": {},
    "dualpipev": {},
}
RATIOS = ["1:1:1", "1:1.2:0.8", "1:2:1", "1:1.88:0.21", "1:0.88:0.21", "1:1.1:0.9",
          "1:1.3:0.7", "1:1.6:0.6", "1:1:0.5"]  # fmt: skip
SLACK = 1e-9  # rounding allowance when a cell is checked against a tick's length


class Deadlock(ValueError):
    """No device can run anything in a tick: the policy failed on this table."""


@dataclasses.dataclass(frozen=True)
class Variant:
    """What a cell may hold and how many activations a device may keep."""

    weights: int = 1  # W pieces per cell
    weight_beside_backward: bool = False  # a W in the same cell as a B or BW
    weight_pieces: int = 1  # each W runs as this many equal pieces
    weight_frees_first: bool = False  # a W's activation is freed before its cell's F
    memory: float = 1.0  # activation limit: the default table's peak per device, times this

    @property
    def is_executors(self) -> bool:
        """True if the cells are the executor's and the activations counted as it holds them."""
        return self == Variant()


RELAXED = dict(weights=10**6, weight_beside_backward=True, weight_pieces=4)
VARIANTS = {
    "executor": Variant(),
    "+w-first": Variant(weight_frees_first=True),
    "relaxed": Variant(**RELAXED),
    "relaxed+w-first": Variant(**RELAXED, weight_frees_first=True),
    "executor x2": Variant(memory=2.0),
    "relaxed+w-first x2": Variant(**RELAXED, weight_frees_first=True, memory=2.0),
}


@dataclasses.dataclass(frozen=True)
class Piece:
    """Part ``index`` of ``count`` equal parts of an action."""

    action: Action
    index: int = 0
    count: int = 1

    def cost(self, costs: Costs) -> float:
        return costs.of(self.action) / self.count

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def pack_for_costs(
    default: Schedule, costs: Costs, variant: Variant, policy: str | float = "adaptive"
) -> list[list[list[Piece]]]:
    """``cells[t][d]``: the pieces device ``d`` runs in tick ``t`` (module docstring).

    ``policy`` picks each tick's length: ``"adaptive"`` the candidate with the least idle
    time among those that run every ready backward, ``"delay"`` the same without that rule,
    a number: that length whenever some cell fits in it (the least idle candidate else).
    """
    S, N = default.num_stages, default.num_logical_stages
    cap = [math.floor(p * variant.memory) for p in default.peak_activations()]
    order: list[list[Action]] = [[] for _ in range(S)]
    for _, d, a in default.timed_actions():
        order[d].append(a)
    rank = {a: i for row in order for i, a in enumerate(row)}
    critical = [deque(a for a in row if a.op != W) for row in order]
    pool: list[list[Piece]] = [[] for _ in range(S)]  # W pieces whose B ran in earlier ticks
    live = [0] * S
    done: set[tuple] = set()
    cells: list[list[list[Piece]]] = []

    def inputs_ready(a: Action) -> bool:
        return all(any(k in done for k in met_by(dep)) for dep in dependencies(a, N))

    def plan(d: int, length: float) -> list[Piece]:
        cell: list[Piece] = []
        used = 0.0
        queue = list(critical[d])[:2]
        forward = None
        if queue and inputs_ready(queue[0]) and costs.of(queue[0]) <= length + SLACK:
            if queue[0].op == F:
                forward = queue[0]  # added below, after the W's that may free memory
            else:
                cell.append(Piece(queue[0]))
                used += costs.of(queue[0])
                if len(queue) > 1 and queue[1].op == F:
                    forward = queue[1]
        elif queue and queue[0].op == F:
            forward = queue[0]
        has_backward = bool(cell)
        room = length - (costs.of(forward) if forward is not None else 0.0)
        for fill_first in (True, False):  # W's leaving room for the forward, then any
            for piece in list(pool[d]):
                weights = sum(p.action.op == W for p in cell)
                if weights >= variant.weights:
                    break
                if has_backward and not variant.weight_beside_backward:
                    break
                if used + piece.cost(costs) > (room if fill_first else length) + SLACK:
                    break
                if piece in cell:
                    continue
                cell.append(piece)
                used += piece.cost(costs)
            if forward is not None and fill_first:
                freed = sum(p.last for p in cell if p.action.op == W)
                held = live[d] - (freed if variant.weight_frees_first else 0)
                if (
                    held < cap[d]
                    and inputs_ready(forward)
                    and used + costs.of(forward) <= length + SLACK
                ):
                    cell.insert(0, Piece(forward))
                    used += costs.of(forward)
                forward = None
        return cell

    remaining = sum(len(row) for row in order)
    while remaining:
        candidates = set()
        for d in range(S):
            heads = [costs.of(a) for a in list(critical[d])[:2]]
            fills = [p.cost(costs) for p in pool[d][:2]] + [costs.forward, 0.0]
            candidates |= {h + x for h in heads + [0.0] for x in fills}
        best = None
        if not isinstance(policy, str):
            row = [plan(d, policy) for d in range(S)]
            if any(row):
                best = ((), row)
        lengths = sorted(c for c in candidates if c > 0) if best is None else []
        for length in lengths:
            row = [plan(d, length) for d in range(S)]
            skipped = any(
                critical[d]
                and critical[d][0].op != F
                and inputs_ready(critical[d][0])
                and not any(p.action == critical[d][0] for p in row[d])
                for d in range(S)
            )
            if skipped and policy == "adaptive":
                continue  # every ready backward runs
            work = sum(p.cost(costs) for cell in row for p in cell)
            progress = sum(p.action.op != W for cell in row for p in cell)
            if work == 0:
                continue
            score = (round(work / (S * length), 9), progress, length)
            if best is None or score > best[0]:
                best = (score, row)
        if best is None:
            raise Deadlock(f"{default.name}: packing deadlocks at tick {len(cells)}")
        row = best[1]
        for d, cell in enumerate(row):
            for p in cell:
                a = p.action
                if a.op == W:
                    pool[d].remove(p)
                else:
                    critical[d].remove(a)
                if p.last:
                    remaining -= 1
                if a.op == F:
                    live[d] += 1
        for d, cell in enumerate(row):
            for p in cell:
                a = p.action
                if p.last:
                    done.add((a.op, a.stage, a.microbatch))
                if a.op in (W, BW) and p.last:
                    live[d] -= 1
                if a.op == B:
                    k = variant.weight_pieces
                    pool[d] += [Piece(Action(W, a.stage, a.microbatch), i, k) for i in range(k)]
            pool[d].sort(key=lambda p: (rank[p.action], p.index))
        cells.append([sorted(c, key=lambda p: (p.action.op != F, p.action.op == W)) for c in row])
    return cells


def as_schedule(default: Schedule, cells: list[list[list[Piece]]]) -> Schedule:
    """The table of ``cells`` (whole actions only: one piece per W)."""
    ticks = tuple(tuple(tuple(p.action for p in cell) for cell in row) for row in cells)
    return dataclasses.replace(default, ticks=ticks, max_actions_per_tick=2)


def lockstep_makespan(cells: list[list[list[Piece]]], costs: Costs) -> float:
    """Sum over ticks of the longest cell (no communication cost)."""
    return sum(max(sum(p.cost(costs) for p in cell) for cell in row) for row in cells)


def policies(costs: Costs) -> list:
    """The tick-length policies tried for ``costs``; the best table is kept."""
    f, b, w = costs.forward, costs.backward_input, costs.backward_weight
    return ["adaptive", "delay", *sorted({max(f, b), f + w, f + b, max(f + w, b)})]


def ratio(text: str) -> Costs:
    f, b, w = map(float, text.split(":"))
    return Costs(forward=f, backward_input=b, backward_weight=w)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--multiples", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--ratios", nargs="+", default=RATIOS)
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "costed_tables.json"))
    args = parser.parse_args()
    start = time.time()
    rows = []
    for name in args.schedules:
        for S in args.stages:
            for M in [k * S for k in args.multiples]:
                try:
                    default = schedules.get(name, S, M, **SCHEDULES.get(name, {}))
                except ValueError:
                    continue
                for text in args.ratios:
                    costs = ratio(text)
                    report = schedules.bubble_fraction(default, costs)
                    busy = sum(simulate(default, costs).busy)
                    row = {"schedule": name, "S": S, "M": M, "costs": text,
                           "default_lockstep": report.lockstep, "default_ideal": report.ideal,
                           "default_neighbour": report.neighbour}  # fmt: skip
                    for label, variant in VARIANTS.items():
                        tables = []
                        for policy in policies(costs):
                            try:
                                tables.append(pack_for_costs(default, costs, variant, policy))
                            except Deadlock:
                                continue
                        cells = min(tables, key=lambda cells: lockstep_makespan(cells, costs))
                        bubble = 1 - busy / (S * lockstep_makespan(cells, costs))
                        if variant.is_executors:  # a table the executor runs, as is
                            table = as_schedule(default, cells)
                            validate(table, default.peak_activations())
                            assert abs(simulate(table, costs).bubble - bubble) < 1e-9
                        row[label] = bubble
                    rows.append(row)
    labels = ["default", *VARIANTS, "best(default, executor)"]
    summary = []
    for name in args.schedules:
        mine = [r for r in rows if r["schedule"] == name]
        if not mine:
            continue

        def worst(key, mine=mine):
            gaps = [
                (min(r["default_lockstep"], r["executor"]) if key == "best(default, executor)"
                 else r["default_lockstep"] if key == "default" else r[key]) - r["default_ideal"]
                for r in mine
            ]  # fmt: skip
            i = max(range(len(gaps)), key=gaps.__getitem__)
            return gaps[i], mine[i]

        entry = {"schedule": name}
        for key in labels:
            gap, where = worst(key)
            entry[key] = gap
            entry[key + " at"] = f"S={where['S']} M={where['M']} {where['costs']}"
        summary.append(entry)
    common.print_table(
        ["schedule", *labels],
        [[e["schedule"], *(f"{100 * e[k]:.1f}" for k in labels)] for e in summary],
        title="Worst lock-step bubble minus the default table's ideal bubble, points "
        f"(S in {args.stages}, M in {args.multiples} x S, F:B:W in {args.ratios})",
    )
    columns = ["default_lockstep", *VARIANTS]
    common.print_table(
        ["F:B:W", "default", *VARIANTS],
        [
            [text, *(f"{100 * max(r[k] - r['default_ideal'] for r in mine):.1f}" for k in columns)]
            for text in args.ratios
            if (mine := [r for r in rows if r["costs"] == text])
        ],
        title="The same gap per cost ratio, worst over schedules, S and M, points",
    )
    print("\nWhere the worst case is:")
    for e in summary:
        print(f"  {e['schedule']:18s} executor: {e['executor at']}; "
              f"relaxed+w-first x2: {e['relaxed+w-first x2 at']}")  # fmt: skip
    worse = sum(r["executor"] > r["default_lockstep"] + 1e-9 for r in rows)
    better = sum(r["executor"] < r["default_lockstep"] - 1e-9 for r in rows)
    print(
        f"\nexecutor-cell tables against the default's lock-step bubble: {better} better, "
        f"{worse} worse, {len(rows) - better - worse} equal, of {len(rows)}"
    )
    meta = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "jax": "not used (pure-Python simulator)",
        "command": " ".join(["benchmarks/costed_tables.py"] + sys.argv[1:]),
        "seconds": round(time.time() - start, 2),
        **common.library_state(),
    }
    variants = {k: dataclasses.asdict(v) for k, v in VARIANTS.items()}
    common.write_json(
        {"meta": meta, "variants": variants, "summary": summary, "rows": rows}, args.out
    )


if __name__ == "__main__":
    main()
