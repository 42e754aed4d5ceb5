"""Smoke tests: every example runs a few steps as a user would start it, in a subprocess."""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import compiles
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TIMEOUT = 300  # seconds; a run here takes 10-40 s on two busy cores
LINE = re.compile(
    r"step\s+(\d+)/(\d+) \| loss (\d+\.\d+) \| accuracy (\d\.\d+) \| lr (\S+) \| ([\d,]+) "
    r"tokens/s \| ETA (\S+)"
)
# A small GPT so that compiling stays quick: 2 stages, 2 blocks, width 32.
SMALL_GPT = ["--schedule", "1f1b", "--stages", "2", "--layers", "4", "--width", "32",
             "--batch", "16", "--log-every", "1"]  # fmt: skip


def run(script, *flags):
    """Runs ``examples/script`` with ``flags``; returns its stdout (fails on a non-zero exit)."""
    env = dict(os.environ, **compiles.LOG)  # conftest: 8 host devices, JAX_PLATFORMS=cpu
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, f"{script} {' '.join(flags)} failed:\n{result.stderr[-3000:]}"
    assert not compiles.step_recompiles(result.stderr), f"{script}: the step compiled twice"
    return result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zbv"])
def test_mlp_pipeline(schedule):
    out = run("mlp_pipeline.py", "--schedule", schedule, "--steps", "3")
    assert out.startswith("platform: cpu")
    losses = [float(x) for x in re.findall(rf"\| {schedule} \| loss (\d+\.\d+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_mlp_pipeline_is_small():
    assert len((EXAMPLES / "mlp_pipeline.py").read_text().splitlines()) < 80


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """3 steps of zbv on 2 stages (4 logical stages, V placement), the table packed for
    F:B:W = 1:2:1, checkpoints every 2 steps: (stdout, output directory)."""
    out_dir = tmp_path_factory.mktemp("gpt") / "run"
    flags = [*SMALL_GPT, "--schedule", "zbv", "--microbatches", "4", "--costs", "1:2:1"]
    out = run("train_gpt.py", *flags, "--steps", "3", "--save-every", "2", "--out", str(out_dir))
    return out, out_dir


@pytest.mark.slow
@pytest.mark.xdist_group("gpt_first_run")
def test_train_gpt_saves_checkpoints_and_a_timeline(first_run):
    out, out_dir = first_run
    assert "platform: cpu, 8 devices" in out
    assert "mesh: {'pipe': 2, 'data': 2}" in out
    assert "schedule: zbv S=2 M=4 v=2" in out
    assert re.search(r"costs F=1 B=2 W=1 BW=3 comm=0; table zbv, \d+ ticks: bubble lock-step", out)
    lines = LINE.findall(out)
    assert [(int(step), int(total)) for step, total, *_ in lines] == [(0, 3), (1, 3), (2, 3)]
    assert lines[0][-1] == "-" and re.fullmatch(r"\d+m\d\ds", lines[-1][-1])  # ETA
    assert (out_dir / "schedule.png").read_bytes()[:4] == b"\x89PNG"
    saved = sorted(p.name for p in (out_dir / "checkpoints").iterdir())
    assert saved == ["0", "2"]  # every --save-every steps, and the last step


@pytest.mark.slow
@pytest.mark.xdist_group("gpt_first_run")
def test_train_gpt_resumes_under_another_schedule_and_stages(first_run):
    # 1f1b on 4 stages x 2 data replicas reads the zbv checkpoint of 2 stages: it holds the
    # blocks in logical stage order. The learning-rate schedule stays the first run's (3
    # steps: after it, the final rate, 0.1 x 3e-3), though --steps now says 5.
    _, out_dir = first_run
    flags = [*SMALL_GPT, "--stages", "4", "--microbatches", "2", "--out", str(out_dir)]
    out = run("train_gpt.py", *flags, "--steps", "5", "--resume")
    assert "schedule: 1f1b S=4 M=2 v=1" in out
    assert "resumed from step 2 of a 3-step learning-rate schedule" in out
    lines = LINE.findall(out)
    assert [int(step) for step, *_ in lines] == [3, 4]
    assert [lr for *_, lr, _, _ in lines] == ["3.00e-04", "3.00e-04"]
    assert "4" in [p.name for p in (out_dir / "checkpoints").iterdir()]


@pytest.mark.slow
@pytest.mark.xdist_group("gpt_first_run")
def test_train_gpt_refuses_a_checkpoint_of_another_stage_count_in_one_line(first_run):
    _, out_dir = first_run
    flags = [*SMALL_GPT, "--microbatches", "2", "--out", str(out_dir), "--resume"]
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_gpt.py"), *flags, "--steps", "9"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"--resume: checkpoint '.*' step \d holds 4 logical stages \(schedule '\w+', S=\d, "
        r"v=\d\), but the target's placed trees have 2 \(schedule '1f1b', S=2, v=1\); use a "
        r"schedule and S with S\*v = 4, or, if every stage is a stack of identical blocks on "
        r"axis 1 \(\[N, B, \.\.\.\]\), pass recut=True to regroup the blocks",
        last,
    ), last


@pytest.mark.slow
def test_train_gpt_without_matplotlib_names_the_extra(tmp_path):
    # matplotlib hidden: `import matplotlib` fails as if it were not installed.
    script = (
        "import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    flags = [*SMALL_GPT, "--microbatches", "2", "--steps", "1", "--out", str(tmp_path / "run")]
    result = subprocess.run(
        [sys.executable, "-c", script, str(EXAMPLES / "train_gpt.py"), *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    hint = "needs matplotlib, which is not installed: pip install 'jaxpipe[viz]'"
    assert f"timeline: not drawn, jaxpipe.viz.draw {hint}" in result.stdout
    assert LINE.search(result.stdout) and (tmp_path / "run" / "checkpoints" / "0").is_dir()


def test_viz_without_matplotlib_names_the_extra(monkeypatch):
    from jaxpipe import schedules, viz

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match=r"needs matplotlib.*pip install 'jaxpipe\[viz\]'"):
        viz.draw(schedules.get("1f1b", 2, 2))


@pytest.mark.slow
def test_train_gpt_on_a_text_file(tmp_path):
    text = tmp_path / "tiny.txt"
    text.write_text("to be or not to be, that is the question.\n" * 40)
    out = run(
        "train_gpt.py", *SMALL_GPT, "--data", "1", "--text", str(text), "--block-size", "16",
        "--steps", "2",
    )  # fmt: skip
    assert "data: " in out and "vocabulary 16" in out
    lines = LINE.findall(out)
    assert len(lines) == 2
    assert all(float(loss) > 0 and 0 <= float(acc) <= 1 for _, _, loss, acc, *_ in lines)
    assert re.search(r"final: loss \d+\.\d+ accuracy \d\.\d+", out)


needs_tpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="plans for a TPU (libtpu)"
)


@pytest.mark.slow
@needs_tpu
def test_train_gpt_plans_by_default_keeps_the_stages_given_and_prints_the_runner_up():
    """No --schedule: jaxpipe.plan chooses for a TPU of as many chips as host devices, with
    --stages 2 kept; the chosen plan and the runner-up are printed, then it trains."""
    small = [f for f in SMALL_GPT if f not in ("--schedule", "1f1b")]
    out = run("train_gpt.py", *small, "--steps", "2")
    assert "schedule auto: the plan for v5p:2x2x2 (jaxpipe.plan), and the runner-up:" in out
    chosen = re.search(r"^  0 .*pipe (\d+) x data (\d+) .*: (\w+)( packed)?, M (\d+)", out, re.M)
    assert chosen and chosen.group(1) == "2", out
    assert re.search(r"^  1 ", out, re.M)
    pipe, data, name, _, micro = chosen.groups()
    assert f"mesh: {{'pipe': {pipe}, 'data': {data}}}" in out
    assert f"schedule: {name} S={pipe} M={micro}" in out
    assert len(LINE.findall(out)) == 2


def test_train_gpt_auto_refuses_costs_it_would_choose():
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_gpt.py"), "--schedule", "auto", "--costs", "1:2:1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode != 0 and "--schedule auto chooses the table" in result.stderr


def test_train_gpt_rejects_resume_without_out():
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_gpt.py"), "--resume"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "--resume needs --out" in result.stderr
