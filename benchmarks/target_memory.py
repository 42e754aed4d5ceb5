"""Memory of jaxpipe schedules on the TPU compiler, against the plain step.

Measurements only, compiled ahead of time with `jaxpipe.target` (needs libtpu: ``pip install
"jax[tpu]==<jax version>"``; ``--target cpu:4`` runs on the CPU compiler instead).

Model (a Llama-3-8B-wide MLP stack): ``blocks`` blocks ``x + silu(x @ up) @ down``,
width 4096, hidden 14336, bf16 weights and activations, S stages of ``blocks / S`` blocks
(a Python loop inside the stage, or with ``--form scan`` a ``lax.scan`` over the stage's
stacked blocks), micro-batches of ``rows`` x ``seq`` tokens, loss
``mean((y - t)^2)`` in float32 on the last stage; the step is ``jax.value_and_grad`` of
``pipe.loss`` with the pipeline's defaults.

The plain step: a ``lax.scan`` over micro-batches of
``jax.value_and_grad`` of the blocks written as a ``lax.scan`` over their stacked weights,
float32 gradient accumulator in the carry, on one device: of all the blocks ("plain all")
and of one device's own ``blocks / S`` blocks ("plain own"). k: the schedule's peak
in-flight activations per device, in micro-batches through all of a device's blocks, over S
(1 for 1f1b and zbv, 1.125 for dualpipev, M / S for gpipe).

Per row: ``temp_size_in_bytes`` and ``peak_memory_in_bytes`` per device, their ratio to the
plain steps scaled by k.

    python benchmarks/target_memory.py                                 # v5p:2x2x1, M = 8
    python benchmarks/target_memory.py --schedules 1f1b --microbatches 8 16 32
    python benchmarks/target_memory.py --target cpu:4 --width 256 --hidden 512 --seq 64
    python benchmarks/target_memory.py --remat --maxtext --microbatches 8 16 32   # vs MaxText
"""

from __future__ import annotations

import argparse
import os
import time

import common

GiB = 2**30


def parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="v5p:2x2x1")
    parser.add_argument(
        "--schedules", nargs="+",
        default=["gpipe", "1f1b", "zb_h1", "zbv", "interleaved_1f1b", "dualpipev"],
    )  # fmt: skip
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=14336)
    parser.add_argument("--rows", type=int, default=8, help="rows per micro-batch")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per row")
    parser.add_argument(
        "--form", choices=["loop", "scan"], default="loop",
        help="the stage runs its blocks in a Python loop or in a lax.scan over their stacks",
    )  # fmt: skip
    parser.add_argument(
        "--remat", action="store_true", help="jaxpipe's remat=True: keep each stage's input"
    )
    parser.add_argument(
        "--maxtext", action="store_true",
        help="also the MaxText-style GPipe (benchmarks/maxtext_baseline.py, r = 1, the same "
        "remat: each iteration's stage inputs kept), compared row by row",
    )  # fmt: skip
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "target_memory.json"))
    return parser.parse_args()


