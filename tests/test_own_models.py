"""Layers written for other libraries as stages: sharding constraints inside a stage (Flax
logical-axis rules as MaxText writes its layers, plain ``with_sharding_constraint``),
modules built on another mesh, per-block kinds, adapters for modules with several inputs
and existing weights, and steps that compile once."""

import contextlib
import functools
import logging
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import models
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpipe

WIDTH, HIDDEN, SEQ = 16, 24, 4  # HIDDEN / 2 = 12 marks the tensor-split activations
# Logical-axis rules as MaxText writes them: activations' batch over the pipeline's manual
# axes, the MLP's hidden dimension over tensor.
RULES = (
    ("activation_batch", ("pipe", "data")),
    ("activation_length", None),
    ("activation_mlp", "tensor"),
    ("activation_embed", None),
)


class LogicalMlp(nn.Module):
    """A residual MLP block that constrains its activations by logical axis names."""

    @nn.compact
    def __call__(self, x):
        w_in = self.param("w_in", nn.initializers.normal(0.3), (WIDTH, HIDDEN))
        w_out = self.param("w_out", nn.initializers.normal(0.3), (HIDDEN, WIDTH))
        x = nn.with_logical_constraint(
            x, ("activation_batch", "activation_length", "activation_embed")
        )
        h = nn.with_logical_constraint(
            jnp.tanh(x @ w_in), ("activation_batch", "activation_length", "activation_mlp")
        )
        return x + h @ w_out


def named_mlp(mesh):
    """The same block with plain ``with_sharding_constraint``s on ``mesh``'s shardings."""

    def block(p, x):
        h = jnp.tanh(x @ p["w_in"])
        h = jax.lax.with_sharding_constraint(
            h, NamedSharding(mesh, P(("pipe", "data"), None, "tensor"))
        )
        return x + h @ p["w_out"]

    return block


def loss_fn(lp, y, target):
    return jnp.mean((y @ lp["head"] - target) ** 2)


def mesh_of(shape, names):
    count = int(np.prod(shape))
    return jax.make_mesh(
        shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
        devices=jax.devices()[:count],
    )  # fmt: skip


def plain_loss(blocks, stage_params, loss_params, x, t):
    """The model without the pipeline: every block in order, the loss over all rows."""
    for s, block in enumerate(blocks):
        x = block(jax.tree_util.tree_map(lambda a, s=s: a[s], stage_params), x)
    return loss_fn(loss_params, x, t)


def batch(key, rows):
    normal = models.numpy_rng(key).standard_normal
    x, t = normal((rows, SEQ, WIDTH)), normal((rows, SEQ, WIDTH))
    head = normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)
    return models.float32((x, t, {"head": head}))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:mesh axis 'tensor'")  # only the constraints name it
def test_constraints_inside_stages_keep_automatic_axes():
    """Logical constraints (rules naming pipe, data and tensor) in the first two stages and a
    plain NamedSharding constraint in the others run in a pipe 2 x data 2 x tensor 2
    pipeline: the manual axes are dropped, the tensor constraints hold in the compiled step,
    and loss and gradients equal the plain model's."""
    mesh = mesh_of((2, 2, 2), ("pipe", "data", "tensor"))
    module = LogicalMlp()
    linen_fn, linen_params = jaxpipe.stages.linen_stage(
        module, jax.random.key(0), jnp.zeros((2, SEQ, WIDTH)), 2
    )
    named_fn = named_mlp(mesh)
    _, more = jaxpipe.stages.linen_stage(module, jax.random.key(1), jnp.zeros((2, SEQ, WIDTH)), 2)
    stage_params = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b]), linen_params, more)

    def stage_fn(p, x, *, stage):
        return jax.lax.cond(stage < 2, linen_fn, named_fn, p, x)

    pipe = jaxpipe.Pipeline(
        stage_fn, loss_fn, mesh=mesh, schedule="interleaved_1f1b", num_microbatches=2,
        schedule_options={"virtual_stages": 2},
    )  # fmt: skip
    x, t, loss_params = batch(jax.random.key(2), 8)
    params = pipe.place(stage_params)  # whole weights: only the constraints split over tensor
    step = jax.jit(jax.value_and_grad(pipe.loss, argnums=(0, 1)))
    with nn.logical_axis_rules(RULES):
        lowered = step.lower(params, loss_params, x, t)
        loss, (grads, loss_grads) = lowered.compile()(params, loss_params, x, t)
    # the stages' constraints on activations reach the program over tensor only
    on_activations = [
        line
        for line in lowered.as_text().splitlines()
        if "sharding_constraint" in line and f"x{SEQ}x{HIDDEN}xf32>" in line
    ]
    assert any('[{}, {}, {"tensor"}]' in line for line in on_activations)
    assert not any('"pipe"' in line or '"data"' in line for line in on_activations)
    # the hidden activations of a micro-batch's rows (2 per replica) are split over tensor
    assert f"f32[2,{SEQ},{HIDDEN // 2}]" in lowered.compile().as_text()

    def plain(sp, lp):
        return plain_loss([linen_fn, linen_fn, named_fn, named_fn], sp, lp, x, t)

    want, (want_grads, want_loss_grads) = jax.jit(jax.value_and_grad(plain, (0, 1)))(
        stage_params, loss_params
    )
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    assert models.relative_error(pipe.logical(grads), want_grads) < 1e-5
    assert models.relative_error(loss_grads, want_loss_grads) < 1e-5


