"""Pipeline x data x FSDP x tensor: per mesh, what one device holds and what the compiled
training step moves, from XLA's own analyses.

The model is a Llama-style decoder (tests/llama.py: RMSNorm, rotary positions, grouped-query
causal attention, SwiGLU), by default 8 blocks, width 256, hidden 1024, sequence 64 (flags
change each), its blocks split the way Megatron-LM splits them over ``tensor`` and their
other weight dimension over ``fsdp``; the step is ``jax.value_and_grad`` of the pipeline's
loss and an ``optax.adam`` update, ``1f1b``, M = 8 (``--microbatches``), compiled as a
training loop compiles it: parameters and Adam state donated, so the updated ones reuse
their buffers and temp is everything the step needs beyond its arguments. (Undonated,
the compilers place temporaries in the output buffers, which temp then leaves out: the
more a mesh stores per device, the more of its transient memory goes unreported.)
Printed per mesh: the per-device bytes XLA reports (arguments: parameters, Adam state and
batch; outputs, all but the loss reusing donated arguments; temp), the collectives of the
compiled step by kind and mesh axes (count and bytes; a collective inside the tick loop
counts once), and the stage-application ratio: stage applications each device runs per
step (read back from the compiled program's trace) over what its row of the table asks for
(CPU only: TPU and GPU programs are compiled ahead of time with ``--target``,
`jaxpipe.target`, not run; their compilers also report a peak).

    python benchmarks/meshes.py
    python benchmarks/meshes.py --width 64 --hidden 128 --blocks 8 --meshes "pipe 8"
    python benchmarks/meshes.py --target v5p:2x2x2 --out benchmarks/results/meshes_v5p.json
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import time

import common

sys.path.insert(0, os.path.join(common.ROOT, "tests"))

MESHES = [  # (name, S, other axes, FSDP gather mode)
    ("pipe 8", 8, (), "per_use"),
    ("pipe 4 x data 2", 4, (("data", 2),), "per_use"),
    ("pipe 4 x fsdp 2, per use", 4, (("fsdp", 2),), "per_use"),
    ("pipe 4 x fsdp 2, once", 4, (("fsdp", 2),), "once"),
    ("pipe 2 x data 2 x tensor 2", 2, (("data", 2), ("tensor", 2)), "per_use"),
    ("pipe 2 x fsdp 2 x tensor 2, per use", 2, (("fsdp", 2), ("tensor", 2)), "per_use"),
    ("pipe 2 x fsdp 2 x tensor 2, once", 2, (("fsdp", 2), ("tensor", 2)), "once"),
]


def measure(name, S, extra, gather, config, blocks, M, target_name):
    import jax
    import llama
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpipe import pipeline, target

    tgt = target.get(target_name)
    mesh = tgt.mesh((S, *(n for _, n in extra)), ("pipe", *(a for a, _ in extra)))
    pipe = pipeline.Pipeline(
        llama.make_stage_fn(config),
        llama.loss_fn,
        mesh=mesh,
        schedule="1f1b",
        num_microbatches=M,
        fsdp_gather=gather,
    )
    tensor = "tensor" if "tensor" in mesh.shape else None
    fsdp = "fsdp" if "fsdp" in mesh.shape else None
    specs = llama.megatron_specs(tensor, fsdp)
    logical = jax.eval_shape(lambda: llama.init_blocks(jax.random.key(0), config, S, blocks // S))
    shapes = jax.eval_shape(lambda tree: pipe.place(tree, specs), logical)
    params = target.abstract(shapes, pipe.layout.shardings(shapes, specs))
    replicated = NamedSharding(mesh, P())
    outer = jax.eval_shape(lambda: llama.init_outer(jax.random.key(1), config))
    tokens, targets, positions = jax.eval_shape(
        lambda: llama.data(jax.random.key(2), config, 2 * M * pipe.num_replicas)
    )
    tokens, targets = target.abstract((tokens, targets), NamedSharding(mesh, P(pipe.data_axes)))
    outer, positions = target.abstract((outer, positions), replicated)
    opt = optax.adam(1e-3)
    opt_state = jax.eval_shape(opt.init, params)
    opt_state = target.abstract(opt_state, jax.tree.map(lambda s: s.sharding, opt_state))

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, outer, tokens, targets, positions):
        def loss(p):
            side = {"positions": positions}
            return pipe.loss(p, outer, outer["embed"][tokens], targets, side=side)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    report = tgt.compile(step, params, opt_state, outer, tokens, targets, positions)
    by_kind = collections.defaultdict(lambda: [0, 0])
    for c in report.collectives:
        key = f"{c.kind} over {'+'.join(sorted(c.axes)) or '-'}"
        by_kind[key][0] += 1
        by_kind[key][1] += c.nbytes
    ratio = None
    if tgt.platform == "cpu":  # the devices are here: run the step's trace
        real = pipe.place(llama.init_blocks(jax.random.key(0), config, S, blocks // S), specs)
        real_outer = llama.init_outer(jax.random.key(1), config)
        tok, tar, pos = llama.data(jax.random.key(2), config, 2 * M * pipe.num_replicas)
        x = real_outer["embed"][tok]
        trace = pipe.trace(real, real_outer, x, tar, side={"positions": pos})
        ratios = []
        for d in range(S):
            executed = int((trace[:, d, 0] != 0).sum() + (trace[:, d, 3] != 0).sum())
            ratios.append(executed / sum(len(row[d]) for row in pipe.schedule.ticks))
        ratio = max(ratios)
    stage_bytes = sum(int(np.prod(leaf.shape)) * 4 for leaf in jax.tree_util.tree_leaves(logical))
    return {
        "mesh": name,
        "fsdp_gather": gather,
        "argument_bytes": report.argument_bytes,
        "output_bytes": report.output_bytes,
        "alias_bytes": report.alias_bytes,
        "temp_bytes": report.temp_bytes,
        "peak_bytes": report.peak_bytes,
        "model_stage_bytes": stage_bytes,
        "collectives": {k: {"count": v[0], "bytes": v[1]} for k, v in sorted(by_kind.items())},
        "stage_application_ratio": ratio,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "meshes.json"))
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=8, help="decoder blocks, split over S")
    parser.add_argument("--microbatches", type=int, default=8, help="M")
    parser.add_argument("--meshes", nargs="*", default=None, help="only meshes named so")
    parser.add_argument(
        "--target",
        default="cpu:8",
        help="the compiler: cpu:8 (8 host devices), a TPU such as v5p:2x2x2, or h100x8 "
        "(compiled ahead of time, jaxpipe.target)",
    )
    args = parser.parse_args()
    names = [name for name, *_ in MESHES]
    unknown = sorted(set(args.meshes or ()) - set(names))
    if unknown:
        parser.error(f"unknown meshes {unknown}; the meshes are {names}")
    chosen = [m for m in MESHES if args.meshes is None or m[0] in args.meshes]
    for name, S, _, _ in chosen:
        if args.blocks % S:
            parser.error(f"--blocks {args.blocks} does not split over the {S} stages of {name!r}")
    if args.target.startswith("cpu"):
        common.host_devices(8)
    import llama

    config = llama.Config(
        width=args.width, heads=8, kv_heads=4, hidden=args.hidden, seq=args.seq, vocab=256
    )
    began = time.time()
    rows = []
    for name, S, extra, gather in chosen:
        rows.append(
            measure(name, S, extra, gather, config, args.blocks, args.microbatches, args.target)
        )
        print(f"{name}: done", flush=True)
    MiB = 2**20
    total = rows[0]["model_stage_bytes"] / MiB
    title = (
        f"Per device, Llama-style {args.blocks} blocks ({total:.1f} MiB of stage weights), "
        f"1f1b, M={args.microbatches}, {args.target} compiler"
    )
    common.print_table(
        ["mesh", "arguments MiB", "outputs MiB", "temp MiB", "peak MiB", "applications / asked"],
        [
            [r["mesh"], r["argument_bytes"] / MiB, r["output_bytes"] / MiB,
             r["temp_bytes"] / MiB,
             "-" if r["peak_bytes"] is None else r["peak_bytes"] / MiB,
             "-" if r["stage_application_ratio"] is None else r["stage_application_ratio"]]
            for r in rows
        ],
        title=title,
    )  # fmt: skip
    common.print_table(
        ["mesh", "collective", "count", "MiB"],
        [
            [r["mesh"], kind, v["count"], v["bytes"] / MiB]
            for r in rows
            for kind, v in r["collectives"].items()
        ],
        title="Collectives of the compiled step, by kind and mesh axes",
    )
    meta = common.metadata()
    meta.update(
        seconds=round(time.time() - began, 1),
        blocks=args.blocks,
        M=args.microbatches,
        target=args.target,
    )
    common.write_json({"meta": meta, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