def main():
    args = parse()
    if args.target.startswith("cpu"):
        common.host_devices(8)
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpipe import pipeline, schedules, target

    tgt = target.get(args.target)
    S, W, H = args.stages, args.width, args.hidden
    dtype = jnp.bfloat16

    def block(p, x):
        return x + jax.nn.silu(x @ p["up"]) @ p["down"]

    def loss_fn(_, y, t):
        return jnp.mean((y.astype(jnp.float32) - t.astype(jnp.float32)) ** 2)

    def weights(n, sharding=None):
        return {
            "up": jax.ShapeDtypeStruct((n, W, H), dtype, sharding=sharding),
            "down": jax.ShapeDtypeStruct((n, H, W), dtype, sharding=sharding),
        }

    def plain(num_blocks, M):
        """The plain step on one device: scan over micro-batches, scan over blocks."""
        mesh = tgt.mesh((1,), ("one",))
        one = NamedSharding(mesh, P())
        params = weights(num_blocks, one)
        x = jax.ShapeDtypeStruct((M, args.rows, args.seq, W), dtype, sharding=one)

        def micro_loss(p, x, t):
            y = lax.scan(lambda x, w: (block(w, x), None), x, p)[0]
            return loss_fn(None, y, t)

        def step(p, xs, ts):
            def one_micro(acc, batch):
                value, grads = jax.value_and_grad(micro_loss)(p, *batch)
                acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
                return acc, value

            zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), p)
            grads, values = lax.scan(one_micro, zeros, (xs, ts))
            return jnp.mean(values), grads

        return tgt.compile(step, params, x, x)

    def piped(name, M):
        mesh = tgt.mesh((S,), ("pipe",))
        schedule = schedules.get(name, S, M)
        per_stage = args.blocks // schedule.num_logical_stages

        def stage_fn(p, x):
            if args.form == "scan":
                return lax.scan(lambda x, w: (block(w, x), None), x, p)[0]
            for i in range(per_stage):
                x = block(jax.tree.map(lambda a, i=i: a[i], p), x)
            return x

        pipe = pipeline.Pipeline(stage_fn, loss_fn, mesh=mesh, schedule=schedule, remat=args.remat)
        logical = weights(schedule.num_logical_stages)
        logical = {
            k: jax.ShapeDtypeStruct((v.shape[0], per_stage, *v.shape[1:]), v.dtype)
            for k, v in logical.items()
        }
        shapes = jax.eval_shape(pipe.place, logical)
        params = target.abstract(shapes, pipe.layout.shardings(shapes))
        x = jax.ShapeDtypeStruct(
            (M * args.rows, args.seq, W), dtype, sharding=NamedSharding(mesh, P())
        )

        def step(p, x, t):
            return jax.value_and_grad(lambda p: pipe.loss(p, None, x, t))(p)

        report = tgt.compile(step, params, x, x)
        return report, schedule

    def maxtext(M):
        """The MaxText-style GPipe (r = 1) of the same stages: ``[S, 1, blocks/S, ...]``
        weights over pipe, vmap over stages, scan over iterations, autodiff backward."""
        import maxtext_baseline

        mesh = tgt.mesh((S,), ("pipe",))
        per_stage = args.blocks // S
        params = {
            k: jax.ShapeDtypeStruct(
                (S, 1, per_stage, *v.shape[1:]), v.dtype, sharding=NamedSharding(mesh, P("pipe"))
            )
            for k, v in weights(1).items()
        }

        def stage_fn(p, x):
            for i in range(per_stage):
                x = block(jax.tree.map(lambda a, i=i: a[i], p), x)
            return x

        def loss(p, x, t):
            return maxtext_baseline.maxtext_loss(
                p, None, x, t, mesh=mesh, num_stages=S, num_microbatches=M, repeats=1,
                remat=args.remat, stage_fn=stage_fn, loss_fn=loss_fn,
            )  # fmt: skip

        x = jax.ShapeDtypeStruct(
            (M * args.rows, args.seq, W), dtype, sharding=NamedSharding(mesh, P())
        )
        return tgt.compile(jax.value_and_grad(loss), params, x, x)

    rows, results, versus = [], [], []
    for M in args.microbatches:
        start = time.perf_counter()
        if args.maxtext:
            base = maxtext(M)
            results.append({
                "schedule": "maxtext_gpipe", "M": M, "temp_bytes": base.temp_bytes,
                "peak_bytes": base.peak_bytes or 0, "argument_bytes": base.argument_bytes,
                "compile_seconds": base.compile_seconds,
            })  # fmt: skip
            print(f"maxtext M={M}: temp {base.temp_bytes / GiB:.2f} GiB", flush=True)
        base_all = plain(args.blocks, M)
        base_own = plain(args.blocks // S, M)
        print(f"M={M}: plain steps compiled in {time.perf_counter() - start:.0f} s", flush=True)
        for name in args.schedules:
            try:
                report, schedule = piped(name, M)
            except target.DoesNotFit as error:
                print(f"{name} M={M}: {str(error).splitlines()[0]}", flush=True)
                results.append({"schedule": name, "M": M, "does_not_fit": str(error)})
                continue
            in_flight = max(schedule.peak_activations()) / (S * schedule.stages_per_device)
            peak = report.peak_bytes or 0
            row = {
                "schedule": name, "M": M, "temp_bytes": report.temp_bytes, "peak_bytes": peak,
                "argument_bytes": report.argument_bytes,
                "plain_all_temp_bytes": base_all.temp_bytes,
                "plain_all_peak_bytes": base_all.peak_bytes or 0,
                "plain_own_temp_bytes": base_own.temp_bytes,
                "plain_own_peak_bytes": base_own.peak_bytes or 0,
                "peak_activations_over_S": in_flight,
                "optimal_seconds": report.optimal_seconds,
                "compile_seconds": report.compile_seconds,
            }  # fmt: skip
            results.append(row)
            rows.append([
                name, M, report.temp_bytes / GiB, peak / GiB, base_all.temp_bytes / GiB,
                base_own.temp_bytes / GiB, report.temp_bytes / (in_flight * base_all.temp_bytes),
                peak / (in_flight * (base_all.peak_bytes or 1)), in_flight,
                report.compile_seconds,
            ])  # fmt: skip
            print(f"{name} M={M}: temp {report.temp_bytes / GiB:.2f} GiB", flush=True)
            if args.maxtext:
                versus.append([
                    name, M, report.temp_bytes / GiB, base.temp_bytes / GiB,
                    report.temp_bytes / base.temp_bytes, peak / GiB,
                    (base.peak_bytes or 0) / GiB, peak / (base.peak_bytes or 1),
                ])  # fmt: skip
    common.print_table(
        ["schedule", "M", "temp GiB", "peak GiB", "plain all temp", "plain own temp",
         "temp / (k x plain all)", "peak / (k x plain all)", "k", "compile s"],
        rows,
        title=f"{args.target}: {args.blocks} blocks ({args.form}) width {W} hidden {H} bf16, "
        f"S={S}, micro-batch {args.rows}x{args.seq}; k = peak_activations / S",
    )  # fmt: skip
    if versus:
        common.print_table(
            ["schedule", "M", "temp GiB", "MaxText temp", "temp / MaxText", "peak GiB",
             "MaxText peak", "peak / MaxText"],
            versus,
            title=f"against the MaxText-style GPipe (r = 1), remat {args.remat}",
        )  # fmt: skip
    common.write_json(
        {"config": vars(args), "meta": common.metadata(), "results": results}, args.out
    )


if __name__ == "__main__":
    main()
