"""The reader of compiled programs (`jaxpipe.analysis.hlo.collectives`) reads the TPU
compiler's asynchronous collective fusions. With its
``xla_tpu_enable_async_collective_fusion*`` options (as MaxText sets them in
``LIBTPU_INIT_ARGS``; an ahead-of-time compile takes them as ``compiler_options``), the TPU
compiler splits an all-gather into steps that run inside the kernels of the computations
scheduled between a fusion named ``async-collective-start`` and one named
``async-collective-done``. Such a gather counts once, as an asynchronous all-gather over
its axes, hidden when a computation is scheduled in its window (skipped without
libtpu)."""

import importlib.util

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe import target
from jaxpipe.analysis import hlo

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed"
)
TPU_ASYNC_FUSION = {
    "xla_tpu_enable_async_collective_fusion": True,
    "xla_tpu_enable_async_collective_fusion_fuse_all_gather": True,
    "xla_tpu_enable_async_collective_fusion_multiple_steps": True,
    "xla_tpu_overlap_compute_collective_tc": True,
    "xla_enable_async_all_gather": True,
}
LAYERS, WIDTH, ROWS = 8, 1024, 256


def _report(options):
    """A loop over layers whose weights are split over fsdp: each iteration gathers the
    next layer's weights while it multiplies by the current ones."""
    tgt = target.get("v5e:2x2")
    mesh = tgt.mesh((4,), ("fsdp",))

    def gather(ws, i):
        return lax.all_gather(lax.dynamic_index_in_dim(ws, i, 0, False), "fsdp", axis=0, tiled=True)

    def body_fn(ws, x):
        def body(i, carry):
            x, w = carry
            following = gather(ws, jnp.minimum(i + 1, LAYERS - 1))
            return jnp.tanh(x @ w) @ w.T, following

        return lax.fori_loop(0, LAYERS, body, (x, gather(ws, 0)))[0]

    f = jax.shard_map(
        body_fn, mesh=mesh, in_specs=(P(None, "fsdp"), P("fsdp")), out_specs=P("fsdp")
    )
    ws = jax.ShapeDtypeStruct(
        (LAYERS, WIDTH, WIDTH), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "fsdp"))
    )
    x = jax.ShapeDtypeStruct(
        (4 * ROWS, WIDTH), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp"))
    )
    compiled = jax.jit(f).lower(ws, x).compile(compiler_options=options)
    return target.analyze(compiled, mesh, tgt), compiled.as_text()


def test_an_async_collective_fusion_reads_as_one_hidden_all_gather():
    """v5e (where the compiler supports the fusion for all-gathers; libtpu 0.0.50 refuses
    it on v5p): the loop's one gather of the next layer's weights, in steps inside the
    matrix products' kernels."""
    report, text = _report(TPU_ASYNC_FUSION)
    in_loop = [c for c in report.collectives if c.in_loop]
    assert [(c.kind, c.axes, c.nbytes) for c in in_loop] == [
        ("all-gather", ("fsdp",), WIDTH * WIDTH * 2)
    ], [c.line[:100] for c in in_loop]
    (gather,) = in_loop
    assert gather.line.startswith("%async-collective-start"), gather.line[:100]
    assert gather.hidden is True
    # found again where it is (the step time weighs each collective there, by its device
    # groups' ring traffic): the four devices of fsdp, 3/4 of the result sent per device
    comps, _ = hlo.computations(text)
    assert comps[gather.computation][gather.index].strip() == gather.line
    assert gather.group_size == 4
    assert gather.traffic == WIDTH * WIDTH * 2 * 3 / 4