def bare_spec_mlp(p, x):
    """The block as code written for ``jax.set_mesh`` writes it: bare ``PartitionSpec``
    constraints, the rows over ``data`` (manual inside the pipeline)."""
    h = jax.lax.with_sharding_constraint(jnp.tanh(x @ p["w_in"]), P("data", None, "tensor"))
    return jax.lax.with_sharding_constraint(x + h @ p["w_out"], P("data", None))


@pytest.mark.filterwarnings("ignore:mesh axis 'tensor'")  # only the constraints name it
@pytest.mark.parametrize("set_mesh", [True, False], ids=["set_mesh", "no-mesh"])
def test_bare_partition_spec_constraints_inside_stages_keep_automatic_axes(set_mesh):
    """A stage constraining with bare ``PartitionSpec``s that name ``data`` runs, under
    ``jax.set_mesh(mesh)`` or with no mesh set, as with a ``NamedSharding``: ``data`` is
    dropped, the ``tensor`` constraint holds in the compiled step, and loss and gradients
    equal the plain model's under ``jax.set_mesh`` (the stage was refused while tracing)."""
    mesh = mesh_of((2, 2, 2), ("pipe", "data", "tensor"))
    normal = models.numpy_rng(jax.random.key(3)).standard_normal
    stage_params = models.float32(
        {
            "w_in": normal((2, WIDTH, HIDDEN)) / np.sqrt(WIDTH),
            "w_out": normal((2, HIDDEN, WIDTH)) / np.sqrt(HIDDEN),
        }
    )
    x, t, loss_params = batch(jax.random.key(4), 8)

    def plain(sp, lp):
        return plain_loss([bare_spec_mlp] * 2, sp, lp, x, t)

    with jax.set_mesh(mesh):
        want, want_grads = jax.jit(jax.value_and_grad(plain, (0, 1)))(stage_params, loss_params)
    pipe = jaxpipe.Pipeline(bare_spec_mlp, loss_fn, mesh=mesh, schedule="1f1b", num_microbatches=2)
    params = pipe.place(stage_params)
    step = jax.jit(jax.value_and_grad(pipe.loss, argnums=(0, 1)))
    with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
        lowered = step.lower(params, loss_params, x, t)
        loss, (grads, loss_grads) = lowered.compile()(params, loss_params, x, t)
    on_activations = [
        line
        for line in lowered.as_text().splitlines()
        if "sharding_constraint" in line and f"x{SEQ}x{HIDDEN}xf32>" in line
    ]
    assert any('[{}, {}, {"tensor"}]' in line for line in on_activations), on_activations
    assert not any('"pipe"' in line or '"data"' in line for line in on_activations)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    on_host = jax.tree_util.tree_map(np.asarray, ((pipe.logical(grads), loss_grads), want_grads))
    assert models.relative_error(*on_host) < 1e-5


class Attention(nn.Module):
    """A block with further inputs (positions, segment ids) by name; ``local`` attends to
    the previous position only, as a sliding window of 2 (Gemma's local layers)."""

    local: bool

    @nn.compact
    def __call__(self, x, positions, segment):
        q = nn.Dense(WIDTH, use_bias=False, name="q")(x)
        k = nn.Dense(WIDTH, use_bias=False, name="k")(x)
        distance = positions[:, :, None] - positions[:, None, :]
        allowed = (distance >= 0) & (segment[:, :, None] == segment[:, None, :])
        if self.local:
            allowed &= distance < 2
        scores = jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(WIDTH)
        attention = jax.nn.softmax(jnp.where(allowed, scores, -1e9), axis=-1)
        return x + nn.Dense(WIDTH, name="o")(jnp.einsum("bqk,bkd->bqd", attention, x))


PATTERN = ("local", "local", "global")  # Gemma 3 has five local layers per global one
NUM_BLOCKS = 6


def attention_batch(key, rows):
    x, t, loss_params = batch(key, rows)
    positions = jnp.tile(jnp.arange(SEQ, dtype=jnp.int32), (rows, 1))
    segment = jnp.asarray(models.numpy_rng(key).integers(0, 2, (rows, SEQ)), jnp.int32)
    return x, t, loss_params, {"positions": positions, "segment": jnp.sort(segment, axis=1)}


