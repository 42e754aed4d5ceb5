"""``fsdp_gather="per_block"``: a stage that runs its blocks in a ``lax.scan`` or a Python
loop over stacked weights gathers each block's FSDP-split weights just before the block runs
and reduce-scatters the block's weight gradient just after its backward
(`jaxpipe._jaxpr.blockwise`). Exact against the plain model under every schedule, on pipe x
fsdp and pipe x fsdp x tensor meshes; no gathered weight is kept for the backward."""

import functools
import importlib.util

import jax
import jax.numpy as jnp
import llama
import models
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe import pipeline, reference, schedules, target
from jaxpipe._executor.sharding import WeightSharding
from jaxpipe._jaxpr import blockwise

CONFIG = llama.Config(width=16, heads=4, kv_heads=2, hidden=32, seq=4, vocab=16)
MESHES = {
    "pipe2-fsdp2": (2, (("fsdp", 2),)),
    "pipe2-fsdp2-tensor2": (2, (("fsdp", 2), ("tensor", 2))),
}
OPTIONS = {
    "interleaved_1f1b": {"virtual_stages": 2},
    "interleaved_zb": {"virtual_stages": 2},
}
M, ROWS, BLOCKS = 4, 2, 3  # micro-batches, rows per micro-batch and replica, blocks a stage


def scanned_stage(p, x, *, side):
    """The stage's blocks in a ``lax.scan`` over their stacked weights (three blocks: the
    pipeline keeps the scan a loop, `jaxpipe._jaxpr.unroll`)."""
    return llama.make_stage_fn(CONFIG)(p, x, side=side)


def unrolled_stage(p, x, *, side):
    """Two blocks in a ``lax.scan`` short enough that the pipeline writes it out as a loop
    (`jaxpipe._jaxpr.unroll`), then the third."""
    first = jax.tree_util.tree_map(lambda a: a[:2], p)
    x = llama.make_stage_fn(CONFIG)(first, x, side=side)
    return llama.block(jax.tree_util.tree_map(lambda a: a[2], p), x, side["positions"], CONFIG)


def looped_stage(p, x, *, side):
    """The stage's blocks in a Python loop, block ``j``'s weights ``p[...][j]``."""
    for j in range(jax.tree_util.tree_leaves(p)[0].shape[0]):
        block = jax.tree_util.tree_map(lambda a, j=j: a[j], p)
        x = llama.block(block, x, side["positions"], CONFIG)
    return x


STAGES = {"scanned": scanned_stage, "looped": looped_stage, "unrolled": unrolled_stage}


@functools.cache
def _reference(num_logical_stages):
    @jax.jit
    def draw(key):
        k_stages, k_outer = jax.random.split(key)
        stages = llama.init_blocks(k_stages, CONFIG, num_logical_stages, BLOCKS)
        return stages, llama.init_outer(k_outer, CONFIG)

    return draw(jax.random.key(0, impl="rbg"))


def _batch(rows):
    tokens, targets, positions = llama.data(jax.random.key(3), CONFIG, rows)
    return tokens, targets, {"positions": positions}


@functools.cache
def _plain(num_logical_stages, rows):
    """Loss and gradients (stages', outer's) of the plain model: the scanned stage."""
    params, outer = _reference(num_logical_stages)
    tokens, targets, side = _batch(rows)

    def plain(params, outer):
        x = outer["embed"][tokens]
        return reference.loss(scanned_stage, llama.loss_fn, params, outer, x, targets, M, side=side)

    return jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))(params, outer)


