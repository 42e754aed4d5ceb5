"""Tables packed for the stage's costs (`jaxpipe.schedules.fit`, ``get(..., costs=)``,
``Pipeline(..., costs=)``).

What a fitted table promises, over a grid of S, M and F:B:W and over random costs drawn
in the box B/F in [0.8, 2.2], W/F in [0.2, 1.3]: it is valid, runs the same actions on the
same devices, holds no more live activations on any device than the default table at its
peak, and runs no longer than the default table at those costs, in lock-step and in
neighbour-synchronised time. Where the default table wastes time (unequal costs) the
fitted one is strictly shorter. Run by the executor, a fitted table gives the plain
model's loss and gradients.
"""

import re

import jax
import jax.numpy as jnp
import models
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxpipe
from jaxpipe import schedules
from jaxpipe.schedules import Costs, F, simulate

TOL = 1e-5
SCHEDULES = {
    "1f1b": {},
    "zb_h1": {},
    "zb_h2": {},
    "zbv": {},
    "interleaved_1f1b": {"virtual_stages": 2},
    "interleaved_zb": {},
    "dualpipev": {},
}
RATIOS = [(1, 1.2, 0.8), (1, 2, 1), (1, 1.88, 0.21), (1, 0.88, 0.21), (1, 2.2, 1.3)]


def costs_of(ratio, communication=0.0):
    f, b, w = ratio
    return Costs(forward=f, backward_input=b, backward_weight=w, communication=communication)


def default_or_none(name, S, M):
    try:
        return schedules.get(name, S, M, **SCHEDULES[name])
    except ValueError:
        return None


def work(table):
    """Per device, the multiset of actions it runs."""
    return [
        sorted(a for _, d, a in table.timed_actions() if d == dev)
        for dev in range(table.num_stages)
    ]


def check_fitted(default, costs):
    fitted = schedules.fit(default, costs)
    schedules.validate(fitted, default.peak_activations())
    assert fitted.stage_device == default.stage_device
    assert work(fitted) == work(default)
    assert all(len([a for a in cell if a.op == F]) <= 1 for row in fitted.ticks for cell in row)
    assert all(len([a for a in cell if a.op != F]) <= 1 for row in fitted.ticks for cell in row)
    for mode in ("lockstep", "neighbour"):
        got = simulate(fitted, costs, mode).makespan
        assert got <= simulate(default, costs, mode).makespan + 1e-9, mode
    return fitted


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_fitted_tables_are_valid_and_never_slower(name):
    for S, M in [(2, 4), (4, 8)]:
        default = default_or_none(name, S, M)
        if default is None:
            continue
        for ratio in RATIOS:
            check_fitted(default, costs_of(ratio))
        check_fitted(default, costs_of((1, 2, 1), communication=0.3))


GRID = [(2, 4), (2, 8), (2, 16), (4, 8), (4, 16), (4, 32), (8, 16), (8, 32)]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_fitted_tables_on_the_grid(name):
    """S in {2, 4, 8}, M from 2S to 8S (4S at S = 8) where the schedule takes it, each at
    one of the cost ratios in turn."""
    for i, (S, M) in enumerate(GRID):
        default = default_or_none(name, S, M)
        if default is not None:
            check_fitted(default, costs_of(RATIOS[i % len(RATIOS)]))


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(list(SCHEDULES)),
    S=st.sampled_from([2, 3, 4]),
    k=st.sampled_from([2, 3, 4]),
    b=st.floats(0.8, 2.2),
    w=st.floats(0.2, 1.3),
)
def test_fitted_tables_for_random_costs(name, S, k, b, w):
    default = default_or_none(name, S, k * S)
    if default is not None:
        check_fitted(default, costs_of((1.0, b, w)))