@pytest.mark.slow
def test_blocks_of_two_kinds_with_side_inputs_and_existing_weights():
    """Linen blocks with several inputs and their own weights, of two kinds in a repeating
    pattern, run through a pipeline of 6 logical stages (a block each, the kind chosen per
    block while the program runs) with the plain model's loss and per-block gradients; a
    stage of 3 blocks (kinds known while tracing) computes what the blocks do in order."""
    x, t, loss_params, side = attention_batch(jax.random.key(3), 8)
    keys = jax.random.split(jax.random.key(4), NUM_BLOCKS)
    modules = {"local": Attention(local=True), "global": Attention(local=False)}
    kinds = [PATTERN[b % len(PATTERN)] for b in range(NUM_BLOCKS)]
    per_block = [
        modules[kind].init(k, x[:2], **jax.tree_util.tree_map(lambda a: a[:2], side))["params"]
        for kind, k in zip(kinds, keys, strict=True)
    ]
    block_fns = {}
    for kind, module in modules.items():
        block_fns[kind], given = jaxpipe.stages.linen_stage(
            module, None, x[:2], NUM_BLOCKS, params=jaxpipe.stages.stack_blocks(per_block),
            sample_side=jax.tree_util.tree_map(lambda a: a[:2], side),
        )  # fmt: skip
        assert given is not None  # the weights given, checked against the module

    def plain(per_block, lp):
        h = x
        for kind, p in zip(kinds, per_block, strict=True):
            h = modules[kind].apply({"params": p}, h, **side)
        return loss_fn(lp, h, t)

    want, (want_grads, want_loss_grads) = jax.jit(jax.value_and_grad(plain, (0, 1)))(
        per_block, loss_params
    )
    stage_fn = jaxpipe.stages.blocks(block_fns, pattern=PATTERN)
    # three blocks per stage: every stage starts the pattern anew, kinds known while tracing
    three = jaxpipe.stages.stack_blocks(per_block, num_stages=2)
    h = x
    for s in range(2):
        h = stage_fn(jaxpipe.stages.stage_slice(three, s), h, stage=jnp.int32(s), side=side)
    np.testing.assert_allclose(loss_fn(loss_params, h, t), want, rtol=1e-5)

    mesh = mesh_of((2,), ("pipe",))
    pipe = jaxpipe.Pipeline(
        stage_fn, loss_fn, mesh=mesh, schedule="interleaved_1f1b", num_microbatches=2,
        schedule_options={"virtual_stages": 3},
    )  # fmt: skip
    assert pipe.num_logical_stages == NUM_BLOCKS
    params = pipe.place(jaxpipe.stages.stack_blocks(per_block, pipe.num_logical_stages))
    loss, (grads, loss_grads) = jax.jit(jax.value_and_grad(pipe.loss, (0, 1)))(
        params, loss_params, x, t, side=side
    )
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    assert (
        models.relative_error(jaxpipe.stages.unstack_blocks(pipe.logical(grads)), want_grads) < 1e-5
    )
    assert models.relative_error(loss_grads, want_loss_grads) < 1e-5


class Scaled(nnx.Module):
    """An NNX block with a further input by name."""

    def __init__(self, rngs):
        self.dense = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x, scale):
        return x + jnp.tanh(self.dense(x)) * scale[:, None, None]


def test_nnx_stage_with_side_keywords_and_existing_weights():
    """Existing NNX modules' weights, stacked per stage, run with a further input from the
    side inputs: the plain model's loss and gradients; weights of the wrong shape are
    refused with the shape they need."""
    x, t, loss_params = batch(jax.random.key(5), 8)
    side = {"scale": jnp.asarray(models.numpy_rng(jax.random.key(6)).uniform(0.5, 1.5, 8))}
    modules = [Scaled(nnx.Rngs(i)) for i in range(2)]
    states = [nnx.state(m, nnx.Param) for m in modules]
    stage_fn, stage_params = jaxpipe.stages.nnx_stage(
        Scaled, None, 2, params=jaxpipe.stages.stack_blocks(states), side_keywords=True
    )
    with pytest.raises(ValueError, match=r"must be \(4, 16\)"):
        jaxpipe.stages.nnx_stage(
            Scaled, None, 4, params=jaxpipe.stages.stack_blocks(states), side_keywords=True
        )

    def plain(states, lp):
        h = x
        for state in states:
            h = nnx.merge(nnx.graphdef(modules[0]), state)(h, **side)
        return loss_fn(lp, h, t)

    want, (want_grads, want_loss_grads) = jax.jit(jax.value_and_grad(plain, (0, 1)))(
        states, loss_params
    )
    pipe = jaxpipe.Pipeline(
        stage_fn, loss_fn, mesh=mesh_of((2,), ("pipe",)), schedule="1f1b", num_microbatches=2
    )
    loss, (grads, loss_grads) = jax.jit(jax.value_and_grad(pipe.loss, (0, 1)))(
        pipe.place(stage_params), loss_params, x, t, side=side
    )
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    got = jaxpipe.stages.unstack_blocks(pipe.logical(grads), blocks_per_stage=False)
    assert models.relative_error(got, want_grads) < 1e-5
    assert models.relative_error(loss_grads, want_loss_grads) < 1e-5


