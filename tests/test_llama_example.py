"""examples/train_llama.py runs a few steps as a user would start it, in a subprocess: its
step-0 loss equals the same model without the pipeline, its progress lines, checkpoints and
resume (under another schedule), bf16 with a tied head on a text file."""

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import compiles
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_llama.py"
TIMEOUT = 300
LINE = re.compile(
    r"step\s+(\d+) \| loss (\d+\.\d+) \| accuracy (\d\.\d+) \| "
    r"(compiled|[\d,]+ tokens/s \| ETA \d+ s)"
)
CHECK = re.compile(r"step (\d+) loss: pipeline (\d+\.\d+), same model without the pipeline "
                   r"(\d+\.\d+) \(relative difference ([\d.e+-]+)")  # fmt: skip
# Small enough to compile quickly: 4 blocks of width 32, 4 logical stages; 1f1b unless a
# later --schedule says otherwise.
SMALL = ["--schedule", "1f1b", "--layers", "4", "--width", "32", "--hidden", "64", "--batch", "16",
         "--microbatches", "4", "--seq", "32", "--log-every", "1"]  # fmt: skip


def run(*flags, check=True):
    """The example's stdout; with ``check=False``, its ``subprocess.CompletedProcess``."""
    env = dict(os.environ, **compiles.LOG)  # conftest: 8 host devices, JAX_PLATFORMS=cpu
    # this checkout's jaxpipe, whichever one is installed
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    if not check:
        return result
    assert result.returncode == 0, f"train_llama.py {' '.join(flags)}:\n{result.stderr[-3000:]}"
    assert not compiles.step_recompiles(result.stderr), "train_llama.py: the step compiled twice"
    return result.stdout


@pytest.mark.slow
def test_train_llama_runs_a_few_steps():
    """The fast check: 1f1b on pipe 2 x data 2, two steps; step 0 equals the plain model."""
    out = run(*SMALL, "--layers", "2", "--stages", "2", "--steps", "2")
    assert "mesh: {'pipe': 2, 'data': 2}" in out
    assert "schedule: 1f1b S=2 M=4 v=1, 2 stages of 1 block(s)" in out
    step, piped, plain, _ = CHECK.search(out).groups()
    assert step == "0" and abs(float(piped) - float(plain)) <= 1e-5 * float(plain)
    lines = LINE.findall(out)
    assert [int(s) for s, *_ in lines] == [0, 1]
    assert lines[0][3] == "compiled" and "tokens/s" in lines[1][3]
    assert re.search(r"final: loss \d+\.\d+ accuracy \d\.\d+ \(chance 0\.100\)", out)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="plans for a TPU (libtpu)")
def test_train_llama_plans_by_default_with_xla_attention_and_prints_the_runner_up():
    """No --schedule: jaxpipe.plan chooses for a TPU of as many chips as host devices, with
    --stages 2 kept and data, fsdp and tensor planned, costing XLA's attention; the chosen
    plan and the runner-up are printed, then the chosen one trains with --attention's
    kernel (splash here), the plan's remat on each stage, and step 0 equals the plain model."""
    small = [f for f in SMALL if f not in ("--schedule", "1f1b")]
    out = run(*small, "--seq", "128", "--layers", "2", "--stages", "2", "--attention", "splash",
              "--steps", "1")  # fmt: skip
    assert "schedule auto: the plan for v5p:2x2x2 (jaxpipe.plan), and the runner-up:" in out
    chosen = re.search(r"^  0 .*pipe (\d+) x data (\d+) x fsdp (\d+) x tensor (\d+): (\w+)"
                       r"( packed)?, M (\d+), v \d+, remat (\w+)", out, re.M)  # fmt: skip
    assert chosen and chosen.group(1) == "2", out
    assert re.search(r"^  1 ", out, re.M)
    pipe, data, fsdp, tensor, name, _, micro, remat = chosen.groups()
    mesh = {"pipe": int(pipe), "data": int(data)}
    mesh.update({a: int(n) for a, n in (("fsdp", fsdp), ("tensor", tensor)) if n != "1"})
    assert f"mesh: {mesh}" in out
    assert f"schedule: {name} S={pipe} M={micro}" in out
    assert f"remat {remat} (the plan's, of each stage)" in out and "attention: splash" in out
    step, piped, plain, _ = CHECK.search(out).groups()
    assert step == "0" and abs(float(piped) - float(plain)) <= 1e-5 * float(plain)
    assert len(LINE.findall(out)) == 1