@pytest.mark.parametrize(
    "name,S,M,ratio,points",
    [
        ("1f1b", 4, 16, (1, 1.88, 0.21), 10),
        ("zbv", 4, 16, (1, 2, 1), 10),
        ("zbv", 4, 16, (1, 0.88, 0.21), 15),
        ("dualpipev", 4, 16, (1, 1.2, 0.8), 8),
        ("interleaved_1f1b", 4, 16, (1, 0.88, 0.21), 10),
    ],
)
def test_fitting_cuts_the_lockstep_bubble(name, S, M, ratio, points):
    """Where unequal costs leave the default table idle, the fitted table is shorter: its
    lock-step bubble is at least ``points`` percentage points below the default's."""
    default = schedules.get(name, S, M, **SCHEDULES[name])
    costs = costs_of(ratio)
    fitted = schedules.get(name, S, M, costs=costs, **SCHEDULES[name])
    before = simulate(default, costs).bubble
    after = simulate(fitted, costs).bubble
    assert after <= before - points / 100, (before, after)
    assert dict(fitted.options)["costs"] == schedules.fitting.describe_costs(costs)


@pytest.mark.parametrize(
    "name, S, M, ratio, points",
    [("1f1b", 4, 16, (1, 2, 1), 15), ("zb_h1", 4, 16, (1, 1.88, 0.21), 15),
     ("interleaved_1f1b", 4, 16, (1, 2, 1), 15), ("1f1b", 8, 32, (1, 1.2, 0.8), 3)],
)  # fmt: skip
def test_one_more_live_micro_batch_cuts_the_lockstep_time(name, S, M, ratio, points):
    """A device allowed one more micro-batch's activations than the table's peak runs a
    forward while a backward waits: valid at that limit (and not at the peak alone), the
    same work on each device, and shorter in lock-step than the table fitted without it by
    at least ``points`` percent; never longer neighbour-synchronised than the default."""
    default = schedules.get(name, S, M, **SCHEDULES[name])
    costs = costs_of(ratio)
    plain = schedules.fit(default, costs)
    more = schedules.fit(default, costs, extra_live=1)
    peak = default.peak_activations()
    schedules.validate(more, [p + 1 for p in peak])
    with pytest.raises(ValueError, match="activation"):
        schedules.validate(more, peak)
    assert work(more) == work(default) and more.stage_device == default.stage_device
    assert dict(more.options)["extra_live"] == 1 and "extra_live" not in dict(plain.options)
    lockstep = [simulate(t, costs, "lockstep").makespan for t in (plain, more)]
    assert lockstep[1] <= (1 - points / 100) * lockstep[0], lockstep
    neighbour = [simulate(t, costs, "neighbour").makespan for t in (default, more)]
    assert neighbour[1] <= neighbour[0] + 1e-9


def test_equal_costs_and_no_costs_keep_the_default_table():
    for name, options in SCHEDULES.items():
        default = schedules.get(name, 4, 8, **options)
        assert schedules.get(name, 4, 8, costs=None, **options) == default
        assert schedules.get(name, 4, 8, costs=Costs(), **options) == default


def test_fit_refuses_what_it_cannot_pack():
    with pytest.raises(TypeError, match="jaxpipe.schedules.Costs"):
        schedules.fit(schedules.get("zbv", 4, 8), (1, 2, 1))
    for unhashable in ({"forward": 1.0}, [1, 2, 1]):  # refused as costs, not as unhashable
        with pytest.raises(TypeError, match="jaxpipe.schedules.Costs"):
            schedules.get("zbv", 4, 8, costs=unhashable)
    with pytest.raises(ValueError, match="U actions"):
        schedules.fit(schedules.get("pipedream", 4, 8), Costs(1, 2, 1))
    with pytest.raises(ValueError, match="extra_live must be an int >= 0, got -1"):
        schedules.fit(schedules.get("zbv", 4, 8), Costs(1, 2, 1), extra_live=-1)