def _exact(mesh_name, schedule, form):
    S, extra = MESHES[mesh_name]
    pipe = pipeline.Pipeline(
        STAGES[form],
        llama.loss_fn,
        mesh=models.pipe_mesh(S, extra),
        schedule=schedule,
        num_microbatches=M,
        schedule_options=OPTIONS.get(schedule),
        fsdp_gather="per_block",
    )
    params, outer = _reference(pipe.num_logical_stages)
    tensor = "tensor" if "tensor" in pipe.mesh.shape else None
    placed = pipe.place(params, llama.megatron_specs(tensor, "fsdp"))
    tokens, targets, side = _batch(ROWS * pipe.num_replicas * M)

    def loss(params, outer):
        return pipe.loss(params, outer, outer["embed"][tokens], targets, side=side)

    got, (grads, outer_grads) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(placed, outer)
    want, (want_grads, want_outer) = _plain(pipe.num_logical_stages, tokens.shape[0])
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert models.relative_error(pipe.logical(grads), want_grads) < 1e-5
    assert models.relative_error(outer_grads, want_outer) < 1e-5
    for name, leaf in grads.items():  # gradients come back split like the parameters
        assert leaf.sharding.is_equivalent_to(placed[name].sharding, leaf.ndim), name


def _case(i, schedule):
    """Every synchronous schedule, the meshes and stage forms taken in turn."""
    mesh = list(MESHES)[i % 2]
    form = list(STAGES)[i % 3]
    return pytest.param(mesh, schedule, form, marks=pytest.mark.slow)


# (the schedules that update weights inside the pipeline, pipedream's, take no batch axes)
SYNCHRONOUS = [s for s in schedules.names() if not s.startswith("pipedream")]


@pytest.mark.parametrize(
    ("mesh_name", "schedule", "form"), [_case(i, s) for i, s in enumerate(SYNCHRONOUS)]
)
def test_exact_under_every_schedule(mesh_name, schedule, form):
    _exact(mesh_name, schedule, form)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_exact_with_the_stages_scan_kept_as_on_gpus(monkeypatch, schedule):
    """On GPUs ``"per_block"`` runs the stage's own scan of blocks, not the loop it is
    written out as elsewhere: exact against the plain model there too, with the backward
    whole (1f1b) and split (zbv)."""
    kept = []

    def rolled(self, params, x, context):
        kept.append(True)
        return self._stage_call(params, x, context, rolled=True)

    monkeypatch.setattr(pipeline.Pipeline, "_per_block_stage_call", rolled)
    _exact("pipe2-fsdp2-tensor2", schedule, "scanned")
    assert kept


