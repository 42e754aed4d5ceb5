"""Errors that name what went wrong and the fix: a stage or loss closing over a value being
differentiated, optimizer state built from unplaced parameters, and optimizer state that
``jax.jit`` left on one device."""

import jax
import jax.numpy as jnp
import models
import numpy as np
import optax
import pytest

import jaxpipe

S, M = 2, 4
SCALE = None  # a module-level value a stage reads


def _loss_fn(_, y, t):
    return jnp.mean((y - t) ** 2)


def _pipe(stage_fn, loss_fn=_loss_fn, schedule="zbv"):
    return jaxpipe.Pipeline(
        stage_fn, loss_fn, mesh=models.pipe_mesh(S), schedule=schedule, num_microbatches=M
    )


def _problem(pipe):
    keys = jax.random.split(jax.random.key(0), 3)
    params = pipe.place({"w": 0.3 * jax.random.normal(keys[0], (pipe.num_logical_stages, 3, 3))})
    x, t = (jax.random.normal(k, (8, 3)) for k in keys[1:])
    return params, x, t


def test_a_function_closing_over_a_differentiated_value_is_named_with_the_fix():
    def grad_through(make_pipe):
        params, x, t = _problem(_pipe(lambda p, x: x))

        def loss(params, scale):
            return make_pipe(scale).loss(params, None, x, t)

        return jax.grad(loss, argnums=(0, 1))(params, jnp.float32(2.0))

    def closing_stage(scale):
        return _pipe(lambda p, x: x + jnp.tanh(x @ p["w"]) * scale)

    with pytest.raises(ValueError, match=r"stage_fn closes over `scale` \(float32\[\], stage_fn"):
        grad_through(closing_stage)
    with pytest.raises(ValueError, match=r"side input \(side=.*jax.lax.stop_gradient"):
        grad_through(closing_stage)

    def one_closing_stage(scale):
        plain = lambda p, x: x + jnp.tanh(x @ p["w"])  # noqa: E731
        closing = lambda p, x: x + jnp.tanh(x @ p["w"]) * scale  # noqa: E731
        return _pipe([plain, closing, plain, plain])

    with pytest.raises(ValueError, match=r"`scale` \(float32\[\], logical stage 1\)"):
        grad_through(one_closing_stage)

    def closing_loss(scale):
        return _pipe(lambda p, x: x, lambda _, y, t: jnp.mean((y * scale - t) ** 2))

    with pytest.raises(ValueError, match=r"loss_fn closes over `scale`.*loss_params"):
        grad_through(closing_loss)

    def global_stage(scale):
        global SCALE
        SCALE = {"factor": scale}
        return _pipe(lambda p, x: x + jnp.tanh(x @ p["w"]) * SCALE["factor"])

    with pytest.raises(ValueError, match=r"`SCALE\['factor'\]` \(float32\[\]"):
        grad_through(global_stage)

    # Closing over a value that is traced by jit but not differentiated is fine.
    params, x, t = _problem(_pipe(lambda p, x: x))
    traced = jax.jit(lambda params, scale: jax.grad(closing_stage(scale).loss)(params, None, x, t))
    traced.trace(params, jnp.float32(2.0))


def test_optimizer_state_built_from_unplaced_parameters_is_refused_before_tracing():
    pipe = _pipe(lambda p, x: x + jnp.tanh(x @ p["w"]))
    params, x, t = _problem(pipe)
    optimizer = optax.adam(1e-2)
    logical_state = optimizer.init(pipe.logical(params))
    with pytest.raises(ValueError, match=r"mu\['w'\] has shape \(4, 3, 3\).*logical stage order"):
        pipe.train(optimizer, params, logical_state, None, x, t)
    with pytest.raises(ValueError, match=r"one state for all stages.*pipe.init_optimizer"):
        pipe.train(optimizer, params, optimizer.init(params), None, x, t)
    with pytest.raises(ValueError, match=r"has \d+ arrays where pipe.init_optimizer"):
        pipe.train(optimizer, params, optax.sgd(0.1, 0.9).init(params), None, x, t)


