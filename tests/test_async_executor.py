"""Asynchronous schedules executed with the optimizer inside the pipeline.

The definition of the semantics is `jaxpipe.replay.replay`, which walks the same table on
one device with explicit version bookkeeping; `Pipeline.train` must agree with it.
"""

import jax
import jax.numpy as jnp
import models
import numpy as np
import optax
import pytest
from against_replay import train_against_replay

from jaxpipe import pipeline
from jaxpipe.schedules.pipedream import weight_versions

STEPS = 3
TOL = 1e-5
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}
CASES = [
    (name, S, opt)
    for name in ("pipedream", "pipedream_2bw")
    for S in (2, 3, 4)
    for opt in OPTIMIZERS
]
FAST = {("pipedream_2bw", 2, "adam")}  # the fast loop's case
PARAMS = [
    pytest.param(
        *case, id="{}-S{}-{}".format(*case), marks=() if case in FAST else pytest.mark.slow
    )
    for case in CASES
]


def _pipe(name, S, M, width=models.WIDTH):
    return pipeline.Pipeline(
        models.stage_fn,
        models.loss_fn,
        mesh=models.pipe_mesh(S),
        schedule=name,
        num_microbatches=M,
    )


@pytest.mark.parametrize("name,S,opt_name", PARAMS)
def test_train_equals_sequential_replay(name, S, opt_name):
    M = 2 * S + 1  # enough micro-batches for several updates and versions in flight
    pipe = _pipe(name, S, M)
    opt = OPTIMIZERS[opt_name]()
    key = jax.random.key(S * 10 + len(name))
    stage_params, loss_params = models.init(key, S)
    batches = [models.batch(jax.random.key(100 + k), 2 * M) for k in range(STEPS)]
    train_against_replay(
        pipe, opt, models.stage_fn, models.loss_fn, stage_params, loss_params, batches,
        tol=TOL, opt_state_atol=1e-7,
    )  # fmt: skip


@pytest.mark.slow
def test_asynchronous_updates_differ_from_synchronous_training():
    """Staleness is real: the same data through 1f1b (one update per step) ends elsewhere."""
    S, M = 3, 7
    opt = optax.sgd(0.1)
    stage_params, loss_params = models.init(jax.random.key(3), S)
    x, t = models.data(jax.random.key(4), 2 * M)
    results = {}
    for name in ("pipedream", "1f1b"):
        pipe = _pipe(name, S, M)
        placed = pipe.place(stage_params)
        state = pipe.init_optimizer(opt, placed)
        results[name] = jax.jit(lambda p, o, lp, x, t, pipe=pipe: pipe.train(opt, p, o, lp, x, t))(
            placed, state, loss_params, x, t
        )[0]
    assert models.relative_error(results["pipedream"], results["1f1b"]) > 1e-3


@pytest.mark.slow
def test_synchronous_train_equals_optax_on_pipeline_gradients():
    S, M = 4, 8
    opt = optax.adam(1e-2)
    pipe = _pipe("1f1b", S, M)
    stage_params, loss_params = models.init(jax.random.key(5), S)
    x, t = models.data(jax.random.key(6), 2 * M)
    placed = pipe.place(stage_params)
    state = pipe.init_optimizer(opt, placed)
    new, _, losses = jax.jit(lambda p, o, lp, x, t: pipe.train(opt, p, o, lp, x, t))(
        placed, state, loss_params, x, t
    )
    new = pipe.logical(new)
    grads = jax.grad(models.sequential_loss)(stage_params, loss_params, x, t, M)
    updates, _ = opt.update(grads, opt.init(stage_params), stage_params)
    assert models.relative_error(new, optax.apply_updates(stage_params, updates)) < TOL
    np.testing.assert_allclose(
        jnp.mean(losses), models.sequential_loss(stage_params, loss_params, x, t, M), rtol=TOL
    )


@pytest.mark.slow
@pytest.mark.parametrize("S", [2, 4])
def test_version_buffers_follow_the_schedule(S):
    """Slots per device equal the table's count, and each slot costs one copy of the weights."""
    M, width = 4 * S, 96
    opt = optax.sgd(0.1)
    temps, slots = {}, {}
    for name in ("pipedream", "pipedream_2bw"):
        pipe = _pipe(name, S, M)
        versions = weight_versions(pipe.schedule)
        if name == "pipedream":
            assert versions == tuple(S - d for d in range(S))
        else:
            assert max(versions) <= 2
        slots[name] = pipe._plan.num_version_slots
        assert slots[name] == max(versions)
        sp, lp = models.init(jax.random.key(0), S, width=width)
        x, t = models.data(jax.random.key(1), M, width=width)
        state = pipe.init_optimizer(opt, pipe.place(sp))
        compiled = (
            jax.jit(lambda p, o, lp, x, t, pipe=pipe: pipe.train(opt, p, o, lp, x, t))
            .lower(pipe.place(sp), state, lp, x, t)
            .compile()
        )
        temps[name] = compiled.memory_analysis().temp_size_in_bytes
    stage_bytes = sum(leaf[0].nbytes for leaf in jax.tree_util.tree_leaves(sp))
    extra = (slots["pipedream"] - slots["pipedream_2bw"]) * stage_bytes
    measured = temps["pipedream"] - temps["pipedream_2bw"]
    assert abs(measured - extra) <= 0.05 * stage_bytes + 0.05 * extra, (measured, extra)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pipedream", "pipedream_2bw"])
def test_asynchronous_training_converges(name):
    """Both schedules learn the task; threshold set from the synchronous (1f1b) run."""
    S, M, steps = 4, 8, 25
    opt = optax.adam(1e-2)
    stage_params, loss_params = models.init(jax.random.key(8), S)
    batches = [models.data(k, 2 * M) for k in jax.random.split(jax.random.key(9), steps)]

    def final_loss(schedule):
        pipe = _pipe(schedule, S, M)
        step = jax.jit(lambda p, o, lp, x, t: pipe.train(opt, p, o, lp, x, t))
        params = pipe.place(stage_params)
        state = pipe.init_optimizer(opt, params)
        first = None
        for x, t in batches:
            params, state, losses = step(params, state, loss_params, x, t)
            first = float(jnp.mean(losses)) if first is None else first
        return first, float(jnp.mean(losses))

    sync_first, sync_last = final_loss("1f1b")
    first, last = final_loss(name)
    assert sync_last < 0.7 * sync_first  # the synchronous run learns
    assert last < sync_first - 0.5 * (sync_first - sync_last)  # at least half of its progress


def test_loss_is_refused_for_asynchronous_schedules():
    pipe = _pipe("pipedream", 2, 4)
    sp, lp = models.init(jax.random.key(0), 2)
    x, t = models.data(jax.random.key(1), 8)
    with pytest.raises(ValueError, match="use Pipeline.train"):
        pipe.loss(pipe.place(sp), lp, x, t)
