"""Memory of a stage of several transformer blocks written as a loop and as a scan.

Measurements only, compiled ahead of time with `jaxpipe.target` (needs libtpu: ``pip install
"jax[tpu]==<jax version>"``; ``--target cpu:4`` runs on the CPU compiler instead).

Model: Llama-3-8B-sized blocks (tests/llama.py: RMS norm, grouped-query causal attention
with rotary positions, SwiGLU; width 4096, 32 heads, 8 key-value heads, hidden 14336), bf16,
S = 4 stages of ``--blocks`` blocks each, micro-batches of ``rows`` x ``seq`` tokens, loss
``mean((y - t)^2)`` in float32; the step is ``jax.value_and_grad`` of ``pipe.loss``. The
stage runs its blocks as

- ``loop``: a Python loop over the stacked blocks' slices;
- ``scan``: a bare ``lax.scan`` over them (the pipeline writes it out as a loop if it is
  small, else runs its body keeping only the results of operations that are not
  elementwise; docs/transformers.md);
- ``checkpoint``: a ``lax.scan`` whose body is ``jax.checkpoint`` with
  ``nothing_saveable``; ``dots`` and ``dots_no_batch`` the same with ``dots_saveable`` and
  ``dots_with_no_batch_dims_saveable``;
- ``nnx``: the blocks as a Flax NNX module (its weights ``nnx.Param``) stacked over the
  blocks and run with ``nnx.scan``.

Per row: ``temp_size_in_bytes`` and ``peak_memory_in_bytes`` per device, their ratio to the
loop's, and the wall time of lowering and compiling.

    python benchmarks/scanned_stage.py                                  # v5p:2x2x1, 3 blocks
    python benchmarks/scanned_stage.py --schedules 1f1b zbv --blocks 3 4 --no-remat
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import common

sys.path.insert(0, os.path.join(common.ROOT, "tests"))
GiB = 2**30
S = 4


def parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="v5p:2x2x1")
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "zbv"])
    parser.add_argument("--blocks", type=int, nargs="+", default=[3], help="blocks per stage")
    parser.add_argument(
        "--forms", nargs="+", default=["loop", "scan", "checkpoint"],
        choices=["loop", "scan", "checkpoint", "dots", "dots_no_batch", "nnx"],
    )  # fmt: skip
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rows", type=int, default=4, help="rows per micro-batch")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per row")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=14336)
    parser.add_argument(
        "--no-remat", dest="remat", action="store_false",
        help="the pipeline's defaults instead of remat=True (keep each stage's input)",
    )  # fmt: skip
    parser.add_argument(
        "--no-split", dest="split", action="store_false",
        help="schedule_options={'split_backward': False}: B and W as one backward",
    )  # fmt: skip
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "scanned_stage.json"))
    return parser.parse_args()


def block_shapes(config) -> dict:
    """One block's weight shapes (tests/llama.py's names)."""
    w, h, kv = config.width, config.hidden, config.kv_heads * config.head_dim
    return {"attn_norm": (w,), "attn_q": (w, w), "attn_k": (w, kv), "attn_v": (w, kv),
            "attn_o": (w, w), "mlp_norm": (w,), "mlp_gate": (w, h), "mlp_up": (w, h),
            "mlp_down": (h, w)}  # fmt: skip


def stage_forms(config, positions):
    """``{form: stage_fn(p, x)}`` for the forms of the module docstring (``nnx`` takes the
    `nnx_weights` of the same arrays)."""
    import jax
    import llama
    from flax import nnx

    def one(x, q):
        return llama.block(q, x, positions, config), None

    def loop(p, x):
        for i in range(jax.tree_util.tree_leaves(p)[0].shape[0]):
            x = one(x, jax.tree.map(lambda a, i=i: a[i], p))[0]
        return x

    def scan(p, x):
        return jax.lax.scan(one, x, p)[0]

    def checkpointed(policy):
        def stage(p, x):
            return jax.lax.scan(jax.checkpoint(one, policy=policy), x, p)[0]

        return stage

    def nnx_stage(state, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):
            return block(x)

        return run(x, nnx.merge(nnx_block(config, positions)[0], state))

    policies = jax.checkpoint_policies
    return {
        "loop": loop, "scan": scan, "checkpoint": checkpointed(policies.nothing_saveable),
        "dots": checkpointed(policies.dots_saveable),
        "dots_no_batch": checkpointed(policies.dots_with_no_batch_dims_saveable),
        "nnx": nnx_stage,
    }  # fmt: skip


def nnx_block(config, positions):
    """``(graphdef, state)`` of one Llama block as a Flax NNX module whose weights are
    ``nnx.Param``s (the state abstract)."""
    import jax
    import jax.numpy as jnp
    import llama
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self):
            for name, shape in block_shapes(config).items():
                setattr(self, name, nnx.Param(jnp.zeros(shape, jnp.bfloat16)))

        def __call__(self, x):
            weights = {name: getattr(self, name)[...] for name in block_shapes(config)}
            return llama.block(weights, x, positions, config)

    return nnx.split(jax.eval_shape(Block))


def nnx_weights(weights: dict, config, positions):
    """``weights`` (``{name: [..., blocks, ...]}``) as the state of `nnx_block`'s module."""
    import jax

    state = nnx_block(config, positions)[1]
    return jax.tree_util.tree_map_with_path(lambda path, _: weights[path[0].key], state)