@pytest.mark.slow
def test_train_llama_runs_a_published_runs_shapes_relu_mlp_tied_head_and_wide_heads():
    """--model maxtext-32b brings that run's ReLU MLP (no gate), tied head and heads wider
    than width / heads; with its sizes made small, step 0 equals the plain model and the
    parameters are the ReLU block's (0.30M; with a SwiGLU gate they would be 0.43M)."""
    small = [f for f in SMALL if f not in ("--hidden", "64")]
    out = run(*small, "--model", "maxtext-32b", "--no-bf16", "--heads", "4", "--kv-heads", "4",
              "--head-dim", "16", "--hidden", "1024", "--vocab", "16", "--stages", "2",
              "--steps", "1")  # fmt: skip
    assert (
        "model: 4 blocks (width 32, 4 heads of 16, 4 kv heads, ReLU 1024), vocabulary 16, "
        "tied head, 0.30M parameters" in out
    )
    step, piped, plain, _ = CHECK.search(out).groups()
    assert step == "0" and abs(float(piped) - float(plain)) <= 1e-5 * float(plain)


def test_train_llama_auto_refuses_costs_it_would_choose():
    result = run("--schedule", "auto", "--costs", "1:2:1", check=False)
    assert result.returncode != 0 and "--schedule auto chooses the table" in result.stderr


@pytest.fixture(scope="module")
def zbv_run(tmp_path_factory):
    """zbv on pipe 2 x data 2 with dropout, the table packed for the stage's costs measured
    here, three steps, checkpoints: ``(out_dir, stdout)``."""
    out_dir = tmp_path_factory.mktemp("llama") / "run"
    out = run(*SMALL, "--schedule", "zbv", "--stages", "2", "--dropout", "0.1", "--costs",
              "measure", "--steps", "3", "--save-every", "2", "--out", str(out_dir))  # fmt: skip
    return out_dir, out


@pytest.mark.slow
@pytest.mark.xdist_group("llama_zbv_run")
def test_train_llama_matches_the_plain_model_and_saves(zbv_run):
    """Step 0 equals the plain model; progress lines; checkpoints every --save-every steps."""
    out_dir, first = zbv_run
    assert "platform: cpu, 8 devices" in first
    assert "mesh: {'pipe': 2, 'data': 2}" in first
    assert "schedule: zbv S=2 M=4 v=2, 4 stages of 1 block(s)" in first
    assert "2 kv heads" in first and "dropout 0.1" in first
    assert re.search(r"costs F=1 B=\S+ W=\S+ BW=\S+ comm=0; table zbv, \d+ ticks: bubble", first)
    step, piped, plain, _ = CHECK.search(first).groups()
    assert step == "0" and abs(float(piped) - float(plain)) <= 1e-5 * float(plain)
    lines = LINE.findall(first)
    assert [int(s) for s, *_ in lines] == [0, 1, 2]
    assert lines[0][3] == "compiled" and "tokens/s" in lines[1][3]
    assert 0.0 <= float(lines[-1][2]) <= 1.0
    saved = sorted(p.name for p in (out_dir / "checkpoints").iterdir())
    assert saved == ["0", "2"]  # every --save-every steps, and the last step


@pytest.mark.slow
@pytest.mark.xdist_group("llama_zbv_run")
def test_train_llama_resumes_under_another_schedule_and_stages(zbv_run):
    """The zbv run resumed under 1f1b on pipe 4 x data 2: the same four logical stages in
    another layout; the resumed step equals the plain model."""
    out_dir, _ = zbv_run
    second = run(*SMALL, "--schedule", "1f1b", "--stages", "4", "--steps", "5", "--out",
                 str(out_dir), "--resume")  # fmt: skip
    assert "resumed from step 2" in second
    step, piped, plain, _ = CHECK.search(second).groups()
    assert step == "3" and abs(float(piped) - float(plain)) <= 1e-5 * float(plain)
    assert [int(s) for s, *_ in LINE.findall(second)] == [3, 4]
    assert re.search(r"final: loss \d+\.\d+ accuracy \d\.\d+ \(chance 0\.100\)", second)


KERNEL_CHECK = re.compile(
    r"step 0 (\w+) against XLA's attention: loss (\d+\.\d+) against (\d+\.\d+) \(relative "
    r"difference ([\d.e+-]+)\), gradients' largest relative difference ([\d.e+-]+)"
)


