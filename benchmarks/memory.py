"""What each schedule's compiled training step holds and moves, per device, from XLA's own
analyses (``compiled.memory_analysis()`` and the collectives in ``compiled.as_text()``).

Two models, S = 4 devices, M = 8 micro-batches, every registered schedule:

- **weight-dominated**: one residual MLP block per logical stage (width 512, hidden 1536,
  6 MiB of weights per stage), 4 rows per micro-batch; the step is ``jax.value_and_grad``
  of ``pipe.loss`` plus an ``optax.adam`` update (``Pipeline.train`` for schedules that
  update weights inside the pipeline), parameters and optimizer state donated, as a
  training loop compiles it. Printed: collectives over the pipe axis other than
  collective-permutes (the loss's sum only: weights never move), the bytes of the
  permutes, output and temp bytes, and temp against that of the plain training step of
  the device's own stages (the gradient accumulation of
  `jaxpipe.reference.accumulation_step` and the same Adam update, donated the same way);
  in the JSON also both compilers' peaks. (Undonated, a compiler may keep temporaries in
  the output buffers, which temp leaves out: the plain step's gradient accumulator, for
  one, which left its temp at 0.13 MiB on the GPU compiler.)
- **activation-dominated**: 8 such blocks (width 128, hidden 512, 256 rows per
  micro-batch) cut into the schedule's stages; the gradient step's temp against the plain
  gradient accumulation of all 8 blocks on one device, next to the schedule's most loaded
  device's activations (`Schedule.peak_activations`, in micro-batches through a device's
  blocks); in the JSON also both steps' peaks.

The arrays are shapes with shardings (nothing is allocated), so ``--target`` compiles the
same steps with the TPU or GPU compiler, ahead of time (`jaxpipe.target`; a target of S
devices: ``v5p:2x2x1``, ``h100x4``).

    python benchmarks/memory.py                       # both tables, JSON
    python benchmarks/memory.py --compile-time        # + compile seconds at M = 8 and 128
    python benchmarks/memory.py --target v5p:2x2x1    # the TPU compiler's figures
    python benchmarks/memory.py --weight-block 1024x3072 --weights-only  # 24 MiB per stage
"""

from __future__ import annotations

import argparse
import os
import re
import time

import common

S, M = 4, 8
TARGET = "cpu"  # set by --target: whose compiler compiles the steps


def block(p, x):
    """``p`` leaves ``[blocks, ...]``: that many residual GELU MLP blocks in order."""
    import jax

    def one(x, q):
        return x + jax.nn.gelu(x @ q["w1"]) @ q["w2"], None

    return jax.lax.scan(one, x, p)[0]


def mse(_, y, target):
    import jax.numpy as jnp

    return jnp.mean((y - target) ** 2)


def params(num_stages, blocks, width, hidden):
    import jax

    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (num_stages, blocks, width, hidden)) / width**0.5,
        "w2": jax.random.normal(k2, (num_stages, blocks, hidden, width)) / hidden**0.5,
    }


def collectives(compiled, mesh) -> list[tuple[str, int]]:
    """``(kind, result bytes on one device)`` of every collective in a compiled step."""
    from jaxpipe.analysis import hlo

    return [(c.kind, c.nbytes) for c in hlo.collectives(compiled.as_text(), mesh)]


def pipeline_for(name, stage_fn, num_microbatches=M):
    from jaxpipe import pipeline, target

    mesh = target.get(TARGET).mesh((S,), ("pipe",))
    return pipeline.Pipeline(
        stage_fn,
        mse,
        mesh=mesh,
        schedule=name,
        num_microbatches=num_microbatches,
        schedule_options=common.SCHEDULE_OPTIONS.get(name),
    )


def placed_params(pipe, blocks, width, hidden):
    """The pipeline's stage parameters as shapes placed on its mesh."""
    import jax

    from jaxpipe import target

    logical = jax.eval_shape(lambda: params(pipe.num_logical_stages, blocks, width, hidden))
    shapes = jax.eval_shape(pipe.place, logical)
    return target.abstract(shapes, pipe.layout.shardings(shapes))


