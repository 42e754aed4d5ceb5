"""benchmarks/on_device.py: what it writes, checked on the CPU with its tiny model.

The script is made for one GPU; here it runs with ``--tiny`` on a CPU host device, and its
JSON must hold every figure it promises with sane values: times measured and predicted,
the two steps' agreement, memory (compiled and predicted; measured where the device reports
it, which a CPU does not), the model's FLOPs, MFU and the device's name. No timing is
checked against another.
"""

import importlib.util
import json
import math
import pathlib
import subprocess
import sys

import jax
import pytest

from jaxpipe import costs

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "on_device.py"


def load_script():
    spec = importlib.util.spec_from_file_location("on_device", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(SCRIPT.parent))  # it imports benchmarks/common.py
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_the_chip_whose_peaks_are_used_is_the_devices_or_named():
    od = load_script()
    assert od.peaks_for("NVIDIA H100 80GB HBM3", None)[0].name == "H100"
    assert od.peaks_for("NVIDIA H100 80GB HBM3", None)[1] is True
    assert od.peaks_for("NVIDIA H200", None) == (costs.get_accelerator("H200"), True)
    assert od.peaks_for("cpu", None) == (costs.get_accelerator("H100"), False)
    assert od.peaks_for("cpu", "A100") == (costs.get_accelerator("A100"), False)
    assert od.device_slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"


def test_attention_falls_back_to_xla_where_cudnn_does_not_compile():
    od = load_script()
    assert jax.default_backend() == "cpu"
    implementation, why = od.attention_implementation(od.parse_args(["--tiny"]))
    assert implementation == "xla" and "cudnn did not compile here" in why
    assert od.attention_implementation(od.parse_args(["--tiny", "--attention", "xla"]))[0] == "xla"
    with pytest.raises((RuntimeError, ValueError)):  # asked for by name: no fallback
        od.attention_implementation(od.parse_args(["--tiny", "--attention", "cudnn"]))


def test_xla_attention_takes_the_8192_tokens_as_two_rows_unless_told():
    od = load_script()
    args = od.parse_args(["--attention", "xla"])
    assert od.resolve(args)[0] == "xla" and (args.rows, args.seq) == (2, 4096)
    args = od.parse_args(["--attention", "xla", "--seq", "8192"])
    od.resolve(args)
    assert (args.rows, args.seq) == (1, 8192)
    args = od.parse_args(["--tiny", "--attention", "xla"])
    od.resolve(args)
    assert (args.rows, args.seq) == (od.TINY["rows"], od.TINY["seq"])


def test_model_flops_are_the_products_with_the_weights_and_causal_attention():
    od = load_script()
    args = od.parse_args(["--tiny", "--seq", "16", "--rows", "3", "--blocks", "2"])
    D, F, H, KV, T = args.width, args.hidden, args.heads, args.kv_heads, 3 * 16
    HD = D // H
    weights = D * H * HD + 2 * D * KV * HD + H * HD * D + 3 * D * F
    # query i attends to i + 1 keys: QK^T and PV, 2 FLOPs a multiply-add, per head
    attention = 3 * H * sum(2 * 2 * HD * (i + 1) for i in range(16))
    assert od.Model(args, "xla").model_flops() == 2 * (2 * T * weights + attention)


@pytest.mark.slow
def test_tiny_run_writes_every_figure(tmp_path):
    out = tmp_path / "on_device.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--repeats", "2", "--step-repeats", "2",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    for title in ("Stage of 2 blocks on cpu", "S = 1, M = 2 (1f1b)", "Peak memory"):
        assert title in result.stdout
    r = json.loads(out.read_text())
    assert r["errors"] == {}

    assert r["device"] == r["meta"]["device_kind"] == "cpu"
    assert r["attention"]["implementation"] == "xla"
    h100 = costs.get_accelerator("H100")
    assert r["peaks"]["name"] == "H100" and r["peaks"]["is_this_device"] is False
    assert r["peaks"]["peak_flops_bf16"] == h100.peak_flops

    stage = r["stage"]
    for kind in ("measured_seconds", "predicted_seconds", "predicted_seconds_minimal_traffic"):
        assert set(stage[kind]) == {"F", "B", "W", "BW"}
        assert all(positive(s) for s in stage[kind].values()), stage[kind]
    for action, name in (("F", "forward"), ("B", "backward_input"), ("W", "backward_weight")):
        c = stage["xla_counts"][name]
        roofline = max(c["flops"] / h100.peak_flops, c["bytes"] / h100.memory_bandwidth)
        assert stage["predicted_seconds"][action] == pytest.approx(roofline, rel=1e-12)
    # XLA counts the whole attention square and the elementwise work besides the products
    xla_forward = stage["xla_counts"]["forward"]["flops"]
    model_forward = r["model_flops"]["forward_per_microbatch"]
    assert 1 < xla_forward / model_forward < 1.5
    assert r["model_flops"]["training_per_microbatch"] == 3 * model_forward

    step = r["step"]
    measured = step["measured_seconds"]
    assert positive(measured["plain"]) and positive(measured["jaxpipe"])
    assert step["jaxpipe_over_plain"] == pytest.approx(measured["jaxpipe"] / measured["plain"])
    assert positive(step["predicted_seconds"])
    assert positive(step["predicted_from_measured_stage_seconds"])
    assert step["loss_relative_difference"] < 1e-2  # the same model, in bfloat16
    assert step["grads_relative_difference"] < 1e-2

    M = r["model"]["microbatches"]
    mfu = r["mfu"]
    for case in ("plain", "jaxpipe"):
        expected = M * 3 * model_forward / (measured[case] * h100.peak_flops)
        assert mfu[f"{case}_step"] == pytest.approx(expected)
    assert all(positive(v) for v in mfu.values())

    for case in ("plain", "jaxpipe"):
        m = r["memory"][case]
        assert "error" not in m, m
        assert m["device_kind"] == "cpu" and m["same_stage_as_timed"] is True
        assert all(positive(m["compiled"][k]) for k in ("argument", "output", "temp", "peak"))
        assert m["measured"] is None and "cpu" in m["measured_unavailable"]
    assert r["memory"]["plain"]["predicted"] is None
    predicted = r["memory"]["jaxpipe"]["predicted"]["total"]
    compiled = r["memory"]["jaxpipe"]["compiled"]["sum"]  # the CPU's peak leaves temp out
    assert 0.5 < predicted / compiled < 2
