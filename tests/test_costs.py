"""jaxpipe.costs: the actions it builds compute F, B, W and BW of the user's stage exactly;
measure returns positive figures; estimate is the roofline of XLA's own counts; predict is
the simulator. Nothing here asserts on a duration."""

import importlib.util
import math
import pathlib

import jax
import jax.numpy as jnp
import models
import numpy as np
import pytest

from jaxpipe import costs, schedules, target
from jaxpipe.analysis import hardware
from jaxpipe.analysis.hardware import ACCELERATORS, Accelerator
from jaxpipe.schedules import Costs

WIDTH = 16
BATCH = 8


def one_stage(seed=0, width=WIDTH):
    stage_params, loss_params = models.init(jax.random.key(seed), 1, width=width)
    p = jax.tree_util.tree_map(lambda a: a[0], stage_params)
    x, target = models.data(jax.random.key(seed + 1), BATCH, width=width)
    return p, loss_params, x, target


def close(a, b, rtol=1e-6, atol=2e-6):
    """Equal to float32 rounding: a product over WIDTH = 16 terms of order one rounds
    differently by up to about 1e-6 when XLA orders its sums differently."""
    jax.tree_util.tree_map(
        lambda u, v: np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol, atol), a, b
    )


def run_actions(actions, cotangent):
    """Runs the four built actions; returns (output, B, W, BW)."""
    output, kept = actions.forward(*actions.primals)
    args = (actions.primals, kept, cotangent)
    dx, stash = actions.backward_input(*args)
    return (
        output,
        dx,
        actions.backward_weight(actions.primals, kept, stash),
        actions.full_backward(*args),
    )


# ------------------------------------------------------------------ the actions' numerics
def test_middle_stage_actions_equal_jax_vjp():
    p, _, x, _ = one_stage()
    actions = costs._stage_actions(models.stage_fn, p, x)
    dy = jax.random.normal(jax.random.key(7), x.shape)
    output, dx, dp, (dp_full, dx_full) = run_actions(actions, dy)
    y_ref, pullback = jax.vjp(models.stage_fn, p, x)
    dp_ref, dx_ref = pullback(dy)
    close(output, y_ref)
    close(dx, dx_ref)
    close(dp, dp_ref)
    close((dp_full, dx_full), (dp_ref, dx_ref))
    # measure and cost_analysis run each action by name through _calls
    _, kept = actions.forward(p, x)
    expected = {
        "backward_input": dx_ref,
        "backward_weight": dp_ref,
        "full_backward": (dp_ref, dx_ref),
    }
    _, stash = actions.backward_input((p, x), kept, dy)
    for name, (fn, args) in costs._calls(actions, (p, x), (p, x), kept, dy, stash).items():
        first = name in ("forward", "backward_input")  # (output, kept), (dx, stash)
        close(fn(*args)[0] if first else fn(*args), expected.get(name, y_ref))
    # the weights are read again by the backward, not kept as residuals
    kept_shapes = {k.shape for k in actions.kept}
    assert p["w1"].shape not in kept_shapes and p["w2"].shape not in kept_shapes


def test_last_stage_actions_are_the_executors():
    """As the executor's forward_last: F runs the stage, the loss and the loss's backward
    (the loss, the stage output's gradient and the loss parameters'); B, W and BW the
    stage's backward from that gradient."""
    p, lp, x, target = one_stage(seed=3)
    actions = costs._stage_actions(
        models.stage_fn, p, x, loss_fn=models.loss_fn, loss_params=lp, target=target
    )
    (loss, dy, dlp), kept = actions.forward(*actions.forward_args)
    y, stage_pullback = jax.vjp(models.stage_fn, p, x)
    loss_ref, loss_pullback = jax.vjp(lambda lp, y: models.loss_fn(lp, y, target), lp, y)
    dlp_ref, dy_ref = loss_pullback(jnp.ones(()))
    dp_ref, dx_ref = stage_pullback(dy_ref)
    close((loss, dy, dlp), (loss_ref, dy_ref, dlp_ref))
    dx, stash = actions.backward_input(actions.primals, kept, dy)
    close(dx, dx_ref)
    close(actions.backward_weight(actions.primals, kept, stash), dp_ref)
    close(actions.full_backward(actions.primals, kept, dy), (dp_ref, dx_ref))


