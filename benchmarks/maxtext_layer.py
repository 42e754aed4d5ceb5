"""MaxText's own pipeline layer against jaxpipe's schedules on the TPU v5p compiler, ahead
of time: temp and peak bytes per device of the same stages under the same remat.

MaxText side: ``maxtext.layers.pipeline.create_nnx_pipeline`` (the path MaxText's NNX
decoders use) around a minimal decoder layer with MaxText's signature and logical axes,
``remat_policy=None`` with MaxText's defaults (``set_remat_policy_on_pipeline_iterations``:
each iteration's input is kept; a layer input tagged ``decoder_layer_input``, as every
MaxText decoder layer tags it, is kept too: ``--no-tag`` drops the tag, which keeps exactly
what jaxpipe's ``remat=True`` keeps). r = 1 runs 2 layers per stage
(``NNXSequentialPipelineStage``), r = 2 one layer per stage, two repeats.

jaxpipe side: the same 8 blocks ``x + silu(x @ up) @ down`` (width 4096, hidden 14336, bf16)
on 4 stages, ``remat=True``, gradients accumulated in float32 (the default) or, with
``--bf16-grads``, in bfloat16 as MaxText's autodiff accumulates them. Each stage runs its
blocks with a ``lax.scan`` over their stacked weights, as MaxText's stage does (``scan``),
and with a Python loop over them (``loop``); ``--forms`` picks.

Needs MaxText (Python 3.12 or newer: ``pip install maxtext==0.2.5``) and libtpu
(``pip install "jax[tpu]==<jax version>"``); writes ``results/maxtext_layer_v5p.json``.

    python benchmarks/maxtext_layer.py                          # M = 8, 16, 32; r = 1, 2
    python benchmarks/maxtext_layer.py --microbatches 8 --no-tag --bf16-grads --forms scan
"""

from __future__ import annotations

import argparse
import os

import common

GiB = 2**30
S, LAYERS, WIDTH, HIDDEN, ROWS, SEQ = 4, 8, 4096, 14336, 8, 2048
SCHEDULES = ("gpipe", "1f1b", "1f1b-unsplit", "zb_h1", "zbv", "interleaved_1f1b", "dualpipev")
FORMS = ("scan", "loop")  # how a jaxpipe stage runs its blocks


def maxtext_config(M: int, repeats: int):
    import maxtext
    from maxtext.configs import pyconfig

    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    config = pyconfig.initialize(
        [None, base], num_pipeline_microbatches=M, per_device_batch_size=M * ROWS // S,
        base_emb_dim=WIDTH, base_mlp_dim=HIDDEN, base_num_decoder_layers=LAYERS,
        num_layers_per_pipeline_stage=LAYERS // (S * repeats), num_pipeline_repeats=repeats,
        ici_pipeline_parallelism=S, ici_fsdp_parallelism=1, max_target_length=SEQ,
        dtype="bfloat16", weight_dtype="bfloat16", compile_topology="v5p-8",
        compile_topology_num_slices=1, enable_checkpointing=False, dataset_type="synthetic",
        run_name="jaxpipe",
    )  # fmt: skip
    assert config.micro_batch_size_to_train_on == M * ROWS
    return config


def maxtext_step(tgt, M: int, repeats: int, tag: bool):
    """MaxText's pipeline layer: its compiled ``value_and_grad`` step's Report."""
    import jax
    import jax.numpy as jnp
    from flax import linen as nn
    from flax import nnx
    from jax.ad_checkpoint import checkpoint_name
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from maxtext.common.common_types import MODEL_MODE_TRAIN
    from maxtext.layers import pipeline as mx_pipeline
    from maxtext.layers.nnx_decoders import NNXSequentialPipelineStage
    from maxtext.utils import sharding as mx_sharding

    config = maxtext_config(M, repeats)
    names = tuple(config.mesh_axes)
    mesh = tgt.mesh(tuple(S if n == "stage" else 1 for n in names), names)
    axes = ("activation_batch", "activation_length", "activation_embed")

    class Layer(nnx.Module):
        """A decoder layer with MaxText's signature and sharding conventions."""

        def __init__(self, config, mesh, quant, model_mode, *, rngs):
            init = nnx.initializers.lecun_normal()
            self.mesh, self.shard_mode = mesh, config.shard_mode
            self.up = nnx.Param(
                init(rngs.params(), (WIDTH, HIDDEN), jnp.bfloat16), sharding=("embed", "mlp")
            )
            self.down = nnx.Param(
                init(rngs.params(), (HIDDEN, WIDTH), jnp.bfloat16), sharding=("mlp", "embed")
            )

        def shard(self, x):
            return mx_sharding.maybe_shard_with_logical(
                x, axes, mesh=self.mesh, shard_mode=self.shard_mode, debug_sharding=False
            )

        def __call__(self, x, segment_ids, positions, deterministic, model_mode, **kwargs):
            x = self.shard(x)
            if tag:
                x = checkpoint_name(x, "decoder_layer_input")
            return self.shard(x + jax.nn.silu(x @ self.up[...]) @ self.down[...]), None

    def stage(rngs):
        if config.num_layers_per_pipeline_stage == 1:
            return Layer(config, mesh, None, MODEL_MODE_TRAIN, rngs=rngs)
        return NNXSequentialPipelineStage(
            Layer, config.num_layers_per_pipeline_stage, config, mesh, None, MODEL_MODE_TRAIN,
            rngs=rngs,
        )  # fmt: skip

    with jax.set_mesh(mesh), nn.partitioning.axis_rules(config.logical_axis_rules):
        abstract = nnx.eval_shape(
            lambda: mx_pipeline.create_nnx_pipeline(
                config, stage, mesh, remat_policy=None, rngs=nnx.Rngs(params=0, dropout=1)
            )
        )
        graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
        specs = nnx.get_partition_spec(params)
        params = jax.tree.map(
            lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, s)),
            params, specs, is_leaf=lambda v: isinstance(v, P),
        )  # fmt: skip
        replicated = NamedSharding(mesh, P())
        rest = jax.tree.map(
            lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=replicated), rest
        )
        x = jax.ShapeDtypeStruct((M * ROWS, SEQ, WIDTH), jnp.bfloat16, sharding=replicated)

        def step(params, rest, x, t):
            def loss(params):
                y = nnx.merge(graphdef, params, rest)(x, None, None, True, MODEL_MODE_TRAIN)
                return jnp.mean((y.astype(jnp.float32) - t.astype(jnp.float32)) ** 2)

            return jax.value_and_grad(loss)(params)

        return tgt.compile(step, params, rest, x, x, mesh=mesh)


