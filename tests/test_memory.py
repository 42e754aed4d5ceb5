"""What the compiled step holds and moves, from XLA's own analyses: no weight collective in
any schedule's training step, per-device memory at a plain step's level (weight- and
activation-dominated models), memory bounded in the number of micro-batches, program size
independent of it."""

import functools

import hlo
import jax
import jax.numpy as jnp
import llama
import models
import numpy as np
import optax
import pytest
from jax import lax

from jaxpipe import pipeline, reference, schedules
from jaxpipe._executor.program import Context
from jaxpipe._jaxpr import residuals

OPTIONS = {"interleaved_1f1b": {"virtual_stages": 2}, "circular": {"repeats": 2}}
S, M = 4, 8


def mlp_blocks(p, x):
    """``p`` leaves ``[blocks, ...]``: that many residual GELU MLP blocks in order."""

    def one(x, q):
        return x + jax.nn.gelu(x @ q["w1"]) @ q["w2"], None

    return lax.scan(one, x, p)[0]


def mse(_, y, target):
    return jnp.mean((y - target) ** 2)


def mlp_params(num_stages, blocks, width, hidden):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (num_stages, blocks, width, hidden)) / width**0.5,
        "w2": jax.random.normal(k2, (num_stages, blocks, hidden, width)) / hidden**0.5,
    }


def plain_accumulation(stage_fn, loss_fn, params, loss_params, microbatch, target, side=None):
    """Memory of the compiled plain step (`jaxpipe.reference.accumulation_step`) over ``M``
    micro-batches shaped like ``microbatch``, of ``params`` (leaves ``[stages, ...]``)."""

    def batch(a):
        return jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct((M * x.shape[0], *x.shape[1:]), x.dtype), a
        )

    step = reference.accumulation_step(stage_fn, loss_fn, M)
    args = (params, loss_params, batch(microbatch), batch(target), batch(side))
    return step.lower(*args).compile().memory_analysis()


def _pipe(name, stage_fn, loss_fn, mesh=None, **kwargs):
    return pipeline.Pipeline(
        stage_fn,
        loss_fn,
        mesh=mesh or models.pipe_mesh(S),
        schedule=name,
        num_microbatches=kwargs.pop("num_microbatches", M),
        schedule_options=OPTIONS.get(name),
        **kwargs,
    )


def _training_step(pipe, params, loss_params, inputs, targets):
    """The compiled training step: value_and_grad and an optax update (``Pipeline.train``
    for schedules that update weights inside the pipeline)."""
    opt = optax.adam(1e-3)
    if pipe.updates_weights:
        state = pipe.init_optimizer(opt, params)
        step = jax.jit(lambda p, s, lp, x, t: pipe.train(opt, p, s, lp, x, t))
        return step.lower(params, state, loss_params, inputs, targets).compile()

    def step(p, s, lp, x, t):
        loss, grads = jax.value_and_grad(pipe.loss)(p, lp, x, t)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    return jax.jit(step).lower(params, opt.init(params), loss_params, inputs, targets).compile()


# ------------------------------------------------------------- weight-dominated model
WIDTH, HIDDEN, ROWS = 256, 768, 2  # 1.5 MiB of weights per stage, 2 rows per micro-batch


@functools.cache
def plain_temp_of_own_stages(stages_per_device):
    """Temp bytes of the plain gradient accumulation of ``stages_per_device`` weight-dominated
    stages: one compile per count, shared by the schedules that hold that many."""
    plain = plain_accumulation(
        mlp_blocks,
        mse,
        mlp_params(stages_per_device, 1, WIDTH, HIDDEN),
        None,
        jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.float32),
        jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.float32),
    )
    return plain.temp_size_in_bytes


def _sharing_the_plain_step(name):
    """Schedule ``name``, slow, in the ``xdist_group`` of its stages per device: the
    schedules of one group compare against one plain step (`plain_temp_of_own_stages`)."""
    v = schedules.get(name, S, M, **OPTIONS.get(name, {})).stages_per_device
    group = pytest.mark.xdist_group(f"memory-plain-{v}-stages")
    return pytest.param(name, marks=[pytest.mark.slow, group])


@pytest.mark.parametrize("name", [_sharing_the_plain_step(n) for n in schedules.names()])
def test_weights_never_move_and_memory_is_a_plain_steps(name):
    """The training step of every schedule: the only collectives over pipe are
    collective-permutes of activation-sized arrays (and a sum of the M losses); temp bytes
    per device at most 1.25x a plain gradient accumulation of the device's own stages."""
    pipe = _pipe(name, mlp_blocks, mse)
    v = pipe.schedule.stages_per_device
    params = pipe.place(mlp_params(pipe.num_logical_stages, 1, WIDTH, HIDDEN))
    x = jax.random.normal(jax.random.key(1), (ROWS * M, WIDTH))
    compiled = _training_step(pipe, params, None, x, x)

    stage_bytes = 2 * WIDTH * HIDDEN * 4
    activation_bytes = ROWS * WIDTH * 4
    for c in hlo.collectives(compiled.as_text(), pipe.mesh):
        if c.kind == "collective-permute":
            assert c.nbytes <= activation_bytes, c.line
        else:
            assert c.kind == "all-reduce" and c.nbytes <= 4 * M, c.line  # the losses

    plain_temp = plain_temp_of_own_stages(v)
    bound = 1.25 * plain_temp
    if pipe.updates_weights:
        # Weight versions are these schedules' own memory, as activations are others': the
        # plan's version slots, plus the one the optimizer builds and the one an action reads.
        bound += (pipe._plan.num_version_slots + 3) * stage_bytes
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= bound, (temp, plain_temp)


