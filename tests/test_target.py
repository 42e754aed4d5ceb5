"""jaxpipe.target: compile-only reports, read off the compiled program itself.

On the CPU compiler always (8 host devices); on the TPU compiler when libtpu is installed
(``pip install "jax[tpu]==<jax version>"``), skipped otherwise.
"""

import importlib.util
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe import pipeline, target

ROOT = pathlib.Path(__file__).resolve().parent.parent
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
NEEDS_LIBTPU = pytest.mark.skipif(
    not HAS_LIBTPU, reason=f"libtpu is not installed ({target.install_command('tpu')})"
)
try:
    HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
except ModuleNotFoundError:
    HAS_CUDA_PLUGIN = False
NEEDS_CUDA_PLUGIN = pytest.mark.skipif(
    not HAS_CUDA_PLUGIN,
    reason=f"jax's CUDA plugin is not installed ({target.install_command('cuda')})",
)
WIDTH, ROWS = 128, 64


def collective_program(mesh):
    """A shard_map over (pipe, data) with one collective of each kind, the ppermute inside a
    loop; returns (fn, its argument as a ShapeDtypeStruct)."""

    def body(x):  # x: [ROWS / 2, WIDTH] per device
        x = jax.lax.psum(x, "data")  # all-reduce over data
        gathered = jax.lax.all_gather(x, "pipe", tiled=True)  # all-gather over pipe
        scattered = jax.lax.psum_scatter(gathered, "pipe", tiled=True)  # reduce-scatter
        swapped = jax.lax.all_to_all(scattered, "data", 0, 0, tiled=True)  # all-to-all

        def step(_, y):
            return jnp.tanh(jax.lax.ppermute(y, "pipe", [(i, (i + 1) % 4) for i in range(4)]))

        return jax.lax.fori_loop(0, 3, step, swapped)

    fn = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False)
    x = jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    return fn, x


def pipeline_step(mesh, schedule="1f1b", microbatches=8):
    """A jaxpipe value_and_grad step from shapes with shardings: (step, params, x)."""

    def stage_fn(p, x):
        return x + jnp.tanh(x @ p["w"])

    def loss_fn(_, y, t):
        return jnp.mean((y - t) ** 2)

    pipe = pipeline.Pipeline(
        stage_fn, loss_fn, mesh=mesh, schedule=schedule, num_microbatches=microbatches
    )
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    shapes = jax.eval_shape(
        lambda k: pipe.init(lambda k: {"w": jax.random.normal(k, (WIDTH, WIDTH))}, k), key
    )
    params = target.abstract(shapes, pipe.layout.shardings(shapes))
    data = NamedSharding(mesh, P(pipe.data_axes))
    x = jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.float32, sharding=data)

    def step(params, x):
        return jax.value_and_grad(lambda p: pipe.loss(p, None, x, x))(params)

    return step, params, x


def per_device_bytes(s):
    """Bytes of one device's shard of a ShapeDtypeStruct with a sharding."""
    return math.prod(s.sharding.shard_shape(s.shape)) * jnp.dtype(s.dtype).itemsize


# ----------------------------------------------------------------------------- names
def test_cpu_target_has_the_host_devices():
    t = target.get("cpu:8")
    assert t.platform == "cpu" and len(t.devices) == 8 and t.memory_per_device is None
    assert dict(t.mesh((4, 2), ("pipe", "data")).shape) == {"pipe": 4, "data": 2}
    with pytest.raises(target.TargetError, match="needs 16 devices"):
        t.mesh((4, 4), ("pipe", "data"))


@pytest.mark.parametrize("name", ["h200", "v5p", "v5p-8", "tpu:2x2", "v7:2x2", "h100:8"])
def test_unknown_names_say_what_is_understood(name):
    with pytest.raises(target.TargetError, match=r"v5p:2x2x2"):
        target.get(name)


def test_without_libtpu_the_error_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "libtpu" else real(n, *a)
    )
    with pytest.raises(target.TargetError) as error:
        target.get("v5p:2x2x2")
    assert f'pip install "jax[tpu]=={jax.__version__}"' in str(error.value)