class BuiltOnMesh(nnx.Module):
    """An MLP block that keeps the mesh it was built on and constrains its hidden
    activations there (as MaxText's NNX layers do); ``switch`` also enters that mesh."""

    def __init__(self, mesh, rngs, switch=False):
        self.mesh, self.switch = mesh, switch
        self.w_in = nnx.Linear(WIDTH, HIDDEN, use_bias=False, rngs=rngs)
        self.w_out = nnx.Linear(HIDDEN, WIDTH, use_bias=False, rngs=rngs)

    def __call__(self, x):
        h = jnp.tanh(self.w_in(x))
        sharding = NamedSharding(self.mesh, P("data", None, "tensor"))
        if self.switch:
            with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
                h = jax.lax.with_sharding_constraint(h, sharding)
        else:
            h = jax.lax.with_sharding_constraint(h, sharding)
        return x + self.w_out(h)


@pytest.mark.filterwarnings("ignore:mesh axis 'tensor'")  # only the constraints name it
def test_module_built_on_the_whole_mesh_runs_on_part_of_it():
    """Modules built on 8 devices (data x tensor x 2 more) run in a pipeline over 4 of them
    (pipe 2 x tensor 2): their constraints move onto the pipeline's mesh over tensor, the
    step equals the plain model; a module that enters its own mesh is refused with a
    message saying what to do."""
    whole = mesh_of((2, 2, 2), ("other", "data", "tensor"))
    part = mesh_of((2, 2), ("pipe", "tensor"))
    stage_fn, stage_params = jaxpipe.stages.nnx_stage(
        lambda rngs: BuiltOnMesh(whole, rngs), jax.random.key(7), 2
    )
    x, t, loss_params = batch(jax.random.key(8), 4)
    graphdef = nnx.graphdef(BuiltOnMesh(whole, nnx.Rngs(0)))

    def plain(sp, lp):
        h = x
        for s in range(2):
            h = nnx.merge(graphdef, jaxpipe.stages.stage_slice(sp, s))(h)
        return loss_fn(lp, h, t)

    want, want_grads = jax.jit(jax.value_and_grad(plain))(stage_params, loss_params)
    pipe = jaxpipe.Pipeline(stage_fn, loss_fn, mesh=part, schedule="1f1b", num_microbatches=2)
    params = pipe.place(stage_params)
    compiled = jax.jit(jax.value_and_grad(pipe.loss)).lower(params, loss_params, x, t).compile()
    loss, grads = compiled(params, loss_params, x, t)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    on_host = jax.tree_util.tree_map(np.asarray, (pipe.logical(grads), want_grads))
    assert models.relative_error(*on_host) < 1e-5
    assert f"f32[2,{SEQ},{HIDDEN // 2}]" in compiled.as_text()  # split over tensor

    switching, _ = jaxpipe.stages.nnx_stage(
        lambda rngs: BuiltOnMesh(whole, rngs, switch=True), jax.random.key(7), 2
    )
    refused = jaxpipe.Pipeline(switching, loss_fn, mesh=part, schedule="1f1b", num_microbatches=2)
    with pytest.raises(ValueError, match="build the module with the pipeline's mesh"):
        jax.jit(refused.loss).lower(params, loss_params, x, t)


def _train_steps(pipe, step, params, loss_params, x, t, count=3):
    """``count`` calls of ``step``, each on what the previous one returned; the number of
    times the step compiled and the pipeline's warnings."""
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(count):
                params, loss_params = step(params, loss_params, x, t)
    finally:
        logger.removeHandler(handler)
    compiles = sum("Compiling jit(train_step)" in message for message in records)
    return compiles, [str(w.message) for w in caught if "traced again" in str(w.message)]


