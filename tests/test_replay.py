"""The sequential replay: the semantics of a table with the optimizer inside, run on what the
pipeline passes its stages (pytree activations, side inputs, keys, data-parallel replicas)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxpipe import pipeline, reference
from jaxpipe.replay import init_opt_states, replay, split_microbatches, stage_slice
from jaxpipe.schedules import BW, F, get

WIDTH = 6


def residual_stage(params, x):
    return x + jnp.tanh(x @ params["w"] + params["b"])


def readout_loss(head, y, target):
    return jnp.mean((y @ head - target) ** 2)


def residual_problem(num_stages, batch, seed):
    k_w, k_b, k_head, k_x, k_teacher = jax.random.split(jax.random.PRNGKey(seed), 5)
    params = {
        "w": 0.4 * jax.random.normal(k_w, (num_stages, WIDTH, WIDTH)),
        "b": 0.1 * jax.random.normal(k_b, (num_stages, WIDTH)),
    }
    head = jax.random.normal(k_head, (WIDTH,)) / np.sqrt(WIDTH)
    x = jax.random.normal(k_x, (batch, WIDTH))
    teacher = jax.random.normal(k_teacher, (WIDTH,))
    targets = jnp.sin(x @ teacher)
    return params, head, x, targets


def sequential_loss(stage_params, head, x, target):
    """The whole model, stage after stage, with no pipeline."""
    num_stages = jax.tree.leaves(stage_params)[0].shape[0]
    for s in range(num_stages):
        x = residual_stage(stage_slice(stage_params, s), x)
    return readout_loss(head, x, target)


def per_microbatch_training(opt, stage_params, head, x, targets, num_microbatches):
    """Plain synchronous training: one optimizer step per micro-batch, in index order."""
    state = opt.init(stage_params)
    losses = []
    xs = split_microbatches(x, num_microbatches)
    ts = split_microbatches(targets, num_microbatches)
    for xm, tm in zip(xs, ts, strict=True):
        loss, grads = jax.value_and_grad(sequential_loss)(stage_params, head, xm, tm)
        updates, state = opt.update(grads, state, stage_params)
        stage_params = optax.apply_updates(stage_params, updates)
        losses.append(loss)
    return stage_params, state, jnp.stack(losses)


def assert_trees_close(a, b, rtol, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def test_split_microbatches_takes_contiguous_blocks_like_the_pipeline():
    x = jnp.arange(24.0).reshape(12, 2)
    parts = split_microbatches(x, 4)
    assert parts.shape == (4, 3, 2)
    np.testing.assert_array_equal(parts[1], x[3:6])
    np.testing.assert_array_equal(parts, pipeline.split_microbatches(x, 4))
    with pytest.raises(ValueError, match="multiple of num_microbatches=5"):
        split_microbatches(x, 5)


@pytest.mark.parametrize("make_opt", [lambda: optax.sgd(0.1), lambda: optax.adam(0.01)])
def test_one_stage_pipedream_is_per_microbatch_training(make_opt):
    opt, M = make_opt(), 8
    params, head, x, targets = residual_problem(num_stages=1, batch=32, seed=1)
    got_params, got_states, got_losses = replay(
        get("pipedream", 1, M),
        residual_stage,
        readout_loss,
        params,
        head,
        opt,
        init_opt_states(opt, params),
        x,
        targets,
    )
    want_params, want_state, want_losses = per_microbatch_training(opt, params, head, x, targets, M)
    assert_trees_close(got_params, want_params, rtol=1e-6, atol=1e-6)
    assert_trees_close(got_losses, want_losses, rtol=1e-6, atol=1e-6)
    # the optimizer state of the one stage is the sequential state with the stage axis dropped
    assert_trees_close(got_states[0], stage_slice_state(want_state), rtol=1e-6, atol=1e-6)
    assert not np.allclose(got_params["w"], params["w"])  # it trained


def stage_slice_state(state):
    return jax.tree.map(lambda leaf: leaf[0] if jnp.ndim(leaf) > 0 else leaf, state)


@pytest.mark.parametrize(
    "name,options",
    [
        pytest.param("gpipe", {}, marks=pytest.mark.slow),
        pytest.param("1f1b", {}, marks=pytest.mark.slow),
        ("zb_h1", {}),  # split backward: B then W
        pytest.param("interleaved_1f1b", {"virtual_stages": 2}, marks=pytest.mark.slow),
    ],
)
def test_synchronous_tables_take_one_step_on_the_mean_gradient(name, options):
    M, lr = 6, 0.1
    schedule = get(name, 3, M, **options)
    opt = optax.sgd(lr)
    params, head, x, targets = residual_problem(schedule.num_logical_stages, batch=24, seed=2)
    got_params, _, got_losses = replay(
        schedule,
        residual_stage,
        readout_loss,
        params,
        head,
        opt,
        init_opt_states(opt, params),
        x,
        targets,
    )
    grads = jax.grad(sequential_loss)(params, head, x, targets)  # equal micro-batches: mean
    want = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    assert_trees_close(got_params, want, rtol=1e-5, atol=1e-6)
    assert got_losses.shape == (M,)
    np.testing.assert_allclose(got_losses.mean(), sequential_loss(params, head, x, targets), 1e-5)


@pytest.mark.slow
def test_stale_pipedream_differs_from_synchronous_but_learns():
    S, M, lr, steps = 4, 16, 0.05, 6
    opt = optax.sgd(lr)
    params, head, x, targets = residual_problem(num_stages=S, batch=64, seed=3)
    start_loss = float(sequential_loss(params, head, x, targets))
    sync_params, _, _ = per_microbatch_training(opt, params, head, x, targets, M)
    for name in ("pipedream", "pipedream_2bw"):
        schedule = get(name, S, M)
        p, states = params, init_opt_states(opt, params)
        for step in range(steps):
            p, states, losses = replay(
                schedule, residual_stage, readout_loss, p, head, opt, states, x, targets
            )
            assert np.all(np.isfinite(losses))
            if step == 0:
                # stale weights: not the same as one synchronous step per micro-batch
                gap = max(
                    float(jnp.max(jnp.abs(a - b)))
                    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(sync_params), strict=True)
                )
                assert gap > 1e-3, (name, gap)
        end_loss = float(sequential_loss(p, head, x, targets))
        assert end_loss < 0.5 * start_loss, (name, start_loss, end_loss)


# ------------------------------------------------------- tiny linear model, by hand
def linear_stage(params, x):
    return x @ params["w"]


def half_squared_error(_, y, target):
    return 0.5 * jnp.sum((y - target) ** 2) / y.shape[0]


def hand_computed_training(weights, xs, ts, num_stages, interval, lr, stale=True):
    """Stage ``s`` is ``h -> h @ W_s``; loss ``0.5 |y - t|^2 / rows`` per micro-batch.

    Micro-batch ``m`` runs stage ``s`` with version ``max(0, m - (S-1-s)) // interval`` of
    ``W_s`` (forward and backward alike); after each group of ``interval`` micro-batches,
    version ``k+1 = version k - lr * mean of the group's gradients``. Gradients by hand:
    ``dL/dW_s = h_s^T g_{s+1}``, ``g_S = (y - t) / rows``, ``g_s = g_{s+1} W_s^T``.
    With ``stale=False`` every micro-batch of group ``k`` reads version ``k`` (synchronous).
    """
    S, M = num_stages, len(xs)
    history = [[np.asarray(w)] for w in weights]  # history[s][k]: version k of stage s
    losses = np.zeros(M, np.float32)
    for k, start in enumerate(range(0, M, interval)):
        group = range(start, min(start + interval, M))
        grads = [[] for _ in range(S)]
        for m in group:
            lag = [S - 1 - s if stale else 0 for s in range(S)]
            used = [history[s][max(0, m - lag[s]) // interval] for s in range(S)]
            hs = [np.asarray(xs[m])]
            for s in range(S):
                hs.append(hs[s] @ used[s])
            rows = hs[0].shape[0]
            error = hs[S] - np.asarray(ts[m])
            losses[m] = 0.5 * np.sum(error**2) / rows
            g = error / rows
            for s in reversed(range(S)):
                grads[s].append(hs[s].T @ g)
                g = g @ used[s].T
        for s in range(S):
            history[s].append(history[s][k] - lr * np.mean(grads[s], axis=0))
    return np.stack([h[-1] for h in history]), losses


@pytest.mark.parametrize("S", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "name,interval", [("pipedream", None), ("pipedream_2bw", 0), ("pipedream_2bw", 1)]
)
def test_linear_model_matches_hand_computed_stale_updates(S, name, interval):
    M, rows, lr = 3 * S + 1, 3, 0.1
    options = {} if interval is None else {"update_interval": S + interval}
    G = 1 if interval is None else S + interval
    k_w, k_x, k_t = jax.random.split(jax.random.PRNGKey(10 * S + G), 3)
    weights = jnp.eye(3) + 0.2 * jax.random.normal(k_w, (S, 3, 3))
    x = jax.random.normal(k_x, (M * rows, 3))
    targets = jax.random.normal(k_t, (M * rows, 3))
    opt = optax.sgd(lr)
    params = {"w": weights}
    got, _, got_losses = replay(
        get(name, S, M, **options),
        linear_stage,
        half_squared_error,
        params,
        None,
        opt,
        init_opt_states(opt, params),
        x,
        targets,
    )
    want, want_losses = hand_computed_training(
        list(weights), split_microbatches(x, M), split_microbatches(targets, M), S, G, lr
    )
    np.testing.assert_allclose(np.asarray(got["w"]), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_losses), want_losses, rtol=1e-5, atol=1e-6)
    # the test tells staleness apart: synchronous group updates give other weights
    fresh, _ = hand_computed_training(
        list(weights), split_microbatches(x, M), split_microbatches(targets, M), S, G, lr, False
    )
    assert not np.allclose(fresh, want, rtol=1e-3, atol=1e-4)


def test_replay_rejects_a_version_that_is_not_alive():
    S, M = 2, 4
    schedule = get("pipedream", S, M, split_backward=False)
    # F(0, 3) reads version 2; version 0 is no longer stashed by anyone at that tick
    assert [a.version for _, _, a in schedule.timed_actions() if a[:3] == (F, 0, 3)] == [2]
    rows = tuple(
        tuple(tuple(a._replace(version=0) if a[1:3] == (0, 3) else a for a in cell) for cell in row)
        for row in schedule.ticks
    )
    opt = optax.sgd(0.1)
    params = {"w": jnp.stack([jnp.eye(3)] * S)}
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 3))
    with pytest.raises(ValueError, match=r"reads version 0 of stage 0, but the versions alive"):
        replay(
            dataclasses.replace(schedule, ticks=rows),
            linear_stage,
            half_squared_error,
            params,
            None,
            opt,
            init_opt_states(opt, params),
            x,
            x,
        )
    bad_backward = tuple(
        tuple(
            tuple(a._replace(version=1) if a[:3] == (BW, 1, 0) else a for a in cell) for cell in row
        )
        for row in schedule.ticks
    )
    with pytest.raises(ValueError, match="its forward read version 0"):
        replay(
            dataclasses.replace(schedule, ticks=bad_backward),
            linear_stage,
            half_squared_error,
            params,
            None,
            opt,
            init_opt_states(opt, params),
            x,
            x,
        )


# ------------------------------------------ what the pipeline passes: pytrees, side, keys
def rich_stage(params, x, *, side, key, stage):
    """A stage with a pytree activation (an integer leaf counts the stages run), a side
    input, dropout from ``key`` and a term from ``stage``."""
    h = x["h"] + jnp.tanh(x["h"] @ params["w"] + params["b"]) * side["gate"][:, None]
    keep = jax.random.bernoulli(key, 0.8, h.shape)
    h = jnp.where(keep, h / 0.8, 0.0) + 0.01 * stage
    return {"h": h, "count": x["count"] + 1}


def rich_loss(head, y, target, *, side, key):
    noise = 0.01 * jax.random.normal(key, target.shape)
    error = (y["h"] @ head - target + noise) * side["weight"]
    return jnp.mean(error**2) + 0.001 * jnp.mean(y["count"])


def rich_problem(num_stages, batch, seed):
    params, head, x, targets = residual_problem(num_stages, batch, seed)
    k_gate, k_weight = jax.random.split(jax.random.PRNGKey(seed + 100))
    inputs = {"h": x, "count": jnp.zeros(batch, jnp.int32)}
    side = {
        "gate": jax.random.uniform(k_gate, (batch,)),
        "weight": 1 + jax.random.uniform(k_weight, (batch,)),
    }
    return params, head, inputs, targets, side


def reference_step(params, head, inputs, targets, side, key, M, lr, num_replicas=1):
    """One SGD step on `jaxpipe.reference.loss` as the pipeline defines it with ``R``
    replicas: the mean over replicas of the loss on replica ``r``'s rows with the key
    ``fold_in(key, r)`` (the key as given with one replica)."""
    R = num_replicas

    def loss(p):
        total = 0.0
        for r in range(R):
            rows = jax.tree.map(lambda a, r=r: jnp.split(a, R)[r], (inputs, targets, side))
            k = jax.random.fold_in(key, r) if R > 1 else key
            total += reference.loss(
                rich_stage, rich_loss, p, head, *rows[:2], M, side=rows[2], key=k
            )
        return total / R

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads), value


def test_accumulation_step_passes_the_keywords_the_pipeline_passes():
    """`reference.accumulation_step` with a stage taking side, key and stage and a loss
    taking side and key: its loss and gradients are `reference.loss`'s; a
    `jaxpipe.stages.blocks` stage (it needs ``stage``) runs too."""
    from jaxpipe import stages

    M = 4
    params, head, inputs, targets, side = rich_problem(3, 16, 7)
    key = jax.random.key(5)
    step = reference.accumulation_step(rich_stage, rich_loss, M)
    loss, grads = step(params, head, inputs, targets, side, key)
    want, want_grads = jax.value_and_grad(reference.loss, argnums=(2, 3))(
        rich_stage, rich_loss, params, head, inputs, targets, M, side=side, key=key
    )
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    assert_trees_close(grads, want_grads, rtol=1e-5, atol=1e-6)
    other, _ = step(params, head, inputs, targets, side, jax.random.key(6))
    assert abs(other - loss) > 1e-4 * abs(loss)  # the key takes part

    def block(p, x, *, block):
        return jnp.tanh(x @ p["w"]) + 0.01 * block

    def array_loss(head, y, target, *, side, key):
        return rich_loss(head, {"h": y, "count": jnp.zeros(())}, target, side=side, key=key)

    blocked = stages.stack_blocks([{"w": params["w"][i % 3]} for i in range(4)], 2)
    loss, grads = reference.accumulation_step(stages.blocks(block), array_loss, M)(
        blocked, head, inputs["h"], targets, side, key
    )
    want, want_grads = jax.value_and_grad(reference.loss, argnums=(2, 3))(
        stages.blocks(block), array_loss, blocked, head, inputs["h"], targets, M, side=side,
        key=key,
    )  # fmt: skip
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    assert_trees_close(grads, want_grads, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "name,R",
    [
        ("zb_h1", 1),
        ("1f1b", 2),
        pytest.param("gpipe", 1, marks=pytest.mark.slow),
        pytest.param("interleaved_1f1b", 1, marks=pytest.mark.slow),
    ],
)
def test_keys_side_inputs_and_pytrees_as_the_pipeline_passes_them(name, R):
    M, lr = 4, 0.1
    schedule = get(name, 2, M)
    params, head, inputs, targets, side = rich_problem(schedule.num_logical_stages, 16, 5)
    key = jax.random.key(3)
    opt = optax.sgd(lr)
    got, _, losses = replay(
        schedule, rich_stage, rich_loss, params, head, opt, init_opt_states(opt, params),
        inputs, targets, side=side, key=key, num_replicas=R,
    )  # fmt: skip
    want, value = reference_step(params, head, inputs, targets, side, key, M, lr, R)
    assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses.mean(), value, rtol=1e-5)
    # the keys take part: another key, or the replicas' own keys, give other weights
    other, _ = reference_step(params, head, inputs, targets, side, jax.random.key(4), M, lr, R)
    assert not np.allclose(got["w"], other["w"], rtol=1e-4, atol=1e-5)
    if R > 1:
        shared, _ = reference_step(params, head, inputs, targets, side, key, M, lr, 1)
        assert not np.allclose(got["w"], shared["w"], rtol=1e-4, atol=1e-5)


def test_a_list_of_stage_functions_runs_function_s_on_stage_s():
    schedule = get("zb_h1", 2, 2)
    params, head, inputs, targets, side = rich_problem(2, 8, 6)
    functions = [
        lambda p, x, *, side, key, s=s: rich_stage(p, x, side=side, key=key, stage=s)
        for s in range(2)
    ]
    opt = optax.sgd(0.1)
    runs = [
        replay(
            schedule,
            fn,
            rich_loss,
            params,
            head,
            opt,
            init_opt_states(opt, params),
            inputs,
            targets,
            side=side,
            key=jax.random.key(0),
        )  # fmt: skip
        for fn in (rich_stage, functions)
    ]
    assert_trees_close(runs[0][0], runs[1][0], rtol=0, atol=0)
    assert_trees_close(runs[0][2], runs[1][2], rtol=0, atol=0)
    with pytest.raises(ValueError, match="one function per stage"):
        replay(
            schedule, functions[:1], rich_loss, params, head, opt, init_opt_states(opt, params),
            inputs, targets, side=side, key=jax.random.key(0),
        )  # fmt: skip


def test_split_microbatches_with_replicas_is_the_pipelines():
    x = {"a": jnp.arange(48.0).reshape(24, 2), "b": jnp.arange(24)}
    parts = split_microbatches(x, 3, num_replicas=2)
    for leaf, part in zip(jax.tree.leaves(x), jax.tree.leaves(parts), strict=True):
        np.testing.assert_array_equal(part, pipeline.split_microbatches(leaf, 3, 2))
    with pytest.raises(ValueError, match="multiple of num_microbatches=5 times num_replicas=2"):
        split_microbatches(x, 5, num_replicas=2)