def test_the_last_stages_loss_and_its_backward_are_in_f_not_in_b_w_bw():
    """A loss of a large matrix product: by XLA's flop counts, F of the last stage is F of
    the stage plus the loss's forward and backward, compiled alone; B, W and BW are the
    middle stage's, to the flop."""
    p, _, x, _ = one_stage(seed=5)
    k1, k2, k3 = jax.random.split(jax.random.key(6), 3)
    lp = {"up": jax.random.normal(k1, (WIDTH, 2048)), "head": jax.random.normal(k2, (2048, 3))}
    target = jax.random.normal(k3, (BATCH, 3))

    def loss_fn(lp, y, target):
        return jnp.mean((jnp.tanh(y @ lp["up"]) @ lp["head"] - target) ** 2)

    def loss_and_grads(lp, y):
        loss, pullback = jax.vjp(lambda lp, y: loss_fn(lp, y, target), lp, y)
        return loss, pullback(jnp.ones(()))

    def flops(fn, *args):
        analysis = jax.jit(fn).lower(*args).compile().cost_analysis()
        return (analysis[0] if isinstance(analysis, list) else analysis)["flops"]

    loss_flops = flops(loss_and_grads, lp, x)
    last = costs.cost_analysis(
        models.stage_fn, p, x, loss_fn=loss_fn, loss_params=lp, target=target
    )
    middle = costs.cost_analysis(models.stage_fn, p, x)
    assert loss_flops > 10 * middle["full_backward"]["flops"]  # the loss dominates
    for name in ("backward_input", "backward_weight", "full_backward"):
        assert last[name]["flops"] == middle[name]["flops"], name
    forward = middle["forward"]["flops"] + loss_flops
    assert last["forward"]["flops"] == pytest.approx(forward, rel=1e-3)


@pytest.mark.slow
def test_pytree_activations():
    def stage_fn(p, h):
        return {"x": h["x"] + jnp.tanh(h["x"] @ p["w"]) * h["gate"], "gate": h["gate"] * p["g"]}

    k = jax.random.split(jax.random.key(4), 4)
    p = {"w": jax.random.normal(k[0], (WIDTH, WIDTH)), "g": jax.random.normal(k[1], (WIDTH,))}
    h = {"x": jax.random.normal(k[2], (BATCH, WIDTH)), "gate": jax.random.normal(k[3], (BATCH, 1))}
    actions = costs._stage_actions(stage_fn, p, h)
    dy = costs._cotangent(actions, jax.random.key(5))
    assert jax.tree_util.tree_structure(dy) == jax.tree_util.tree_structure(h)
    output, dx, dp, full = run_actions(actions, dy)
    y_ref, pullback = jax.vjp(stage_fn, p, h)
    dp_ref, dx_ref = pullback(dy)
    close(output, y_ref)
    close(dx, dx_ref)
    close(dp, dp_ref)
    close(full, (dp_ref, dx_ref))
    assert costs.activation_bytes(h) == h["x"].nbytes + h["gate"].nbytes
    positive_finite(costs.measure(stage_fn, p, h, repeats=1, warmup=0))


# ------------------------------------------------------------------ measure
def positive_finite(c: Costs):
    for name in ("forward", "backward_input", "backward_weight", "full_backward"):
        value = getattr(c, name)
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (name, value)


