"""Predicted step time and bubble of every schedule for one model, per accelerator.

The model is a stack of ``--layers`` transformer-style MLP blocks (``common.block_fn``:
layer norm, ``width -> hidden -> width`` with gelu, residual) on micro-batches of
``--tokens`` rows. For each schedule of ``jaxpipe.schedules.names()`` and each S, M, the
layers are cut into the schedule's logical stages (``layers / (S * stages_per_device)``
blocks each); the costs of one such stage are

- estimated (default) for each accelerator of ``jaxpipe.costs.ACCELERATORS``, from XLA's
  flop and byte counts of the stage (`jaxpipe.costs.cost_analysis` once per stage size,
  then `jaxpipe.costs.roofline` per accelerator; activations sent over the accelerator's
  own interconnect), twice: with the bytes XLA counts (compiled here, on CPU: an upper
  bound) and with each action's arguments and results moved once (a lower bound), or
- measured on this machine with ``--measure`` (`jaxpipe.costs.measure`; CPU timings on
  CPU host devices, small default shapes), or
- with ``--compiler TOPOLOGY`` (a `jaxpipe.target` name such as ``v5p:2x2x1``; needs
  libtpu), compiled for one chip of that topology: the roofline then reads that chip's
  compiler's flop and byte counts, and a third kind, "compiler", takes each action's time
  from the compiler's own estimate (`jaxpipe.costs.compiler_seconds`), side by side.

`jaxpipe.costs.predict` turns each schedule table and those costs into the step time (the
pipeline part: every F, B, W and the sends) in lock-step, as the executor runs it, and in
the ideal timeline, and both bubbles. Prints tables and writes JSON.

    python benchmarks/predict.py                          # estimates, all accelerators
    python benchmarks/predict.py --accelerators H100 "TPU v5e" --stages 4 8 --multiples 1 4
    python benchmarks/predict.py --measure                # measured on this machine
    python benchmarks/predict.py --compiler v5p:2x2x1 --layers 32 --width 4096 \
        --hidden 14336 --tokens 16384 --stages 4 --multiples 2 4   # Llama-3-8B-wide on v5p

JSON: ``benchmarks/results/predict.json`` (``predict_measure.json`` with ``--measure``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import common

ESTIMATE_SHAPES = {"layers": 32, "width": 1024, "hidden": 4096, "tokens": 4096, "dtype": "bf16"}
MEASURE_SHAPES = {"layers": 16, "width": 256, "hidden": 1024, "tokens": 256, "dtype": "fp32"}


def stage_fn(params, x):
    """``blocks`` blocks in order (a Python loop: XLA counts each, see cost_analysis)."""
    import jax

    blocks = jax.tree_util.tree_leaves(params)[0].shape[0]
    for i in range(blocks):
        x = common.block_fn(jax.tree_util.tree_map(lambda a, i=i: a[i], params), x)
    return x


def stage_inputs(blocks: int, args, concrete: bool):
    """One logical stage's params (``[blocks, ...]``) and one micro-batch of input."""
    import jax
    import jax.numpy as jnp

    dtype = {"bf16": jnp.bfloat16, "fp32": jnp.float32}[args.dtype]

    def make():
        params, _ = common.init_blocks(jax.random.key(0), blocks, args.width, args.hidden)
        x = jax.random.normal(jax.random.key(1), (args.tokens, args.width))
        return jax.tree_util.tree_map(lambda a: a.astype(dtype), (params, x))

    return make() if concrete else jax.eval_shape(make)


def schedule_variants(args):
    """(name, options, schedule) for every schedule, S and M; skipped ones with a reason."""
    from jaxpipe import schedules

    for name in schedules.names():
        options = common.SCHEDULE_OPTIONS.get(name, {})
        for S in args.stages:
            for multiple in args.multiples:
                M = multiple * S
                try:
                    schedule = schedules.get(name, S, M, **options)
                except ValueError as error:
                    yield name, options, S, M, None, str(error).splitlines()[0]
                    continue
                if args.layers % schedule.num_logical_stages:
                    reason = f"{args.layers} layers do not split into {schedule.num_logical_stages}"
                    yield name, options, S, M, None, reason
                    continue
                yield name, options, S, M, schedule, None