@pytest.mark.slow
def test_train_llama_splash_attention_equals_xlas_on_pipe_fsdp_tensor():
    """--attention splash on a CPU runs the Pallas TPU kernel in interpret mode, under a
    shard_map over tensor inside the pipeline's: its loss and every gradient equal those of
    XLA's attention on the first batch (float32, packed documents: causal within each), the
    pipeline equals the plain model, and it trains."""
    out = run(*SMALL, "--seq", "128", "--layers", "2", "--stages", "2", "--data", "1",
              "--fsdp", "2", "--tensor", "2", "--steps", "2", "--attention", "splash")  # fmt: skip
    assert "attention: splash (the Pallas TPU kernel, tiles of 128, interpret mode)" in out
    step, piped, plain, _ = CHECK.search(out).groups()
    assert step == "0" and abs(float(piped) - float(plain)) <= 1e-5 * float(plain)
    kernel, fused, xla, _, grads = KERNEL_CHECK.search(out).groups()
    assert kernel == "splash"
    assert abs(float(fused) - float(xla)) <= 1e-6 * float(xla)
    assert float(grads) <= 1e-5
    assert [int(s) for s, *_ in LINE.findall(out)] == [0, 1]


def test_train_llama_refuses_a_kernel_the_platform_lacks():
    """--attention cudnn on a CPU: refused from the flags, naming what it needs."""
    result = run(*SMALL, "--attention", "cudnn", check=False)
    assert result.returncode != 0
    assert "--attention cudnn: cuDNN's attention runs on an NVIDIA GPU" in result.stderr
    assert "got platform cpu" in result.stderr and "or --attention xla" in result.stderr


@pytest.mark.slow
def test_train_llama_bf16_tied_head_on_a_text_file(tmp_path):
    text = tmp_path / "tiny.txt"
    text.write_text("to be or not to be, that is the question.\n" * 40)
    out = run(*SMALL, "--stages", "4", "--data", "1", "--text", str(text), "--bf16", "--tied",
              "--steps", "2")  # fmt: skip
    assert "vocabulary 16" in out and "tied head" in out and "compute bfloat16" in out
    _, piped, plain, _ = CHECK.search(out).groups()
    assert abs(float(piped) - float(plain)) <= 1e-2 * float(plain)  # both in bf16
    assert len(LINE.findall(out)) == 2
    assert re.search(r"final: loss \d+\.\d+ accuracy \d\.\d+ \(chance 0\.062\)", out)


def test_train_llama_rejects_resume_without_out():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--resume"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0 and "--resume needs --out" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [(), ("--sequence-parallel",), ("--fsdp-gather", "ahead"), ("--fsdp-gather", "per_block")],
    ids=["", "sequence-parallel", "gathered-ahead", "gathered-per-block"],
)
def test_train_llama_on_pipe_fsdp_tensor(flags):
    """--fsdp 2 --tensor 2: the blocks split over fsdp and tensor, the embedding and head by
    vocabulary over tensor and fsdp (and with --sequence-parallel the residual stream by
    sequence over tensor; with --fsdp-gather ahead each tick gathers the next action's
    weights, with per_block each block's weights are gathered as it runs); two steps, step
    0 equals the plain model."""
    out = run(*SMALL, "--layers", "2", "--stages", "2", "--data", "1", "--fsdp", "2",
              "--tensor", "2", "--steps", "2", *flags)  # fmt: skip
    assert "mesh: {'pipe': 2, 'data': 1, 'fsdp': 2, 'tensor': 2}" in out
    step, piped, plain, _ = CHECK.search(out).groups()
    assert step == "0" and abs(float(piped) - float(plain)) <= 1e-5 * float(plain)
    assert [int(s) for s, *_ in LINE.findall(out)] == [0, 1]


def test_train_llama_rejects_an_xla_option_without_a_value():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--xla-option", "xla_tpu_spmd_unroll_windowed_einsum"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "--xla-option 'xla_tpu_spmd_unroll_windowed_einsum': expected NAME=VALUE" in (
        result.stderr
    )


# The TPU compiler's collective matmuls, version 2 (docs/llama3_70b.md)
TPU_COLLECTIVE_MATMULS = (
    "--xla-option", "xla_tpu_all_gather_collective_matmul_mode=post_spmd",
    "--xla-option", "xla_tpu_reduce_scatter_collective_matmul_mode=post_spmd",
)  # fmt: skip