def test_exact_with_an_nnx_scan_over_stacked_modules():
    """Blocks made by ``nnx.vmap`` and run by ``nnx.scan`` (the stage merges its weights into
    the modules), pipe 2 x fsdp 2, 1f1b: loss and gradients those of the plain model."""
    from flax import nnx

    width, hidden = 8, 16

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(width, hidden, rngs=rngs)
            self.down = nnx.Linear(hidden, width, use_bias=False, rngs=rngs)

        def __call__(self, x):
            return x + self.down(jnp.tanh(self.up(x)))

    @nnx.split_rngs(splits=BLOCKS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return Block(rngs)

    states = [nnx.split(make(nnx.Rngs(k))) for k in range(2)]
    graphdef = states[0][0]
    params = jax.tree.map(lambda *a: jnp.stack(a), *[s for _, s in states])

    def stage_fn(p, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, one):
            return one(x)

        return run(x, nnx.merge(graphdef, p))

    def loss_fn(_, y, t):
        return jnp.mean((y - t) ** 2)

    pipe = pipeline.Pipeline(
        stage_fn, loss_fn, mesh=models.pipe_mesh(2, (("fsdp", 2),)), schedule="1f1b",
        num_microbatches=M, fsdp_gather="per_block",
    )  # fmt: skip
    specs = jax.tree.map(lambda a: P(None, "fsdp") if a.ndim == 4 else None, params)
    placed = pipe.place(params, specs)
    x = jax.random.normal(jax.random.key(7), (2 * M * ROWS, width))
    t = jax.random.normal(jax.random.key(8), (2 * M * ROWS, width))
    got, grads = jax.jit(jax.value_and_grad(lambda p: pipe.loss(p, None, x, t)))(placed)
    want, want_grads = jax.value_and_grad(
        lambda p: reference.loss(stage_fn, loss_fn, p, None, x, t, M)
    )(params)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert models.relative_error(pipe.logical(grads), want_grads) < 1e-5


def test_exact_with_uneven_stacked_layers():
    """`jaxpipe.partition.stack_layers` (stages of 3 and 2 layers, the second padded) run by
    `jaxpipe.partition.layered_stage_fn` (a scan whose body runs each layer in a
    ``lax.cond`` on its ``active`` flag), pipe 2 x fsdp 2, 1f1b: loss and gradients those
    of the plain model."""
    from jaxpipe import partition

    width = 8
    keys = jax.random.split(jax.random.key(9), 5)
    layers = [{"w": jax.random.normal(k, (width, width)) / width**0.5} for k in keys]
    params = partition.stack_layers(layers, [(0, 3), (3, 5)])
    stage_fn = partition.layered_stage_fn(lambda p, x: x + jnp.tanh(x @ p["w"]))

    def loss_fn(_, y, t):
        return jnp.mean((y - t) ** 2)

    pipe = pipeline.Pipeline(
        stage_fn, loss_fn, mesh=models.pipe_mesh(2, (("fsdp", 2),)), schedule="1f1b",
        num_microbatches=M, fsdp_gather="per_block",
    )  # fmt: skip
    placed = pipe.place(params, {"layers": {"w": P(None, "fsdp")}, "active": None})
    x = jax.random.normal(jax.random.key(10), (2 * M * ROWS, width))
    t = jax.random.normal(jax.random.key(11), (2 * M * ROWS, width))
    got, grads = jax.jit(jax.value_and_grad(lambda p: pipe.loss(p, None, x, t)))(placed)
    want, want_grads = jax.value_and_grad(
        lambda p: reference.loss(stage_fn, loss_fn, p, None, x, t, M)
    )(params)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert models.relative_error(pipe.logical(grads), want_grads) < 1e-5


# ---------------------------------------------------------------- the rewritten stage alone
K, D = 3, 8


def _blocks(p, x):
    return jnp.tanh(x @ p["a"]) @ p["b"]


def _scan_stage(p, x, context):
    return lax.scan(lambda x, q: (_blocks(q, x), None), x, p)[0]


def _loop_stage(p, x, context):
    for j in range(K):
        x = _blocks(jax.tree_util.tree_map(lambda a, j=j: a[j], p), x)
    return x


@pytest.mark.parametrize("stage", [_scan_stage, _loop_stage])
def test_backward_keeps_shards_and_gathers_per_block(stage):
    """fsdp 2: the rewritten stage's vjp keeps no gathered weight (only the shards, as
    they came in, or one block's shard); its forward runs one all-gather per block and
    weight, and its backward one all-gather and one reduce-scatter per block and weight,
    each of one block's weights (tiled reduce-scatters); exact against the plain stage."""
    mesh = models.pipe_mesh(1, (("fsdp", 2),))
    keys = jax.random.split(jax.random.key(1), 3)
    params = {
        "a": jax.random.normal(keys[0], (K, D, 2 * D)),
        "b": jax.random.normal(keys[1], (K, 2 * D, D)),
    }
    x = jax.random.normal(keys[2], (4, D))
    specs = [P(None, "fsdp"), P(None, None, "fsdp")]  # dims after the stage axis
    weights = WeightSharding.of(jax.tree_util.tree_structure(params), specs, ("fsdp",), "per_block")
    rewritten = blockwise.per_block(stage, weights, {"fsdp": 2})
    found = {}

    def body(p, x, dy):
        y, vjp_fn = jax.vjp(lambda p, x: rewritten(p, x, None), p, x)
        found["saved"] = [jnp.shape(a) for a in jax.tree_util.tree_leaves(vjp_fn)]
        found["jaxpr"] = jax.make_jaxpr(lambda p, x, dy: jax.vjp(
            lambda p, x: rewritten(p, x, None), p, x)[1](dy))(p, x, dy)  # fmt: skip
        return y, vjp_fn(dy)

    # each replica its own rows; the weight gradient is the sum of the replicas'
    in_specs = ({"a": P(None, "fsdp"), "b": P(None, None, "fsdp")}, P("fsdp"), P("fsdp"))
    run = jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=(P("fsdp"), (in_specs[0], P("fsdp"))),
        axis_names={"fsdp"}, check_vma=False,
    )  # fmt: skip
    dy = jax.random.normal(jax.random.key(4), (4, D))
    y, (d_params, dx) = jax.jit(run)(params, x, dy)
    want_y, want_vjp = jax.vjp(lambda p, x: stage(p, x, None), params, x)
    want_dp, want_dx = want_vjp(dy)
    assert models.relative_error((y, d_params, dx), (want_y, want_dp, want_dx)) < 1e-5

    whole = {(D, 2 * D), (2 * D, D), (K, D, 2 * D), (K, 2 * D, D)}
    assert found["saved"] and not whole & set(found["saved"]), found["saved"]
    counts = {"all_gather": 0, "reduce_scatter": 0}
    for eqn in _all_eqns(found["jaxpr"].jaxpr):
        if eqn.primitive.name in counts:
            counts[eqn.primitive.name] += 1
            shard = eqn.invars[0] if eqn.primitive.name == "all_gather" else eqn.outvars[0]
            assert shard.aval.size == D * D, eqn  # one block's shard
            # tiled: the TPU compiler runs an untiled reduce-scatter as an all-reduce
            assert eqn.primitive.name == "all_gather" or eqn.params["tiled"], eqn
    if stage is _scan_stage:  # inside the forward's scan, and inside the backward's
        assert counts == {"all_gather": 2 + 2, "reduce_scatter": 2}
    else:
        assert counts == {"all_gather": 2 * K + 2 * K, "reduce_scatter": 2 * K}


