"""The executor against a plain sequential model: loss, every gradient, outputs, trace."""

import dataclasses

import jax
import jax.numpy as jnp
import models
import numpy as np
import pytest

from jaxpipe import pipeline, schedules
from jaxpipe._executor import actions
from jaxpipe._executor.plan import ForwardOp

# (schedule, options, S, M): S = 3 and M not a multiple of S wherever the schedule allows;
# the fast loop runs one small case per schedule.
SLOW = pytest.mark.slow
CASES = [
    pytest.param(("gpipe", {}, 2, 3), marks=SLOW),
    pytest.param(("gpipe", {}, 4, 8), marks=SLOW),
    pytest.param(("gpipe", {}, 8, 8), marks=SLOW),
    pytest.param(("gpipe", {}, 3, 5), marks=SLOW),
    ("1f1b", {}, 2, 5),
    pytest.param(("1f1b", {}, 4, 6), marks=SLOW),
    pytest.param(("1f1b", {}, 8, 9), marks=SLOW),
    pytest.param(("1f1b", {}, 3, 4), marks=SLOW),
    pytest.param(("1f1b", {"overlap": True}, 4, 8), marks=SLOW),
    ("1f1b", {"overlap": True}, 3, 5),
    ("interleaved_1f1b", {"virtual_stages": 2}, 2, 4),
    pytest.param(("interleaved_1f1b", {"virtual_stages": 2}, 4, 8), marks=SLOW),
    pytest.param(("interleaved_1f1b", {"virtual_stages": 2}, 8, 8), marks=SLOW),
    pytest.param(("interleaved_1f1b", {"virtual_stages": 3}, 3, 6), marks=SLOW),
    pytest.param(("interleaved_1f1b", {"virtual_stages": 3}, 4, 4), marks=SLOW),
    ("circular", {"repeats": 2}, 2, 3),
    pytest.param(("circular", {"repeats": 2}, 4, 6), marks=SLOW),
    pytest.param(("circular", {"repeats": 2}, 8, 8), marks=SLOW),
    pytest.param(("circular", {"repeats": 2}, 3, 4), marks=SLOW),
]
TOL = 1e-5


def _case_id(case):
    name, opts, S, M = case
    return f"{name}-{'-'.join(f'{k}{v}' for k, v in opts.items())}-S{S}-M{M}"


def _setup(name, opts, S, M, seed, remat=False):
    mesh = models.pipe_mesh(S)
    pipe = pipeline.Pipeline(
        models.stage_fn,
        models.loss_fn,
        mesh=mesh,
        schedule=name,
        num_microbatches=M,
        schedule_options=opts,
        remat=remat,
    )
    k1, k2 = jax.random.split(jax.random.key(seed))
    stage_params, loss_params = models.init(k1, pipe.num_logical_stages)
    inputs, targets = models.data(k2, 2 * M)
    return pipe, stage_params, loss_params, inputs, targets


def _logical(pipe, grads):
    """The stage gradients (first element) back in logical order."""
    return (pipe.logical(grads[0]), *grads[1:])


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_loss_and_gradients_match_sequential_reference(case):
    name, opts, S, M = case
    pipe, sp, lp, x, t = _setup(name, opts, S, M, seed=S * 100 + M)
    placed = pipe.place(sp)
    loss, grads = jax.jit(jax.value_and_grad(pipe.loss, argnums=(0, 1, 2)))(placed, lp, x, t)
    grads = _logical(pipe, grads)
    for leaf in jax.tree_util.tree_leaves(grads[0]):
        assert leaf.shape[0] == pipe.num_logical_stages
    ref_loss, ref_grads = jax.value_and_grad(models.sequential_loss, argnums=(0, 1, 2))(
        sp, lp, x, t, M
    )
    np.testing.assert_allclose(loss, ref_loss, rtol=TOL)
    assert models.relative_error(grads[0], ref_grads[0]) < TOL
    assert models.relative_error(grads[1], ref_grads[1]) < TOL
    assert models.relative_error(grads[2], ref_grads[2]) < TOL