def _tensor_collectives_in_loop(tmp_path, *flags) -> dict:
    """Per kind, (count, hidden) of the tick loop's collectives over ``tensor`` in the report
    of a small sequence-parallel step on pipe 2 x fsdp 2 x tensor 2 compiled for v5p."""
    path = tmp_path / f"report{len(flags)}.json"
    run("--target", "v5p:2x2x2", "--attention", "xla", "--stages", "2", "--data", "1",
        "--fsdp", "2", "--tensor", "2",
        "--sequence-parallel", "--layers", "4", "--width", "256", "--heads", "4", "--kv-heads",
        "2", "--hidden", "512", "--seq", "256", "--batch", "8", "--microbatches", "4", "--bf16",
        "--remat", "dots", "--json", str(path), *flags)  # fmt: skip
    report = json.loads(path.read_text())
    assert report["run"]["xla_options"] == dict(option.split("=") for option in flags[1::2]), (
        report["run"]["xla_options"]
    )
    return {
        c["kind"]: (c["count"], c["hidden"])
        for c in report["report"]["collectives"]
        if c["in_loop"] and c["axes"] == ["tensor"]
    }


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_tpu_collective_matmuls_put_tensor_gathers_behind_the_matmuls(tmp_path):
    """--xla-option reaches the compiler. With --sequence-parallel the tick loop gathers each
    block's input over tensor before its column-split projections: synchronous all-gathers
    by default (nothing over tensor behind computation). With the TPU compiler's collective
    matmuls they run as collective-permutes inside the projections, which compute on one
    piece while the next arrives: some of them behind computation."""
    plain = _tensor_collectives_in_loop(tmp_path)
    assert plain["all-gather"][0] >= 16, plain
    assert not any(hidden for _, hidden in plain.values()), plain
    fused = _tensor_collectives_in_loop(tmp_path, *TPU_COLLECTIVE_MATMULS)
    assert fused["all-gather"][0] <= plain["all-gather"][0] // 4, fused
    permutes, hidden = fused["collective-permute"]
    assert permutes >= 32 and hidden >= permutes // 5, fused


# A small model compiled for 4 TPU v5p chips, pipe 2 x (fsdp 2 | tensor 2 | nothing).
TINY_TPU = ["--target", "v5p:2x2x1", "--attention", "xla", "--stages", "2", "--data", "1",
            "--layers", "4", "--width", "256", "--heads", "4", "--kv-heads", "2", "--hidden",
            "512", "--seq", "128", "--microbatches", "4", "--bf16", "--schedule", "zbv",
            "--costs", "target"]  # fmt: skip


def _compiled(tmp_path, *flags) -> tuple[str, dict]:
    """(stdout, JSON report) of the example compiled for TINY_TPU with ``flags``."""
    path = tmp_path / f"report{len(list(tmp_path.iterdir()))}.json"
    out = run(*TINY_TPU, "--json", str(path), *flags)
    return out, json.loads(path.read_text())


@pytest.fixture(scope="module")
def fsdp_ahead(tmp_path_factory):
    """pipe 2 x fsdp 2, weights gathered a tick ahead, 2 rows a device per micro-batch."""
    return _compiled(tmp_path_factory.mktemp("ahead"), "--fsdp", "2", "--batch", "16",
                     "--fsdp-gather", "ahead", "--step-time")  # fmt: skip


@pytest.mark.slow
@pytest.mark.xdist_group("llama_fsdp_ahead")
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_train_llama_predicts_the_step_time_with_weights_gathered_ahead(fsdp_ahead):
    """--fsdp-gather ahead --step-time: the tick loop's trips are read and the step time
    predicted over the table's ticks, as for the other gather modes."""
    out, report = fsdp_ahead
    assert "not predicted" not in out and "predicted step time" in out, out[-2000:]
    table = re.search(r"table zbv, (\d+) ticks", out)
    assert table and report["step_time"]["ticks"] == int(table.group(1)), out[-2000:]
    assert report["report"]["ticks"] is not None and report["step_time"]["tick_seconds"] > 0


@pytest.mark.slow
@pytest.mark.xdist_group("llama_fsdp_ahead")
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_train_llama_prints_the_calibrated_step_time(fsdp_ahead):
    """--step-time on a TPU: the prediction is the calibrated one (the TPU's scale of the
    computation, exposed communication added as it is) and says so."""
    from jaxpipe import calibration

    out, report = fsdp_ahead
    step = report["step_time"]
    scale = calibration.get("tpu").compute_scale
    assert step["calibration"]["compute_scale"] == scale
    assert step["tick_seconds"] == pytest.approx(
        scale * step["tick_compute_seconds"] + step["tick_exposed_seconds"]
    )
    assert "predicted step time (calibrated" in out and f"x{scale:.3f}" in out, out[-2000:]


