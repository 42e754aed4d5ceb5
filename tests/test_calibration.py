"""The calibrated step-time model: its published step times, the compiler's whole-step
estimate from the layer variants, the fit and its held-out errors (benchmarks/calibration.py),
the figures the library carries (jaxpipe.analysis.calibration) against the fit's JSON, and
what a calibration does to a `StepTime`."""

import json
import math
import pathlib
import sys

import pytest

from jaxpipe.analysis import calibration
from jaxpipe.analysis.target import StepTime

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import calibration as fit  # noqa: E402  (benchmarks/calibration.py)
import published_runs  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "calibration.json"
RUN = {r.name: r for r in published_runs.RUNS}


def test_model_flops_give_the_published_mfu_from_tokens_per_second():
    """MaxText's Llama-2-70B v5p row publishes both tokens/s and MFU: the FLOP count here at
    that rate gives the MFU it published (to its rounding of tokens/s, 692)."""
    run = RUN["maxtext-llama2-70b-v5p-512"]
    step, _ = fit.published_step_seconds(run)
    mfu = fit.model_flops_per_chip(run, causal_half=True) / step / (run.peak_tflops * 1e12)
    assert mfu == pytest.approx(run.mfu, abs=0.01)


def test_published_step_from_tflops_uses_the_sources_count():
    """A row published as TFLOP/s counts attention as its source did: in full for the
    2023 v5e row, at half for the 2023 v5p rows."""
    v5e, v5p = RUN["maxtext-32b-v5e-256"], RUN["maxtext-32b-v5p-64"]
    for run, half in ((v5e, False), (v5p, True)):
        step, how = fit.published_step_seconds(run)
        flops = fit.model_flops_per_chip(run, causal_half=half)
        assert step == pytest.approx(flops / (run.tflops_per_chip * 1e12), rel=1e-12)
        assert ("at half" in how) == half
    run = RUN["maxtext-32b-v5e-256"]
    assert fit.model_flops_per_chip(run, True) < fit.model_flops_per_chip(run, False)


def test_compiler_step_extends_one_and_two_layers_to_the_model(tmp_path, monkeypatch):
    run = RUN["maxtext-llama2-70b-v5p-512"]
    monkeypatch.setattr(fit, "COMPILED", str(tmp_path))
    for variant, seconds, flops in (("layers1", 0.5, 3e13), ("layers2", 0.75, 5e13)):
        with open(fit.compiled_path(run, variant), "w") as f:
            json.dump({"cost": {"optimal_seconds": seconds, "flops": flops}}, f)
    step = fit.compiler_step(run)
    layers = run.model["layers"]
    assert step["optimal_seconds"] == pytest.approx(0.5 + (layers - 1) * 0.25)
    assert step["flops"] == pytest.approx(3e13 + (layers - 1) * 2e13)
    assert step["optimal_seconds_per_layer"] == pytest.approx(0.25)


def test_fit_recovers_a_known_scale_and_holds_out_each_row():
    """Rows made by a known scale are fitted to it exactly, held out too; a row made off
    by 10% shows about that error held out, and pulls the others' errors the other way."""
    scale = 1.234
    rows = [
        {"name": f"r{i}", "compute": c, "exposed": e, "published": 0.0}
        for i, (c, e) in enumerate(((10.0, 1.0), (3.0, 0.2), (7.0, 0.0)))
    ]
    for r in rows:
        r["published"] = scale * r["compute"] + r["exposed"]
    result = fit.evaluate(rows)
    assert result["scale"] == pytest.approx(scale, rel=1e-9)
    assert result["worst_held_out_error"] < 1e-9
    rows[0]["published"] *= 1.1
    result = fit.evaluate(rows)
    assert result["rows"]["r0"]["held_out_error"] == pytest.approx(-1 / 11, rel=0.05)
    assert all(result["rows"][n]["error"] > 0 for n in ("r1", "r2"))


def test_the_fit_charges_no_exposed_time_and_checks_the_reading(tmp_path, monkeypatch):
    """A published run hid its collectives: the fit charges none; the report's reading is
    kept, said to be read with the run's own options or not, and held against the room
    the measured step leaves beside the calibrated computation."""
    run = RUN["maxtext-llama2-70b-v5p-512"]
    assert run.xla_flags
    monkeypatch.setattr(fit, "COMPILED", str(tmp_path))
    report = {"fits": True, "needed_bytes": 2**30, "capacity_bytes": 2**31, "collectives": []}
    for flags, own in (("", False), (run.libtpu_init_args(), True)):
        with open(fit.compiled_path(run, "full"), "w") as f:
            json.dump({"report": report, "exposed_step_seconds": 1.5, "loop_trips": 80,
                       "exposed_loop_seconds": 0.25, "xla_flags": flags}, f)  # fmt: skip
        exposed = fit.exposed_step(run)
        assert exposed["seconds"] == 0.0
        assert exposed["read_seconds"] == 1.5 + 80 * 0.25
        assert exposed["read_with_the_runs_options"] is own
    row = {"name": run.name, "platform": "tpu", "published": 30.0, "compute": 20.0,
           "compiled": exposed}  # fmt: skip
    check = fit.communication_check([row], {"tpu": {"scale": 1.2}})
    assert check == {run.name: {"read_seconds": 21.5, "room_seconds": pytest.approx(6.0)}}