def batch_of(mesh, rows, width):
    """A replicated float32 ``[rows, width]`` batch, as a shape."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return jax.ShapeDtypeStruct((rows, width), jnp.float32, sharding=NamedSharding(mesh, P()))


def training_step(pipe, placed, x):
    import jax
    import optax

    from jaxpipe import target

    opt = optax.adam(1e-3)
    if pipe.updates_weights:  # per-stage optimizer state, in the pipeline's layout
        shapes = jax.eval_shape(lambda p: pipe.init_optimizer(opt, p), placed)
        state = target.abstract(shapes, pipe.layout.shardings(shapes))
        step = jax.jit(lambda p, s, x, t: pipe.train(opt, p, s, None, x, t), donate_argnums=(0, 1))
        return step.lower(placed, state, x, x).compile()

    shardings = optax.tree_utils.tree_map_params(
        opt, lambda _, p: p.sharding, jax.eval_shape(opt.init, placed), placed,
        transform_non_params=lambda _: x.sharding,
    )  # fmt: skip
    state = target.abstract(jax.eval_shape(opt.init, placed), shardings)

    def step(p, s, x, t):
        loss, grads = jax.value_and_grad(pipe.loss)(p, None, x, t)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    return jax.jit(step, donate_argnums=(0, 1)).lower(placed, state, x, x).compile()


def plain_temp(num_stages, blocks, width, hidden, rows, train=False):
    """The plain gradient accumulation's memory analysis on one device of the target; with
    ``train``, followed by the same ``optax.adam`` update as the pipeline's step, its
    parameters and optimizer state donated."""
    import jax
    import optax

    from jaxpipe import reference, target

    mesh = target.get(TARGET).mesh((1,), ("one",))
    one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    stage_params = target.abstract(
        jax.eval_shape(lambda: params(num_stages, blocks, width, hidden)), one
    )
    batch = batch_of(mesh, rows * M, width)
    accumulate = reference.accumulation_step(block, mse, M)
    if not train:
        return accumulate.lower(stage_params, None, batch, batch).compile().memory_analysis()
    opt = optax.adam(1e-3)

    def step(p, s, x, t):
        loss, (grads, _) = accumulate(p, None, x, t)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    state = target.abstract(jax.eval_shape(opt.init, stage_params), one)
    jitted = jax.jit(step, donate_argnums=(0, 1))
    return jitted.lower(stage_params, state, batch, batch).compile().memory_analysis()


def weight_row(name, width=512, hidden=1536):
    rows = 4
    pipe = pipeline_for(name, block)
    v = pipe.schedule.stages_per_device
    placed = placed_params(pipe, 1, width, hidden)
    x = batch_of(pipe.mesh, rows * M, width)
    compiled = training_step(pipe, placed, x)
    memory = compiled.memory_analysis()
    found = collectives(compiled, pipe.mesh)
    others = [b for kind, b in found if kind != "collective-permute"]
    plain = plain_temp(v, 1, width, hidden, rows, train=True)
    return {
        "schedule": name,
        "block": [width, hidden],
        "non_permute_collectives": len(others),
        "non_permute_bytes": sum(others),
        "permute_bytes_per_tick": sum(b for kind, b in found if kind == "collective-permute"),
        "output_bytes": memory.output_size_in_bytes,
        "temp_bytes": memory.temp_size_in_bytes,
        "plain_train_temp_bytes": plain.temp_size_in_bytes,
        "temp_over_plain": memory.temp_size_in_bytes / plain.temp_size_in_bytes,
        "peak_bytes": peak_of(memory),
        "plain_train_peak_bytes": peak_of(plain),
    }


def activation_row(name, plain):
    import jax

    blocks, width, hidden, rows = 8, 128, 512, 256
    pipe = pipeline_for(name, block)
    N, v = pipe.num_logical_stages, pipe.schedule.stages_per_device
    placed = placed_params(pipe, blocks // N, width, hidden)
    x = batch_of(pipe.mesh, rows * M, width)
    if pipe.updates_weights:
        compiled = training_step(pipe, placed, x)
    else:
        compiled = jax.jit(jax.grad(pipe.loss)).lower(placed, None, x, x).compile()
    held = max(pipe.schedule.peak_activations()) / v
    memory = compiled.memory_analysis()
    temp = memory.temp_size_in_bytes
    return {
        "schedule": name,
        "held_microbatches": held,
        "temp_bytes": temp,
        "plain_temp_bytes": plain.temp_size_in_bytes,
        "temp_over_plain": temp / plain.temp_size_in_bytes,
        "peak_bytes": peak_of(memory),
        "plain_peak_bytes": peak_of(plain),
        "bound": 1.25 * max(1.0, held / S),
    }


def peak_of(memory):
    """The compiler's peak of live bytes (arguments included), where it reports one."""
    return getattr(memory, "peak_memory_in_bytes", None) or None


