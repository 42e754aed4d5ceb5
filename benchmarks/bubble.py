"""Simulated bubble of every schedule next to the closed forms from the literature.

For every schedule in ``jaxpipe.schedules.names()`` (its default table, and the other tables
named in ``OTHER_TABLES``, among them the previous defaults), S in {2, 4, 8}, M in
{S, 2S, 4S, 8S} and the cost ratios F:B:W = 1:1:1 (the default costs), 1:1.2:0.8 and 1:2:0
(``1:2:0`` is a full backward twice a forward: ``Costs(forward=1, backward_input=2,
backward_weight=0)``), prints the bubble fraction ``1 - busy / (S * makespan)`` of the table
run in lock-step (as the executor runs it: jaxpipe's "bubble") and in the ideal per-device
order (`jaxpipe.schedules.simulate`), the closed form from the paper that introduced the
schedule (or jaxpipe's own, for its split-backward tables), and the peak activations a
device holds. Combinations a schedule forbids (``ValueError`` from ``get``) are listed as
skipped. Pure Python, no JAX compute: runs in seconds.

    python benchmarks/bubble.py                      # table, JSON, docs/img/bench_bubble*.png
    python benchmarks/bubble.py --stages 4 8 --multiples 1 2 4 8 16 --virtual-stages 2 4
"""

from __future__ import annotations

import argparse
import os
import time

import common  # noqa: F401  (puts the repository root on sys.path)

from jaxpipe import schedules
from jaxpipe.schedules import Costs

COSTS = {
    "1:1:1": Costs(forward=1, backward_input=1, backward_weight=1),
    "1:1.2:0.8": Costs(forward=1, backward_input=1.2, backward_weight=0.8),
    "1:2:0": Costs(forward=1, backward_input=2, backward_weight=0),
}
PLOTS = {"1:1:1": "", "1:2:0": "_120", "1:1.2:0.8": "_1208"}  # file suffix per cost ratio
# Other tables of a schedule, next to its default (the previous defaults among them).
OTHER_TABLES = {
    "1f1b": [{"split_backward": False}, {"overlap": True}],
    "interleaved_1f1b": [{"split_backward": False}],
    "dualpipev": [{"overlap": True}],
}


def closed_form(name: str, S: int, M: int, options: dict, c: Costs) -> tuple[float, str]:
    """The literature's bubble fraction ``idle / (idle + busy)`` per device, and its source.

    F, B, W are one chunk's costs (a chunk is one logical stage); BW = B + W is the full
    backward. All forms assume no communication cost. For jaxpipe's split-backward tables
    (B then W in the next tick) the form is jaxpipe's: only F and B are on the critical path,
    ``(S-1)(F+B)`` idle per device.
    """
    F, B, W = c.forward, c.backward_input, c.backward_weight
    BW = c.full_backward if c.full_backward is not None else B + W
    split = options.get("split_backward", not options.get("overlap", False))
    v = options.get("virtual_stages", 1)
    if name == "gpipe":
        return (S - 1) / (M + S - 1), "(S-1)/(M+S-1) [Huang 2019]"
    if name in ("1f1b", "pipedream", "pipedream_2bw", "interleaved_1f1b") and split:
        idle, busy = (S - 1) * (F + B), v * M * (F + B + W)
        return idle / (idle + busy), "idle (S-1)(F+B), B then W [jaxpipe split backward]"
    if name in ("1f1b", "pipedream", "pipedream_2bw"):
        return (S - 1) / (M + S - 1), "(S-1)/(M+S-1) [Narayanan 2019/2021]"
    if name == "interleaved_1f1b":
        return (S - 1) / (v * M + S - 1), "(S-1)/(vM+S-1) [Narayanan SC'21 sec. 2.2]"
    if name == "circular":
        r = options["repeats"]
        return (S - 1) / (r * M + S - 1), "(S-1)/(rM+S-1) [GPipe fill/drain paid once]"
    if name in ("zb_h1", "interleaved_zb"):
        idle, busy = (S - 1) * max(F + B - W, 0), v * M * (F + B + W)
        return idle / (idle + busy), "(S-1)(F+B-W) idle [Qi et al. ICLR'24, ZB-H1 form]"
    if name == "zb_h2":
        idle, busy = (S - 1) * max(F + B - 2 * W, 0), M * (F + B + W)
        return idle / (idle + busy), "(S-1)(F+B-2W) idle, M>=2S-1 [Qi et al. ICLR'24, ZB-H2]"
    if name == "zbv" or (name == "dualpipev" and not options.get("overlap")):
        idle, busy = (S - 1) * max(F + B - 2 * W, 0), 2 * M * (F + B + W)
        return idle / (idle + busy), "(S-1)(F+B-2W) idle, 2 chunks [Qi et al. arXiv v2, ZB-V]"
    if name == "dualpipev":
        f_and_b = F + BW  # a lock-step pair cell lasts F + BW (no overlap credit)
        idle, busy = (S - 1) * max(f_and_b + BW - 3 * W, 0), 2 * M * (F + B + W)
        return idle / (idle + busy), "(PP/2-1)(F&B+B-3W), PP=2S, F&B=F+B [DeepSeek DualPipe]"
    return float("nan"), "no closed form known"


def variants(virtual_stages: list[int], repeats: list[int]):
    for name in schedules.names():
        if name in ("interleaved_1f1b", "interleaved_zb"):
            bases = [{"virtual_stages": v} for v in virtual_stages]
        elif name == "circular":
            bases = [{"repeats": r} for r in repeats]
        else:
            bases = [{}]
        for base in bases:
            yield name, base
            for other in OTHER_TABLES.get(name, []):
                yield name, {**base, **other}