def test_jitted_optimizer_init_of_placed_parameters_is_refused_eager_keeps_sharding():
    pipe = _pipe(lambda p, x: x)
    params, _, _ = _problem(pipe)
    optimizer = optax.adam(1e-2)
    with pytest.raises(ValueError, match=r"not split over the 2 pipe devices.*outside jit"):
        jax.jit(optimizer.init)(params)
    with jax.set_mesh(pipe.mesh), pytest.raises(ValueError, match="not split over"):
        jax.jit(optimizer.init)(params)  # replicated on every device
    state = optimizer.init(params)
    assert state[0].mu["w"].sharding == params["w"].sharding
    state = pipe.init_optimizer(optimizer, params)
    assert state[0].mu["w"].sharding == params["w"].sharding


@pytest.mark.parametrize(
    "options,says",
    [
        (
            {"grad_dtype": jnp.int32},
            r"grad_dtype must be a floating dtype .*int32 would be truncated",
        ),
        ({"grad_dtype": jnp.bool_}, r"grad_dtype must be a floating dtype"),
        ({"grad_dtype": "bf16"}, r"grad_dtype must be a floating dtype .*got 'bf16'"),
        ({"remat": "no"}, r"remat must be True or False, got 'no'"),
        ({"loss_has_aux": 1}, r"loss_has_aux must be True or False, got 1"),
        ({"split_loss_grads": "split"}, r"split_loss_grads must be True or False, got 'split'"),
        ({"remat_policy": "dots"}, r"remat_policy must be a jax.checkpoint policy .*got 'dots'"),
        (
            {"remat": True, "remat_policy": jax.checkpoint_policies.everything_saveable},
            r"remat=True and remat_policy=everything_saveable contradict each other: remat=True "
            r"keeps only each stage's input .*Pass remat_policy alone .* or remat=True alone",
        ),
        ({"costs": "measured"}, r"costs must be .*Costs, 'measure' or .*Target .* got 'measured'"),
        ({"costs": {"F": 1.0, "B": 2.0}}, r"costs must be a jaxpipe.schedules.Costs.*got \{'F'"),
        (
            {"schedule_options": "virtual_stages=2"},
            r"schedule_options must be a mapping .*got str 'virtual_stages=2'; pass "
            r"schedule_options=dict\(virtual_stages=2\)",
        ),
    ],
)
def test_pipeline_options_of_the_wrong_kind_are_refused_when_built(options, says):
    """An integer grad_dtype truncated every gradient to whole numbers; a string remat or
    loss_has_aux was read as True; a string policy and a misspelt costs failed at the first
    call; a string schedule_options raised Python's own error from dict(); a policy given
    with remat=True was dropped without a word."""
    with pytest.raises(ValueError, match=says):
        jaxpipe.Pipeline(
            models.stage_fn, models.loss_fn, mesh=models.pipe_mesh(4), schedule="1f1b",
            num_microbatches=4, **options,
        )  # fmt: skip
    pipe = jaxpipe.Pipeline(
        models.stage_fn, models.loss_fn, mesh=models.pipe_mesh(4), schedule="1f1b",
        num_microbatches=4, grad_dtype="bfloat16",
    )  # fmt: skip
    assert pipe.grad_dtype == jnp.bfloat16


def test_loss_fn_is_checked_when_loss_params_and_targets_are_both_none():
    """Without loss parameters and targets the loss checks were skipped: a loss_fn that
    returns the output whole failed inside the schedule's lax.switch."""
    pipe = _pipe(lambda p, x: x, lambda _, y, t: y)
    params, x, _ = _problem(pipe)
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar per micro-batch, got"):
        pipe.loss(params, None, x, None)
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar per micro-batch, got"):
        pipe.loss_and_grads(params, None, x, None)
    with pytest.raises(ValueError, match=r"this Pipeline has no loss_fn"):
        _pipe(lambda p, x: x, None).loss(params, None, x, None)
    pipe = _pipe(lambda p, x: x + jnp.tanh(x @ p["w"]), lambda _, y, t: jnp.mean(y**2))
    assert pipe.forward(params, x).shape == x.shape  # forward runs no loss_fn
    assert jnp.isfinite(pipe.loss(params, None, x, None))