@pytest.mark.slow
def test_arguments_off_the_mesh_are_warned_about_once_and_placed_compile_once():
    """Loss parameters and a batch made off the mesh make a jitted step compile twice: the
    pipeline says so once, with the fix; placed with `replicate` and `place_batch`, the
    step compiles once."""
    stage_params, loss_params = models.init(jax.random.key(9), 2)
    x, t = models.data(jax.random.key(10), 8)
    runs = []
    for placed in (False, True):
        pipe = jaxpipe.Pipeline(
            models.stage_fn, models.loss_fn, mesh=mesh_of((2,), ("pipe",)), schedule="1f1b",
            num_microbatches=2,
        )  # fmt: skip

        def train_step(params, loss_params, x, t, pipe=pipe):
            grads = jax.grad(pipe.loss, (0, 1))(params, loss_params, x, t)
            return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, (params, loss_params), grads)

        args = (pipe.place(stage_params), loss_params, x, t)
        if placed:
            args = (args[0], pipe.replicate(loss_params), *pipe.place_batch((x, t)))
        runs.append(_train_steps(pipe, jax.jit(train_step), *args))
    (compiles, messages), (placed_compiles, placed_messages) = runs
    assert compiles == 2 and len(messages) == 1
    assert "pipe.replicate(loss_params)" in messages[0] and "test_own_models.py" in messages[0]
    assert placed_compiles == 1 and placed_messages == []


@pytest.mark.slow
def test_gemma_blocks_as_stages():
    """Gemma 3's own Linen ``Block`` (the ``gemma`` package), five sliding-window layers and
    a global one, with its weights and its further inputs (positions, cache, mask) taken as
    they are: a pipeline of 2 stages of 3 blocks gives the plain model's loss and per-block
    gradients. Skipped where the package is not installed."""
    gemma = pytest.importorskip("gemma.gm.nn._modules")
    kinds = [gemma.AttentionType.LOCAL_SLIDING] * 5 + [gemma.AttentionType.GLOBAL]

    def block(kind):
        local = kind == gemma.AttentionType.LOCAL_SLIDING
        return gemma.Block(
            num_heads=2, num_kv_heads=1, embed_dim=WIDTH, head_dim=8, hidden_dim=HIDDEN,
            use_post_attn_norm=True, use_post_ffw_norm=True, attn_type=kind,
            query_pre_attn_scalar=8**-0.5, transpose_gating_einsum=True, use_qk_norm=True,
            sliding_window_size=2 if local else None,
        )  # fmt: skip

    x, t, loss_params = batch(jax.random.key(11), 4)
    positions = jnp.tile(jnp.arange(SEQ, dtype=jnp.int32), (4, 1))
    causal = jnp.tril(jnp.ones((SEQ, SEQ), bool))
    side = {"segment_pos": positions, "cache": None, "attn_mask": jnp.tile(causal, (4, 1, 1))}
    one = jax.tree_util.tree_map(lambda a: a[:2], side)
    keys = jax.random.split(jax.random.key(12), len(kinds))
    try:  # the package imports some of its dependencies on first use
        per_block = [
            block(k).init(key, x[:2], **one)["params"] for k, key in zip(kinds, keys, strict=True)
        ]
    except ModuleNotFoundError as missing:
        pytest.skip(f"the gemma package is installed without its dependencies: {missing}")
    # norms start at zero in Gemma; random scales make every weight matter
    rng = models.numpy_rng(jax.random.key(13))
    per_block = jax.tree_util.tree_map(
        lambda a: a + 0.1 * jnp.asarray(rng.standard_normal(a.shape), a.dtype), per_block
    )
    stacked = jaxpipe.stages.stack_blocks(per_block)
    block_fns = {
        kind.name: jaxpipe.stages.linen_stage(
            block(kind), None, x[:2], len(kinds), params=stacked, sample_side=one,
            output=lambda out: out[1],
        )[0]
        for kind in set(kinds)
    }  # fmt: skip
    stage_fn = jaxpipe.stages.blocks(block_fns, pattern=[k.name for k in kinds])

    def plain(per_block, lp):
        h = x
        for kind, p in zip(kinds, per_block, strict=True):
            h = block(kind).apply({"params": p}, h, **side)[1]
        return loss_fn(lp, h, t)

    want, (want_grads, want_loss_grads) = jax.jit(jax.value_and_grad(plain, (0, 1)))(
        per_block, loss_params
    )
    pipe = jaxpipe.Pipeline(
        stage_fn, loss_fn, mesh=mesh_of((2,), ("pipe",)), schedule="1f1b", num_microbatches=2
    )
    params = pipe.place(jaxpipe.stages.stack_blocks(per_block, pipe.num_logical_stages))
    loss, (grads, loss_grads) = jax.jit(jax.value_and_grad(pipe.loss, (0, 1)))(
        params, loss_params, x, t, side=side
    )
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    got = jaxpipe.stages.unstack_blocks(pipe.logical(grads))
    assert models.relative_error(got, want_grads) < 1e-5
    assert models.relative_error(loss_grads, want_loss_grads) < 1e-5