def label(name: str, options: dict) -> str:
    if not options:
        return name
    short = {"virtual_stages": "v", "repeats": "r"}
    return name + "(" + ",".join(f"{short.get(k, k)}={v}" for k, v in options.items()) + ")"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument(
        "--multiples", type=int, nargs="+", default=[1, 2, 4, 8], help="M = multiple * S"
    )
    parser.add_argument("--virtual-stages", type=int, nargs="+", default=[2])
    parser.add_argument("--repeats", type=int, nargs="+", default=[2])
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "bubble.json"))
    parser.add_argument("--plot", default=os.path.join(common.IMAGES, "bench_bubble.png"))
    args = parser.parse_args()

    import platform
    import sys

    start = time.time()
    rows, skipped = [], []
    for name, options in variants(args.virtual_stages, args.repeats):
        for S in args.stages:
            for k in args.multiples:
                M = k * S
                try:
                    sched = schedules.get(name, S, M, **options)
                except ValueError as e:
                    skipped.append(
                        {
                            "schedule": label(name, options),
                            "S": S,
                            "M": M,
                            "reason": str(e).split(";")[0],
                        }
                    )
                    continue
                peak = max(sched.peak_activations())
                for cname, costs in COSTS.items():
                    rep = schedules.bubble_fraction(sched, costs)
                    form, source = closed_form(name, S, M, options, costs)
                    rows.append(
                        {
                            "schedule": label(name, options),
                            "name": name,
                            "options": options,
                            "S": S,
                            "M": M,
                            "costs": cname,
                            "lockstep": rep.lockstep,
                            "ideal": rep.ideal,
                            "closed_form": form,
                            "formula": source,
                            "ticks": sched.num_ticks,
                            "peak_activations": peak,
                        }
                    )
    elapsed = time.time() - start

    for cname in COSTS:
        table = [
            [
                r["schedule"],
                r["S"],
                r["M"],
                r["lockstep"],
                r["ideal"],
                r["closed_form"],
                r["lockstep"] - r["closed_form"],
                r["peak_activations"],
            ]
            for r in rows
            if r["costs"] == cname
        ]
        common.print_table(
            ["schedule", "S", "M", "lockstep", "ideal", "closed", "lock-closed", "peak_act"],
            table,
            title=f"Bubble fraction, F:B:W = {cname}, communication 0",
        )
    print("\nClosed forms used:")
    for lab, src in sorted({(r["schedule"], r["formula"]) for r in rows}):
        print(f"  {lab:28s} {src}")
    if skipped:
        print("\nSkipped (the schedule's generator raises ValueError):")
        for s in skipped:
            print(f"  {s['schedule']:28s} S={s['S']} M={s['M']}: {s['reason']}")

    meta = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": "not used (pure-Python simulator)",
        "command": " ".join(["benchmarks/bubble.py"] + sys.argv[1:]),
        "seconds": round(elapsed, 2),
        **common.library_state(),
    }
    common.write_json(
        {
            "meta": meta,
            "costs": {k: vars(c) for k, c in COSTS.items()},
            "rows": rows,
            "skipped": skipped,
        },
        args.out,
    )
    if args.plot:
        plot(rows, skipped, args, args.plot)


def plot(rows, skipped, args, path):
    """One panel per table; colour = S; solid lock-step, dashed ideal, dotted closed form.
    ``path`` gets F:B:W = 1:1:1, ``<path>_120.png`` 1:2:0, ``<path>_1208.png`` 1:1.2:0.8."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({r["schedule"] for r in rows})
    colors = {
        S: plt.cm.viridis(i / max(1, len(args.stages) - 1) * 0.85)
        for i, S in enumerate(args.stages)
    }
    cols = 4
    nrows = -(-len(labels) // cols)
    for cname in COSTS:
        fig, axes = plt.subplots(
            nrows, cols, figsize=(3.4 * cols, 2.6 * nrows), sharey=True, squeeze=False
        )
        for ax, lab in zip(axes.flat, labels, strict=False):
            for S in args.stages:
                pts = sorted(
                    (r["M"], r["lockstep"], r["ideal"], r["closed_form"])
                    for r in rows
                    if r["schedule"] == lab and r["S"] == S and r["costs"] == cname
                )
                if not pts:
                    continue
                ms = [p[0] for p in pts]
                ax.plot(
                    ms, [p[1] for p in pts], "o-", color=colors[S], ms=3, label=f"S={S} lock-step"
                )
                ax.plot(ms, [p[2] for p in pts], "--", color=colors[S], lw=1, label=f"S={S} ideal")
                ax.plot(
                    ms,
                    [p[3] for p in pts],
                    "x:",
                    color=colors[S],
                    lw=1,
                    ms=4,
                    label=f"S={S} closed form",
                )
            ax.set_xscale("log", base=2)
            ax.set_title(lab, fontsize=9)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=7)
        for ax in axes.flat[len(labels) :]:
            ax.axis("off")
        for ax in axes[:, 0]:
            ax.set_ylabel("bubble fraction", fontsize=8)
        for ax in axes[-1]:
            ax.set_xlabel("micro-batches M", fontsize=8)
        handles, names = axes.flat[0].get_legend_handles_labels()
        fig.legend(
            handles, names, loc="lower right", fontsize=7, ncol=1, bbox_to_anchor=(0.98, 0.03)
        )
        fig.suptitle(
            f"Bubble vs M, F:B:W = {cname}: lock-step (solid), ideal (dashed), "
            "closed form (x, dotted)",
            fontsize=10,
        )
        fig.tight_layout(rect=(0, 0, 1, 0.97))
        out = path.replace(".png", f"{PLOTS[cname]}.png")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        fig.savefig(out, dpi=100)
        plt.close(fig)
        print(f"wrote {os.path.relpath(out)}")


if __name__ == "__main__":
    main()