@pytest.mark.parametrize("case", CASES[1::4], ids=_case_id)
def test_forward_and_undifferentiated_loss(case):
    name, opts, S, M = case
    pipe, sp, lp, x, t = _setup(name, opts, S, M, seed=7)
    placed = pipe.place(sp)
    outputs = jax.jit(pipe.forward)(placed, x)
    np.testing.assert_allclose(outputs, models.sequential_forward(sp, x), rtol=TOL, atol=1e-6)
    loss = jax.jit(pipe.loss)(placed, lp, x, t)
    np.testing.assert_allclose(loss, models.sequential_loss(sp, lp, x, t, M), rtol=TOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1", "zbv", "dualpipev"])
def test_remat_gives_the_same_gradients(name):
    """With ``remat`` a split backward's W also recomputes the wide cotangents it needs from
    narrow ones (`split_backward`'s ``narrow_stash``): the gradients stay those of the
    sequential model."""
    pipe, sp, lp, x, t = _setup(name, {}, 4, 8, seed=3, remat=True)
    grads = jax.jit(jax.grad(pipe.loss, argnums=(0, 1, 2)))(pipe.place(sp), lp, x, t)
    grads = _logical(pipe, grads)
    ref = jax.grad(models.sequential_loss, argnums=(0, 1, 2))(sp, lp, x, t, 8)
    assert models.relative_error(grads, ref) < TOL


@pytest.mark.slow
def test_loss_and_grads_without_autodiff_equals_autodiff():
    pipe, sp, lp, x, t = _setup("1f1b", {}, 4, 8, seed=11)
    step = jax.jit(pipe.loss_and_grads, static_argnums=4)
    loss, (gs, gl, gx) = step(pipe.place(sp), lp, x, t, True)
    gs = pipe.logical(gs)
    ref_loss, ref = jax.value_and_grad(models.sequential_loss, argnums=(0, 1, 2))(sp, lp, x, t, 8)
    np.testing.assert_allclose(loss, ref_loss, rtol=TOL)
    assert models.relative_error((gs, gl, gx), ref) < TOL


@pytest.mark.slow
def test_gradient_scales_with_outer_cotangent():
    """The custom_vjp boundary composes with user code around it (embedding, scaling)."""
    pipe, sp, lp, x, t = _setup("interleaved_1f1b", {"virtual_stages": 2}, 2, 4, seed=5)
    embed = jax.random.normal(jax.random.key(9), (5, models.WIDTH))

    def user_loss(embed, sp, lp, ids, t):
        inputs = jnp.tanh(ids @ embed)
        return 3.0 * pipe.loss(sp, lp, inputs, t) + jnp.sum(embed**2)

    def ref_loss(embed, sp, lp, ids, t):
        inputs = jnp.tanh(ids @ embed)
        return 3.0 * models.sequential_loss(sp, lp, inputs, t, 4) + jnp.sum(embed**2)

    ids = jax.random.normal(jax.random.key(10), (x.shape[0], 5))
    got = jax.jit(jax.grad(user_loss, argnums=(0, 1, 2)))(embed, pipe.place(sp), lp, ids, t)
    got = (got[0], pipe.logical(got[1]), got[2])
    want = jax.grad(ref_loss, argnums=(0, 1, 2))(embed, sp, lp, ids, t)
    assert models.relative_error(got, want) < TOL


def _assert_trace_is_the_table(pipe, trace):
    """``trace`` (what the program ran) is the schedule's table: every action where the
    table has it, on its stage and micro-batch, and nothing else."""
    table = pipe.schedule
    assert trace.shape == (table.num_ticks, pipe.num_stages, 6)
    np.testing.assert_array_equal(trace, pipe.expected_trace())
    # And the expected trace is the table itself: every action appears where the table has it.
    for tick, device, action in table.timed_actions():
        row = trace[tick, device]
        if action.op == schedules.F:
            assert row[0] != 0 and (row[1], row[2]) == (action.stage, action.microbatch)
        else:
            assert row[3] != 0 and (row[4], row[5]) == (action.stage, action.microbatch)
    busy = (trace[:, :, 0] != 0).sum() + (trace[:, :, 3] != 0).sum()
    assert busy == sum(1 for _ in table.actions())


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in schedules.names() if "pipedream" not in n])
def test_trace_equals_table(name):
    S = 4
    opts = {"interleaved_1f1b": {"virtual_stages": 2}, "circular": {"repeats": 2}}.get(name, {})
    M = 8
    pipe, sp, lp, x, t = _setup(name, opts, S, M, seed=1)
    _assert_trace_is_the_table(pipe, pipe.trace(pipe.place(sp), lp, x, t))


def test_the_trace_fails_for_a_broken_table_or_executor(monkeypatch):
    """The trace records what ran (the action's own op code, the micro-batch of the slot it
    read), not the plan's row: a plan whose receive slots disagree with its rows, and a
    tick that runs another action than its row names, each give a trace that is not the
    table."""
    pipe, sp, lp, x, t = _setup("interleaved_1f1b", {"virtual_stages": 2}, 2, 4, seed=2)
    placed = pipe.place(sp)
    _assert_trace_is_the_table(pipe, pipe.trace(placed, lp, x, t))

    # The first activation sent lands in the junk slot instead of the slot its reader reads.
    plan = pipe._plan
    act_recv = plan.act_recv.copy()
    channel, tick, device = np.argwhere(act_recv != plan.num_act_slots)[0]
    act_recv[channel, tick, device] = plan.num_act_slots
    monkeypatch.setattr(pipe, "_plan", dataclasses.replace(plan, act_recv=act_recv))
    broken = pipe.trace(placed, lp, x, t)
    with pytest.raises(AssertionError):
        _assert_trace_is_the_table(pipe, broken)
    monkeypatch.setattr(pipe, "_plan", plan)

    # A tick whose dispatch runs the idle forward where its row names a stage's forward.
    monkeypatch.setitem(actions.FORWARD, ForwardOp.STAGE, actions.forward_idle)
    broken = pipe.trace(placed, lp, x, t)
    with pytest.raises(AssertionError):
        _assert_trace_is_the_table(pipe, broken)


def test_schedule_object_and_csv_round_trip(tmp_path):
    sched = schedules.get("1f1b", 2, 4)
    path = tmp_path / "custom.csv"
    schedules.to_csv(sched, path)
    loaded = schedules.from_csv(path)
    mesh = models.pipe_mesh(2)
    pipe = pipeline.Pipeline(models.stage_fn, models.loss_fn, mesh=mesh, schedule=loaded)
    sp, lp = models.init(jax.random.key(2), 2)
    x, t = models.data(jax.random.key(3), 8)
    loss = jax.jit(pipe.loss)(pipe.place(sp), lp, x, t)
    np.testing.assert_allclose(loss, models.sequential_loss(sp, lp, x, t, 4), rtol=TOL)
