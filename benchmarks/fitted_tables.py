"""Tables packed for the stage's costs against the default tables: bubbles and step time.

For each schedule, S and M, and each F:B:W cost ratio, the default table (packed for equal
costs) and the table `jaxpipe.schedules.get(..., costs=...)` packs for those costs are run
by the simulator in its three modes (lock-step as the executor runs a table,
neighbour-synchronised as a chip runs the ticks, and ideal), and their peak live
activations per device are compared. ``circular`` and ``gpipe``, whose ticks are all alike,
are shown beside them unchanged. Costs are given as ratios (``name=F:B:W``); the step time
is the lock-step makespan in units of the forward of a stage of ``1 / S`` of the model (a
table with ``v`` stages per device runs actions of ``1 / v`` of that cost). Pure Python, no
JAX.

The default costs include two for a Llama-3-8B stage of two blocks (width 4096, one row of
8192 tokens, bf16, attention included) as the TPU v5p compiler estimates them
(`jaxpipe.costs.cost_analysis` then `compiler_seconds`): F 90 ms, B 79 ms, W 19 ms, and with
``remat=True``, where B also recomputes the forward, B 169 ms.

    python benchmarks/fitted_tables.py
    python benchmarks/fitted_tables.py --stages 8 --multiples 2 4 --costs mine=1:1.7:0.4
"""

from __future__ import annotations

import argparse
import os
import time

import common

from jaxpipe import schedules
from jaxpipe.schedules import simulate

FITTED = {
    "1f1b": {},
    "zb_h1": {},
    "zb_h2": {},
    "zbv": {},
    "interleaved_1f1b": {"virtual_stages": 2},
    "interleaved_zb": {},
    "dualpipev": {},
}
UNCHANGED = {"circular": {}, "gpipe": {}}
COSTS = [
    "1:1:1=1:1:1",
    "1:1.2:0.8=1:1.2:0.8",
    "1:2:1=1:2:1",
    "llama3-8b v5p=90:79:19",
    "llama3-8b v5p remat=90:169:19",
]


def bubbles(table, costs) -> dict:
    report = schedules.bubble_fraction(table, costs)
    # Costs are per logical stage; a table of v stages per device cuts the model into v
    # times as many, each 1/v of a device's layers: the step in one v = 1 stage's forward.
    step = simulate(table, costs).makespan / (costs.forward * table.stages_per_device)
    return {
        "lockstep": report.lockstep,
        "neighbour": report.neighbour,
        "ideal": report.ideal,
        "step": step,
        "ticks": table.num_ticks,
        "peak": max(table.peak_activations()),
    }


def three(figures: dict) -> str:
    """Lock-step / neighbour / ideal bubble, in percent."""
    return " / ".join(f"{100 * figures[k]:.1f}%" for k in ("lockstep", "neighbour", "ideal"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[4])
    parser.add_argument("--multiples", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--schedules", nargs="+", default=[*FITTED, *UNCHANGED])
    parser.add_argument("--costs", nargs="+", default=COSTS, help="name=F:B:W, ...")
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "fitted_tables.json"))
    args = parser.parse_args()
    start = time.time()
    rows = []
    for item in args.costs:
        label, _, text = item.rpartition("=")
        costs = schedules.Costs.from_text(text)
        for S in args.stages:
            for M in [k * S for k in args.multiples]:
                for name in args.schedules:
                    options = {**FITTED, **UNCHANGED}.get(name, {})
                    try:
                        default = schedules.get(name, S, M, **options)
                    except ValueError:
                        continue
                    fitted = schedules.fit(default, costs) if name in FITTED else default
                    rows.append({"costs": label or text, "ratio": schedules.describe_costs(costs),
                                 "schedule": name, "S": S, "M": M,
                                 "default": bubbles(default, costs),
                                 "fitted": bubbles(fitted, costs)})  # fmt: skip
    for label in dict.fromkeys(r["costs"] for r in rows):
        mine = [r for r in rows if r["costs"] == label]
        common.print_table(
            ["schedule", "S", "M", "default L / N / I", "fitted L / N / I", "step default",
             "step fitted", "peak"],
            [[r["schedule"], r["S"], r["M"],
              three(r["default"]), three(r["fitted"]),
              f"{r['default']['step']:.1f}", f"{r['fitted']['step']:.1f}",
              f"{r['default']['peak']} -> {r['fitted']['peak']}"] for r in mine],
            title=f"{label} ({mine[0]['ratio']}): bubble lock-step / neighbour / ideal, step in F",
        )  # fmt: skip
    gaps = []
    for name in dict.fromkeys(r["schedule"] for r in rows if r["schedule"] in FITTED):
        mine = [r for r in rows if r["schedule"] == name]
        worst = max(mine, key=lambda r: r["fitted"]["lockstep"] - r["default"]["ideal"])
        gap = worst["fitted"]["lockstep"] - worst["default"]["ideal"]
        before = max(r["default"]["lockstep"] - r["default"]["ideal"] for r in mine)
        where = f"S={worst['S']} M={worst['M']} {worst['costs']}"
        gaps.append([name, f"{100 * before:.1f}", f"{100 * gap:.1f}", where])
    common.print_table(
        ["schedule", "equal-cost table", "packed table", "worst case"],
        gaps,
        title="Worst lock-step bubble minus the equal-cost table's ideal bubble, points",
    )
    meta = {**common.library_state(), "command": "benchmarks/fitted_tables.py",
            "seconds": round(time.time() - start, 1), "jax": "not used"}  # fmt: skip
    common.write_json({"meta": meta, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