def test_unstacking_what_logical_returns_on_an_explicit_mesh():
    """On a mesh of Explicit axes (jax.make_mesh's default on JAX 0.10) ``pipe.logical``
    leaves are split over pipe; stage_slice (of stages and of replay), unstack_blocks and
    unstack_layers index them and give back exactly the blocks stacked."""
    explicit = (jax.sharding.AxisType.Explicit,)
    mesh = jax.make_mesh((2,), ("pipe",), axis_types=explicit, devices=jax.devices()[:2])
    pipe = jaxpipe.Pipeline(
        jaxpipe.stages.blocks(lambda p, x: x @ p["w"]),
        lambda lp, y, t: jnp.mean((y - t) ** 2),
        mesh=mesh,
        num_microbatches=2,
    )
    rng = np.random.default_rng(0)
    per_block = [{"w": jnp.asarray(rng.standard_normal((4, 4)), jnp.float32)} for _ in range(4)]
    logical = pipe.logical(pipe.place(jaxpipe.stages.stack_blocks(per_block, 2)))
    assert logical["w"].sharding.spec[0] == "pipe"
    for got, want in zip(jaxpipe.stages.unstack_blocks(logical), per_block, strict=True):
        np.testing.assert_array_equal(got["w"], want["w"])
    np.testing.assert_array_equal(jaxpipe.stages.stage_slice(logical, 1)["w"][0], per_block[2]["w"])
    replayed = jaxpipe.replay.stage_slice(logical, 1)["w"][1]
    np.testing.assert_array_equal(replayed, per_block[3]["w"])
    layers = jaxpipe.partition.unstack_layers({"layers": logical}, [(0, 2), (2, 4)])
    for got, want in zip(layers, per_block, strict=True):
        np.testing.assert_array_equal(got["w"], want["w"])