def test_without_the_cuda_plugin_the_error_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda n, *a: None if n.startswith("jax_plugins") else real(n, *a),
    )
    with pytest.raises(target.TargetError) as error:
        target.get("h100x8")
    assert f'pip install "jax-cuda12-plugin=={jax.__version__}"' in str(error.value)


# ----------------------------------------------------------------------------- CPU compiler
def test_collectives_by_kind_axis_bytes_and_loop_on_cpu():
    t = target.get("cpu:8")
    mesh = t.mesh((4, 2), ("pipe", "data"))
    fn, x = collective_program(mesh)
    report = t.compile(fn, x)
    shard = (ROWS // 2) * WIDTH * 4  # one device's [ROWS/2, WIDTH] f32
    found = {(c.kind, c.axes, c.in_loop): c.nbytes for c in report.collectives}
    assert found[("all-reduce", ("data",), False)] == shard
    assert found[("all-gather", ("pipe",), False)] == 4 * shard
    assert found[("reduce-scatter", ("pipe",), False)] == shard
    assert found[("all-to-all", ("data",), False)] == shard
    assert found[("collective-permute", ("pipe",), True)] == shard
    summary = report.collective_summary()
    assert sum(e["count"] for e in summary) == len(report.collectives)
    text = str(report)
    assert "collective-permute  over pipe" in text and "in loop" in text


def test_memory_is_the_compiled_programs_on_cpu():
    t = target.get("cpu:8")
    mesh = t.mesh((4, 2), ("pipe", "data"))
    step, params, x = pipeline_step(mesh)
    compiled = jax.jit(step).lower(params, x).compile()
    memory = compiled.memory_analysis()
    report = target.analyze(compiled, mesh, t)
    assert report.temp_bytes == memory.temp_size_in_bytes > 0
    assert report.output_bytes == memory.output_size_in_bytes
    # arguments: each device's shard of the stage weights and of the batch
    expected = sum(per_device_bytes(s) for s in jax.tree.leaves(params)) + per_device_bytes(x)
    assert report.argument_bytes == expected
    assert report.fits is None and "capacity: unknown" in str(report)
    kinds = {(c.kind, c.axes) for c in report.collectives}
    assert ("collective-permute", ("pipe",)) in kinds
    assert any(c.in_loop for c in report.collectives if c.kind == "collective-permute")
    # the verdict against a chip: a small one does not hold it, a large one does
    small = target.Chip("tiny", report.needed_bytes - 1, "test")
    large = target.Chip("huge", 2 * report.needed_bytes, "test")
    tiny = target.analyze(compiled, mesh, target.Target("t", "cpu", t.devices, small))
    huge = target.analyze(compiled, mesh, target.Target("h", "cpu", t.devices, large))
    assert tiny.fits is False and tiny.headroom_bytes == -1 and "DOES NOT FIT" in str(tiny)
    assert huge.fits is True and huge.headroom_bytes == report.needed_bytes
    assert huge.as_dict()["fits"] is True


# HLO lines as the TPU compiler prints them: replica groups in mesh form, with a device
# order, and a result tuple whose /*index=5*/ comments hold '='.
TPU_LINES = """\
HloModule m

ENTRY %main (p: f32[8]) -> f32[8] {
  %a = (f32[]{:T(128)}, f32[64]{0:T(128)}, f32[64]{0:T(128)}, f32[11,64]{1,0:T(8,128)}, f32[8,4,16,64]{3,2,1,0:T(8,128)}, /*index=5*/f32[8]{0:T(128)}) all-reduce(%x, %y), channel_id=35, replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=1,'axis_3'=1,'axis_4'=1,'axis_5'=2] {'axis_1'}, use_global_device_ids=true, to_apply=%r
  %b = (f32[12,64]{1,0:T(8,128)}, f32[64]{0:T(128)}) all-reduce(%x, %y), channel_id=3, replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=1,'axis_3'=4], device_ids=([4,2]T(1,0)) {'axis_0','axis_1'}, use_global_device_ids=true, to_apply=%r
  %c = (f32[4,256]{1,0:T(4,128)S(1)}, f32[4,256]{1,0:T(4,128)}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%d), channel_id=1, source_target_pairs={{0,2},{2,4},{4,6},{6,0},{1,3},{3,5},{5,7},{7,1}}
  %e = f32[4,256]{1,0} collective-permute-done(%c)
  %f = f32[8,16]{1,0} all-gather(%x), channel_id=4, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}
}
"""  # noqa: E501


def test_tpu_hlo_forms_are_parsed():
    mesh = jax.make_mesh(
        (4, 2), ("pipe", "data"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
        devices=jax.devices()[:8],
    )  # fmt: skip
    found = target.collectives(TPU_LINES, mesh)
    assert [(c.kind, c.axes) for c in found] == [
        ("all-reduce", ("pipe",)),
        ("all-reduce", ("data",)),
        ("collective-permute", ("pipe",)),
        ("all-gather", ("pipe",)),
    ]
    assert found[0].nbytes == 4 * (1 + 64 + 64 + 11 * 64 + 8 * 4 * 16 * 64 + 8)
    assert found[2].nbytes == 4 * 4 * 256  # the result buffer, not operand or context words
    assert not any(c.in_loop for c in found)
    assert [c.hidden for c in found] == [None, None, False, None]  # nothing between start/done


# Async collectives as the CUDA compiler prints them: a -start's type is
# ((operands...), results...); the bytes are the results', counted once.
GPU_ASYNC_LINES = """\
HloModule m

ENTRY %main (p: f32[8]) -> f32[8] {
  %ar = ((bf16[8,1,64,32]{3,2,1,0}), bf16[8,1,64,32]{3,2,1,0}) all-reduce-start(%x), channel_id=1, replica_groups=[2,4]<=[4,2]T(1,0), use_global_device_ids=true, to_apply=%r
  %ard = bf16[8,1,64,32]{3,2,1,0} all-reduce-done(%ar)
  %ag = ((f32[1,4,16]{2,1,0}, f32[1,4,8]{2,1,0}), (f32[2,4,16]{2,1,0}, f32[2,4,8]{2,1,0})) all-gather-start(%y, %z), channel_id=2, replica_groups=[4,2]<=[8], dimensions={0}, use_global_device_ids=true
  %agd = (f32[2,4,16]{2,1,0}, f32[2,4,8]{2,1,0}) all-gather-done(%ag)
}
"""  # noqa: E501


def test_gpu_async_forms_count_their_results_once():
    mesh = jax.make_mesh(
        (4, 2), ("pipe", "data"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
        devices=jax.devices()[:8],
    )  # fmt: skip
    found = target.collectives(GPU_ASYNC_LINES, mesh)
    assert [(c.kind, c.axes) for c in found] == [
        ("all-reduce", ("pipe",)),
        ("all-gather", ("data",)),
    ]
    assert found[0].nbytes == 2 * 8 * 64 * 32  # not twice: the operand tuple is left out
    assert found[1].nbytes == 4 * (2 * 4 * 16 + 2 * 4 * 8)


# A scheduled loop body: one transfer has a matmul (inside a fusion) before its done, one a
# conditional, one only elementwise work.
SCHEDULED = """\
HloModule m, is_scheduled=true

%mm (p0: f32[8,8], p1: f32[8,8]) -> f32[8,8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  %p1 = f32[8,8]{1,0} parameter(1)
  ROOT %d = f32[8,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f32[8,8]) -> f32[8,8] {
  %x = f32[8,8]{1,0} parameter(0)
  %s1 = (f32[8,8]{1,0}, f32[8,8]{1,0}) collective-permute-start(%x), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %f = f32[8,8]{1,0} fusion(%x, %x), kind=kOutput, calls=%mm
  %d1 = f32[8,8]{1,0} collective-permute-done(%s1)
  %s2 = (f32[8,8]{1,0}, f32[8,8]{1,0}) collective-permute-start(%f), channel_id=2, source_target_pairs={{0,1},{1,0}}
  %c = f32[8,8]{1,0} conditional(%i, %x, %x), branch_computations={%mm, %mm}
  %d2 = f32[8,8]{1,0} collective-permute-done(%s2)
  %s3 = (f32[8,8]{1,0}, f32[8,8]{1,0}) collective-permute-start(%c), channel_id=3, source_target_pairs={{0,1},{1,0}}
  %a = f32[8,8]{1,0} add(%c, %c)
  ROOT %d3 = f32[8,8]{1,0} collective-permute-done(%s3)
}
"""  # noqa: E501


def test_a_transfer_is_hidden_when_a_computation_is_scheduled_inside_its_window():
    mesh = jax.make_mesh((2,), ("pipe",), axis_types=(jax.sharding.AxisType.Auto,))
    found = target.collectives(SCHEDULED, mesh)
    assert [c.hidden for c in found] == [True, True, False]
    summary = target.Report(
        "t", None, {"pipe": 2}, 0, 0, 0, 0, 0, None, None, tuple(found), None, None, None
    ).collective_summary()
    assert [(e["count"], e["hidden"]) for e in summary] == [(3, 2)]


@pytest.mark.slow
def test_train_gpt_target_cpu_prints_the_report_and_runs_nothing():
    out = _example("train_gpt.py", "--target", "cpu", "--stages", "2", "--layers", "4")
    assert "(compile only)" in out and "loss" not in out and "final:" not in out
    assert "memory per device" in out and "collective-permute  over pipe" in out


# ----------------------------------------------------------------------------- TPU compiler
@NEEDS_LIBTPU
def test_tpu_report_of_a_pipeline_step():
    t = target.get("v5p:2x2x1")
    assert len(t.devices) == 4 and t.memory_per_device == 95 * 2**30
    mesh = t.mesh((4,), ("pipe",))
    step, params, x = pipeline_step(mesh)
    report = t.compile(step, params, x)
    compiled = jax.jit(step).lower(params, x).compile()
    assert report.temp_bytes == compiled.memory_analysis().temp_size_in_bytes > 0
    assert report.peak_bytes is not None and report.peak_bytes >= report.argument_bytes
    assert report.fits is True and report.headroom_bytes == t.memory_per_device - report.peak_bytes
    assert report.optimal_seconds is not None and report.optimal_seconds > 0
    permutes = [c for c in report.collectives if c.kind == "collective-permute"]
    assert permutes and all(c.axes == ("pipe",) and c.in_loop for c in permutes)
    # an activation (or its gradient) per transfer: one micro-batch of [ROWS / M, WIDTH] f32
    assert {c.nbytes for c in permutes} == {ROWS // 8 * WIDTH * 4}
    assert "optimal_seconds" in str(report)


@NEEDS_LIBTPU
def test_tpu_compiler_refusing_a_step_raises_does_not_fit():
    t = target.get("v5e:2x2")  # 16 GiB per chip
    mesh = t.mesh((4,), ("pipe",))
    x = jax.ShapeDtypeStruct((5 * 2**30,), jnp.float32, sharding=NamedSharding(mesh, P()))
    with pytest.raises(target.DoesNotFit, match="(?s)does NOT FIT.*more pipeline stages"):
        t.compile(lambda x: x * 2, x)


@NEEDS_LIBTPU
def test_v4_devices_share_a_chip():
    t = target.get("v4:2x2x1")
    assert t.devices_per_chip == 2 and t.memory_per_device == 16 * 2**30


@NEEDS_LIBTPU
@pytest.mark.slow
@pytest.mark.parametrize("script", ["train_gpt.py", "train_llama.py"])
def test_examples_target_tpu(script):
    out = _example(script, "--target", "v5p:2x2x2")
    assert "target v5p:2x2x2: mesh pipe 4 x data 2 (8 devices)" in out
    assert "fits: headroom" in out and "optimal_seconds" in out
    assert "collective-permute  over pipe" in out


# ----------------------------------------------------------------------------- GPU compiler
@NEEDS_CUDA_PLUGIN
def test_gpu_report_of_a_pipeline_step():
    t = target.get("h100x4")
    assert len(t.devices) == 4 and t.platform == "cuda"
    mesh = t.mesh((4,), ("pipe",))
    step, params, x = pipeline_step(mesh)
    report = t.compile(step, params, x)
    assert report.temp_bytes > 0 and report.capacity_bytes == t.chip.memory_bytes
    assert report.fits is True
    permutes = [c for c in report.collectives if c.kind == "collective-permute"]
    assert permutes and all(c.axes == ("pipe",) and c.in_loop for c in permutes)
    assert {c.nbytes for c in permutes} == {ROWS // 8 * WIDTH * 4}


def _example(script, *flags):
    env = dict(os.environ)
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *flags],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_abstract_keeps_shapes_and_puts_shardings():
    mesh = target.get("cpu:8").mesh((8,), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    tree = {"a": np.zeros((8, 3), np.float32), "b": jax.ShapeDtypeStruct((16,), jnp.int32)}
    out = target.abstract(tree, sharding)
    assert out["a"].shape == (8, 3) and out["b"].dtype == jnp.int32
    assert out["a"].sharding == sharding == out["b"].sharding


@NEEDS_LIBTPU
def test_a_mesh_axis_may_split_a_physical_axis():
    """pipe 2 x fsdp 64 on v5p:4x4x8 (physical 4 x 4 x 8): the pipe axis takes half of a
    physical axis of 4, which ``jax.make_mesh`` alone refuses."""
    mesh = target.get("v5p:4x4x8").mesh((2, 64), ("pipe", "fsdp"))
    assert dict(mesh.shape) == {"pipe": 2, "fsdp": 64}
    assert len({d.id for d in mesh.devices.flat}) == 128


def _nodes_per_group(mesh, axis: str, node_of) -> set:
    """How many nodes the groups of ``axis`` hold (one figure per group size seen)."""
    nodes = np.vectorize(node_of, otypes=[int])(mesh.devices)
    moved = np.moveaxis(nodes, mesh.axis_names.index(axis), -1)
    return {len(set(group)) for group in moved.reshape(-1, moved.shape[-1]).tolist()}


@pytest.mark.parametrize("name,shape,across,spans", [
    ("4xv5p:2x2x1", (4, 2, 2), {"pipe": 2, "data": 2}, {"pipe": 2, "data": 2, "tensor": 1}),
    ("4xv5p:2x2x1", (4, 2, 2), "pipe", {"pipe": 4, "data": 1, "tensor": 1}),
    ("h100x32", (2, 2, 8), {"pipe": 2, "data": 2}, {"pipe": 2, "data": 2, "tensor": 1}),
    ("h100x32", (4, 1, 8), {"pipe": 2, "tensor": 2}, {"pipe": 2, "data": 1, "tensor": 2}),
])  # fmt: skip
def test_a_mesh_spans_nodes_on_the_axes_named_across_and_no_other(name, shape, across, spans):
    """On a target of 4 slices or GPU nodes, each axis's groups hold devices of as many
    nodes as ``across`` gives it, the other axes' groups devices of one node, and the mesh
    holds every device once."""
    if (name.startswith("h100") and not HAS_CUDA_PLUGIN) or ("v5p" in name and not HAS_LIBTPU):
        pytest.skip("needs the target's compiler")
    t = target.get(name)
    assert t.nodes == 4
    mesh = t.mesh(shape, ("pipe", "data", "tensor"), across=across)
    assert mesh.axis_names == ("pipe", "data", "tensor")
    assert dict(mesh.shape) == dict(zip(("pipe", "data", "tensor"), shape, strict=True))
    assert len({d.id for d in mesh.devices.flat}) == len(t.devices)
    for axis, count in spans.items():
        assert _nodes_per_group(mesh, axis, t.links.node_of) == {count}, axis


@pytest.mark.parametrize("across", [{"pipe": 2}, {"pipe": 3, "data": 2}, {"tensor": 8}, "data"])
def test_across_that_does_not_split_the_nodes_exactly_is_refused(across):
    """Counts whose product is not the nodes, or that do not divide their axis: refused,
    naming the mesh and what to pass."""
    sizes = {"pipe": 4, "data": 2, "tensor": 2}
    with pytest.raises(target.TargetError, match=r"across=.*\{axis: count"):
        target.node_counts(sizes, across, 4)
    assert target.node_counts(sizes, None, 4) == {"pipe": 4}
    assert target.node_counts(sizes, {"pipe": 2, "data": 2, "tensor": 1}, 4) == {
        "pipe": 2, "data": 2
    }  # fmt: skip
