"""Compiled per-device temp memory and compile time of a training step, per schedule.

The step is ``jax.jit(jax.grad(pipe.loss, argnums=(0, 1)))`` on a fixed small
transformer-style stage (layer norm + GELU MLP, width 64, hidden 256; one block per
logical stage; every micro-batch 16 x 64 whatever M), on CPU host devices. Memory is
``compiled.memory_analysis().temp_size_in_bytes``: XLA's own count of the scratch one
device needs, which is where activations and stashed residuals live. Compile time is the
wall time of ``.lower(...).compile()`` (tracing + XLA), one compile per point, after one
warm-up compile; on a shared machine expect +-20% noise on single numbers.

    python benchmarks/memory.py                    # S=4, M in {8,32,64}, remat at M in {8,64},
                                                   # + train steps incl. pipedream (below)
    python benchmarks/memory.py --compile-time     # + compile time, M in {8,128}, S in {2,4,8}
    python benchmarks/memory.py --full             # all of it: M in {8,16,32,64}, both remat
                                                   # settings, compile time, 1f1b_fused proposal

Schedules: every name in ``jaxpipe.schedules.names()`` except ``pipedream`` and
``pipedream_2bw`` for the gradient step (they have no ``pipe.loss``: the optimizer runs
inside the pipeline). Those two are measured in a second table, the *train step*
``jax.jit(pipe.train)`` with ``optax.sgd`` (no optimizer state), next to ``1f1b`` and
``gpipe`` run through the same ``pipe.train`` (gradients, then one update per stage), at
the same M, without remat (``--no-train`` skips it). Every row records the plan's slot
counts (residual, activation, cotangent and weight-version slots per device).
"""

from __future__ import annotations

import argparse
import os
import time

import common

WIDTH, HIDDEN, ROWS = 64, 256, 16  # stage width, MLP hidden size, rows per micro-batch


def build(name, S, M, remat):
    import jax

    from jaxpipe import pipeline

    mesh = common.pipe_mesh(S)
    if name == "1f1b_fused":
        schedule, options = common.one_f_one_b_fused(S, M), None
    else:
        schedule, options = name, common.SCHEDULE_OPTIONS.get(name)
    pipe = pipeline.Pipeline(
        common.block_fn,
        common.head_loss_fn,
        mesh=mesh,
        schedule=schedule,
        num_microbatches=None if name == "1f1b_fused" else M,
        schedule_options=options,
        remat=remat,
    )
    stage, loss = common.init_blocks(jax.random.key(0), pipe.num_logical_stages, WIDTH, HIDDEN)
    x, t = common.block_data(jax.random.key(1), ROWS * M, WIDTH)
    return pipe, (stage, loss, x, t)


def measure(name, S, M, remat, train=False):
    """Compile the gradient step (``train``: the optax train step); returns temp bytes,
    other sizes and compile seconds."""
    import jax

    pipe, args = build(name, S, M, remat)
    if train:
        import optax

        opt = optax.sgd(0.1)
        opt_state = pipe.init_optimizer(opt, args[0])
        args = (args[0], opt_state, *args[1:])

        def train_step(stage, state, loss, x, t):
            return pipe.train(opt, stage, state, loss, x, t)

        step = jax.jit(train_step)
    else:
        step = jax.jit(jax.grad(pipe.loss, argnums=(0, 1)))
    start = time.perf_counter()
    lowered = step.lower(*args)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    end = time.perf_counter()
    mem = compiled.memory_analysis()
    plan = pipe._plan
    return {
        "schedule": name,
        "S": S,
        "M": M,
        "remat": remat,
        "step": "train" if train else "grad",
        "slots": {
            k: int(getattr(plan, f"num_{k}_slots", 0))
            for k in ("res", "act", "grad", "dy", "version")
        },
        "logical_stages": pipe.num_logical_stages,
        "ticks": pipe.schedule.num_ticks,
        "peak_activations": max(pipe.schedule.peak_activations()),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "lower_s": lowered_at - start,
        "compile_s": end - lowered_at,
        "total_s": end - start,
    }