def test_a_rewritten_constraint_keeps_python_numbers_weakly_typed():
    """A stage whose constraint names a manual axis is traced again for its rewrite: a
    Python number it takes (``x * 2.0`` with ``x`` bfloat16) stays weakly typed there, so
    the result is bfloat16 as in the stage itself; it was float32."""
    from jaxpipe._jaxpr import constraints

    mesh = mesh_of((2, 2), ("pipe", "tensor"))

    def fn(x, scale):
        return jax.lax.with_sharding_constraint(x * scale, NamedSharding(mesh, P("pipe")))

    fitted = constraints.fit(fn, mesh, {"pipe"})
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 4)), jnp.bfloat16)
    for scale in (2.0, jnp.float32(2.0)):
        want = jax.jit(lambda x, scale=scale: fn(x, scale))(x)
        got = jax.jit(lambda x, scale=scale: fitted(x, scale))(x)
        assert got.dtype == want.dtype, (type(scale), got.dtype, want.dtype)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("kinds,k", [
    (("one",), 3),
    pytest.param(("even", "odd"), 4, marks=pytest.mark.slow),
    pytest.param(("even", "odd"), 3, marks=pytest.mark.slow),
])  # fmt: skip
def test_scanned_blocks_compute_what_the_loop_does(kinds, k):
    """``blocks(..., scan=True)`` runs a stage's blocks in one ``lax.scan`` (over groups of
    the pattern where k is a multiple of it, over blocks choosing each one's kind as the
    program runs where not) and gives the plain model's loss and gradients through a
    pipeline (2 devices, 2 virtual stages, k blocks each), as the loop does: each block gets
    its model index ``block`` and its own key."""
    rng = np.random.default_rng(len(kinds) * 10 + k)
    num_logical = 4
    functions = {
        kind: lambda p, x, key, block, sign=sign: x
        + sign * jnp.tanh(x @ p["w"] + p["b"])
        * (1.0 + 0.1 * block + 0.01 * jax.random.normal(key, x.shape[-1:]))
        for kind, sign in zip(kinds, (1.0, -0.5), strict=False)
    }  # fmt: skip
    pattern = [kinds[b % len(kinds)] for b in range(len(kinds))]
    per_block = [
        models.float32({"w": rng.normal(size=(WIDTH, WIDTH)) / 4, "b": rng.normal(size=WIDTH)})
        for _ in range(num_logical * k)
    ]
    x, t, loss_params = batch(jax.random.key(5), 8)
    key = jax.random.key(6)

    def plain(per_block, lp, x, t):  # micro-batch m of stage s: fold_in(key, (m, s)), then j
        h = []
        for m in range(4):
            y = x[2 * m : 2 * m + 2]
            for b, p in enumerate(per_block):
                stage_key = jax.random.fold_in(jax.random.fold_in(key, m), b // k)
                block_key = jax.random.fold_in(stage_key, b % k)
                y = functions[pattern[b % len(pattern)]](p, y, block_key, jnp.int32(b))
            h.append(y)
        return loss_fn(lp, jnp.concatenate(h), t)

    want, want_grads = jax.value_and_grad(plain, (0, 1, 2))(per_block, loss_params, x, t)
    for scan in (False, True):
        named = functions if len(kinds) > 1 else functions["one"]
        stage_fn = jaxpipe.stages.blocks(
            named, pattern=pattern if len(kinds) > 1 else None, scan=scan
        )
        pipe = jaxpipe.Pipeline(
            stage_fn, loss_fn, mesh=mesh_of((2,), ("pipe",)), schedule="interleaved_1f1b",
            num_microbatches=4, schedule_options={"virtual_stages": 2},
        )  # fmt: skip
        params = pipe.place(jaxpipe.stages.stack_blocks(per_block, num_logical))
        stage_jaxpr = jax.make_jaxpr(functools.partial(stage_fn, stage=0, key=key))(
            jaxpipe.stages.stage_slice(jaxpipe.stages.stack_blocks(per_block, num_logical), 0),
            x[:2],
        )
        scans = [e for e in stage_jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
        group = len(kinds) if k % len(kinds) == 0 else 1
        assert [e.params["length"] for e in scans] == ([k // group] if scan else [])
        got, grads = jax.value_and_grad(pipe.loss, (0, 1, 2))(params, loss_params, x, t, key=key)
        np.testing.assert_allclose(got, want, rtol=1e-5)
        per_block_grads = jaxpipe.stages.unstack_blocks(pipe.logical(grads[0]))
        assert models.relative_error(per_block_grads, want_grads[0]) < 1e-5, scan
        assert models.relative_error(grads[1:], want_grads[1:]) < 1e-5, scan


def test_scanned_blocks_that_change_the_dtype_are_refused_with_the_fix():
    """A block returning another dtype than it was given runs in a loop; in a scan it is
    refused naming the dtype expected and both ways out."""
    params = {"w": jnp.ones((2, 4, 4), jnp.bfloat16)}
    x = jnp.ones((3, 4), jnp.bfloat16)

    def widening(p, x):
        return jnp.tanh(x @ p["w"]).astype(jnp.float32)

    assert jaxpipe.stages.blocks(widening)(params, x, stage=0).dtype == jnp.float32
    with pytest.raises(
        TypeError, match=r"(?s)x's shape and dtype \(\(3, 4\), bfloat16\).*scan=False"
    ):
        jaxpipe.stages.blocks(widening, scan=True)(params, x, stage=0)


def test_blocks_of_unequal_counts_or_dtypes_are_refused():
    """Leaves holding different numbers of blocks ran the first leaf's count, silently;
    blocks of different dtypes were stacked promoted to one."""
    rng = np.random.default_rng(0)
    stage_fn = jaxpipe.stages.blocks(lambda p, x: jnp.tanh(x @ p["w"]) + p["b"])
    params = {
        "w": jnp.asarray(rng.normal(size=(2, 4, 4)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(4, 4)), jnp.float32),  # four blocks' biases
    }
    with pytest.raises(ValueError, match=r"the same number of blocks .*got \[2, 4\]"):
        stage_fn(params, jnp.ones((3, 4)), stage=0)
    per_block = [
        {"w": jnp.ones((4, 4), jnp.float32)},
        {"w": jnp.ones((4, 4), jnp.bfloat16)},
    ]
    with pytest.raises(ValueError, match=r"per_block\[1\] has other leaf dtypes"):
        jaxpipe.stages.stack_blocks(per_block, 1)


class Bf16Block(nnx.Module):
    """An NNX block whose weights are bfloat16 (``param_dtype``)."""

    def __init__(self, rngs):
        self.dense = nnx.Linear(WIDTH, WIDTH, param_dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.dense(x))


def test_weights_of_another_dtype_than_the_modules_are_refused():
    """Weights given of another dtype than the module's own were taken, and the stage
    returned other dtypes than the module (float32 weights in a bfloat16 module gave float32
    activations for bfloat16 inputs); they are refused, naming both dtypes and the fix."""
    x = jnp.ones((2, WIDTH), jnp.bfloat16)
    module = Bf16Block(nnx.Rngs(0))
    assert module(x).dtype == jnp.bfloat16
    states = jaxpipe.stages.stack_blocks([nnx.state(module, nnx.Param)] * 2)
    stage_fn, stage_params = jaxpipe.stages.nnx_stage(Bf16Block, None, 2, params=states)
    assert stage_fn(jaxpipe.stages.stage_slice(stage_params, 0), x).dtype == jnp.bfloat16
    wide = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), states)
    with pytest.raises(ValueError, match=r"\['dense'\]\['bias'\].* is float32; .* is bfloat16"):
        jaxpipe.stages.nnx_stage(Bf16Block, None, 2, params=wide)
    dense = nn.Dense(WIDTH)
    weights = jaxpipe.stages.stack_blocks([dense.init(jax.random.key(0), x)["params"]] * 2)
    narrow = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), weights)
    with pytest.raises(ValueError, match=r"param_dtype=jnp.bfloat16"):
        jaxpipe.stages.linen_stage(dense, None, x, 2, params=narrow)


