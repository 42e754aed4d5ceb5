"""FSDP with tensor parallelism, in the programs the CPU, TPU (v5p) and GPU (H100) compilers
build (compiled ahead of time with `jaxpipe.target`; the accelerators' skipped without
libtpu or jax's CUDA plugin): a Llama-style block split the way Megatron splits it over
``tensor``, its other weight dimension over ``fsdp``. Stage weights are all-gathered and
their gradients reduce-scattered over ``fsdp`` only, each device moving its own ``tensor``
share: nothing of a weight is gathered over ``tensor``, and the largest gathered weight is
one chunk's ``tensor`` share. Gathered ``"ahead"``, the gathers and reduce-scatters of the
tick loop run behind a stage's computation."""

import functools
import importlib.util

import jax
import llama
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe import pipeline, target

try:
    HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
except ModuleNotFoundError:
    HAS_CUDA_PLUGIN = False
# All slow (each step compiles for 10-20 s on CPU); one xdist group per compiler, so that a
# parallel run compiles each of its steps once (`compiled` is cached per worker).
COMPILERS = [
    pytest.param("cpu:8", marks=[pytest.mark.slow, pytest.mark.xdist_group("fsdp-cpu")]),
    pytest.param(
        "v5p:2x2x2",
        marks=[
            pytest.mark.slow,
            pytest.mark.xdist_group("fsdp-v5p"),
            pytest.mark.skipif(
                importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed"
            ),
        ],
    ),
    pytest.param(
        "h100x8",
        marks=[
            pytest.mark.slow,
            pytest.mark.xdist_group("fsdp-h100"),
            pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason="jax's CUDA plugin is missing"),
        ],
    ),
]
# Weights much larger than one micro-batch's activations ([1, 8, 128], 4 KiB in float32),
# so that a collective of a weight cannot be mistaken for one of an activation.
CONFIG = llama.Config(width=128, heads=4, kv_heads=2, hidden=512, seq=8, vocab=32)
MESHES = {  # name -> (S, other axes)
    "pipe2-fsdp2-tensor2": (2, (("fsdp", 2), ("tensor", 2))),
    "pipe2-data2-tensor2": (2, (("data", 2), ("tensor", 2))),
    "pipe4-fsdp2": (4, (("fsdp", 2),)),
    "pipe4-data2": (4, (("data", 2),)),
}
BLOCKS, M, ROWS = 8, 4, 1  # decoder blocks (split over the S stages), micro-batches, rows
# XLA's GPU scheduler keeps one collective in flight at a time unless told otherwise; with
# weights gathered ahead, a tick has up to four: two transfers between stages, a gather and
# a reduce-scatter.
GPU_AHEAD_OPTIONS = {"xla_gpu_experimental_parallel_collective_overlap_limit": 4}