def compile_row(name, microbatches):
    import jax

    out = {"schedule": name}
    for count in microbatches:
        pipe = pipeline_for(name, block, count)
        placed = placed_params(pipe, 1, 64, 256)
        x = batch_of(pipe.mesh, 16 * count, 64)
        start = time.perf_counter()
        if pipe.updates_weights:  # no pipe.loss: the training step, as in weight_row
            training_step(pipe, placed, x)
        else:
            jax.jit(jax.grad(pipe.loss)).lower(placed, None, x, x).compile()
        out[f"compile_s_M{count}"] = time.perf_counter() - start
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schedules", nargs="+", default=None)
    parser.add_argument("--compile-time", action="store_true")
    parser.add_argument("--target", default="cpu", help="cpu, or a TPU/GPU of S devices")
    parser.add_argument("--out", default=None, help="JSON path (default results/memory*.json)")
    parser.add_argument(
        "--weight-block", default="512x1536", metavar="WIDTHxHIDDEN",
        help="the weight-dominated model's block (default 512x1536: 6 MiB per stage)",
    )  # fmt: skip
    parser.add_argument("--weights-only", action="store_true", help="only the weight table")
    args = parser.parse_args()
    try:
        width, hidden = (int(n) for n in args.weight_block.split("x"))
    except ValueError:
        parser.error(f"--weight-block takes WIDTHxHIDDEN (1024x3072), not {args.weight_block!r}")
    global TARGET
    TARGET = args.target
    suffix = "" if args.target == "cpu" else "_" + re.sub(r"\W", "_", args.target)
    if args.weight_block != "512x1536":
        suffix = f"_weights_{width}x{hidden}{suffix}"
    out = args.out or os.path.join(common.RESULTS, f"memory{suffix}.json")
    common.host_devices(8)
    from jaxpipe import schedules

    names = args.schedules or schedules.names()
    began = time.time()
    MiB = 2**20

    weights = [weight_row(name, width, hidden) for name in names]
    common.print_table(
        ["schedule", "other collectives (bytes)", "permute KiB/tick", "output MiB", "temp MiB",
         "plain temp MiB", "temp / plain"],
        [[r["schedule"], f"{r['non_permute_collectives']} ({r['non_permute_bytes']} B)",
          r["permute_bytes_per_tick"] / 1024,
          r["output_bytes"] / MiB, r["temp_bytes"] / MiB, r["plain_train_temp_bytes"] / MiB,
          r["temp_over_plain"]] for r in weights],
        title=f"Weight-dominated ({2 * width * hidden * 4 / MiB:g} MiB of weights per stage), "
        f"S={S}, M={M}: training step",
    )  # fmt: skip
    results = {"weights": weights}
    if args.weights_only:
        return write(results, began, args.target, out)

    plain = plain_temp(1, 8, 128, 512, 256)
    activations = [activation_row(name, plain) for name in names]
    common.print_table(
        ["schedule", "held (device-0 units)", "temp MiB", "plain temp MiB", "temp / plain",
         "bound"],
        [[r["schedule"], r["held_microbatches"], r["temp_bytes"] / MiB,
          r["plain_temp_bytes"] / MiB, r["temp_over_plain"], r["bound"]] for r in activations],
        title=f"Activation-dominated (8 blocks), S={S}, M={M}: gradient step",
    )  # fmt: skip

    compile_rows = []
    if args.compile_time:
        compile_rows = [compile_row(name, (8, 128)) for name in names]
        common.print_table(
            ["schedule", "compile s, M=8", "compile s, M=128"],
            [[r["schedule"], r["compile_s_M8"], r["compile_s_M128"]] for r in compile_rows],
            title=f"Compile time, S={S}",
        )
    results.update(activations=activations, compile=compile_rows)
    write(results, began, args.target, out)


def write(results: dict, began: float, target_name: str, out: str):
    meta = common.metadata()
    meta.update(seconds=round(time.time() - began, 1), S=S, M=M, target=target_name)
    common.write_json({"meta": meta, **results}, out)


if __name__ == "__main__":
    main()
