"""Every benchmark script runs on the current API, on small sizes, and writes its JSON.

The numbers are not checked here (docs/benchmarks.md reports them; the properties they show
are tested elsewhere): only that a user who runs a script gets a table and a JSON file.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMALL = {
    "bubble.py": ["--stages", "2", "--multiples", "1", "2"],
    "fitted_tables.py": ["--stages", "2", "--multiples", "2", "--schedules", "1f1b", "zbv",
                         "circular", "--costs", "1:1:1", "r=1:2:1"],
    "memory.py": ["--schedules", "1f1b", "zbv"],
    "overhead.py": ["--stages", "2x16", "1x8", "--rows", "4", "--microbatches", "2",
                    "--repeats", "1"],
    "maxtext_baseline.py": ["--stages", "2", "--microbatches", "2", "--no-remat",
                            "--schedules", "circular"],
    "predict.py": ["--layers", "8", "--width", "32", "--hidden", "64", "--tokens", "16",
                   "--stages", "2", "--accelerators", "H100"],
    "zero_bubble.py": ["--stages", "2", "--microbatches", "4", "--schedules", "zb_h1", "zbv"],
    "target_memory.py": ["--target", "cpu:4", "--width", "32", "--hidden", "64", "--seq", "8",
                         "--rows", "2", "--schedules", "1f1b"],
    "memory_prediction.py": ["--predict-only", "--targets", "cpu:8", "--schedules", "1f1b"],
    "scale.py": ["--small", "--only", "8b-v5p-1f1b", "--remat", "dots"],
    "scanned_stage.py": ["--target", "cpu:4", "--width", "32", "--heads", "4", "--kv-heads",
                         "2", "--hidden", "64", "--seq", "8", "--rows", "2", "--blocks", "3",
                         "--schedules", "1f1b", "--microbatches", "4", "--forms", "loop",
                         "scan", "nnx", "dots"],
    "plan.py": ["--model", "tiny", "--target", "v5p:2x2x1", "--compile-top", "1", "--schedules",
                "1f1b", "gpipe", "--microbatches", "4"],
    "meshes.py": ["--width", "32", "--hidden", "64", "--seq", "8", "--blocks", "2",
                  "--microbatches", "2", "--meshes", "pipe 2 x fsdp 2 x tensor 2, per use"],
}  # fmt: skip


def test_every_script_is_listed():
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")}
    # pytorch_tables needs torch, maxtext_layer MaxText and libtpu, moe_overlap libtpu: not
    # run here; doc_figures compiles the docs' configurations: tests/test_doc_figures.py;
    # on_device is made for a GPU: tests/test_on_device.py runs its tiny model
    helpers = {"common.py", "pytorch_tables.py", "maxtext_layer.py", "doc_figures.py"}
    helpers |= {"moe_overlap.py", "on_device.py"}
    # published_runs is data (tests/test_published_runs.py)
    helpers |= {"published_runs.py"}
    # maxtext_compile runs in MaxText's environment; calibration's fit: tests/test_calibration.py
    helpers |= {"maxtext_compile.py", "calibration.py"}
    # maxtext_memory compiles MaxText's step: its table of the saved results is tested below
    helpers |= {"maxtext_memory.py"}
    assert scripts - helpers == set(SMALL)


# The fast loop runs the scripts that need no compilation.
FAST = {"bubble.py", "fitted_tables.py"}


@pytest.mark.parametrize(
    "script", [s if s in FAST else pytest.param(s, marks=pytest.mark.slow) for s in sorted(SMALL)]
)
def test_benchmark_runs_and_writes_json(script, tmp_path):
    out = tmp_path / "result.json"
    env = dict(os.environ)  # conftest's 8 host devices; bubble.py writes its plots too
    flags = [*SMALL[script], "--out", str(out)]
    if script == "bubble.py":
        flags += ["--plot", str(tmp_path / "bubble.png")]
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data and "wrote" in result.stdout


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_predict_on_the_tpu_compiler_puts_the_compilers_estimate_beside_the_roofline(tmp_path):
    out = tmp_path / "result.json"
    flags = [*SMALL["predict.py"][:-2], "--compiler", "v5p:2x2x1", "--out", str(out)]
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "predict.py"), *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["compiled_for"] == "v5p:2x2x1"
    assert {row["target"] for row in data["rows"]} == {"TPU v5p"}
    for row in data["rows"]:
        assert row["compiler"]["step_time"] > 0 and row["compiled"]["step_time"] > 0
    assert "compiler / step" in result.stdout


def test_maxtext_memory_prints_the_table_of_its_saved_results():
    """`benchmarks/maxtext_memory.py --table` reads benchmarks/results/maxtext_memory.json
    (no MaxText needed) and prints one row per compared run, with both peaks."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "maxtext_memory.py"), "--table"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads((ROOT / "benchmarks" / "results" / "maxtext_memory.json").read_text())
    rows = [line for line in result.stdout.splitlines() if line.startswith("| pipe")]
    assert len(rows) == len(saved["rows"]) >= 2
    for line, row in zip(rows, saved["rows"], strict=True):
        assert f"{row['maxtext']['peak_bytes'] / 2**30:.2f} GiB" in line
        assert f"{row['jaxpipe']['peak_bytes'] / 2**30:.2f} GiB" in line
