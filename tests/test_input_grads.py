"""Gradients through every float input of `Pipeline.loss`: side inputs and targets.

Every stage reads a float side input (and an integer one); the loss reads the side input
and float and integer targets. ``jax.grad`` of ``pipe.loss`` with respect to the stage
parameters, the loss parameters, ``side`` and ``targets`` is held to the plain model
(`jaxpipe.reference.loss`, no pipeline), float32, under gpipe, 1f1b, zbv (split
backward), interleaved_1f1b and dualpipev, with and without a data axis: one compiled
program per case checks all of them at once. Integer leaves get JAX's ``float0`` zero.
`Pipeline.loss_and_grads` returns the same gradients when asked, None at integer leaves.
"""

import functools

import jax
import jax.numpy as jnp
import models
import numpy as np
import pytest

import jaxpipe

WIDTH, ROWS, M, S = 8, 32, 8, 4
RTOL = 1e-5


def stage_fn(p, x, *, side):
    """Reads the float side input ``bias`` and the integer ``shift``."""
    return x + jnp.tanh(x @ p + side["bias"] * (1.0 + side["shift"][:, None]))


def loss_fn(head, y, target, *, side):
    """Squared error on the float target, weighted by the integer target, plus a term
    in the side input: the loss reads both."""
    err = (y @ head - target["y"]) ** 2
    weight = 1.0 + target["weight"][:, None]
    return jnp.mean(err * weight) + 0.3 * jnp.mean(jnp.sin(side["bias"]) * y)


def problem(seed, num_stages):
    rng = np.random.default_rng(seed)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    stages = f32(rng.normal(size=(num_stages, WIDTH, WIDTH)) / np.sqrt(WIDTH))
    head = f32(rng.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH))
    inputs = f32(rng.normal(size=(ROWS, WIDTH)))
    targets = {"y": f32(rng.normal(size=(ROWS, WIDTH))), "weight": rng.integers(0, 3, ROWS)}
    side = {"bias": f32(rng.normal(size=(ROWS, WIDTH))), "shift": rng.integers(0, 2, ROWS)}
    targets["weight"] = jnp.asarray(targets["weight"], jnp.int32)
    side["shift"] = jnp.asarray(side["shift"], jnp.int32)
    return stages, head, inputs, targets, side


def assert_close(got, want):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        scale = float(np.abs(w).max())
        assert scale > 0  # a zero gradient proves nothing
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=RTOL * scale)


CASES = [
    ("1f1b", False),
    ("zbv", True),
    *[
        pytest.param(name, data, marks=pytest.mark.slow)
        for name, data in [
            ("gpipe", False),
            ("gpipe", True),
            ("1f1b", True),
            ("zbv", False),
            ("interleaved_1f1b", False),
            ("interleaved_1f1b", True),
            ("dualpipev", False),
            ("dualpipev", True),
        ]
    ],
]


@pytest.mark.parametrize("name, data", CASES)
def test_side_and_target_gradients_equal_the_plain_model(name, data):
    mesh = models.pipe_mesh(S, [("data", 2)] if data else [])
    pipe = jaxpipe.Pipeline(stage_fn, loss_fn, mesh=mesh, schedule=name, num_microbatches=M)
    stages, head, inputs, targets, side = problem(0, pipe.num_logical_stages)
    params = pipe.place(stages)

    def piped(params, head, targets, side):
        return pipe.loss(params, head, inputs, targets, side=side)

    def plain(stages, head, targets, side):
        return jaxpipe.reference.loss(
            stage_fn, loss_fn, stages, head, inputs, targets, M, side=side
        )

    argnums = (0, 1, 2, 3)
    got_loss, got = jax.jit(jax.value_and_grad(piped, argnums, allow_int=True))(
        params, head, targets, side
    )
    want_loss, want = jax.value_and_grad(plain, argnums, allow_int=True)(
        stages, head, targets, side
    )
    np.testing.assert_allclose(got_loss, want_loss, rtol=RTOL)
    d_params, d_head, d_targets, d_side = got
    floats = (pipe.logical(d_params), d_head, d_targets["y"], d_side["bias"])
    assert_close(floats, (want[0], want[1], want[2]["y"], want[3]["bias"]))
    for d in (d_targets["weight"], d_side["shift"]):
        assert d.dtype == jax.dtypes.float0 and d.shape == (ROWS,)


@pytest.mark.filterwarnings("ignore:the pipeline step called")  # eager grads, traced per call
def test_side_gradient_costs_about_the_side_input():
    """The side gradient's accumulator is the side input's size per device (one buffer for
    every stage on the device, filled per micro-batch); beyond it only micro-batch-sized
    values: the compiled step's temp grows by less than 1.5 times the side input (zbv: two
    stages per device, split backward; 8 micro-batches)."""
    width, rows, num_microbatches = 128, 256, 8
    mesh = models.pipe_mesh(S)
    pipe = jaxpipe.Pipeline(
        lambda p, x, *, side: x + jnp.tanh(x @ p + side),
        lambda _, y, t: jnp.mean((y - t) ** 2),
        mesh=mesh,
        schedule="zbv",
        num_microbatches=num_microbatches,
    )
    rng = np.random.default_rng(1)
    weights = rng.normal(size=(pipe.num_logical_stages, width, width)) / 3
    params = pipe.place(jnp.asarray(weights, jnp.float32))
    x, side = (jnp.asarray(rng.normal(size=(rows, width)), jnp.float32) for _ in range(2))

    def temp(argnums):
        grad = jax.grad(lambda p, s: pipe.loss(p, None, x, x, side=s), argnums=argnums)
        return jax.jit(grad).lower(params, side).compile().memory_analysis().temp_size_in_bytes

    extra = temp((0, 1)) - temp(0)
    assert side.nbytes <= extra < 1.5 * side.nbytes, (extra, side.nbytes)


def test_loss_and_grads_returns_side_and_target_gradients():
    """`Pipeline.loss_and_grads` returns what ``jax.grad`` of the plain model gives for
    ``inputs``, ``side`` and ``targets`` (None at the integer leaves), in that order after
    the parameters' gradients (1f1b; it returned the input gradient alone)."""
    mesh = models.pipe_mesh(S)
    pipe = jaxpipe.Pipeline(stage_fn, loss_fn, mesh=mesh, schedule="1f1b", num_microbatches=M)
    stages, head, inputs, targets, side = problem(1, pipe.num_logical_stages)

    def plain(stages, head, inputs, targets, side):
        return jaxpipe.reference.loss(
            stage_fn, loss_fn, stages, head, inputs, targets, M, side=side
        )

    step = jax.jit(
        functools.partial(pipe.loss_and_grads, input_grads=True, side_grads=True),
        static_argnames="target_grads",
    )
    loss, got = step(pipe.place(stages), head, inputs, targets, side=side, target_grads=True)
    want_loss, want = jax.value_and_grad(plain, (0, 1, 2, 3, 4), allow_int=True)(
        stages, head, inputs, targets, side
    )
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL)
    d_params, d_head, d_inputs, d_side, d_targets = got
    assert d_side["shift"] is None and d_targets["weight"] is None
    floats = (pipe.logical(d_params), d_head, d_inputs, d_side["bias"], d_targets["y"])
    assert_close(floats, (*want[:3], want[4]["bias"], want[3]["y"]))