def test_measure_returns_positive_finite_costs():
    p, lp, x, target = one_stage()
    middle = costs.measure(models.stage_fn, p, x, repeats=3, warmup=1)
    positive_finite(middle)
    assert middle.communication == 0.0
    last = costs.measure(
        models.stage_fn, p, x, loss_fn=models.loss_fn, loss_params=lp, target=target, repeats=2
    )
    positive_finite(last)


@pytest.mark.slow
def test_measure_communication_given_or_from_bandwidth():
    p, _, x, _ = one_stage()
    given = costs.measure(models.stage_fn, p, x, repeats=1, warmup=0, communication=2.5e-6)
    assert given.communication == 2.5e-6
    from_link = costs.measure(models.stage_fn, p, x, repeats=1, warmup=0, bandwidth=1e9)
    assert from_link.communication == x.nbytes / 1e9


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"repeats": 0}, "repeats must be an int >= 1"),
        ({"warmup": -1}, "warmup must be an int >= 0"),
        ({"communication": 1e-6, "bandwidth": 1e9}, "not both"),
        ({"bandwidth": 0}, r"bandwidth must be bytes/s > 0"),
        ({"communication": -1.0}, "communication must be seconds >= 0"),
        ({"loss_fn": models.loss_fn}, "loss_fn was given without target"),
        ({"target": jnp.ones((BATCH, 3))}, "without loss_fn"),
    ],
)
def test_measure_rejects_bad_arguments(kwargs, match):
    p, _, x, _ = one_stage()
    with pytest.raises(ValueError, match=match):
        costs.measure(models.stage_fn, p, x, **kwargs)


def test_measure_needs_arrays_and_a_callable():
    p, _, x, _ = one_stage()
    with pytest.raises(ValueError, match=r"x is a jax.ShapeDtypeStruct.*estimate accepts"):
        costs.measure(models.stage_fn, p, jax.ShapeDtypeStruct(x.shape, x.dtype))
    with pytest.raises(TypeError, match=r"stage_params\['scale'\] is a float .*jnp.asarray"):
        costs.measure(models.stage_fn, {**p, "scale": 1.0}, x)
    with pytest.raises(TypeError, match="stage_fn must be callable"):
        costs.measure("block", p, x)
    with pytest.raises(ValueError, match="x holds no arrays"):
        costs.measure(models.stage_fn, p, {})


def test_errors_in_the_stage_name_the_call():
    p, _, x, _ = one_stage()
    with pytest.raises(ValueError, match="Incompatible shapes") as info:
        costs.measure(models.stage_fn, p, x[:, :5])
    assert "stage_fn(stage_params, x)" in "".join(getattr(info.value, "__notes__", []))


def test_loss_must_be_scalar():
    p, lp, x, target = one_stage()
    with pytest.raises(ValueError, match="loss_fn must return a scalar loss, got shape"):
        costs.estimate(
            models.stage_fn, p, x, loss_fn=lambda lp, y, t: y, loss_params=lp, target=target
        )


# ------------------------------------------------------------------ estimate
def matmul_stage(p, x):
    return jnp.tanh(x @ p["w"])


def matmul_args(width, dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(width))
    p = {"w": (jax.random.normal(k1, (width, width)) / math.sqrt(width)).astype(dtype)}
    return p, jax.random.normal(k2, (32, width)).astype(dtype)


def read_cost_analysis(stage_fn, p, x):
    """flops and bytes of the four actions, read here from each compiled action."""
    actions = costs._stage_actions(stage_fn, p, x)
    output, kept = actions.forward(p, x)
    dy = jnp.ones_like(output)
    _, stash = actions.backward_input((p, x), kept, dy)
    calls = {
        "forward": (actions.forward, (p, x)),
        "backward_input": (actions.backward_input, ((p, x), kept, dy)),
        "backward_weight": (actions.backward_weight, ((p, x), kept, stash)),
        "full_backward": (actions.full_backward, ((p, x), kept, dy)),
    }
    out = {}
    for name, (fn, args) in calls.items():
        analysis = fn.lower(*args).compile().cost_analysis()
        if isinstance(analysis, list):
            analysis = analysis[0]
        out[name] = (analysis["flops"], analysis["bytes accessed"])
    return out


