"""An optax training loop through the pipeline equals the same loop without pipelining."""

import functools

import jax
import models
import numpy as np
import optax
import pytest

from jaxpipe import pipeline

SCHEDULES = [
    ("gpipe", {}),
    ("1f1b", {}),
    ("1f1b", {"overlap": True}),
    ("interleaved_1f1b", {"virtual_stages": 2}),
    ("interleaved_1f1b", {"virtual_stages": 3}),
    ("circular", {"repeats": 2}),
    ("zb_h1", {}),
    ("zb_h2", {}),
    ("zbv", {}),
    ("dualpipev", {}),
]
S, M, STEPS = 4, 8, 20


def _train(loss_fn, params, batches, mesh=None):
    """20 Adam steps, the whole step jitted with params and optimizer state donated;
    returns the losses and the final parameters. With a ``mesh``, the parameters and the
    optimizer state start on it (`models.on_mesh`): the step compiles once."""
    opt = optax.adam(1e-2)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, x, t):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, t)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = opt.init(params)
    if mesh is not None:
        params, opt_state = models.on_mesh((params, opt_state), mesh)
    losses = []
    for x, t in batches:
        params, opt_state, loss = step(params, opt_state, x, t)
        losses.append(float(loss))
    return np.array(losses), params


def _start(num_logical_stages):
    """The initial parameters and the batches of every step."""
    stage_params, loss_params = models.init(jax.random.key(42), num_logical_stages)
    batches = [models.data(k, 2 * M) for k in jax.random.split(jax.random.key(7), STEPS)]
    return stage_params, loss_params, batches


@functools.cache
def _plain_training(num_logical_stages):
    """`_train` of the plain model from `_start`: the same for every schedule of that many
    logical stages, so it runs once per process for each."""
    stage_params, loss_params, batches = _start(num_logical_stages)

    def plain(params, x, t):
        return models.sequential_loss(params[0], params[1], x, t, M)

    return _train(plain, (stage_params, loss_params), batches)


@pytest.mark.slow
@pytest.mark.parametrize("name,opts", SCHEDULES, ids=[f"{n}{o}" for n, o in SCHEDULES])
def test_training_matches_unpipelined_loop(name, opts):
    pipe = pipeline.Pipeline(
        models.stage_fn,
        models.loss_fn,
        mesh=models.pipe_mesh(S),
        schedule=name,
        num_microbatches=M,
        schedule_options=opts,
    )
    stage_params, loss_params, batches = _start(pipe.num_logical_stages)

    def piped(params, x, t):
        return pipe.loss(params[0], params[1], x, t)

    placed = pipe.place(stage_params)
    got, (trained, _) = _train(piped, (placed, loss_params), batches, pipe.mesh)
    want, (want_params, _) = _plain_training(pipe.num_logical_stages)
    assert want[-1] < 0.8 * want[0]  # the loop learns, so equal losses mean something
    np.testing.assert_allclose(got, want, rtol=1e-4)
    # Parameters and optimizer state stayed in the layout, each device holding its stages.
    for leaf in jax.tree_util.tree_leaves(trained):
        assert leaf.sharding.spec[:2] == (None, "pipe")
    assert models.relative_error(pipe.logical(trained), want_params) < 1e-3
