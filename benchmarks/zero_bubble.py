"""Zero-bubble schedules against 1F1B: bubble, compiled memory and communication per step.

For each schedule, S in {4, 8} and M in {8, 16, 32, 64} it prints
- the simulated bubble with F = B = W = 1, lock-step (as the executor runs a table) and ideal;
- per-device temp bytes of the compiled training step (`memory_analysis`);
- the activation and gradient bytes each device sends per step: the ``collective-permute``
  instructions in the compiled tick loop times the number of ticks, each carrying one
  micro-batch activation (V placements send in both directions, so they issue more).

    python benchmarks/zero_bubble.py                 # S=4, M in {8, 16, 32, 64}
    python benchmarks/zero_bubble.py --stages 4 8    # also S=8
    python benchmarks/zero_bubble.py --schedules 1f1b zbv --microbatches 8
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

SCHEDULES = ["1f1b", "zb_h1", "zb_h2", "zbv", "dualpipev"]
WIDTH, ROWS = 64, 16


def measure(name: str, S: int, M: int) -> dict:
    import jax

    from jaxpipe import pipeline, schedules
    from jaxpipe.schedules import Costs

    try:
        schedule = schedules.get(name, S, M)
    except ValueError as err:
        return {"schedule": name, "S": S, "M": M, "skipped": str(err).split(";")[0]}
    unit = Costs(forward=1, backward_input=1, backward_weight=1)
    bubble = schedules.bubble_fraction(schedule, unit)
    pipe = pipeline.Pipeline(
        common.block_fn, common.head_loss_fn, mesh=common.pipe_mesh(S), schedule=schedule
    )
    sp, lp = common.init_blocks(jax.random.key(0), pipe.num_logical_stages, WIDTH)
    sp = pipe.place(sp)  # the pipeline's device layout [v, S, ...], once
    x, t = common.block_data(jax.random.key(1), ROWS * M, WIDTH)
    compiled = jax.jit(jax.grad(pipe.loss, argnums=(0, 1))).lower(sp, lp, x, t).compile()
    text = compiled.as_text()
    loop_permutes = len(re.findall(r"collective-permute\(", _loop_bodies(text)))
    activation_bytes = ROWS * WIDTH * 4
    return {
        "schedule": name,
        "S": S,
        "M": M,
        "bubble_lockstep": bubble.lockstep,
        "bubble_ideal": bubble.ideal,
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "ticks": schedule.num_ticks,
        "permutes_per_tick": loop_permutes,
        "sent_bytes_per_step": loop_permutes * schedule.num_ticks * activation_bytes,
    }


def _loop_bodies(hlo: str) -> str:
    """Text of the computations the while loops run (the tick loop)."""
    names = set(re.findall(r"while\([^\n]*body=%([\w.\-]+)", hlo))
    parts = re.split(r"\n(?=%[\w.\-]+ )", hlo)
    return "\n".join(p for p in parts if re.match(r"%([\w.\-]+) ", p) and p.split()[0][1:] in names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=SCHEDULES)
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "zero_bubble.json"))
    args = parser.parse_args()
    common.host_devices(max(8, *args.stages))
    rows = [
        measure(n, S, M) for S in args.stages for n in args.schedules for M in args.microbatches
    ]
    table = []
    for r in rows:
        if "skipped" in r:
            table.append([r["schedule"], r["S"], r["M"], "-", "-", "-", "-", "not allowed"])
            continue
        table.append(
            [
                r["schedule"],
                r["S"],
                r["M"],
                f"{r['bubble_lockstep']:.3f}",
                f"{r['bubble_ideal']:.3f}",
                f"{r['temp_bytes'] / 2**20:.2f}",
                r["permutes_per_tick"],
                f"{r['sent_bytes_per_step'] / 2**20:.2f}",
            ]
        )
    common.print_table(
        [
            "schedule",
            "S",
            "M",
            "bubble lock-step",
            "bubble ideal",
            "temp MiB",
            "permutes/tick",
            "sent MiB/step",
        ],
        table,
        title=f"Zero-bubble schedules (F=B=W=1; width {WIDTH}, {ROWS} rows per micro-batch; "
        "zbv and dualpipev hold two blocks per device, the others one)",
    )
    common.write_json({"meta": common.metadata(), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