@pytest.mark.slow
@pytest.mark.xdist_group("llama_fsdp_ahead")
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_train_llama_costs_target_cost_one_devices_share_of_the_stage(fsdp_ahead, tmp_path):
    """--costs target packs the table for what one device runs: its rows of a micro-batch
    (split over data x fsdp; fsdp gathers the weights whole before use) and its share of
    the heads and hidden width (split over tensor). pipe 2 x fsdp 2 on 16 rows costs what
    pipe 2 alone costs on 8 (2 rows a device per micro-batch); tensor 2 costs less."""
    out, sharded = fsdp_ahead
    assert "stage costs on v5p:2x2x1: the TPU compiler's optimal_seconds of one block on " \
        "one device's share, x1 blocks a stage" in out  # fmt: skip
    assert re.search(r"costs F=1 B=\S+ W=\S+ BW=\S+ comm=0; table zbv", out)
    _, alone = _compiled(tmp_path, "--batch", "8")
    _, split = _compiled(tmp_path, "--batch", "8", "--tensor", "2")
    assert sharded["stage_costs"] == alone["stage_costs"]
    for action in ("forward", "backward_input", "backward_weight", "full_backward"):
        assert 0 < split["stage_costs"][action] < alone["stage_costs"][action], action


def test_train_llama_refuses_to_cost_a_share_whose_heads_do_not_group():
    """4 query heads over --tensor 4 leave one a device, and the 2 kv heads (which tensor 4
    does not divide) stay whole: no block of that share exists to cost. Refused from the
    flags alone, with the fix."""
    result = run(*TINY_TPU, "--tensor", "4", check=False)
    assert result.returncode != 0
    assert "its 1 query heads must group over its 2 key/value heads" in result.stderr
    assert "give --kv-heads a multiple of --tensor" in result.stderr


# 1024-token rows (two tiles of 512 a side: the kernel computes three of the four) of a
# narrow model (2 heads of 128), one row a micro-batch, one block a stage.
KERNEL_TPU = ["--target", "v5p:2x2x1", "--stages", "2", "--data", "1", "--layers", "2",
              "--width", "256", "--heads", "2", "--kv-heads", "1", "--hidden", "512", "--seq",
              "1024", "--microbatches", "4", "--batch", "4", "--bf16", "--schedule", "1f1b",
              "--costs", "target", "--step-time"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_train_llama_compiles_splash_for_a_tpu_and_charges_its_time(tmp_path):
    """On a TPU target --attention auto takes splash attention, which compiles ahead of time
    inside the pipeline. The compiler's estimate does not see the kernel's work, so a
    block's cost (the table's and the step-time prediction's) is the compiler's estimate of
    the block around the kernel plus the kernel's matrix products at 50% of the chip's peak,
    counted here from the shapes: the causal tiles of 512 on and below the diagonal, 2
    products forward, 7 backward (splash's dq and dk/dv kernels), and the forward again in B
    and W (--remat dots keeps no kernel output)."""
    from jaxpipe import target

    path = tmp_path / "report.json"
    out = run(*KERNEL_TPU, "--json", str(path))
    report = json.loads(path.read_text())
    assert "attention: splash (the Pallas TPU kernel, tiles of 512)" in out
    assert report["run"]["attention"] == "splash"
    rows, heads, head_width, tile, seq = 1, 2, 128, 512, 1024
    pairs = (seq // tile) * (seq // tile + 1) // 2 * tile**2
    product = 2 * rows * heads * pairs * head_width  # FLOPs of one matrix product
    rate = 0.5 * target.get("v5p:2x2x1").peaks.peak_flops
    forward, backward = 2 * product / rate, 7 * product / rate
    expected = {"forward": forward, "backward_input": forward + backward,
                "backward_weight": forward, "full_backward": forward + backward}  # fmt: skip
    block, stage = report["block_costs"], report["stage_costs"]
    for action, seconds in expected.items():
        assert block["kernel"][action] == pytest.approx(seconds, rel=1e-9), action
        assert block["around"][action] > 0, action
        assert block[action] == pytest.approx(block["around"][action] + seconds), action
        assert stage[action] == pytest.approx(block[action]), action  # one block a stage
    # every tick of the lock-step prediction runs at least one forward
    assert report["step_time"]["tick_compute_seconds"] >= block["forward"]
