"""What the executor itself costs: a pipelined step on one device against the plain step.

With one device (S = 1) there is nothing to communicate and no bubble, so any difference
between jaxpipe and a plain jitted gradient accumulation of the same blocks over the same
micro-batches (``lax.scan`` over micro-batches of ``jax.value_and_grad``, gradients added
into the carry) is what the executor adds. (A one-device table runs as that same gradient
accumulation, without the tick loop.) This script times both for several stage sizes side by
side in one run (interleaved repeats, medians) and prints their ratios; and the fixed cost per
tick, from the same pipeline on a width-8 model (compute ~ 0) divided by its table's number of
ticks, with four devices (the tick loop, every tick with its ``ppermute`` rendezvous) and with
one (no tick loop: the fixed cost of the step, spread over the same count for comparison).

    python benchmarks/overhead.py                 # stages 2x256 4x256 4x1024, 64 rows, M = 8
    python benchmarks/overhead.py --stages 2x256 8x512 --rows 128 --microbatches 8 32

Times are wall-clock on whatever machine runs it; the ratios are what to compare.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import common


def plain_step(stage_fn, loss_fn, num_microbatches):
    """``(params, loss_params, inputs, targets) -> (loss, grads)``: the plain step."""
    import jax
    import jax.numpy as jnp

    M = num_microbatches

    def step(params, loss_params, inputs, targets):
        def split(a):
            return a.reshape(M, a.shape[0] // M, *a.shape[1:])

        def one(total, batch):
            def loss(p, lp):
                return loss_fn(lp, stage_fn(p, batch[0]), batch[1])

            value, grads = jax.value_and_grad(loss, argnums=(0, 1))(params, loss_params)
            return jax.tree_util.tree_map(jnp.add, total, grads), value

        zeros = jax.tree_util.tree_map(jnp.zeros_like, (params, loss_params))
        grads, values = jax.lax.scan(one, zeros, (split(inputs), split(targets)))
        return jnp.mean(values), jax.tree_util.tree_map(lambda g: g / M, grads)

    return jax.jit(step)


def interleaved_medians(functions: dict, repeats: int) -> dict:
    """Median seconds per call of each ``name: (fn, args)``, calls interleaved."""
    import jax

    for fn, args in functions.values():
        jax.block_until_ready(fn(*args))  # compile and warm up
    times = {name: [] for name in functions}
    for _ in range(repeats):
        for name, (fn, args) in functions.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--stages",
        nargs="+",
        default=["2x256", "4x256", "4x1024"],
        help="stage sizes to compare, each BLOCKSxWIDTH (blocks in the one stage, their width)",
    )
    parser.add_argument("--rows", type=int, default=64, help="rows per micro-batch")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "overhead.json"))
    args = parser.parse_args()
    common.host_devices(4)
    import jax

    from jaxpipe import pipeline

    def stage_fn(p, x):  # all blocks of the model in one stage: a scan over the block axis
        return jax.lax.scan(lambda h, q: (common.block_fn(q, h), None), x, p)[0]

    def pipe_on(num_devices, M):
        mesh = jax.make_mesh(
            (num_devices,),
            ("pipe",),
            axis_types=(jax.sharding.AxisType.Auto,),
            devices=jax.devices()[:num_devices],
        )
        return pipeline.Pipeline(
            stage_fn if num_devices == 1 else common.block_fn,
            common.head_loss_fn,
            mesh=mesh,
            schedule="1f1b",
            num_microbatches=M,
        )

    began = time.time()
    rows = []
    sizes = [tuple(int(n) for n in spec.lower().split("x")) for spec in args.stages]
    for M in args.microbatches:
        pipe = pipe_on(1, M)
        functions = {}
        for num_blocks, width in sizes:
            blocks, head = common.init_blocks(jax.random.key(M), num_blocks, width)
            x, t = common.block_data(jax.random.key(M + 1), args.rows * M, width)
            placed = pipe.place(jax.tree_util.tree_map(lambda a: a[None], blocks))
            functions[("plain", num_blocks, width)] = (
                plain_step(stage_fn, common.head_loss_fn, M),
                (blocks, head, x, t),
            )
            functions[("jaxpipe", num_blocks, width)] = (
                jax.jit(jax.value_and_grad(pipe.loss, argnums=(0, 1))),
                (placed, head, x, t),
            )
        tiny_blocks, tiny_head = common.init_blocks(jax.random.key(7), 4, 8)
        tx, tt = common.block_data(jax.random.key(8), 8 * M, 8)
        tiny1, tiny4 = pipe_on(1, M), pipe_on(4, M)
        functions.update(
            {
                "tiny1": (
                    jax.jit(jax.value_and_grad(tiny1.loss, argnums=(0, 1))),
                    (
                        tiny1.place(jax.tree_util.tree_map(lambda a: a[None], tiny_blocks)),
                        tiny_head,
                        tx,
                        tt,
                    ),
                ),
                "tiny4": (
                    jax.jit(jax.value_and_grad(tiny4.loss, argnums=(0, 1))),
                    (tiny4.place(tiny_blocks), tiny_head, tx, tt),
                ),
            }
        )
        medians = interleaved_medians(functions, args.repeats)
        for num_blocks, width in sizes:
            plain_s = medians[("plain", num_blocks, width)]
            jaxpipe_s = medians[("jaxpipe", num_blocks, width)]
            row = {
                "M": M,
                "blocks": num_blocks,
                "width": width,
                "schedule": pipe.schedule.name,
                "ticks": pipe.schedule.num_ticks,
                "plain_ms": 1e3 * plain_s,
                "jaxpipe_ms": 1e3 * jaxpipe_s,
                "ratio": jaxpipe_s / plain_s,
                "tick_us_1_device": 1e6 * medians["tiny1"] / tiny1.schedule.num_ticks,
                "tick_us_4_devices": 1e6 * medians["tiny4"] / tiny4.schedule.num_ticks,
            }
            rows.append(row)
            print(
                f"M={M:3d} {num_blocks}x{width}: plain {row['plain_ms']:8.2f} ms  "
                f"jaxpipe {row['jaxpipe_ms']:8.2f} ms  ratio {row['ratio']:.3f}  "
                f"tick {row['tick_us_1_device']:.0f} us (1 device), "
                f"{row['tick_us_4_devices']:.0f} us (4 devices)",
                flush=True,
            )
    common.print_table(
        [
            "M",
            "blocks",
            "width",
            "ticks",
            "plain ms",
            "jaxpipe ms",
            "jaxpipe / plain",
            "us/tick 1 dev",
            "us/tick 4 dev",
        ],
        [
            [
                r["M"],
                r["blocks"],
                r["width"],
                r["ticks"],
                r["plain_ms"],
                r["jaxpipe_ms"],
                r["ratio"],
                r["tick_us_1_device"],
                r["tick_us_4_devices"],
            ]
            for r in rows
        ],
        title=(
            f"One device: jaxpipe ({rows[0]['schedule']}) against the plain step, "
            f"stages of BLOCKS blocks of width WIDTH, {args.rows} rows per micro-batch"
        ),
    )
    meta = common.metadata()
    meta.update(
        seconds=round(time.time() - began, 1),
        stages=args.stages,
        rows_per_microbatch=args.rows,
        repeats=args.repeats,
    )
    common.write_json({"meta": meta, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