# ---------------------------------------------------------------- the executor runs them
def run_against_the_plain_model(pipe, S, M):
    k1, k2 = jax.random.split(jax.random.key(7 * S + M))
    sp, lp = models.init(k1, pipe.num_logical_stages)
    x, t = models.data(k2, 2 * M)
    step = jax.jit(jax.value_and_grad(pipe.loss, argnums=(0, 1, 2)))
    loss, grads = step(pipe.place(sp), lp, x, t)
    grads = (pipe.logical(grads[0]), *grads[1:])
    ref_loss, ref = jax.value_and_grad(models.sequential_loss, argnums=(0, 1, 2))(sp, lp, x, t, M)
    np.testing.assert_allclose(loss, ref_loss, rtol=TOL)
    for got, want in zip(grads, ref, strict=True):
        assert models.relative_error(got, want) < TOL


CASES = [
    ("zbv", 4, 8, (1, 2, 1), False),
    ("1f1b", 4, 8, (1, 2, 1), "one more live"),
    pytest.param("1f1b", 4, 8, (1, 1.88, 0.21), True, marks=pytest.mark.slow),
    pytest.param("dualpipev", 4, 8, (1, 1.2, 0.8), True, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name,S,M,ratio,remat", CASES)
def test_fitted_tables_run_exactly(name, S, M, ratio, remat):
    default = schedules.get(name, S, M, **SCHEDULES[name])
    if remat == "one more live":  # a table that holds one more micro-batch than its peak
        table = schedules.fit(default, costs_of(ratio), extra_live=1)
        assert max(table.peak_activations()) == max(default.peak_activations()) + 1
        pipe = jaxpipe.Pipeline(models.stage_fn, models.loss_fn, mesh=models.pipe_mesh(S),
                                schedule=table)  # fmt: skip
        run_against_the_plain_model(pipe, S, M)
        return
    pipe = jaxpipe.Pipeline(
        models.stage_fn,
        models.loss_fn,
        mesh=models.pipe_mesh(S),
        schedule=name,
        num_microbatches=M,
        schedule_options=SCHEDULES[name],
        costs=costs_of(ratio),
        remat=remat,
    )
    assert pipe.costs == costs_of(ratio)
    assert pipe.schedule != default  # really refitted
    run_against_the_plain_model(pipe, S, M)


@pytest.mark.slow
def test_costs_measured_on_the_first_call():
    """``costs="measure"``: the table is packed for this machine's timings of the stage,
    on the first call, and the step stays exact."""
    pipe = jaxpipe.Pipeline(
        models.stage_fn,
        models.loss_fn,
        mesh=models.pipe_mesh(4),
        schedule="zbv",
        num_microbatches=8,
        costs="measure",
    )
    assert pipe.costs is None
    run_against_the_plain_model(pipe, 4, 8)
    assert isinstance(pipe.costs, Costs) and pipe.costs.forward > 0
    assert pipe.schedule == schedules.get("zbv", 4, 8, costs=pipe.costs)


def test_costs_refused_with_the_fix():
    with pytest.raises(ValueError, match="'measure' or a jaxpipe.target.Target"):
        pipe = jaxpipe.Pipeline(
            models.stage_fn,
            models.loss_fn,
            mesh=models.pipe_mesh(2),
            schedule="1f1b",
            num_microbatches=4,
            costs="fast",
        )
        run_against_the_plain_model(pipe, 2, 4)


@pytest.mark.slow
def test_costs_from_the_tpu_compiler():
    """A target's costs are its compiler's own estimate of the stage's actions."""
    target = pytest.importorskip("jaxpipe.analysis.target")
    pytest.importorskip("libtpu")
    v5p = target.get("v5p:2x2x1")
    sp, _ = models.init(jax.random.key(0), 1)
    stage = jax.tree_util.tree_map(lambda a: a[0], sp)
    x, _ = models.data(jax.random.key(1), 2)
    got = jaxpipe.costs.of_stage(v5p, models.stage_fn, stage, x)
    want = jaxpipe.costs.compiler_seconds(
        jaxpipe.costs.cost_analysis(models.stage_fn, stage, x, device=v5p.devices[0])
    )
    assert got == want and got.forward > 0
    with pytest.raises(ValueError, match="no time estimate"):
        jaxpipe.costs.of_stage(target.get("cpu:1"), models.stage_fn, stage, x)


def test_costs_from_a_target_refuse_a_stage_too_large_for_one_device_with_the_fix():
    """A stage whose compile for one device runs out of its memory (a 128 GiB weight on a
    95 GiB v5p) is refused naming the target, the compiler's words and what to pass."""
    target = pytest.importorskip("jaxpipe.analysis.target")
    pytest.importorskip("libtpu")
    weight = jax.ShapeDtypeStruct((1 << 17, 1 << 19), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((8, 1 << 17), jnp.bfloat16)
    with pytest.raises(ValueError) as refused:
        jaxpipe.costs.of_stage(target.get("v5p:2x2x1"), lambda w, x: x @ w, weight, x)
    message = str(refused.value)
    assert "target 'v5p:2x2x1'" in message and "does not fit one device's memory" in message
    assert "RESOURCE_EXHAUSTED" in message and "one device's share of the stage" in message
    assert "costs=jaxpipe.schedules.Costs" in message


@pytest.mark.slow
@pytest.mark.parametrize("remat", [True])
def test_packed_table_with_a_scanned_stage_pytree_activations_and_side_inputs(remat):
    """A stage that scans its blocks over a pytree activation and reads a side input, run
    under a zbv table packed for 1:1.88:0.21, with remat (the stage input kept, the scan
    recomputed): loss and gradients of the stage parameters, the head and the side input
    equal the plain model's."""
    S, M, width, blocks, rows = 4, 8, 8, 2, 2

    def stage_fn(p, x, *, side):
        def block(x, w):
            h = x["h"] + jnp.tanh(x["h"] @ w + side)
            return {"h": h, "g": 0.9 * x["g"] + h}, None

        return jax.lax.scan(block, x, p["w"])[0]

    def loss_fn(lp, y, target):
        return jnp.mean((y["h"] @ lp + y["g"].sum(-1, keepdims=True) - target) ** 2)

    pipe = jaxpipe.Pipeline(
        stage_fn, loss_fn, mesh=models.pipe_mesh(S), schedule="zbv", num_microbatches=M,
        costs=costs_of((1, 1.88, 0.21)), remat=remat,
    )  # fmt: skip
    assert pipe.schedule != schedules.get("zbv", S, M)
    rng = np.random.default_rng(3)
    N = pipe.num_logical_stages
    normal = rng.standard_normal
    params = {"w": jnp.asarray(normal((N, blocks, width, width)) / np.sqrt(width), jnp.float32)}
    head = jnp.asarray(normal((width, 1)), jnp.float32)
    x = {
        "h": jnp.asarray(normal((M * rows, width)), jnp.float32),
        "g": jnp.zeros((M * rows, width)),
    }
    side = jnp.asarray(0.1 * normal((M * rows, width)), jnp.float32)
    target = jnp.asarray(normal((M * rows, 1)), jnp.float32)

    def plain(params, head, side):
        losses = []
        for m in range(M):
            rows_m = slice(m * rows, (m + 1) * rows)
            y = {k: a[rows_m] for k, a in x.items()}
            for s in range(N):
                y = stage_fn({"w": params["w"][s]}, y, side=side[rows_m])
            losses.append(loss_fn(head, y, target[rows_m]))
        return jnp.mean(jnp.stack(losses))

    def piped(placed, head, side):
        return pipe.loss(placed, head, x, target, side=side)

    loss, grads = jax.jit(jax.value_and_grad(piped, argnums=(0, 1, 2)))(
        pipe.place(params), head, side
    )
    # jitted: op by op, dispatching the M x N stages and their scans one at a time is slow
    want_loss, want = jax.jit(jax.value_and_grad(plain, argnums=(0, 1, 2)))(params, head, side)
    np.testing.assert_allclose(loss, want_loss, rtol=TOL)
    got = (pipe.logical(grads[0]), grads[1], grads[2])
    for g, w in zip(got, want, strict=True):
        assert models.relative_error(g, w) < TOL


def test_describe_costs_names_the_all_to_alls_that_take_time():
    """The actions' computations (BW too: B + W, without its all-to-alls), the transfer,
    then each all-to-all time that is not 0, all relative to F."""
    costs = Costs(forward=2, backward_input=4, backward_weight=1)
    assert schedules.describe_costs(costs) == "F=1 B=2 W=0.5 BW=2.5 comm=0"
    costs = Costs(
        forward=2, backward_input=4, backward_weight=1, all_to_all_forward=1, all_to_all_weight=0.5
    )
    assert schedules.describe_costs(costs) == "F=1 B=2 W=0.5 BW=2.5 comm=0 a2a_F=0.5 a2a_W=0.25"


@pytest.mark.parametrize(
    "field,value,says",
    [
        ("forward", float("inf"), "finite"),
        ("backward_input", float("nan"), "finite"),
        ("backward_weight", -1.0, ">= 0"),
        ("forward", None, "a number"),
        ("communication", None, "a number"),
        ("all_to_all_forward", "1", "a number"),
        ("forward", True, "a number"),
    ],
)
def test_costs_are_finite_numbers(field, value, says):
    """Every cost is a finite number >= 0 (``full_backward`` may be None: B + W); an
    infinite cost made every bubble NaN, and None failed later inside the simulator."""
    with pytest.raises(ValueError, match=f"Costs.{field} must be .*{re.escape(says)}"):
        Costs(**{field: value})
    with pytest.raises(ValueError, match="Costs.forward"):
        Costs.from_text("inf:1:1")
    assert Costs(full_backward=None).full_backward is None


@pytest.mark.slow
def test_costs_with_remat_charge_the_backward_its_forward_again():
    """With ``remat=True`` a stage's B and W recompute its forward, and the costs the table
    is packed for say so: read from the TPU compiler for the same stage (an MLP block of
    width 1024 on 2048 rows), B, W and BW cost more than without remat (on v5p, libtpu
    0.0.42: B +8%, W +27%, BW +5%; each reads fewer stored values, which offsets much of
    the work added), F the same."""
    target = pytest.importorskip("jaxpipe.analysis.target")
    pytest.importorskip("libtpu")
    v5p = target.get("v5p:2x2x1")
    width, rows = 1024, 2048

    def stage_fn(p, x):
        return x + jax.nn.gelu(x @ p["up"]) @ p["down"]

    keys = jax.random.split(jax.random.key(0), 3)
    logical = {
        "up": jax.random.normal(keys[0], (8, width, 4 * width)) / width**0.5,
        "down": jax.random.normal(keys[1], (8, 4 * width, width)) / (4 * width) ** 0.5,
    }
    x = jax.random.normal(keys[2], (4 * rows, width))
    found = {}
    for remat in (False, True):
        pipe = jaxpipe.Pipeline(
            stage_fn, lambda _, y, t: jnp.mean((y - t) ** 2), mesh=models.pipe_mesh(4),
            schedule="zbv", num_microbatches=4, costs=v5p, remat=remat,
        )  # fmt: skip
        jax.eval_shape(pipe.loss, pipe.place(logical), None, x, x)
        found[remat] = pipe.costs
    plain, remat = found[False], found[True]
    assert remat.forward == pytest.approx(plain.forward, rel=0.05), found
    assert remat.backward_input > plain.backward_input, found
    assert remat.backward_weight > 1.1 * plain.backward_weight, found
    assert remat.full_backward > plain.full_backward, found