@functools.cache
def compiled(name: str, mesh_name: str, gather: str = "per_use"):
    """The `jaxpipe.target.Report` of a training step (``value_and_grad`` of the pipeline's
    loss, ``1f1b``, and an Adam update, parameters and optimizer state donated, as a
    training loop compiles it) on mesh ``mesh_name`` of target ``name``, and the bytes of
    one chunk's weights that are split over fsdp (whole). Gathered ``"ahead"`` on a GPU,
    compiled with `GPU_AHEAD_OPTIONS`."""
    S, extra = MESHES[mesh_name]
    tgt = target.get(name)
    mesh = tgt.mesh((S, *(n for _, n in extra)), ("pipe", *(a for a, _ in extra)))
    pipe = pipeline.Pipeline(
        llama.make_stage_fn(CONFIG),
        llama.loss_fn,
        mesh=mesh,
        schedule="1f1b",
        num_microbatches=M,
        fsdp_gather=gather,
    )
    specs = llama.megatron_specs(
        "tensor" if "tensor" in mesh.shape else None, "fsdp" if "fsdp" in mesh.shape else None
    )
    logical = jax.eval_shape(lambda: llama.init_blocks(jax.random.key(0), CONFIG, S, BLOCKS // S))
    shapes = jax.eval_shape(lambda tree: pipe.place(tree, specs), logical)
    params = target.abstract(shapes, pipe.layout.shardings(shapes, specs))
    replicated = NamedSharding(mesh, P())
    outer = target.abstract(
        jax.eval_shape(lambda: llama.init_outer(jax.random.key(1), CONFIG)), replicated
    )
    tokens, targets, positions = jax.eval_shape(
        lambda: llama.data(jax.random.key(2), CONFIG, ROWS * M * pipe.num_replicas)
    )
    rows = NamedSharding(mesh, P(pipe.data_axes))
    tokens, targets = target.abstract((tokens, targets), rows)
    positions = target.abstract(positions, replicated)
    opt = optax.adam(1e-3)
    opt_state = jax.eval_shape(opt.init, params)
    opt_state = target.abstract(opt_state, jax.tree.map(lambda s: s.sharding, opt_state))

    ahead_on_gpu = gather == "ahead" and tgt.platform == "cuda"

    @functools.partial(
        jax.jit, donate_argnums=(0, 1), compiler_options=GPU_AHEAD_OPTIONS if ahead_on_gpu else None
    )
    def step(params, opt_state, outer, tokens, targets, positions):
        def loss(params):
            x = outer["embed"][tokens]
            return pipe.loss(params, outer, x, targets, side={"positions": positions})

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    report = tgt.compile(step, params, opt_state, outer, tokens, targets, positions)
    split = [k for k, spec in specs.items() if spec is not None and "fsdp" in tuple(spec)]
    chunk_bytes = sum(logical[k].size * logical[k].dtype.itemsize for k in split) // S
    return report, chunk_bytes


ACTIVATION_BYTES = ROWS * CONFIG.seq * CONFIG.width * 4


def _weighty(report, kinds=("all-gather", "reduce-scatter", "all-to-all")):
    return [c for c in report.collectives if c.kind in kinds and c.nbytes > ACTIVATION_BYTES]


@pytest.mark.parametrize("name", COMPILERS)
def test_fsdp_with_tensor_moves_weights_over_fsdp_only(name):
    """pipe 2 x fsdp 2 x tensor 2, per use: every all-gather and reduce-scatter larger than
    a micro-batch's activation runs over fsdp alone (none over tensor), each all-gather
    moves at most one chunk's weights over tensor (its fsdp-gathered, tensor-split share);
    there are such all-gathers and reduce-scatters. All-to-alls over tensor (the TPU
    compiler's relayouts inside a tensor-parallel stage) move no more than in the
    pipe 2 x data 2 x tensor 2 step of the same model, which has no FSDP."""
    report, chunk_bytes = compiled(name, "pipe2-fsdp2-tensor2")
    share = chunk_bytes // 2  # over tensor 2
    moved = _weighty(report, ("all-gather", "reduce-scatter"))
    assert {c.kind for c in moved} == {"all-gather", "reduce-scatter"}, moved
    for c in moved:
        assert c.axes == ("fsdp",), c.line
        if c.kind == "all-gather":
            assert c.nbytes <= share, (c.nbytes, share, c.line)
    relayouts = _weighty(report, ("all-to-all",))
    assert all(c.axes == ("tensor",) for c in relayouts), relayouts
    if relayouts:
        data_parallel, _ = compiled(name, "pipe2-data2-tensor2")
        baseline = sum(c.nbytes for c in _weighty(data_parallel, ("all-to-all",)))
        assert sum(c.nbytes for c in relayouts) <= baseline, (relayouts, baseline)


PAIRS = [  # (FSDP mesh, the data-parallel mesh of the same size, tensor size)
    ("pipe2-fsdp2-tensor2", "pipe2-data2-tensor2", 2),
    ("pipe4-fsdp2", "pipe4-data2", 1),
]


@pytest.mark.slow
@pytest.mark.parametrize(("fsdp_mesh", "data_mesh", "tensor"), PAIRS)
@pytest.mark.parametrize("name", COMPILERS)
def test_per_use_fsdp_temp_is_data_parallel_plus_at_most_one_gathered_chunk(
    name, fsdp_mesh, data_mesh, tensor
):
    """The per-use FSDP step's temp is at most the data-parallel step's (same model, same
    number of devices) plus one chunk's fsdp-gathered weights (their tensor share): the
    gathered chunk is the one transient FSDP adds, and its smaller gradient accumulator
    pays for the full-size weight gradient before its reduce-scatter. Both steps donate
    their parameters and optimizer state: undonated, the compilers place temporaries in
    the output buffers, which temp leaves out, and data parallelism's outputs are twice
    FSDP's."""
    fsdp, chunk_bytes = compiled(name, fsdp_mesh)
    data, _ = compiled(name, data_mesh)
    for report in (fsdp, data):  # all outputs but a few scalars reuse donated arguments
        assert report.output_bytes - report.alias_bytes <= 1024, report
    share = chunk_bytes // tensor
    assert fsdp.temp_bytes <= data.temp_bytes + share, (fsdp.temp_bytes, data.temp_bytes, share)


def _accelerator(name: str, *extra):
    (param,) = [p for p in COMPILERS if p.values[0] == name]
    return pytest.param(name, marks=[*param.marks, *extra])


# On the TPU compiler these collectives stay synchronous (its default, and with its
# asynchronous collective fusion options too): only the GPU compiler is checked.
@pytest.mark.parametrize("mesh_name", ["pipe2-fsdp2-tensor2"])
@pytest.mark.parametrize("name", [_accelerator("h100x8")])
def test_fsdp_gathered_ahead_runs_its_gathers_behind_a_stage(name, mesh_name):
    """``fsdp_gather="ahead"``: in the scheduled program, every all-gather over fsdp inside
    the tick loop (larger than a micro-batch's activation) is asynchronous, a ``-start`` and
    a ``-done`` with a stage's computation scheduled between them; there are such
    all-gathers. (With ``"per_use"`` they sit inside the actions' branches, and none is.)"""
    report, _ = compiled(name, mesh_name, "ahead")
    gathers = [c for c in _weighty(report, ("all-gather",)) if c.in_loop]
    assert gathers
    assert all(c.axes == ("fsdp",) for c in gathers), gathers
    assert all(c.hidden for c in gathers), [c.line[:100] for c in gathers]


@pytest.mark.parametrize("mesh_name", ["pipe2-fsdp2-tensor2"])
@pytest.mark.parametrize("name", [_accelerator("h100x8")])
def test_fsdp_gathered_ahead_runs_its_reduce_scatters_behind_a_stage(name, mesh_name):
    """``fsdp_gather="ahead"``: every reduction of a weight gradient over fsdp inside the
    tick loop (a reduce-scatter, or the all-reduce a compiler makes of one) is asynchronous
    with a stage's computation between its ``-start`` and ``-done``."""
    report, _ = compiled(name, mesh_name, "ahead")
    kinds = ("reduce-scatter", "all-reduce")
    reductions = [c for c in _weighty(report, kinds) if c.in_loop and "fsdp" in c.axes]
    assert reductions
    assert all(c.hidden for c in reductions), [c.line[:100] for c in reductions]