def _fitted_columns(prediction: dict) -> list:
    """Step time (ms) and lock-step bubble of the table packed for the costs, if any."""
    fitted = prediction.get("fitted")
    if fitted is None:
        return ["-", "-"]
    return [fitted["step_time"] * 1e3, f"{fitted['lockstep_bubble']:.1%}"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="measure costs on this machine")
    parser.add_argument("--compiler", default=None, help="jaxpipe.target topology, e.g. v5p:2x2x1")
    parser.add_argument("--accelerators", nargs="+", default=None, help="names (estimate mode)")
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--multiples", type=int, nargs="+", default=[4], help="M = multiple * S")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None, help="rows per micro-batch")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None)
    parser.add_argument("--efficiency", type=float, default=1.0, help="fraction of roofline")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls (--measure)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")
    args = parser.parse_args()
    if args.out is None:
        name = "predict_measure.json" if args.measure else "predict.json"
        if args.compiler:
            name = f"predict_{args.compiler.replace(':', '_')}.json"
        args.out = os.path.join(common.RESULTS, name)
    for key, value in (MEASURE_SHAPES if args.measure else ESTIMATE_SHAPES).items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    import jax

    from jaxpipe import costs, schedules
    from jaxpipe.analysis.target import get as get_target

    device = None
    if args.measure:
        targets = [f"this machine ({jax.default_backend()})"]
    else:
        names = args.accelerators or list(costs.ACCELERATORS)
        if args.compiler:
            compiled_for = get_target(args.compiler)
            device = compiled_for.devices[0]
            names = args.accelerators or [compiled_for.chip.name]
        chips = [costs.get_accelerator(a) for a in names]
        targets = [chip.name for chip in chips]

    variants = list(schedule_variants(args))
    sizes = sorted({args.layers // s.num_logical_stages for *_, s, _ in variants if s})
    print(
        f"model: {args.layers} blocks, width {args.width}, hidden {args.hidden}, "
        f"{args.tokens} rows per micro-batch, {args.dtype}; "
        + ("measured here" if args.measure else "estimated from XLA's cost analysis")
        + (f" on the {args.compiler} compiler" if args.compiler else "")
    )

    # costs of one logical stage of each size, per target: {(target, blocks): {kind: Costs}}
    # kinds: "measured", or "compiled" (XLA's byte count) and "minimal" (arguments and
    # results once) for the roofline's memory side: the step lies between the two.
    kinds = ["measured"] if args.measure else ["compiled", "minimal"]
    if args.compiler:
        kinds.append("compiler")
    stage_costs: dict[tuple[str, int], dict] = {}
    counts_by_size = {}
    for blocks in sizes:
        start = time.perf_counter()
        if args.measure:
            params, x = stage_inputs(blocks, args, concrete=True)
            measured = costs.measure(stage_fn, params, x, repeats=args.repeats)
            stage_costs[targets[0], blocks] = {"measured": measured}
        else:
            params, x = stage_inputs(blocks, args, concrete=False)
            counts = costs.cost_analysis(stage_fn, params, x, device=device)
            counts_by_size[blocks] = counts
            for chip in chips:
                link = chip.interconnect_bandwidth
                comm = costs.activation_bytes(x) / link if link else 0.0
                stage_costs[chip.name, blocks] = {
                    traffic: costs.roofline(
                        counts,
                        chip,
                        precision=args.dtype,
                        efficiency=args.efficiency,
                        communication=comm,
                        traffic=traffic,
                    )
                    for traffic in ("compiled", "minimal")
                }
                if args.compiler:
                    by_compiler = costs.compiler_seconds(counts, communication=comm)
                    stage_costs[chip.name, blocks]["compiler"] = by_compiler
        print(f"  stage of {blocks} blocks: {time.perf_counter() - start:.1f} s")

    us = 1e6
    common.print_table(
        ["target", "blocks", "kind", "F us", "B us", "W us", "BW us", "send us"],
        [
            [t, b, kind, c.forward * us, c.backward_input * us, c.backward_weight * us]
            + [c.full_backward * us, c.communication * us]
            for (t, b), by_kind in stage_costs.items()
            for kind, c in by_kind.items()
        ],
        title="Costs of one logical stage (F forward, B input gradient, W weight gradient, "
        "BW both, send one activation)"
        + ("" if args.measure else "; kind: bytes counted by XLA, or the minimal traffic"),
    )

    rows, skipped = [], []
    for name, options, S, M, schedule, reason in variants:
        if schedule is None:
            skipped.append({"schedule": name, "options": options, "S": S, "M": M, "why": reason})
            continue
        blocks = args.layers // schedule.num_logical_stages
        for target in targets:
            row = {
                "target": target,
                "schedule": name,
                "options": options,
                "S": S,
                "M": M,
                "stages_per_device": schedule.stages_per_device,
                "blocks_per_stage": blocks,
            }
            for kind, c in stage_costs[target, blocks].items():
                row[kind] = {
                    **costs.predict(schedule, c)._asdict(),
                    "costs_s": dataclasses.asdict(c),
                }
                if not schedule.has_updates:  # the table packed for these costs
                    row[kind]["fitted"] = costs.predict(schedules.fit(schedule, c), c)._asdict()
            rows.append(row)
    first = kinds[0]
    for target in targets:
        mine = sorted((r for r in rows if r["target"] == target), key=lambda r: (r["S"], r["M"]))
        header = ["schedule", "S", "M", "v", "step ms", "ideal ms", "bubble lock-step", "ideal"]
        if not args.measure:
            header[4:6] = ["step ms", "minimal", "ideal ms"]
        if args.compiler:
            header[6:6] = ["compiler ms", "compiler / step", "compiler bubble"]
            header += ["compiler, table packed: ms", "bubble"]
        common.print_table(
            header,
            [
                [r["schedule"], r["S"], r["M"], r["stages_per_device"], r[first]["step_time"] * 1e3]
                + ([] if args.measure else [r["minimal"]["step_time"] * 1e3])
                + (
                    [
                        r["compiler"]["step_time"] * 1e3,
                        r["compiler"]["step_time"] / r[first]["step_time"],
                        f"{r['compiler']['lockstep_bubble']:.1%}",
                    ]
                    if args.compiler
                    else []
                )
                + [r[first]["ideal_step_time"] * 1e3]
                + [f"{r[first]['lockstep_bubble']:.1%}", f"{r[first]['ideal_bubble']:.1%}"]
                + (_fitted_columns(r["compiler"]) if args.compiler else [])
                for r in mine
            ],
            title=f"{target}: predicted pipeline time per step (lock-step is how jaxpipe runs)"
            + ("" if args.measure else "; 'minimal': with the least memory traffic")
            + ("; 'compiler': each action as the compiler estimates it" if args.compiler else ""),
        )
    for s in skipped:
        print(f"skipped {s['schedule']} S={s['S']} M={s['M']}: {s['why']}")

    config = {k: getattr(args, k) for k in ("layers", "width", "hidden", "tokens", "dtype")}
    result = {
        "what": "predicted pipeline step time and bubble per schedule",
        "mode": "measure" if args.measure else "estimate",
        "compiled_for": args.compiler,
        "config": config | {"efficiency": args.efficiency, "repeats": args.repeats},
        "metadata": common.metadata(),
        "accelerators": (
            {}
            if args.measure
            else {
                chip.name: {
                    "peak_flops": chip.peak(args.dtype),
                    "memory_bandwidth": chip.memory_bandwidth,
                    "interconnect_bandwidth": chip.interconnect_bandwidth,
                    "source": chip.source,
                    "interconnect_source": chip.interconnect_source,
                }
                for chip in chips
            }
        ),
        "cost_analysis": {str(b): counts for b, counts in counts_by_size.items()},
        "stage_costs_s": [
            {"target": t, "blocks": b, "kind": kind, **dataclasses.asdict(c)}
            for (t, b), by_kind in stage_costs.items()
            for kind, c in by_kind.items()
        ],
        "rows": rows,
        "skipped": skipped,
    }
    common.write_json(result, args.out)


if __name__ == "__main__":
    common.host_devices(8)
    main()