class WithConstant(nnx.Module):
    """An NNX block holding a constant array outside any nnx.Variable."""

    def __init__(self, rngs):
        self.dense = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.scale = jnp.linspace(0.5, 1.5, WIDTH)

    def __call__(self, x):
        return x + jnp.tanh(self.dense(x)) * self.scale


def test_arrays_outside_nnx_variables_are_refused_when_the_stage_is_built():
    """A module holding an array outside any nnx.Variable was taken, the array left in the
    graph definition as a tracer of nnx_stage's trace, and every call of the stage failed
    with an UnexpectedTracerError; it is refused when the stage is built, naming where."""
    with pytest.raises(ValueError, match=r"arrays that are not nnx.Param at \[\"\['scale'\]"):
        stage_fn, params = jaxpipe.stages.nnx_stage(WithConstant, jax.random.key(0), 2)
        stage_fn(jaxpipe.stages.stage_slice(params, 0), jnp.ones((2, WIDTH)))


class FrozenScale(nnx.Variable):
    """A variable kind of the user's own, not an nnx.Param."""


class WithFrozen(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.scale = FrozenScale(jnp.ones(WIDTH))

    def __call__(self, x):
        return self.dense(x) * self.scale[...]


def test_state_other_than_params_is_refused_naming_its_kinds_and_their_fixes():
    """The refusal of state other than nnx.Param names each variable's kind and gives the
    fix for the kinds held (it gave the dropout and BatchNorm fixes for any variable, a
    kind of the user's own included, and named paths only)."""
    with pytest.raises(ValueError) as caught:
        jaxpipe.stages.nnx_stage(WithFrozen, jax.random.key(0), 2)
    message = str(caught.value)
    assert "nnx.FrozenScale at [\"['scale']\"]" in message
    assert "make a trained variable an nnx.Param" in message
    assert "Dropout" not in message and "BatchNorm" not in message

    class WithBatchNorm(nnx.Module):
        def __init__(self, rngs):
            self.norm = nnx.BatchNorm(WIDTH, rngs=rngs)

    with pytest.raises(ValueError) as caught:
        jaxpipe.stages.nnx_stage(WithBatchNorm, jax.random.key(0), 2)
    message = str(caught.value)
    assert "nnx.BatchStat at [\"['norm']['mean']\", \"['norm']['var']\"]" in message
    assert "nnx.LayerNorm or nnx.RMSNorm" in message and "Dropout" not in message


def test_activations_narrower_than_an_nnx_stages_weights_are_refused_with_the_flax_fix():
    """bfloat16 activations through an NNX stage of float32 weights come out float32; the
    refusal gives the fix a module built by nnx_stage can take, the layers' dtype= (it
    told to cast the parameters inside stage_fn, which nnx_stage writes)."""

    class Dense(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

        def __call__(self, x):
            return x + jnp.tanh(self.dense(x))

    stage_fn, stage_params = jaxpipe.stages.nnx_stage(Dense, jax.random.key(0), 2)
    pipe = jaxpipe.Pipeline(
        stage_fn, loss_fn, mesh=mesh_of((2,), ("pipe",)), schedule="1f1b", num_microbatches=2
    )
    x = jnp.ones((4, SEQ, WIDTH), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"layers with dtype=jnp.bfloat16"):
        pipe.forward(pipe.place(stage_params), x)


def test_one_loss_jitted_alone_and_differentiated_is_not_warned_about():
    """A loss function traced once under ``jax.jit`` (to print the first loss) and once
    under ``jax.grad`` inside the training step, both from the same line and on placed
    arguments, is two programs, not a retrace: no warning. The same jitted step called
    again on arguments placed differently still is."""
    stage_params, loss_params = models.init(jax.random.key(11), 2)
    x, t = models.data(jax.random.key(12), 8)
    pipe = jaxpipe.Pipeline(
        models.stage_fn, models.loss_fn, mesh=mesh_of((2,), ("pipe",)), schedule="1f1b",
        num_microbatches=2,
    )  # fmt: skip
    params, loss_params = pipe.place(stage_params), pipe.replicate(loss_params)
    x, t = pipe.place_batch((x, t))

    def loss(params, loss_params):
        return pipe.loss(params, loss_params, x, t)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(loss)(params, loss_params)
        jax.jit(jax.grad(loss, (0, 1)))(params, loss_params)
    assert not [w for w in caught if "traced again" in str(w.message)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jitted = jax.jit(loss)
        jitted(params, loss_params)
        jitted(params, jax.tree_util.tree_map(np.asarray, loss_params))  # placed elsewhere
    assert [w for w in caught if "traced again" in str(w.message)]