def test_numpy_float64_batches_run_as_jit_reads_them_in_float32():
    """With x64 off jax.jit reads a NumPy float64 array as float32; the pipeline refused
    one, saying the stage changed the dtype."""
    pipe = _pipe(lambda p, x: x + jnp.tanh(x @ p["w"]), lambda h, y, t: jnp.mean((y * h - t) ** 2))
    params, _, _ = _problem(pipe)
    rng = np.random.default_rng(0)
    x, t, head = rng.standard_normal((8, 3)), rng.standard_normal((8, 3)), rng.standard_normal(3)
    assert x.dtype == np.float64 and not jax.config.jax_enable_x64
    as32 = [a.astype(np.float32) for a in (head, x, t)]
    want = pipe.loss_and_grads(params, *as32, input_grads=True)
    got = pipe.loss_and_grads(params, head, x, t, input_grads=True)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert a.dtype == b.dtype == jnp.float32
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(pipe.loss(params, head, x, t), want[0], rtol=1e-6)
    np.testing.assert_allclose(pipe.forward(params, x), pipe.forward(params, as32[1]), rtol=1e-6)


def test_arrays_on_another_mesh_are_refused_naming_both_and_place_moves_them():
    """Parameters placed by a pipeline on other devices failed with JAX's 'incompatible
    devices', and so did pipe.place, which the layout error advises."""
    pipe = _pipe(lambda p, x: x + jnp.tanh(x @ p["w"]))  # zbv on devices 0, 1
    devices = jax.devices()[2:4]
    other_mesh = jax.make_mesh((S,), ("pipe",), (jax.sharding.AxisType.Auto,), devices=devices)
    other = jaxpipe.Pipeline(
        pipe.stage_fn, _loss_fn, mesh=other_mesh, schedule="interleaved_1f1b",
        num_microbatches=M, schedule_options={"virtual_stages": 2},
    )  # fmt: skip
    params, x, t = _problem(pipe)
    logical = pipe.logical(params)
    theirs = other.place(logical)
    with pytest.raises(
        ValueError,
        match=r"stage_params\['w'\] is on a mesh \{'pipe': 2\} of devices \[2, 3\], but this "
        r"pipeline's mesh \{'pipe': 2\} has devices \[0, 1\].*params = pipe.place\(params\)",
    ):
        pipe.loss(params=theirs, loss_params=None, inputs=x, targets=t)
    moved = pipe.place(theirs)
    assert moved.order == params.order
    assert {d.id for d in moved["w"].sharding.device_set} == {0, 1}
    np.testing.assert_array_equal(pipe.logical(theirs)["w"], logical["w"])
    want = pipe.loss_and_grads(params, None, x, t)
    got = pipe.loss_and_grads(moved, None, x, t)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)

    optimizer = optax.adam(1e-2)
    state = other.init_optimizer(optimizer, theirs)
    with pytest.raises(
        ValueError, match=r"opt_state\[0\]\.count is on a mesh .*pipe.place\(opt_state\)"
    ):
        pipe.train(optimizer, moved, state, None, x, t)
    pipe.train(optimizer, moved, pipe.place(state), None, x, t)
    head = jax.device_put(jnp.ones(()), devices[1])
    with pytest.raises(ValueError, match=r"loss_params is on devices \[3\].*pipe.replicate"):
        pipe.loss(moved, head, x, t)
    with pytest.raises(ValueError, match=r"inputs is on devices \[2\].*pipe.place_batch"):
        pipe.loss(moved, None, jax.device_put(x, devices[0]), t)


def test_remat_keeps_the_stage_input_only_and_the_default_policy_otherwise():
    def build(**options):
        return jaxpipe.Pipeline(
            models.stage_fn, models.loss_fn, mesh=models.pipe_mesh(4), schedule="1f1b",
            num_microbatches=4, **options,
        )  # fmt: skip

    assert build().remat_policy is jax.checkpoint_policies.dots_saveable
    assert build(remat=True).remat_policy is None
    assert build(remat=True, remat_policy=None).remat_policy is None
    policy = jax.checkpoint_policies.everything_saveable
    assert build(remat_policy=policy).remat_policy is policy