def _one_block_stage(p, x, context):
    """One block's weights, unstacked: nothing to gather a block at a time."""
    return _blocks(p, x)


def _step_jaxpr(stage, mesh, stacked, specs, fsdp_gather=None):
    """The pipe's gather mode and the jaxpr of a training step (loss and gradients, 1f1b,
    M = 4) on ``mesh`` of a stage's weights ``a``, ``b`` (``[2, K, ...]`` if ``stacked``,
    else ``[2, ...]``), as shapes placed on the mesh, with ``fsdp_gather`` (None: the
    default)."""
    chosen = {} if fsdp_gather is None else {"fsdp_gather": fsdp_gather}
    pipe = pipeline.Pipeline(
        lambda p, x: stage(p, x, None), lambda _, y, t: jnp.mean((y - t) ** 2), mesh=mesh,
        schedule="1f1b", num_microbatches=M, **chosen,
    )  # fmt: skip
    lead = (2, K) if stacked else (2,)
    logical = {
        "a": jax.ShapeDtypeStruct((*lead, D, 2 * D), jnp.float32),
        "b": jax.ShapeDtypeStruct((*lead, 2 * D, D), jnp.float32),
    }
    shapes = jax.eval_shape(lambda p: pipe.place(p, specs), logical)
    placed = target.abstract(shapes, pipe.layout.shardings(shapes, specs))
    rows = NamedSharding(mesh, P(pipe.data_axes))
    x = jax.ShapeDtypeStruct((2 * M * ROWS, D), jnp.float32, sharding=rows)
    step = jax.make_jaxpr(jax.grad(lambda p, x: pipe.loss(p, None, x, x)))(placed, x)
    return pipe.gather_mode(placed, x), step