def test_estimate_is_the_roofline_of_the_cost_analysis():
    p, x = matmul_args(64)
    counts = read_cost_analysis(matmul_stage, p, x)
    for name, chip in ACCELERATORS.items():
        estimated = costs.estimate(matmul_stage, p, x, name)
        for action, (flops, nbytes) in counts.items():
            expected = max(flops / chip.peak_flops_fp32, nbytes / chip.memory_bandwidth)
            assert getattr(estimated, action) == pytest.approx(expected, rel=1e-12), (name, action)
        assert estimated.communication == pytest.approx(x.nbytes / chip.interconnect_bandwidth)
    half = costs.estimate(matmul_stage, p, x, "A100", efficiency=0.5)
    full = costs.estimate(matmul_stage, p, x, "A100")
    assert half.forward == pytest.approx(2 * full.forward, rel=1e-12)


@pytest.mark.slow
def test_doubling_the_width_scales_flops_by_four_and_the_estimate_by_the_roofline():
    compute_bound = Accelerator("compute", peak_flops=1e12, memory_bandwidth=1e30, source="test")
    memory_bound = Accelerator("memory", peak_flops=1e30, memory_bandwidth=1e9, source="test")
    small, large = matmul_args(64), matmul_args(128)
    counts = [read_cost_analysis(matmul_stage, *args) for args in (small, large)]
    ratio = counts[1]["forward"][0] / counts[0]["forward"][0]
    assert 3.5 < ratio < 4.1, ratio
    for (flops, nbytes), (flops2, nbytes2), action in zip(
        counts[0].values(), counts[1].values(), counts[0], strict=True
    ):
        c = [
            costs.estimate(matmul_stage, *a, compute_bound, precision="bf16")
            for a in (small, large)
        ]
        assert getattr(c[0], action) == pytest.approx(flops / 1e12, rel=1e-12)
        assert getattr(c[1], action) / getattr(c[0], action) == pytest.approx(flops2 / flops)
        m = [
            costs.estimate(matmul_stage, *a, memory_bound, precision="bf16") for a in (small, large)
        ]
        assert getattr(m[1], action) / getattr(m[0], action) == pytest.approx(nbytes2 / nbytes)


@pytest.mark.slow
def test_estimate_takes_shapes_and_picks_the_peak_by_dtype():
    p, x = matmul_args(64, jnp.bfloat16)
    shapes = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (p, x))
    chip = Accelerator(
        "two peaks", peak_flops=2e12, peak_flops_fp32=1e12, memory_bandwidth=1e30, source="test"
    )
    from_shapes = costs.estimate(matmul_stage, *shapes, chip)
    assert from_shapes == costs.estimate(matmul_stage, p, x, chip)
    assert from_shapes == costs.estimate(matmul_stage, p, x, chip, precision="bf16")
    fp32 = costs.estimate(matmul_stage, p, x, chip, precision="fp32")
    assert fp32.forward == pytest.approx(2 * from_shapes.forward, rel=1e-12)
    assert from_shapes.communication == 0.0  # the chip has no interconnect figure
    no_fp32 = Accelerator("bf16 only", peak_flops=1e12, memory_bandwidth=1e12, source="test")
    with pytest.raises(ValueError, match="has no float32 figure.*precision='bf16'"):
        costs.estimate(matmul_stage, *matmul_args(64), no_fp32)


def test_cost_analysis_normalises_every_jax_shape():
    assert costs._analysis_dict({"flops": 2.0}) == {"flops": 2.0}
    assert costs._analysis_dict([{"flops": 3.0}]) == {"flops": 3.0}
    for empty in (None, [], {}):
        with pytest.raises(RuntimeError, match="no cost analysis.*use measure"):
            costs._analysis_dict(empty)
    p, x = matmul_args(32)
    counts = costs.cost_analysis(matmul_stage, p, x)
    read = read_cost_analysis(matmul_stage, p, x)
    assert {k: (v["flops"], v["bytes"]) for k, v in counts.items()} == read