def compile_step(args, tgt, stage_fn, schedule, blocks, config, positions=None):
    """(temp bytes, peak bytes, seconds) of the gradient step, compiled for ``tgt``; with
    ``positions``, the weights are `nnx_weights` (the ``nnx`` form's)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpipe import pipeline, target

    mesh = tgt.mesh((S,), ("pipe",))
    pipe = pipeline.Pipeline(
        stage_fn,
        lambda _, y, t: jnp.mean((y.astype(jnp.float32) - t.astype(jnp.float32)) ** 2),
        mesh=mesh, schedule=schedule, num_microbatches=args.microbatches, remat=args.remat,
        schedule_options=None if args.split else {"split_backward": False},
    )  # fmt: skip
    lead = (pipe.num_logical_stages, blocks)
    logical = {
        k: jax.ShapeDtypeStruct((*lead, *v), jnp.bfloat16) for k, v in block_shapes(config).items()
    }
    if positions is not None:
        logical = nnx_weights(logical, config, positions)
    placed = jax.eval_shape(pipe.place, logical)
    params = target.abstract(placed, pipe.layout.shardings(placed))
    batch = jax.ShapeDtypeStruct(
        (args.microbatches * args.rows, args.seq, config.width), jnp.bfloat16,
        sharding=NamedSharding(mesh, P()),
    )  # fmt: skip

    def step(p, x, t):
        return jax.value_and_grad(lambda p: pipe.loss(p, None, x, t))(p)

    start = time.perf_counter()
    report = tgt.compile(step, params, batch, batch)
    return report.temp_bytes, report.peak_bytes or 0, time.perf_counter() - start


def main():
    args = parse()
    if args.target.startswith("cpu"):
        common.host_devices(8)
    import jax.numpy as jnp
    import llama

    from jaxpipe import target

    tgt = target.get(args.target)
    config = llama.Config(
        width=args.width, heads=args.heads, kv_heads=args.kv_heads, hidden=args.hidden,
        seq=args.seq,
    )  # fmt: skip
    positions = jnp.broadcast_to(jnp.arange(args.seq), (args.rows, args.seq))
    forms = stage_forms(config, positions)
    rows, results = [], []
    for schedule in args.schedules:
        for blocks in args.blocks:
            loop = None
            for form in args.forms:
                temp, peak, seconds = compile_step(
                    args, tgt, forms[form], schedule, blocks, config,
                    positions if form == "nnx" else None,
                )  # fmt: skip
                loop = (temp, peak) if form == "loop" else loop
                pairs = zip((temp, peak), loop or (0, 0), strict=True)
                ratio = [x / y if loop and y else None for x, y in pairs]
                results.append(dict(
                    schedule=schedule, blocks=blocks, form=form, temp_bytes=temp,
                    peak_bytes=peak, temp_over_loop=ratio[0], peak_over_loop=ratio[1],
                    compile_seconds=round(seconds, 1),
                ))  # fmt: skip
                rows.append([schedule, blocks, form, temp / GiB, peak / GiB,
                             ratio[0] or "-", ratio[1] or "-", round(seconds)])  # fmt: skip
    common.print_table(
        ["schedule", "blocks", "form", "temp GiB", "peak GiB", "temp / loop", "peak / loop",
         "compile s"],
        rows,
        title=f"{args.target}, S = {S}, M = {args.microbatches}, remat={args.remat}"
        + ("" if args.split else ", split_backward=False"),
    )  # fmt: skip
    data = {"meta": {**common.metadata(), "args": vars(args)}, "results": results}
    common.write_json(data, args.out)


if __name__ == "__main__":
    main()
