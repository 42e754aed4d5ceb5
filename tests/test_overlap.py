"""Transfers between stages run behind a stage's computation, in the programs the TPU and GPU
compilers build (compiled ahead of time with `jaxpipe.target`; skipped without libtpu or
jax's CUDA plugin). Read from the scheduled HLO by `jaxpipe.target` (`Collective.hidden`):
between each ``collective-permute-start`` of an activation or gradient and its ``-done``,
the compiler has placed a forward, backward or weight-gradient action of the tick (see
docs/executor.md, "Transfers run behind computation")."""

import importlib.util

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe import pipeline, schedules, target
from jaxpipe._executor.plan import make_plan

try:
    HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
except ModuleNotFoundError:
    HAS_CUDA_PLUGIN = False
COMPILERS = [
    pytest.param(
        "v5p:2x2x1",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed"
        ),
    ),
    pytest.param(
        "h100x4",
        marks=pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason="jax's CUDA plugin is missing"),
    ),
]
SCHEDULES = ["gpipe", "1f1b", "zb_h1", "zbv", "interleaved_1f1b", "dualpipev"]
# XLA's GPU scheduler keeps one transfer in flight at a time unless told otherwise; the
# V-shaped schedules send two activations (one per direction) while one action computes.
GPU_OPTIONS = {"xla_gpu_experimental_parallel_collective_overlap_limit": 2}
ROWS, SEQ, WIDTH, HIDDEN = 8, 128, 512, 2048


def compiled_report(name: str, schedule: str, compiler_options=None, costs=None):
    """The `jaxpipe.target.Report` of ``value_and_grad`` of a 4-device pipeline's loss (8 MLP
    blocks, bf16, 8 micro-batches) compiled for ``name``, and the pipeline's plan; ``costs``
    (a `jaxpipe.schedules.Costs`) packs the schedule's table for those costs."""
    tgt = target.get(name)
    mesh = tgt.mesh((4,), ("pipe",))
    pipe = pipeline.Pipeline(
        lambda p, x: x + jax.nn.silu(x @ p["up"]) @ p["down"],
        lambda _, y, t: jnp.mean((y.astype(jnp.float32) - t.astype(jnp.float32)) ** 2),
        mesh=mesh,
        schedule=schedule,
        num_microbatches=8,
        costs=costs,
    )
    stages = pipe.num_logical_stages
    logical = {
        "up": jax.ShapeDtypeStruct((stages, WIDTH, HIDDEN), jnp.bfloat16),
        "down": jax.ShapeDtypeStruct((stages, HIDDEN, WIDTH), jnp.bfloat16),
    }
    shapes = jax.eval_shape(pipe.place, logical)
    params = target.abstract(shapes, pipe.layout.shardings(shapes))
    replicated = NamedSharding(mesh, P())
    batch = jax.ShapeDtypeStruct((8 * ROWS, SEQ, WIDTH), jnp.bfloat16, sharding=replicated)

    def step(p, x, t):
        return jax.value_and_grad(lambda p: pipe.loss(p, None, x, t))(p)

    compiled = jax.jit(step).lower(params, batch, batch).compile(compiler_options=compiler_options)
    return target.analyze(compiled, mesh, tgt), make_plan(pipe.schedule)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", COMPILERS)
def test_every_transfer_between_stages_runs_behind_a_stages_computation(name, schedule):
    check_transfers_run_behind_computation(name, schedule)


@pytest.mark.slow
@pytest.mark.parametrize("name", COMPILERS[:1])
def test_a_table_packed_for_unequal_costs_keeps_transfers_behind_computation(name):
    """zbv's table packed for F:B:W = 1:2:0.5 (several actions in some ticks)."""
    costs = schedules.Costs(forward=1.0, backward_input=2.0, backward_weight=0.5)
    check_transfers_run_behind_computation(name, "zbv", costs)


def check_transfers_run_behind_computation(name, schedule, costs=None):
    options = GPU_OPTIONS if name.startswith("h100") else None
    report, plan = compiled_report(name, schedule, options, costs)
    between_stages = [
        c
        for c in report.collectives
        if c.kind == "collective-permute" and c.in_loop and c.nbytes == ROWS * SEQ * WIDTH * 2
    ]
    channels = [o for o in (*plan.forward_offsets, *plan.backward_offsets) if o % 4]
    assert len(between_stages) == len(channels), [c.line[:80] for c in between_stages]
    assert all(c.axes == ("pipe",) for c in between_stages)
    assert all(c.hidden for c in between_stages), [c.line[:80] for c in between_stages]
    (summary,) = [e for e in report.collective_summary() if e["kind"] == "collective-permute"]
    assert f"{summary['hidden']} behind computation" in str(report)
