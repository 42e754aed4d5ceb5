"""Wall-clock speedup of a pipelined training step over the same model on one device.

CPU host devices stand in for accelerators: ``--xla_force_host_platform_device_count=S``
with single-threaded XLA CPU devices (``--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1``, unless ``--multi-thread``), so each device can use at
most one core and S devices can overlap only if the machine has S free cores.

Measured, for S stages (one block of the transformer-style stage in benchmarks/common.py per
stage) and each M:

- ``one device``: ``jit(grad(loss))`` of the same S blocks on one device, gradient
  accumulation over micro-batches (``lax.scan``, same micro-batch shapes as the pipeline);
- ``jaxpipe``: ``jit(grad(pipe.loss))`` on S devices, per schedule;
- speedup = one device / jaxpipe, against the ideal ``S*M/(M+S-1)`` (GPipe/1F1B with
  F:BW = 1:2 run ideally);
- where the time goes: the same pipeline on a width-8 model (compute ~ 0), whose time per
  tick is the executor's floor per lock-step tick (switches, buffer updates, one
  ``ppermute`` rendezvous per channel per tick); and a 1-stage jaxpipe (mesh of one device,
  all blocks in the stage) against the plain loop: the executor's cost without any
  communication.

Times are medians of ``--repeats`` calls after one warm-up call. On a machine with fewer
free cores than S this cannot show a speedup; the script says so and prints the ratio.

    python benchmarks/concurrency.py                     # S=4, M in {8, 32}, width 128
    python benchmarks/concurrency.py --width 512 --rows 128 --repeats 10   # on 16 cores
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import common

SINGLE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def timed(fn, args, repeats):
    import jax

    jax.block_until_ready(fn(*args))  # warm-up (and compile)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def accumulate_loss(stage_params, loss_params, inputs, targets, num_microbatches):
    """The same model on one device: scan over micro-batches, stages applied in order."""
    import jax
    import jax.numpy as jnp

    from jaxpipe.pipeline import split_microbatches

    xs = split_microbatches(inputs, num_microbatches)
    ts = split_microbatches(targets, num_microbatches)

    def one(total, xt):
        x, t = xt
        h = jax.lax.scan(lambda h, p: (common.block_fn(p, h), None), x, stage_params)[0]
        return total + common.head_loss_fn(loss_params, h, t), None

    total, _ = jax.lax.scan(one, jnp.zeros((), jnp.float32), (xs, ts))
    return total / num_microbatches


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--rows", type=int, default=32, help="rows per micro-batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--multi-thread", action="store_true", help="leave XLA's multi-threaded CPU devices on"
    )
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "concurrency.json"))
    args = parser.parse_args()

    S = args.stages
    common.host_devices(max(8, S), "" if args.multi_thread else SINGLE_THREAD)
    import functools

    import jax

    from jaxpipe import pipeline

    began = time.time()
    cores = len(os.sched_getaffinity(0))
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    one_device = jax.devices()[:1]
    rows = []
    for M in args.microbatches:
        stage, lossp = common.init_blocks(jax.random.key(M), S, args.width)
        x, t = common.block_data(jax.random.key(M + 1), args.rows * M, args.width)
        on_one = jax.device_put((stage, lossp, x, t), one_device[0])
        plain = jax.jit(
            jax.grad(functools.partial(accumulate_loss, num_microbatches=M), argnums=(0, 1))
        )
        t_one, raw_one = timed(plain, on_one, args.repeats)

        # jaxpipe with one stage on one device: the executor without communication
        mesh1 = jax.make_mesh(
            (1,), ("pipe",), axis_types=(jax.sharding.AxisType.Auto,), devices=one_device
        )

        def all_blocks(p, h):
            return jax.lax.scan(lambda h, q: (common.block_fn(q, h), None), h, p)[0]

        pipe1 = pipeline.Pipeline(
            all_blocks, common.head_loss_fn, mesh=mesh1, schedule="1f1b", num_microbatches=M
        )
        stage1 = jax.tree_util.tree_map(lambda p: p[None], stage)
        t_pipe1, _ = timed(
            jax.jit(jax.grad(pipe1.loss, argnums=(0, 1))),
            jax.device_put((stage1, lossp, x, t), one_device[0]),
            args.repeats,
        )

        mesh = common.pipe_mesh(S)
        tiny_stage, tiny_loss = common.init_blocks(jax.random.key(7), S, 8)
        tx, tt = common.block_data(jax.random.key(8), args.rows * M, 8)
        for name in args.schedules:
            pipe = pipeline.Pipeline(
                common.block_fn, common.head_loss_fn, mesh=mesh, schedule=name, num_microbatches=M
            )
            step = jax.jit(jax.grad(pipe.loss, argnums=(0, 1)))
            t_pipe, raw_pipe = timed(step, (stage, lossp, x, t), args.repeats)
            t_tiny, _ = timed(
                jax.jit(jax.grad(pipe.loss, argnums=(0, 1))),
                (tiny_stage, tiny_loss, tx, tt),
                args.repeats,
            )
            ticks = pipe.schedule.num_ticks
            ideal = S * M / (M + S - 1)
            rows.append(
                {
                    "schedule": name,
                    "S": S,
                    "M": M,
                    "ticks": ticks,
                    "one_device_s": t_one,
                    "jaxpipe_s": t_pipe,
                    "speedup": t_one / t_pipe,
                    "ideal_speedup": ideal,
                    "share_of_ideal": t_one / t_pipe / ideal,
                    "jaxpipe_1stage_s": t_pipe1,
                    "executor_overhead_1stage": t_pipe1 / t_one,
                    "tiny_model_s": t_tiny,
                    "tick_floor_us": 1e6 * t_tiny / ticks,
                    "tick_floor_share": t_tiny / t_pipe,
                    "raw_one_device_s": raw_one,
                    "raw_jaxpipe_s": raw_pipe,
                }
            )
            r = rows[-1]
            print(
                f"  {name:6s} M={M:3d} one={t_one * 1e3:8.1f} ms  pipe={t_pipe * 1e3:8.1f} ms "
                f"speedup={r['speedup']:.2f} (ideal {ideal:.2f})  tick floor "
                f"{r['tick_floor_us']:.0f} us",
                flush=True,
            )

    common.print_table(
        [
            "schedule",
            "S",
            "M",
            "one dev ms",
            "jaxpipe ms",
            "speedup",
            "ideal",
            "of ideal",
            "1-stage/plain",
            "ticks",
            "floor us/tick",
            "floor share",
        ],
        [
            [
                r["schedule"],
                r["S"],
                r["M"],
                1e3 * r["one_device_s"],
                1e3 * r["jaxpipe_s"],
                r["speedup"],
                r["ideal_speedup"],
                r["share_of_ideal"],
                r["executor_overhead_1stage"],
                r["ticks"],
                r["tick_floor_us"],
                r["tick_floor_share"],
            ]
            for r in rows
        ],
        title=f"Pipelined step vs one device, width {args.width}, {args.rows} rows/micro-batch",
    )
    note = None
    if cores < S:
        note = (
            f"this machine gives the process {cores} cores for {S} single-threaded "
            "devices: the devices cannot run concurrently, so no speedup can show here; "
            "the ratios are printed anyway"
        )
        print(f"\nNOTE: {note}")
    meta = common.metadata()
    meta.update(
        seconds=round(time.time() - began, 1),
        cores_available=cores,
        load_average=load,
        width=args.width,
        rows_per_microbatch=args.rows,
        repeats=args.repeats,
        single_thread=not args.multi_thread,
    )
    common.write_json({"meta": meta, "rows": rows, "note": note}, args.out)


if __name__ == "__main__":
    main()