def check_proposal():
    """Gradients of the 1f1b_fused proposal against the sequential reference (S=4, M=8)."""
    import jax

    pipe, args = build("1f1b_fused", 4, 8, False)
    got = jax.jit(jax.grad(pipe.loss, argnums=(0, 1)))(*args)
    want = jax.grad(common.sequential_block_loss, argnums=(0, 1))(*args, 8)
    errs = jax.tree_util.tree_map(
        lambda a, b: float(abs(a - b).max() / (abs(b).max() + 1e-30)), got, want
    )
    return max(jax.tree_util.tree_leaves(errs))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--remat-microbatches", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument(
        "--compile-time",
        action="store_true",
        help="also compile time at M in {8,128} for S in {2,4,8}",
    )
    parser.add_argument("--compile-stages", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--compile-microbatches", type=int, nargs=2, default=[8, 128])
    parser.add_argument(
        "--proposals",
        action="store_true",
        help="also the 1f1b_fused proposal (benchmarks/common.py)",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="M in {8,16,32,64} with and without remat, --compile-time, --proposals",
    )
    parser.add_argument("--schedules", nargs="+", default=None)
    parser.add_argument(
        "--no-train",
        action="store_true",
        help="skip the train-step table (pipedream, pipedream_2bw against 1f1b, gpipe)",
    )
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "memory.json"))
    parser.add_argument("--plot", default=os.path.join(common.IMAGES, "bench_memory.png"))
    args = parser.parse_args()
    if args.full:
        args.microbatches = args.remat_microbatches = [8, 16, 32, 64]
        args.compile_time = args.proposals = True

    common.host_devices(8)
    from jaxpipe import schedules

    names = args.schedules or [n for n in schedules.names() if n not in common.NOT_EXECUTED]
    if args.proposals and "1f1b_fused" not in names:
        names = names + ["1f1b_fused"]
    S = args.stages
    began = time.time()
    measure("1f1b", 2, 2, False)  # warm-up: the first compile in a process pays for setup

    rows, skipped = [], []
    for name in names:
        for remat, ms in ((False, args.microbatches), (True, args.remat_microbatches)):
            for M in ms:
                try:
                    rows.append(measure(name, S, M, remat))
                except ValueError as e:
                    skipped.append({"schedule": name, "S": S, "M": M, "reason": str(e)})
                    continue
                r = rows[-1]
                print(
                    f"  {name:18s} S={S} M={M:3d} remat={remat!s:5s} "
                    f"temp={r['temp_bytes'] / 2**20:8.3f} MiB  compile={r['total_s']:.1f}s",
                    flush=True,
                )

    def temp(name, M, remat=False):
        for r in rows:
            if (r["schedule"], r["S"], r["M"], r["remat"]) == (name, S, M, remat):
                return r["temp_bytes"]
        return None

    table = []
    for name in names:
        line = [name]
        for remat, ms in ((False, args.microbatches), (True, args.remat_microbatches)):
            line += [(temp(name, M, remat) or float("nan")) / 2**20 for M in ms]
        table.append(line)
    header = (
        ["schedule"]
        + [f"M={M}" for M in args.microbatches]
        + [f"M={M} remat" for M in args.remat_microbatches]
    )
    common.print_table(header, table, title=f"Temp MiB per device, S={S} (memory_analysis)")

    lo, hi = min(args.microbatches), max(args.microbatches)
    ratios = {}
    summary = []
    for name in names:
        a, b = temp(name, lo), temp(name, hi)
        ra, rb = (
            temp(name, min(args.remat_microbatches), True),
            temp(name, max(args.remat_microbatches), True),
        )
        ratios[name] = {
            f"M{hi}_over_M{lo}": b / a if a and b else None,
            f"remat_M{max(args.remat_microbatches)}_over_M{min(args.remat_microbatches)}": (
                rb / ra if ra and rb else None
            ),
        }
        summary.append(
            [
                name,
                ratios[name][f"M{hi}_over_M{lo}"] or float("nan"),
                list(ratios[name].values())[1] or float("nan"),
            ]
        )
    common.print_table(
        ["schedule", f"M={hi}/M={lo}", "same, remat"],
        summary,
        title="Growth of temp memory with M (1.0 = bounded)",
    )

    mid = 32 if 32 in args.microbatches else hi
    comparisons = {}
    for num, den in (
        ("1f1b", "gpipe"),
        ("zb_h1", "1f1b"),
        ("zb_h2", "1f1b"),
        ("zbv", "1f1b"),
        ("interleaved_1f1b", "1f1b"),
        ("1f1b_fused", "1f1b"),
    ):
        a, b = temp(num, mid), temp(den, mid)
        if a and b:
            comparisons[f"{num}/{den} S={S} M={mid}"] = a / b
    common.print_table(["ratio of temp bytes", "value"], [[k, v] for k, v in comparisons.items()])

    train_rows = []
    train_names = ["gpipe", "1f1b", "pipedream", "pipedream_2bw"]
    if not args.no_train:
        for name in train_names:
            for M in args.microbatches:
                try:
                    r = measure(name, S, M, False, train=True)
                except ValueError as e:
                    skipped.append({"schedule": name, "S": S, "M": M, "reason": str(e)})
                    continue
                train_rows.append(r)
                print(
                    f"  train {name:14s} S={S} M={M:3d} temp={r['temp_bytes'] / 2**20:8.3f} MiB"
                    f"  slots={r['slots']}  compile={r['total_s']:.1f}s",
                    flush=True,
                )
        ttable = []
        for name in train_names:
            got = {r["M"]: r for r in train_rows if r["schedule"] == name}
            ttable.append(
                [name]
                + [
                    got[M]["temp_bytes"] / 2**20 if M in got else float("nan")
                    for M in args.microbatches
                ]
                + [got[hi]["slots"]["version"] if hi in got else "-"]
            )
        common.print_table(
            ["schedule"] + [f"M={M}" for M in args.microbatches] + ["version slots"],
            ttable,
            title=f"Train step (jit(pipe.train), optax.sgd) temp MiB per device, S={S}",
        )

    compile_rows = []
    if args.compile_time:
        m_lo, m_hi = args.compile_microbatches
        for name in names:
            for s in args.compile_stages:
                for M in (m_lo, m_hi):
                    try:
                        r = measure(name, s, M, False)
                    except ValueError as e:
                        skipped.append({"schedule": name, "S": s, "M": M, "reason": str(e)})
                        continue
                    compile_rows.append(r)
                    print(f"  compile {name:18s} S={s} M={M:3d} {r['total_s']:.2f}s", flush=True)
        ctable = []
        for name in names:
            line = [name]
            for s in args.compile_stages:
                t = {
                    r["M"]: r["total_s"]
                    for r in compile_rows
                    if r["schedule"] == name and r["S"] == s
                }
                line += [
                    t.get(m_lo, float("nan")),
                    t.get(m_hi, float("nan")),
                    t.get(m_hi, float("nan")) / t.get(m_lo, float("nan")),
                ]
            ctable.append(line)
        header = ["schedule"]
        for s in args.compile_stages:
            header += [f"S={s} M={m_lo} s", f"S={s} M={m_hi} s", f"S={s} ratio"]
        common.print_table(header, ctable, title="Compile time (lower + compile), seconds")

    proposal_error = check_proposal() if args.proposals else None
    if proposal_error is not None:
        print(
            f"\n1f1b_fused gradients vs sequential reference: max rel. error {proposal_error:.2e}"
        )
    for s in skipped:
        print(f"skipped {s['schedule']} S={s['S']} M={s['M']}: {s['reason'][:120]}")

    meta = common.metadata()
    meta["seconds"] = round(time.time() - began, 1)
    meta["model"] = {
        "stage": "x + W2 gelu(W1 layernorm(x) + b1) + b2",
        "width": WIDTH,
        "hidden": HIDDEN,
        "rows_per_microbatch": ROWS,
        "dtype": "float32",
        "schedule_options": common.SCHEDULE_OPTIONS,
    }
    common.write_json(
        {
            "meta": meta,
            "memory": rows,
            "growth": ratios,
            "comparisons": comparisons,
            "train_step": train_rows,
            "compile_time": compile_rows,
            "proposal_1f1b_fused_grad_error": proposal_error,
            "skipped": skipped,
        },
        args.out,
    )
    if args.plot:
        plot(rows, names, S, args.plot)


def plot(rows, names, S, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, remat in zip(axes, (False, True), strict=False):
        for i, name in enumerate(names):
            pts = sorted(
                (r["M"], r["temp_bytes"] / 2**20)
                for r in rows
                if r["schedule"] == name and r["remat"] == remat
            )
            if pts:
                ax.plot(
                    *zip(*pts, strict=False), "o-", label=name, color=plt.cm.tab10(i % 10), ms=4
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("micro-batches M")
        ax.set_title(f"S={S}, remat={'on' if remat else 'off'}")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("temp MiB per device (memory_analysis)")
    axes[1].legend(fontsize=8)
    fig.suptitle("Compiled temp memory of jit(grad(pipe.loss)) vs M", fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