def test_cost_analysis_compiles_for_the_device_given_and_compiler_seconds_reads_its_estimate():
    p, x = matmul_args(32)
    counts = costs.cost_analysis(matmul_stage, p, x, device=jax.devices()[-1])
    read = read_cost_analysis(matmul_stage, p, x)
    assert {k: (v["flops"], v["bytes"]) for k, v in counts.items()} == read
    with pytest.raises(TypeError, match="device must be a jax.Device.*got str"):
        costs.cost_analysis(matmul_stage, p, x, device="v5p")
    rng = np.random.default_rng(0)
    seconds = rng.uniform(1e-4, 1e-2, size=4)
    given = {
        action: dict(c, optimal_seconds=float(t))
        for (action, c), t in zip(counts.items(), seconds, strict=True)
    }
    assert costs.compiler_seconds(given, communication=2e-3) == Costs(*seconds, 2e-3)
    given["backward_weight"]["optimal_seconds"] = None  # what the CPU and GPU compilers give
    with pytest.raises(ValueError, match=r"no optimal_seconds for \['backward_weight'\]"):
        costs.compiler_seconds(given)
    with pytest.raises(ValueError, match="counts must be a dict with keys"):
        costs.compiler_seconds({"forward": given["forward"]})


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_the_tpu_compilers_estimate_of_each_action_is_at_or_above_the_v5p_roofline():
    """Compiled for a v5p device: the counts are the TPU compiler's (a matmul's flops
    exactly), and its time estimate never beats the chip's peak or its memory bandwidth."""
    rows, width = 4096, 2048
    p = {"w": jax.ShapeDtypeStruct((width, width), jnp.bfloat16)}
    x = jax.ShapeDtypeStruct((rows, width), jnp.bfloat16)
    counts = costs.cost_analysis(matmul_stage, p, x, device=target.get("v5p:2x2x1").devices[0])
    matmul = 2 * rows * width * width
    assert matmul <= counts["forward"]["flops"] < 1.01 * matmul
    assert 2 * matmul <= counts["full_backward"]["flops"] < 2.02 * matmul
    compiler = costs.compiler_seconds(counts)
    floor = costs.roofline(counts, "TPU v5p", traffic="minimal")
    for action in costs.ACTIONS:
        assert getattr(compiler, action) >= getattr(floor, action), action
    assert compiler.forward < compiler.full_backward


def test_unknown_accelerator_lists_the_known_ones():
    p, x = matmul_args(16)
    with pytest.raises(ValueError) as info:
        costs.estimate(matmul_stage, p, x, "B200")
    message = str(info.value)
    assert "'B200'" in message and "Accelerator(" in message
    assert all(name in message for name in ACCELERATORS)
    assert costs.get_accelerator("tpu-v5e") is ACCELERATORS["TPU v5e"]
    assert costs.get_accelerator("h100") is ACCELERATORS["H100"]
    with pytest.raises(TypeError, match="accelerator must be a name"):
        costs.get_accelerator(989e12)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"efficiency": 0}, r"efficiency must be in \(0, 1\]"),
        ({"efficiency": 1.5}, r"efficiency must be in \(0, 1\]"),
        ({"precision": "fp8"}, "precision must be one of"),
        ({"bandwidth": -1.0}, "bandwidth must be bytes/s > 0"),
    ],
)
def test_estimate_rejects_bad_arguments(kwargs, match):
    p, x = matmul_args(16)
    with pytest.raises(ValueError, match=match):
        costs.estimate(matmul_stage, p, x, "H100", **kwargs)