def _fsdp_specs(stacked):
    inner = (None,) if stacked else ()
    return {"a": P(*inner, "fsdp"), "b": P(*inner, None, "fsdp")}


try:
    HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
except ModuleNotFoundError:
    HAS_CUDA_PLUGIN = False


@pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason="jax's CUDA plugin is missing")
@pytest.mark.parametrize(
    ("stage", "stacked", "picked"),
    [(_scan_stage, True, "per_block"), (_loop_stage, True, "per_block"),
     (_one_block_stage, False, "per_use")],
)  # fmt: skip
def test_default_on_gpus_gathers_per_block_where_the_stage_takes_blocks(stage, stacked, picked):
    """``fsdp_gather``'s default on pipe 2 x fsdp 2 of H100s (traced for them, not run):
    ``"per_block"`` for a stage that scans or loops over its stacked blocks (every
    all-gather of the step gathers one block's shard, none a stack), ``"per_use"`` for a
    stage of one block's unstacked weights; in either case the step is the one that mode
    builds."""
    mesh = target.get("h100x4").mesh((2, 2), ("pipe", "fsdp"))
    specs = _fsdp_specs(stacked)
    mode, step = _step_jaxpr(stage, mesh, stacked, specs)
    assert mode == picked
    gathered = [e.invars[0].aval.shape for e in _all_eqns(step.jaxpr) if e.primitive.name
                == "all_gather"]  # fmt: skip
    assert gathered
    if stacked:  # one block's shard, [D / 2, 2 D] or [2 D, D / 2], never [K, ...]
        assert all(len(shape) == 2 for shape in gathered), gathered
    assert str(step) == str(_step_jaxpr(stage, mesh, stacked, specs, picked)[1])


TPU = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="no libtpu")


@pytest.mark.parametrize("platform", ["cpu", pytest.param("tpu", marks=TPU)])
def test_default_on_tpus_and_cpus_gathers_per_use(platform):
    """On CPU host devices and TPUs the default stays ``"per_use"``, also for a scanned
    stage (on v5p ``"per_block"`` was predicted slower at width 4096: the Pipeline
    docstring)."""
    if platform == "cpu":
        mesh = models.pipe_mesh(2, (("fsdp", 2),))
    else:
        mesh = target.get("v5p:2x2x1").mesh((2, 2), ("pipe", "fsdp"))
    mode, step = _step_jaxpr(_scan_stage, mesh, True, _fsdp_specs(True))
    assert mode == "per_use"
    assert str(step) == str(_step_jaxpr(_scan_stage, mesh, True, _fsdp_specs(True), "per_use")[1])


def test_default_gathers_nothing_without_split_weights():
    """On pipe 2 x data 2 (weights whole on every replica) the default gathers nothing and
    builds ``"per_use"``'s step."""
    mesh = models.pipe_mesh(2, (("data", 2),))
    mode, step = _step_jaxpr(_scan_stage, mesh, True, None)
    assert mode == "per_use"
    assert not [e for e in _all_eqns(step.jaxpr) if e.primitive.name == "all_gather"]
    assert str(step) == str(_step_jaxpr(_scan_stage, mesh, True, None, "per_use")[1])


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                yield from _all_eqns(inner)