def jaxpipe_step(tgt, name: str, M: int, bf16_grads: bool, form: str = "scan"):
    """jaxpipe's schedule ``name`` on the same stages with ``remat=True``, each stage running
    its blocks as ``form`` (`FORMS`): its Report. ``"1f1b-unsplit"`` is 1f1b with
    ``split_backward=False``."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpipe import pipeline, schedules, target

    mesh = tgt.mesh((S,), ("pipe",))
    if name == "1f1b-unsplit":
        schedule = schedules.get("1f1b", S, M, split_backward=False)
    else:
        schedule = schedules.get(name, S, M)
    per_stage = LAYERS // schedule.num_logical_stages

    def block(x, q):
        return x + jax.nn.silu(x @ q["up"]) @ q["down"]

    def looped(p, x):
        for i in range(per_stage):
            x = block(x, jax.tree.map(lambda a, i=i: a[i], p))
        return x

    def scanned(p, x):
        return jax.lax.scan(lambda x, q: (block(x, q), None), x, p)[0]

    stage_fn = {"scan": scanned, "loop": looped}[form]

    def loss_fn(_, y, t):
        return jnp.mean((y.astype(jnp.float32) - t.astype(jnp.float32)) ** 2)

    pipe = pipeline.Pipeline(
        stage_fn, loss_fn, mesh=mesh, schedule=schedule, remat=True,
        **({"grad_dtype": None} if bf16_grads else {}),
    )  # fmt: skip
    N = schedule.num_logical_stages
    logical = {
        "up": jax.ShapeDtypeStruct((N, per_stage, WIDTH, HIDDEN), jnp.bfloat16),
        "down": jax.ShapeDtypeStruct((N, per_stage, HIDDEN, WIDTH), jnp.bfloat16),
    }
    shapes = jax.eval_shape(pipe.place, logical)
    params = target.abstract(shapes, pipe.layout.shardings(shapes))
    x = jax.ShapeDtypeStruct(
        (M * ROWS, SEQ, WIDTH), jnp.bfloat16, sharding=NamedSharding(mesh, P())
    )

    def step(p, x, t):
        return jax.value_and_grad(lambda p: pipe.loss(p, None, x, t))(p)

    return tgt.compile(step, params, x, x)


def row(name, M, report, base):
    temp, peak = report.temp_bytes, report.peak_bytes or 0
    return [name, M, temp / GiB, peak / GiB, temp / base.temp_bytes]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--repeats", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS))
    parser.add_argument("--no-tag", action="store_true", help="untagged layer inputs")
    parser.add_argument("--bf16-grads", action="store_true", help="jaxpipe grad_dtype=None")
    parser.add_argument("--target", default="v5p:2x2x1")
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "maxtext_layer_v5p.json"))
    args = parser.parse_args()
    from jaxpipe import target

    tgt = target.get(args.target)
    results, table = [], []
    for M in args.microbatches:
        base = None
        for r in args.repeats:
            report = maxtext_step(tgt, M, r, tag=not args.no_tag)
            base = base or report
            results.append({"side": "maxtext", "r": r, "M": M, **report.as_dict()})
            table.append(row(f"MaxText r={r}", M, report, base))
        for name in args.schedules:
            for form in args.forms:
                report = jaxpipe_step(tgt, name, M, args.bf16_grads, form)
                results.append(
                    {"side": "jaxpipe", "schedule": name, "form": form, "M": M} | report.as_dict()
                )
                table.append(row(f"{name} ({form})", M, report, base))
    common.print_table(
        ["pipeline", "M", "temp GiB", "peak GiB", "temp / MaxText r=1"], table,
        title=f"{args.target}, remat; MaxText layer inputs tagged: {not args.no_tag}; "
        f"jaxpipe gradients in {'bfloat16' if args.bf16_grads else 'float32'}",
    )  # fmt: skip
    common.write_json(
        {"config": vars(args), "meta": common.metadata(), "results": results}, args.out
    )


if __name__ == "__main__":
    main()
