"""Memory of compiled pipeline steps on each compiler that will run them: the CPU compiler
always, the TPU compiler (v5p) when libtpu is installed, the CUDA compiler (H100) when
jax's CUDA plugin is. Read from ``memory_analysis()`` of the compiled program
(`jaxpipe.target`), never estimated.
"""

import importlib.util

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe import pipeline, target

try:
    HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
except ModuleNotFoundError:
    HAS_CUDA_PLUGIN = False
COMPILERS = [
    "cpu:4",
    pytest.param(
        "v5p:2x2x1",
        marks=[
            pytest.mark.slow,
            pytest.mark.skipif(
                importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed"
            ),
        ],
    ),
    pytest.param(
        "h100x4",
        marks=[
            pytest.mark.slow,
            pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason="jax's CUDA plugin is missing"),
        ],
    ),
]
# One micro-batch: [8, 128, 512] bf16, 1 MiB: large enough that the accelerator compilers'
# buffer packing (which moves temp by up to about 1 MiB between programs) is not mistaken
# for a copy of the batch, which would add a micro-batch per micro-batch.
ROWS, SEQ, WIDTH = 8, 128, 512


def step_temp_bytes(name: str, schedule: str, microbatches: int) -> int:
    """``temp_size_in_bytes`` of ``value_and_grad`` of a 4-stage pipeline's loss, compiled
    for ``name``, with ``microbatches`` micro-batches of ``[ROWS, SEQ, WIDTH]`` bf16."""
    tgt = target.get(name)
    mesh = tgt.mesh((4,), ("pipe",))

    def stage_fn(p, x):
        return x + jnp.tanh(x @ p["w"])

    def loss_fn(_, y, t):
        return jnp.mean((y.astype(jnp.float32) - t.astype(jnp.float32)) ** 2)

    pipe = pipeline.Pipeline(
        stage_fn, loss_fn, mesh=mesh, schedule=schedule, num_microbatches=microbatches
    )
    logical = {"w": jax.ShapeDtypeStruct((pipe.num_logical_stages, WIDTH, WIDTH), jnp.bfloat16)}
    shapes = jax.eval_shape(pipe.place, logical)
    params = target.abstract(shapes, pipe.layout.shardings(shapes))
    batch = jax.ShapeDtypeStruct(
        (microbatches * ROWS, SEQ, WIDTH), jnp.bfloat16, sharding=NamedSharding(mesh, P())
    )

    def step(p, x, t):
        return jax.value_and_grad(lambda p: pipe.loss(p, None, x, t))(p)

    return tgt.compile(step, params, batch, batch).temp_bytes


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
@pytest.mark.parametrize("name", COMPILERS)
def test_temp_does_not_grow_with_the_number_of_microbatches(name, schedule):
    """1f1b and zbv keep at most S micro-batches in flight whatever M is, and the batch's
    inputs and targets are arguments: 32 micro-batches (and a batch 4x larger) add less
    than one micro-batch to the temp of 8 on the accelerators' compilers. A copy of the
    inputs or targets inside the step (the TPU compiler relays out a batch whose
    micro-batches are not contiguous) would add 24 or 48 of them."""
    microbatch_bytes = ROWS * SEQ * WIDTH * 2
    eight, many = (step_temp_bytes(name, schedule, m) for m in (8, 32))
    if name.startswith("cpu"):
        # The CPU compiler copies the loop's read-only arguments (inputs and targets) into
        # the loop's state, whatever their layout: 2 x 24 more micro-batches, and no more
        # (but the 24 more losses, 4 bytes each, and their alignment).
        assert many - eight <= 2 * 24 * microbatch_bytes + 1024, (eight, many)
    else:
        assert many - eight < microbatch_bytes, (eight, many)
