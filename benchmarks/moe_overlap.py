"""Predicted step time of a mixture-of-experts stage on TPU v5p, with and without the tables
that run one micro-batch's all-to-alls behind another's computation.

The stage is one MoE layer of Mixtral-8x7B's shape (width 4096, 8 experts of hidden width
14336, top-2, capacity factor 1.25), bf16, on ``--tokens`` tokens per micro-batch of one
device. The experts are split over an expert axis of ``--experts-axis`` chips; each device
routes its own tokens and runs its own experts on every device's tokens for them.

- Computation of F, B, W and BW: the TPU v5p compiler's own estimate of each action
  (`jaxpipe.costs.cost_analysis` on one v5p chip, `jaxpipe.costs.compiler_seconds`) of the
  layer with every expert local on the same tokens: under balanced routing, the matrix
  products one device runs under expert parallelism.
- All-to-alls: the layer exchanges its ``[E, groups, capacity, width]`` buffers twice in
  a forward (tokens out, results back) and their cotangents twice in a backward (a B or
  BW; a W none), as with ``remat_policy=jaxpipe.moe.dots_and_exchanges_saveable``. Each
  moves ``(e - 1) / e`` of the buffer over one ICI link at jaxpipe's v5p figure
  (`jaxpipe.target`), a lower bound on its time.
- Step time: `jaxpipe.schedules.simulate` in lock-step, S = ``--stages`` devices on the
  pipe axis, M = ``--microbatches``; a tick that pairs a forward with a backward takes the
  larger of their computations and their all-to-alls, and no less than either action alone
  (`jaxpipe.schedules.Costs.of_cell`).

    python benchmarks/moe_overlap.py            # needs libtpu

JSON: ``benchmarks/results/moe_overlap.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import common
import jax
import jax.numpy as jnp
from flax import nnx

import jaxpipe
from jaxpipe import costs as costs_lib
from jaxpipe import moe, schedules

TABLES = [  # (label, schedule, options)
    ("1f1b", "1f1b", {}),
    ("1f1b, overlap", "1f1b", {"overlap": True}),
    ("zbv", "zbv", {}),
    ("dualpipev", "dualpipev", {}),
    ("dualpipev, overlap", "dualpipev", {"overlap": True}),
]
MODELS = {  # name -> (width, expert hidden width, experts, top_k)
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
}
CAPACITY_FACTOR, GROUP = 1.25, 2048
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def layer_costs(name: str, tokens: int, expert_axis: int):
    """``(computation, all-to-all seconds, buffer bytes)`` of one MoE layer of ``name``'s
    shape on ``tokens`` tokens of one v5p chip."""
    width, hidden, experts, top_k = MODELS[name]
    layer = nnx.eval_shape(
        lambda: moe.MoE(width, hidden, experts, rngs=nnx.Rngs(0), top_k=top_k,
                        capacity_factor=CAPACITY_FACTOR, param_dtype=jnp.bfloat16)
    )  # fmt: skip
    graph, params = nnx.split(layer, nnx.Param)

    def stage(p, x):
        return x + nnx.merge(graph, p)(x)[0]

    x = jax.ShapeDtypeStruct((tokens // GROUP, GROUP, width), jnp.bfloat16)
    tgt = jaxpipe.target.get("v5p:2x2x1")
    computation = costs_lib.compiler_seconds(
        costs_lib.cost_analysis(stage, params, x, device=tgt.devices[0])
    )
    buffer = experts * (tokens // GROUP) * layer.capacity(GROUP) * width * 2
    one = buffer * (expert_axis - 1) / expert_axis / tgt.links.within.bandwidth
    return computation, one, buffer


def scaled(costs, factor: float):
    """``costs`` with every time multiplied by ``factor`` (a stage of that many layers)."""
    fields = {f.name: getattr(costs, f.name) for f in dataclasses.fields(costs)}
    return dataclasses.replace(costs, **{k: v * factor for k, v in fields.items() if v is not None})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts-axis", type=int, default=4)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8, help="MoE layers the pipeline holds")
    parser.add_argument("--out", default=os.path.join(RESULTS, "moe_overlap.json"))
    args = parser.parse_args()
    S, M, e = args.stages, args.microbatches, args.experts_axis
    results = {}
    for model in MODELS:
        computation, one, buffer = layer_costs(model, args.tokens, e)
        exchanged = dataclasses.replace(
            computation, all_to_all_forward=2 * one, all_to_all_backward=2 * one
        )
        per = {
            k: getattr(computation, k) * 1e3
            for k in ("forward", "backward_input", "backward_weight")
        }
        rows, data = [], []
        for label, name, options in TABLES:
            table = schedules.get(name, S, M, **options)
            layers = args.layers / table.num_logical_stages  # per stage
            alone = schedules.simulate(table, scaled(computation, layers)).makespan
            step = schedules.simulate(table, scaled(exchanged, layers)).makespan
            rows.append([label, f"{alone * 1e3:.0f}", f"{step * 1e3:.0f}"])
            data.append({"table": label, "computation_ms": alone * 1e3, "step_ms": step * 1e3})
        print(
            f"{model}: one layer on a v5p chip, ms: F {per['forward']:.2f}, "
            f"B {per['backward_input']:.2f}, W {per['backward_weight']:.2f}; one all-to-all "
            f"{one * 1e3:.2f} ({buffer / 2**20:.0f} MiB buffer)"
        )
        common.print_table(
            ["table", "step, all-to-alls free, ms", "step, ms"],
            rows,
            title=f"{model}: {args.layers} layers, S = {S}, M = {M}, expert axis {e}, lock-step",
        )
        results[model] = {
            "shape": dict(zip(("width", "hidden", "experts", "top_k"), MODELS[model], strict=True)),
            "layer_ms": per,
            "all_to_all_ms": one * 1e3,
            "buffer_bytes": buffer,
            "tables": data,
        }
    data = {"metadata": common.metadata(), "args": vars(args), "models": results}
    common.write_json(data, args.out)


if __name__ == "__main__":
    main()