def test_the_gradient_output_is_the_devices_own_stages():
    pipe = _pipe("zbv", mlp_blocks, mse)
    params = pipe.place(mlp_params(pipe.num_logical_stages, 1, WIDTH, HIDDEN))
    x = jax.random.normal(jax.random.key(1), (ROWS * M, WIDTH))
    compiled = jax.jit(jax.grad(pipe.loss)).lower(params, None, x, x).compile()
    own = 2 * 2 * WIDTH * HIDDEN * 4  # two chunks of two matrices
    assert own <= compiled.memory_analysis().output_size_in_bytes <= 1.01 * own


# --------------------------------------------------------- activation-dominated model
BLOCKS, A_WIDTH, A_HIDDEN, A_ROWS = 8, 64, 256, 128


@pytest.fixture(scope="module")
def plain_mlp_temp():
    """A plain gradient accumulation of all 8 blocks on one device."""
    structs = jax.ShapeDtypeStruct((A_ROWS, A_WIDTH), jnp.float32)
    params = mlp_params(1, BLOCKS, A_WIDTH, A_HIDDEN)
    return plain_accumulation(mlp_blocks, mse, params, None, structs, structs).temp_size_in_bytes


@pytest.mark.parametrize(
    "name",
    [
        n if n == "interleaved_1f1b" else pytest.param(n, marks=pytest.mark.slow)
        for n in schedules.names()
    ],
)
def test_activation_memory_follows_the_schedule(name, plain_mlp_temp):
    """8 blocks on S = 4: 1f1b's device 0 holds S micro-batches through L/S blocks, what a
    plain step holds for one micro-batch through all L, so its temp is at most 1.25x the
    plain step's; every schedule in proportion to its most loaded device's activations
    (`Schedule.peak_activations`, in units of one micro-batch through a device's blocks)."""
    pipe = _pipe(name, mlp_blocks, mse)
    N, v = pipe.num_logical_stages, pipe.schedule.stages_per_device
    params = pipe.place(mlp_params(N, BLOCKS // N, A_WIDTH, A_HIDDEN))
    x = jax.random.normal(jax.random.key(1), (A_ROWS * M, A_WIDTH))
    if pipe.updates_weights:
        compiled = _training_step(pipe, params, None, x, x)
    else:
        compiled = jax.jit(jax.grad(pipe.loss)).lower(params, None, x, x).compile()
    held = max(pipe.schedule.peak_activations()) / v  # micro-batches through a device
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= 1.25 * plain_mlp_temp * max(1.0, held / S), (temp, plain_mlp_temp, held)


@pytest.mark.slow
def test_llama_style_model_memory_is_a_plain_steps():
    """8 Llama-style blocks over 4 stages (width 64, sequence 32, M = 8), 1f1b."""
    config = llama.Config()
    stage_fn = llama.make_stage_fn(config)
    pipe = _pipe("1f1b", stage_fn, llama.loss_fn)
    rows = 8
    params = pipe.place(llama.init_blocks(jax.random.key(0), config, S, 2))
    outer = llama.init_outer(jax.random.key(1), config)
    x = jnp.zeros((rows * M, config.seq, config.width))
    tokens = jnp.zeros((rows * M, config.seq), jnp.int32)

    def loss(p, lp, x, t, positions):
        return pipe.loss(p, lp, x, t, side={"positions": positions})

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    temp = step.lower(params, outer, x, tokens, tokens).compile().memory_analysis()
    plain = plain_accumulation(
        stage_fn,
        llama.loss_fn,
        llama.init_blocks(jax.random.key(0), config, 1, 8),
        outer,
        jax.ShapeDtypeStruct((rows, config.seq, config.width), jnp.float32),
        jax.ShapeDtypeStruct((rows, config.seq), jnp.int32),
        {"positions": jax.ShapeDtypeStruct((rows, config.seq), jnp.int32)},
    )
    assert temp.temp_size_in_bytes <= 1.25 * plain.temp_size_in_bytes, (
        temp.temp_size_in_bytes,
        plain.temp_size_in_bytes,
    )


# ------------------------------------------------------------------ residual store
def _stored(stage, params, x):
    context = Context(side=None, key=None, stage=jnp.int32(0), microbatch=jnp.int32(0))
    return residuals.analyse(lambda p, x, c: stage(p, x), params, x, context)


@pytest.mark.parametrize("cast", [None, jnp.bfloat16])
def test_no_weight_sized_leaf_is_stored_per_microbatch(cast):
    """The residual store keeps what depends on the stage input; the weights, and weights
    cast for mixed precision, are recomputed from the parameters in the backward."""
    width, hidden, rows = 512, 1536, 2

    def stage(p, x):
        w1, w2 = (
            (p["w1"], p["w2"]) if cast is None else (p["w1"].astype(cast), p["w2"].astype(cast))
        )
        return x + (jnp.tanh(x.astype(w1.dtype) @ w1) @ w2).astype(x.dtype)

    params = {
        "w1": jax.ShapeDtypeStruct((width, hidden), jnp.float32),
        "w2": jax.ShapeDtypeStruct((hidden, width), jnp.float32),
    }
    spec = _stored(stage, params, jax.ShapeDtypeStruct((rows, width), jnp.float32))
    assert spec.structs, "the stage input's residuals are kept"
    for struct in spec.structs:
        assert struct.shape[0] == rows, struct  # activations only: a leading row axis
    assert spec.nbytes <= 4 * rows * (width + 2 * hidden)


# ------------------------------------------------------------------ bounded in M
WIDTH_M, ROWS_M = 64, 16


@functools.cache
def _temp(name, num_microbatches, remat=False):
    """The compiled gradient step of schedule ``name``; cached, as several tests read the
    same step (gpipe at M = 8 and 32, 1f1b at M = 8 and 64, zbv at M = 16 and 64)."""
    pipe = _pipe(
        name, models.stage_fn, models.loss_fn, num_microbatches=num_microbatches, remat=remat
    )
    sp, lp = models.init(jax.random.key(0), pipe.num_logical_stages, width=WIDTH_M)
    x, t = models.data(jax.random.key(1), ROWS_M * num_microbatches, width=WIDTH_M)
    step = jax.jit(jax.grad(pipe.loss, argnums=(0, 1)))
    return step.lower(pipe.place(sp), lp, x, t).compile()


TEMP_STEPS = pytest.mark.xdist_group("memory-temp-steps")  # tests sharing `_temp`s


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,small,large",
    [
        pytest.param("1f1b", 8, 64, marks=TEMP_STEPS),
        ("interleaved_1f1b", 8, 64),
        ("zb_h2", 16, 64),
        pytest.param("zbv", 16, 64, marks=TEMP_STEPS),
    ],
)
def test_activation_memory_is_bounded_in_microbatches(name, small, large):
    temp_small = _temp(name, small).memory_analysis().temp_size_in_bytes
    temp_large = _temp(name, large).memory_analysis().temp_size_in_bytes
    assert temp_large <= 1.10 * temp_small, (temp_small, temp_large)


@pytest.mark.slow
@TEMP_STEPS
def test_gpipe_memory_grows_with_microbatches():
    """The contrast that makes the test above meaningful: GPipe keeps every micro-batch."""
    small = _temp("gpipe", 8).memory_analysis().temp_size_in_bytes
    assert _temp("gpipe", 32).memory_analysis().temp_size_in_bytes > 2.5 * small


@pytest.mark.slow
@TEMP_STEPS
def test_remat_lowers_gpipe_memory():
    full = _temp("gpipe", 32).memory_analysis().temp_size_in_bytes
    assert _temp("gpipe", 32, remat=True).memory_analysis().temp_size_in_bytes < 0.7 * full


@pytest.mark.slow
@TEMP_STEPS
@pytest.mark.parametrize("name,small,large", [("gpipe", 8, 32), ("1f1b", 8, 64), ("zbv", 16, 64)])
def test_program_size_does_not_grow_with_microbatches(name, small, large):
    """One scan over ticks: the same HLO instructions at 4 or 8 times the micro-batches (an
    unrolled tick loop grows with them). The steps are the ones the memory tests above
    compile (`_temp`, cached on their worker)."""

    def instructions(num_microbatches):
        text = _temp(name, num_microbatches).as_text()
        return sum(1 for line in text.splitlines() if " = " in line)

    assert instructions(small) == instructions(large)


@pytest.mark.slow
def test_remat_policy_trades_memory_for_recompute_with_the_same_gradients():
    """Keeping every residual costs more than the default policy (matrix products only),
    which costs more than keeping stage inputs only; gradients are the same."""

    def temp_and_grads(**kwargs):
        pipe = _pipe("gpipe", models.stage_fn, models.loss_fn, num_microbatches=16, **kwargs)
        sp, lp = models.init(jax.random.key(0), S, width=WIDTH_M)
        x, t = models.data(jax.random.key(1), ROWS_M * 16, width=WIDTH_M)
        step = jax.jit(jax.grad(pipe.loss, argnums=(0, 1)))
        placed = pipe.place(sp)
        temp = step.lower(placed, lp, x, t).compile().memory_analysis().temp_size_in_bytes
        return temp, step(placed, lp, x, t)

    everything, grads_all = temp_and_grads(remat_policy=jax.checkpoint_policies.everything_saveable)
    default, grads_default = temp_and_grads()
    inputs_only, _ = temp_and_grads(remat=True)
    assert inputs_only < default < everything, (inputs_only, default, everything)
    for a, b in zip(
        jax.tree_util.tree_leaves(grads_default), jax.tree_util.tree_leaves(grads_all), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7 * float(jnp.abs(b).max()))