def test_accelerator_table_and_validation():
    assert set(ACCELERATORS) == {"H100", "H200", "A100", "TPU v5e", "TPU v5p", "TPU v6e"}
    # one catalog: jaxpipe.costs and jaxpipe.target read the same chips
    assert costs.ACCELERATORS is ACCELERATORS and costs.Accelerator is Accelerator
    assert target.CHIPS["v5p"] is hardware.CATALOG["v5p"].memory
    assert target.GPUS["h100"][0] is hardware.CATALOG["h100"].memory
    for name, chip in ACCELERATORS.items():
        assert chip.name == name
        assert "https://" in chip.source and chip.interconnect_source
        assert chip.peak_flops_fp32 <= chip.peak_flops
        assert chip.memory_bandwidth > 1e11 and chip.interconnect_bandwidth > 1e10
    with pytest.raises(ValueError, match=r"Accelerator\('mine'\).peak_flops must be a positive"):
        Accelerator("mine", peak_flops=0, memory_bandwidth=1e12, source="me")
    with pytest.raises(ValueError, match="memory_bandwidth must be a positive"):
        Accelerator("mine", peak_flops=1e12, memory_bandwidth=float("nan"), source="me")


# ------------------------------------------------------------------ predict
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zbv"])
def test_predict_equals_the_simulator(name):
    schedule = schedules.get(name, 4, 8)
    c = Costs(forward=1.0, backward_input=1.3, backward_weight=0.7, communication=0.1)
    prediction = costs.predict(schedule, c)
    lockstep = schedules.simulate(schedule, c, "lockstep")
    ideal = schedules.simulate(schedule, c, "ideal")
    assert prediction.step_time == lockstep.makespan
    assert prediction.ideal_step_time == ideal.makespan
    assert prediction.lockstep_bubble == lockstep.bubble
    assert prediction.ideal_bubble == ideal.bubble
    assert prediction._asdict()["step_time"] == lockstep.makespan
    with pytest.raises(TypeError, match="schedule must be a jaxpipe.schedules.Schedule"):
        costs.predict("1f1b", c)
    with pytest.raises(TypeError, match="costs must be a jaxpipe.schedules.Costs"):
        costs.predict(schedule, {"forward": 1.0})


def test_roofline_of_the_counts_runs_at_the_peak_estimate_picks_by_dtype():
    """With no precision given, `roofline` of `cost_analysis` runs at the peak `estimate`
    picks from the stage's dtypes: float32's for a float32 stage, bfloat16's for a
    bfloat16 one (on a chip where flops bind)."""
    chip = Accelerator(
        "two peaks", peak_flops=2e12, peak_flops_fp32=1e12, memory_bandwidth=1e30, source="test"
    )
    for dtype, precision, peak in ((jnp.float32, "fp32", 1e12), (jnp.bfloat16, "bf16", 2e12)):
        p, x = matmul_args(64, dtype)
        counts = costs.cost_analysis(matmul_stage, p, x)
        assert {c["precision"] for c in counts.values()} == {precision}
        by_roofline = costs.roofline(counts, chip)
        assert by_roofline.forward == counts["forward"]["flops"] / peak
        assert by_roofline == costs.estimate(matmul_stage, p, x, chip)


@pytest.mark.slow
def test_roofline_serves_every_accelerator_from_one_count():
    p, x = matmul_args(32)
    counts = costs.cost_analysis(matmul_stage, p, x)
    for name in ACCELERATORS:
        assert costs.roofline(counts, name, precision="fp32") == costs.estimate(
            matmul_stage, p, x, name, communication=0.0
        )
    chip = Accelerator("toy", peak_flops=10.0, memory_bandwidth=4.0, source="test")
    toy = {a: {"flops": 100.0, "bytes": 80.0} for a in costs.ACTIONS}
    assert costs.roofline(toy, chip).forward == 20.0  # bytes bind: 80 / 4 > 100 / 10
    toy["forward"] = {"flops": 300.0, "bytes": 80.0}
    assert costs.roofline(toy, chip, efficiency=0.5).forward == 60.0  # flops bind: 30 / 0.5
    with pytest.raises(ValueError, match="counts must be a dict with keys"):
        costs.roofline({"forward": {"flops": 1.0, "bytes": 1.0}}, chip)


