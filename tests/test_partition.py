"""`jaxpipe.partition`: balanced layer ranges (exact, against brute force), costs from XLA,
per-stage memory of a schedule, and uneven stages running through the pipeline."""

import itertools

import jax
import jax.numpy as jnp
import models
import numpy as np
import optax
import pytest

from jaxpipe import partition, pipeline, schedules


def _brute_force(costs, num_stages):
    """The smallest possible slowest-stage cost over every contiguous split."""
    L = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, L), num_stages - 1):
        bounds = (0, *cuts, L)
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def _check_ranges(ranges, L, num_stages):
    assert len(ranges) == num_stages and ranges[0][0] == 0 and ranges[-1][1] == L
    assert all(b > a for a, b in ranges)
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(num_stages - 1))


def test_balanced_costs_give_equal_stages():
    assert partition.partition([1.0] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    ranges = partition.partition([3.0] * 126, 12)
    _check_ranges(ranges, 126, 12)
    sizes = sorted(b - a for a, b in ranges)
    assert sizes == [10] * 6 + [11] * 6  # 126 = 6 * 10 + 6 * 11: as even as possible


def test_skewed_costs_move_layers():
    costs = [8.0, 1, 1, 1, 1, 1, 1, 1, 1, 8]
    ranges = partition.partition(costs, 4)
    _check_ranges(ranges, 10, 4)
    assert ranges[0] == (0, 1) and ranges[-1] == (9, 10)  # heavy layers alone
    costs = np.linspace(1, 12, 126) ** 2  # later layers much dearer: later stages shorter
    ranges = partition.partition(costs, 12)
    sizes = [b - a for a, b in ranges]
    assert sizes[0] > sizes[-1] and sizes == sorted(sizes, reverse=True)
    slowest = max(costs[a:b].sum() for a, b in ranges)
    assert slowest <= 1.2 * costs.sum() / 12


@pytest.mark.parametrize("seed", range(12))
def test_partition_is_optimal_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    L = int(rng.integers(3, 10))
    S = int(rng.integers(1, L + 1))
    costs = [float(c) for c in rng.integers(1, 20, size=L)]
    ranges = partition.partition(costs, S)
    _check_ranges(ranges, L, S)
    assert max(sum(costs[a:b]) for a, b in ranges) == _brute_force(costs, S)


def test_memory_limit_and_errors():
    costs, memory = [1.0] * 6, [1, 1, 1, 1, 1, 5]
    # without a limit the even split; with one, the big-memory layer sits alone
    assert partition.partition(costs, 3) == [(0, 2), (2, 4), (4, 6)]
    ranges = partition.partition(costs, 3, memory=memory, memory_limit=5)
    assert ranges[-1] == (5, 6) and max(b - a for a, b in ranges) == 3
    with pytest.raises(ValueError, match="keeps every stage within memory_limit"):
        partition.partition(costs, 3, memory=memory, memory_limit=4)
    with pytest.raises(ValueError, match="3 layers cannot fill 4 stages"):
        partition.partition([1, 1, 1], 4)
    with pytest.raises(ValueError, match="finite and >= 0"):
        partition.partition([1, -1], 1)
    with pytest.raises(ValueError, match=r"memory_limit has shape \(2,\); .* \(3 values\)"):
        partition.partition(costs, 3, memory=memory, memory_limit=[5, 5])
    per_stage = partition.partition(costs, 3, memory=memory, memory_limit=[5, 5, 5])
    assert per_stage == ranges


def test_layer_costs_from_xla_and_parameter_count():
    def layer(p, x):
        return x @ p["w"]

    layers = [{"w": np.ones((8, 8), np.float32)}, {"w": np.ones((8, 8), np.float32)}]
    x = jax.ShapeDtypeStruct((4, 8), np.float32)
    flops = partition.layer_costs(layer, layers, x)
    assert flops[0] == flops[1] and flops[0] >= 2 * 4 * 8 * 8 * 0.9
    stacked = {"w": np.ones((3, 8, 8), np.float32)}
    assert partition.layer_costs(layer, stacked, x, measure="params") == [64.0] * 3


def test_stage_memory_report_early_stages_hold_more():
    schedule = schedules.get("1f1b", 4, 8)
    ranges = partition.partition([1.0] * 8, 4)
    report = partition.stage_memory_report(schedule, ranges, 100.0)
    in_flight = [row["in_flight"] for row in report]
    assert in_flight == [4, 3, 2, 1] == list(schedule.peak_activations())
    assert [row["stage_bytes"] for row in report] == [800.0, 600.0, 400.0, 200.0]
    # trading layers for memory: fewer layers on early stages evens the bytes out
    report = partition.stage_memory_report(schedule, [(0, 1), (1, 3), (3, 6), (6, 12)], 100.0)
    assert max(r["stage_bytes"] for r in report) == 600.0
    with pytest.raises(ValueError, match="contiguous"):
        partition.stage_memory_report(schedule, [(0, 2), (3, 4), (4, 6), (6, 8)], 1.0)


@pytest.mark.slow
def test_uneven_layers_run_and_match_the_reference():
    """10 layers on 4 stages (3, 3, 2, 2): loss and every layer gradient equal the plain stack."""
    S, L, M = 4, 10, 4
    mesh = models.pipe_mesh(S)
    k1, k2 = jax.random.split(jax.random.key(3))
    layer_params, loss_params = models.init(k1, L)  # leaves [L, ...]: one entry per layer
    inputs, targets = models.data(k2, 2 * M)
    ranges = partition.partition([1.0] * L, S)
    assert sorted(b - a for a, b in ranges) == [2, 2, 3, 3]
    stage_params = partition.stack_layers(layer_params, ranges)
    pipe = pipeline.Pipeline(
        partition.layered_stage_fn(models.stage_fn),
        models.loss_fn,
        mesh=mesh,
        schedule="1f1b",
        num_microbatches=M,
    )
    loss, (stage_grads, loss_grads) = jax.jit(jax.value_and_grad(pipe.loss, argnums=(0, 1)))(
        pipe.place(stage_params), loss_params, inputs, targets
    )
    stage_grads = pipe.logical(stage_grads)
    ref_loss, (ref_layer_grads, ref_loss_grads) = jax.value_and_grad(
        models.sequential_loss, argnums=(0, 1)
    )(layer_params, loss_params, inputs, targets, M)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    layer_grads = partition.unstack_layers(stage_grads, ranges)
    layer_grads = jax.tree_util.tree_map(lambda *g: np.stack(g), *layer_grads)
    assert models.relative_error(layer_grads, ref_layer_grads) < 1e-5
    assert models.relative_error(loss_grads, ref_loss_grads) < 1e-5
    w1 = np.asarray(stage_grads["layers"]["w1"])
    padded = [w1[s, k] for s, (a, b) in enumerate(ranges) for k in range(b - a, 3)]
    assert len(padded) == 2 and all(np.all(g == 0) for g in padded)
    assert np.all(np.asarray(stage_grads["active"]) == 0)


def _layer(p, x):
    return x + jnp.tanh(x @ p["w"] + p["b"])


def test_weight_decay_does_not_turn_layers_off():
    """adamw's decay shrinks ``active`` (zero gradient) well below 0.5: every layer still runs,
    so the pipeline's loss is the plain model's on the trained layers; padding stays 0."""
    rng = np.random.default_rng(0)
    layers = [
        {"w": jnp.asarray(rng.standard_normal((4, 4)) / 4, jnp.float32), "b": jnp.zeros(4)}
        for _ in range(3)
    ]
    ranges = [(0, 2), (2, 3)]
    x, t = (jnp.asarray(rng.standard_normal((8, 4)), jnp.float32) for _ in range(2))

    def loss_fn(lp, y, t):
        return jnp.mean((y - t) ** 2)

    pipe = pipeline.Pipeline(
        partition.layered_stage_fn(_layer),
        loss_fn,
        mesh=models.pipe_mesh(2),
        schedule="1f1b",
        num_microbatches=2,
    )
    opt = optax.adamw(0.1, weight_decay=1.0)  # active *= 0.9 per step
    params = pipe.place(partition.stack_layers(layers, ranges))
    state = pipe.init_optimizer(opt, params)
    step = jax.jit(lambda p, s: pipe.train(opt, p, s, None, x, t)[:2])
    for _ in range(10):
        params, state = step(params, state)
    active = np.asarray(jax.device_get(pipe.logical(params)["active"]))
    assert np.all(active[:, :1] < 0.5) and np.all(active[:, :1] > 0) and active[1, 1] == 0
    trained = partition.unstack_layers(jax.device_get(pipe.logical(params)), ranges)
    h = x
    for p in trained:
        h = _layer(p, h)
    np.testing.assert_allclose(pipe.loss(params, None, x, t), loss_fn(None, h, t), rtol=1e-5)


def test_any_nonzero_active_runs_the_layer():
    """Momentum with weight decay can swing ``active`` negative: the layer still runs."""
    rng = np.random.default_rng(1)
    layers = [{"w": jnp.asarray(rng.standard_normal((4, 4)), jnp.float32), "b": jnp.ones(4)}]
    x = jnp.asarray(rng.standard_normal((2, 4)), jnp.float32)
    stage_fn = partition.layered_stage_fn(_layer)
    one = jax.tree_util.tree_map(lambda a: a[0], partition.stack_layers(layers, [(0, 1)]))
    for value, expected in [(-0.3, _layer(layers[0], x)), (1e-30, _layer(layers[0], x)), (0, x)]:
        p = {**one, "active": jnp.full_like(one["active"], value)}
        np.testing.assert_allclose(stage_fn(p, x), expected, rtol=1e-5, atol=1e-7)


def test_pytree_activations_pass_through_the_layers():
    """A dict activation with an integer leaf: each stage equals a plain loop over its
    layers (the padding layer leaves it alone, the integer leaf stays an integer)."""
    rng = np.random.default_rng(2)
    layers = [
        {"w": jnp.asarray(rng.standard_normal((4, 4)) / 2, jnp.float32), "b": jnp.zeros(4)}
        for _ in range(3)
    ]
    ranges = [(0, 1), (1, 3)]

    def layer_fn(p, x):
        return {"h": _layer(p, x["h"]), "count": x["count"] + 1}

    stage_fn = partition.layered_stage_fn(layer_fn)
    stacked = partition.stack_layers(layers, ranges)
    x = {"h": jnp.asarray(rng.standard_normal((2, 4)), jnp.float32), "count": jnp.zeros(2, int)}
    for s, (a, b) in enumerate(ranges):
        got = stage_fn(jax.tree_util.tree_map(lambda v, s=s: v[s], stacked), x)
        want = x
        for p in layers[a:b]:
            want = layer_fn(p, want)
        assert got["count"].dtype == x["count"].dtype
        np.testing.assert_array_equal(got["count"], want["count"])
        np.testing.assert_allclose(got["h"], want["h"], rtol=1e-5, atol=1e-7)
