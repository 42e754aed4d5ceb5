"""Smoke tests: every example runs a few steps as a user would start it, in a subprocess."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TIMEOUT = 300  # seconds; a run here takes 10-40 s on two busy cores
LINE = re.compile(r"step\s+(\d+) \| loss (\d+\.\d+) \| accuracy (\d\.\d+) \| ([\d,]+) tokens/s")
# A small GPT so that compiling stays quick: 2 stages, 2 blocks, width 32.
SMALL_GPT = ["--stages", "2", "--layers", "4", "--width", "32", "--batch", "16", "--log-every", "1"]


def run(script, *flags):
    """Runs ``examples/script`` with ``flags``; returns its stdout (fails on a non-zero exit)."""
    env = dict(os.environ)  # conftest has set 8 host devices and JAX_PLATFORMS=cpu
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, f"{script} {' '.join(flags)} failed:\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.mark.parametrize("schedule", ["zbv"])
def test_mlp_pipeline(schedule):
    out = run("mlp_pipeline.py", "--schedule", schedule, "--steps", "3")
    assert out.startswith("platform: cpu")
    losses = [float(x) for x in re.findall(rf"\| {schedule} \| loss (\d+\.\d+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_mlp_pipeline_is_small():
    assert len((EXAMPLES / "mlp_pipeline.py").read_text().splitlines()) < 80


def test_train_gpt_checkpoint_and_resume(tmp_path):
    out_dir = str(tmp_path / "run")
    flags = [*SMALL_GPT, "--schedule", "interleaved_1f1b", "--microbatches", "2"]
    first = run("train_gpt.py", *flags, "--steps", "3", "--save-every", "2", "--out", out_dir)
    assert "platform: cpu, 8 devices" in first
    assert "mesh: {'pipe': 2, 'data': 2}" in first
    assert "schedule: interleaved_1f1b S=2 M=2 v=2" in first
    steps = [int(m.group(1)) for m in LINE.finditer(first)]
    assert steps == [0, 1, 2]
    assert (tmp_path / "run" / "schedule.png").read_bytes()[:4] == b"\x89PNG"
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert saved == ["0", "2"]  # every --save-every steps, and the last step

    second = run("train_gpt.py", *flags, "--steps", "5", "--out", out_dir, "--resume")
    assert "resumed from step 2" in second
    steps = [int(m.group(1)) for m in LINE.finditer(second)]
    assert steps == [3, 4]
    assert "4" in [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()]


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
    assert all(float(loss) > 0 and 0 <= float(acc) <= 1 for _, loss, acc, _ in lines)
    assert re.search(r"final: loss \d+\.\d+ accuracy \d\.\d+", out)


def test_train_gpt_rejects_resume_without_out():
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_gpt.py"), "--resume"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "--resume needs --out" in result.stderr