def test_a_loop_in_the_stage_warns_that_counts_are_too_low():
    p = {"w": jnp.stack([matmul_args(16)[0]["w"]] * 3)}
    x = matmul_args(16)[1]

    def scanned(p, x):
        return jax.lax.scan(lambda h, w: (matmul_stage({"w": w}, h), None), x, p["w"])[0]

    with pytest.warns(UserWarning, match="counts a loop body once.*unroll"):
        costs.cost_analysis(scanned, p, x)


def test_the_docs_table_shows_the_library_figures():
    page = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "costs.md").read_text()
    rows = {
        cells[0]: cells[1:5]
        for line in page.splitlines()
        if line.startswith("| ") and (cells := [c.strip() for c in line.strip("|").split("|")])
    }
    for name, chip in ACCELERATORS.items():
        shown = [float(c) for c in rows[name]]
        assert shown == [
            chip.peak_flops / 1e12,
            chip.peak_flops_fp32 / 1e12,
            chip.memory_bandwidth / 1e12,
            chip.interconnect_bandwidth / 1e9,
        ], name


def test_w_is_the_weight_half_of_the_split_backward():
    """W computes only the weight gradients, from the cotangents B stashes, as the executor
    runs it: in a stage of four blocks its flops are BW's minus B's, not BW's."""

    def four_blocks(p, x):
        for i in range(4):
            x = x + jnp.tanh(x @ p["w"][i])
        return x

    width = 64
    p = {"w": jax.random.normal(jax.random.key(3), (4, width, width)) / math.sqrt(width)}
    x = jax.random.normal(jax.random.key(4), (32, width))
    counts = costs.cost_analysis(four_blocks, p, x)
    flops = {name: c["flops"] for name, c in counts.items()}
    assert flops["backward_weight"] < 0.6 * flops["full_backward"], flops
    together = flops["backward_input"] + flops["backward_weight"]
    assert together == pytest.approx(flops["full_backward"], rel=0.1), flops


def test_minimal_traffic_is_arguments_and_results_once():
    p, x = matmul_args(64)
    counts = costs.cost_analysis(matmul_stage, p, x)
    actions = costs._stage_actions(matmul_stage, p, x)
    kept = sum(math.prod(k.shape) * k.dtype.itemsize for k in actions.kept)
    weights, activation = p["w"].nbytes, x.nbytes  # the output has the input's shape
    assert counts["forward"]["minimal_bytes"] == weights + activation + activation + kept
    backward_args = weights + activation + kept + activation  # primals, kept, cotangent
    stash = sum(math.prod(k.shape) * k.dtype.itemsize for k in actions.stash)
    # B hands W its stash (the cotangent at the matmul's output) instead of the cotangent
    assert counts["backward_input"]["minimal_bytes"] == backward_args + activation + stash
    weight_args = weights + activation + kept + stash  # primals, kept, stash
    assert counts["backward_weight"]["minimal_bytes"] == weight_args + weights
    assert counts["full_backward"]["minimal_bytes"] == backward_args + weights + activation
    chip = Accelerator("memory", peak_flops=1e30, memory_bandwidth=1e9, source="test")
    low = costs.roofline(counts, chip, precision="bf16", traffic="minimal")
    assert low.forward == counts["forward"]["minimal_bytes"] / 1e9
    assert low == costs.estimate(matmul_stage, p, x, chip, precision="bf16", traffic="minimal")
    for call in (
        lambda: costs.roofline(counts, chip, traffic="fused"),
        lambda: costs.estimate(matmul_stage, p, x, "H100", traffic="fused"),
    ):
        with pytest.raises(ValueError, match="traffic must be one of"):
            call()