def test_the_library_carries_the_fits_figures():
    """jaxpipe.analysis.calibration's scale, runs and held-out error per platform are those
    of the fit benchmarks/calibration.py wrote (rerun it and copy them when it changes)."""
    results = json.loads(RESULTS.read_text())
    assert set(results["fits"]) == set(calibration.CALIBRATIONS)
    for platform, fitted in results["fits"].items():
        carried = calibration.get(platform)
        assert carried.platform == platform
        assert carried.compute_scale == pytest.approx(fitted["scale"], rel=1e-3)
        assert set(carried.fitted_on) == set(fitted["rows"]) <= set(RUN)
        assert carried.held_out_error == pytest.approx(fitted["worst_held_out_error"], abs=5e-4)
    assert calibration.get("cpu") is None


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_the_fit_meets_its_bounds(platform):
    """Every run within 10% of its published step, each held out within 15%, on at least
    two runs per platform; the TPU's are MaxText's own programs on at least three."""
    fitted = json.loads(RESULTS.read_text())["fits"][platform]
    assert len(fitted["rows"]) >= (3 if platform == "tpu" else 2)
    assert fitted["worst_error"] <= 0.10
    assert fitted["worst_held_out_error"] <= 0.15


def test_the_published_steps_in_the_fit_are_the_sources():
    """The fit's published steps are those `published_step_seconds` gives its runs."""
    for row in json.loads(RESULTS.read_text())["rows"]:
        assert row["published"] == pytest.approx(fit.published_step_seconds(RUN[row["name"]])[0])


def _step_time(calibration_=None):
    return StepTime(
        ticks=10,
        tick_compute_seconds=0.2,
        compute_source="test",
        tick_exposed_seconds=0.05,
        step_exposed_seconds=0.3,
        step_compute_seconds=0.1,
        step_compute_source="test",
        tick_exposed=(),
        step_exposed=(),
        links=None,
        devices=4,
        model_flops=4e15,
        peak_flops=1e15,
        calibration=calibration_,
    )


def test_a_calibration_scales_the_computation_alone():
    scale = 1.37
    calibrated = _step_time(
        calibration.Calibration("tpu", scale, ("a", "b"), 0.08, "fitted on two runs")
    )
    raw = _step_time()
    assert raw.step_seconds == pytest.approx(10 * (0.2 + 0.05) + 0.1 + 0.3)
    assert calibrated.step_seconds == pytest.approx(10 * (scale * 0.2 + 0.05) + scale * 0.1 + 0.3)
    assert calibrated.mfu == pytest.approx(4e15 / (4 * 1e15 * calibrated.step_seconds))
    assert math.isclose(calibrated.tick_compute_seconds, 0.2)  # the raw estimate is kept
    assert "raw compiler estimates" in str(raw) and "calibrated" not in str(raw)
    text = str(calibrated)
    assert "calibrated" in text and "x1.370" in text and "8%" in text
    assert calibrated.as_dict()["calibration"]["compute_scale"] == scale


def test_a_runs_attention_kernel_is_counted_beside_the_compilers_estimate():
    """The published TPU runs ran splash attention, whose custom call the compiler gives a
    token time: the fit adds the kernel's time as jaxpipe counts its own, here counted by
    hand for Llama-2-70B (80 layers, 4 rows of 4096 tokens a chip, 64 heads of 128, tiles of
    512: 36 of 64 computed; forward 2 products, backward 7, the forward again under remat,
    at half the v5p's 459 TFLOP/s)."""
    run = RUN["maxtext-llama2-70b-v5p-512"]
    product = 2 * 4 * 64 * 36 * 512 * 512 * 128
    expected = 80 * (2 + 2 + 7) * product / (0.5 * 459e12)
    assert fit.kernel_seconds(run) == pytest.approx(expected, rel=1e-9)
    rows = {r["name"]: r for r in json.loads(RESULTS.read_text())["rows"]}
    row = rows[run.name]
    assert row["kernel_seconds"] == pytest.approx(expected, rel=1e-9)
    assert row["compute"] == pytest.approx(row["compiler_seconds"] + expected)