# ------------------------------------------------------------- memory on the accelerators
ACCELERATORS = [
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
# pipe 2 x fsdp 2; a stage of 8 blocks of 32 MiB (float32), rows of 4 KiB
MEM_BLOCKS, MEM_WIDTH, MEM_HIDDEN, MEM_ROWS = 8, 1024, 4096, 8


def _mlp_block(x, q):
    return x + jax.nn.gelu(x @ q["w1"]) @ q["w2"]


def _mlp_scanned(p, x):
    return lax.scan(lambda x, q: (_mlp_block(x, q), None), x, p)[0]


@functools.cache
def _compiled_peak(name, fsdp_gather=None):
    """The compiler's peak per chip (bytes) of a training step (gradients and a donated
    Adam update, 1f1b, M = 4) of a scanned stage of `MEM_BLOCKS` blocks on pipe 2 x fsdp 2
    of ``name``, with ``fsdp_gather`` (None: the default)."""
    tgt = target.get(name)
    mesh = tgt.mesh((2, 2), ("pipe", "fsdp"))
    chosen = {} if fsdp_gather is None else {"fsdp_gather": fsdp_gather}
    pipe = pipeline.Pipeline(
        _mlp_scanned, lambda _, y, t: jnp.mean((y - t) ** 2), mesh=mesh, schedule="1f1b",
        num_microbatches=M, **chosen,
    )  # fmt: skip
    K, W, H = MEM_BLOCKS, MEM_WIDTH, MEM_HIDDEN
    logical = {
        "w1": jax.ShapeDtypeStruct((2, K, W, H), jnp.float32),
        "w2": jax.ShapeDtypeStruct((2, K, H, W), jnp.float32),
    }
    specs = {"w1": P(None, "fsdp", None), "w2": P(None, None, "fsdp")}
    shapes = jax.eval_shape(lambda p: pipe.place(p, specs), logical)
    params = target.abstract(shapes, pipe.layout.shardings(shapes, specs))
    rows = NamedSharding(mesh, P("fsdp"))
    batch = jax.ShapeDtypeStruct((MEM_ROWS * M * 2, W), jnp.float32, sharding=rows)
    opt = optax.adam(1e-3)
    state = jax.eval_shape(opt.init, params)
    state = target.abstract(state, jax.tree.map(lambda s: s.sharding, state))

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p, s, x, t):
        loss, grads = jax.value_and_grad(pipe.loss)(p, None, x, t)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    return step.lower(params, state, batch, batch).compile().memory_analysis().peak_memory_in_bytes


@pytest.mark.parametrize("name", ACCELERATORS)
def test_compiled_peak_holds_two_blocks_gathered(name):
    """With ``"per_block"`` the compiler's peak per chip is at most 1.1x what the step must
    hold: the weights and Adam's moments (shards), the gradient accumulator and one
    backward's gradient (shards), two blocks' weights and one block's gradient gathered,
    and the activations (at most 19 MiB). (Measured with jax 0.10.2: 668.6 MiB on v5p,
    726.9 MiB on H100 against a bound of 830.4 MiB; ``"per_use"``, which gathers the
    stage's eight blocks at once, 835.6 and 964.2 MiB.)"""
    peak = _compiled_peak(name, "per_block")
    K, W, H = MEM_BLOCKS, MEM_WIDTH, MEM_HIDDEN
    block = 2 * W * H * 4
    shard = K * block // 2
    activations = 2 * M * K * MEM_ROWS * (W + 2 * H) * 4  # every block's, every micro-batch's
    bound = 1.1 * (3 * shard + 2 * shard + 3 * block + activations)
    assert peak <= bound, (peak / 2**20, bound / 2**20)


@pytest.mark.parametrize("name", ACCELERATORS[1:])
def test_compiled_peak_of_the_default_at_most_per_use(name):
    """On H100s the default ``fsdp_gather`` (``"per_block"`` for this scanned stage)
    holds at most what ``"per_use"`` holds, by the compiler's peak. (On TPUs the default
    is ``"per_use"``.)"""
    assert _compiled_peak(name) <= _compiled_peak(name, "per_use")


MEM_VOCAB = 8192


@functools.cache
def _pipe_1_peaks(name):
    """The compiler's peaks per chip (bytes) of one training step on pipe 1 x fsdp 4 of
    ``name``, jaxpipe's (``"per_block"``, one micro-batch) and the plain one's (``jax.jit``
    of the same loss, XLA splitting it over fsdp as the weights are split): `MEM_BLOCKS`
    scanned blocks and a head over `MEM_VOCAB` words with a cross-entropy, bfloat16
    compute copies of float32 weights, a donated Adam update."""
    tgt = target.get(name)
    mesh = tgt.mesh((1, 4), ("pipe", "fsdp"))
    K, W, H = MEM_BLOCKS, MEM_WIDTH, MEM_HIDDEN

    def head_loss(head, y, labels):
        logits = (y @ head).astype(jnp.float32)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))

    pipe = pipeline.Pipeline(
        _mlp_scanned, head_loss, mesh=mesh, schedule="1f1b", num_microbatches=1,
        fsdp_gather="per_block",
    )  # fmt: skip
    specs = {"w1": P(None, "fsdp", None), "w2": P(None, None, "fsdp")}
    logical = {
        "w1": jax.ShapeDtypeStruct((1, K, W, H), jnp.float32),
        "w2": jax.ShapeDtypeStruct((1, K, H, W), jnp.float32),
    }
    shapes = jax.eval_shape(lambda p: pipe.place(p, specs), logical)
    placed = target.abstract(shapes, pipe.layout.shardings(shapes, specs))
    head = target.abstract(
        jax.ShapeDtypeStruct((W, MEM_VOCAB), jnp.float32), NamedSharding(mesh, P(None, "fsdp"))
    )
    plain = target.abstract(
        {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in logical.items()},
        {k: NamedSharding(mesh, spec) for k, spec in specs.items()},
    )
    x = jax.ShapeDtypeStruct(
        (4 * MEM_ROWS, W), jnp.float32, sharding=NamedSharding(mesh, P("fsdp"))
    )
    labels = jax.ShapeDtypeStruct((4 * MEM_ROWS,), jnp.int32, sharding=x.sharding)

    def bf16(tree):
        return jax.tree.map(lambda a: a.astype(jnp.bfloat16), tree)

    def piped(params, x, labels):
        blocks, head = bf16(params)
        return pipe.loss(blocks, head, bf16(x), labels)

    def unpiped(params, x, labels):
        blocks, head = bf16(params)
        return head_loss(head, _mlp_scanned(blocks, bf16(x)), labels)

    def peak(loss, params):
        opt = optax.adam(1e-3)
        state = jax.eval_shape(opt.init, params)
        state = target.abstract(state, jax.tree.map(lambda s: s.sharding, state))

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(p, s, x, labels):
            value, grads = jax.value_and_grad(loss)(p, x, labels)
            updates, s = opt.update(grads, s, p)
            return optax.apply_updates(p, updates), s, value

        compiled = step.lower(params, state, x, labels).compile()
        return compiled.memory_analysis().peak_memory_in_bytes

    return peak(piped, (placed, head)), peak(unpiped, (plain, head))


@pytest.mark.parametrize(
    "name,ratio",
    [
        pytest.param(a.values[0], r, marks=a.marks)
        for a, r in zip(ACCELERATORS, (1.2, 1.35), strict=True)
    ],
)
def test_compiled_peak_at_pipe_1_at_most_the_plain_step(name, ratio):
    """With no pipeline (pipe 1 x fsdp 4, one micro-batch) the compiler's peak per chip of
    jaxpipe's step is within ``ratio`` of the plain step's, where XLA gathers each block's
    weights inside the scan as MaxText's step does: no float32 copy of the bfloat16
    gradients is held, as with one micro-batch nothing accumulates. (Measured with jax
    0.10.2 on v5p: 348.8 MiB against 297.0 MiB; 434.1 MiB with float32 accumulators. The
    rest is the head's gradient, held whole on each chip: loss parameters enter the
    pipeline replicated. On H100: 399.4 MiB against 303.2 MiB, the stage's scan kept; with
    its blocks written out as a loop the compiler gathered them all at once, 494.9 MiB.)"""
    ours, plain = _pipe_1_peaks(name)
    assert ours <= ratio * plain, (ours / 2**20, plain / 2**20)
