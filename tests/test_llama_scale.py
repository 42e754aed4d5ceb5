"""Llama-3 8B at its published shapes (32 blocks, width 4096, 8192 tokens per row, vocabulary
128256) compiled ahead of time for 8 H100s by ``examples/train_llama.py --model --target
h100x8`` (``--remat dots --sequence-parallel``, as docs/llama3_70b.md quotes it).

What docs/llama3_70b.md claims of such a step, checked on the CUDA compiler's own program:
it fits the chip; between stages only activations and their gradients travel (collective-
permutes, no weight crosses the pipe axis), each device sending its ``tensor`` share of
them, and what is summed over ``pipe`` is at most the pipeline's input gradient (the
embedding's backward) and scalars. The TPU compiler's 8B programs are checked the same way
by tests/test_memory_prediction.py, which compiles them (in process) for its own checks;
the examples' ``--target v5p:...`` path is tests/test_target.py's.
"""

import importlib.util
import json
import pathlib
import subprocess
import sys

import figures
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_llama.py"

pytestmark = pytest.mark.slow


def _has_cuda_plugin():
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:
        return False


MICROBATCHES, BATCH, SEQ, WIDTH, TENSOR = 8, 16, 8192, 4096, 2
FLAGS = ["--model", "llama3-8b", "--attention", "xla", "--stages", "2", "--data", "2",
         "--tensor", str(TENSOR), "--microbatches", str(MICROBATCHES), "--batch",
         str(BATCH)]  # fmt: skip
# Without --sequence-parallel the CUDA compiler keeps and sends whole activations on every
# tensor device.
TARGET = ["--target", "h100x8", "--schedule", "1f1b", "--remat", "dots", "--sequence-parallel"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """``(stdout, the --json file)`` of the 8B step compiled for 8 H100s."""
    if not _has_cuda_plugin():
        pytest.skip("needs jax-cuda12-plugin")
    path = tmp_path_factory.mktemp("scale") / "report.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *FLAGS, *TARGET, "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout, json.loads(path.read_text())


def test_llama3_8b_compiles_fits_and_sends_only_activations_over_pipe(compiled):
    """One test per compile (a parallel run compiles it once): the published shapes, the
    fit, what crosses the pipe axis, and the figures docs/llama3_70b.md quotes of it."""
    has_the_published_shapes(*compiled)
    fits_the_chip(*compiled)
    only_activations_cross_the_pipe_axis(*compiled)
    is_what_the_docs_quote(*compiled)


def is_what_the_docs_quote(out, data):
    """Within 5%, on the jax whose compilers the page quotes."""
    if figures.compiler_missing("8b-h100-1f1b"):
        return
    problems = figures.drift("8b-h100-1f1b", {"returncode": 0, "stdout": out, **data})
    assert not problems, figures.message(problems)


def has_the_published_shapes(out, data):
    run = data["run"]
    assert (run["layers"], run["width"], run["hidden"]) == (32, WIDTH, 14336)
    assert (run["heads"], run["kv_heads"], run["vocab"], run["seq"]) == (32, 8, 128256, SEQ)
    assert run["compute"] == "bfloat16"
    assert 8.0e9 <= run["parameters"] <= 8.1e9  # Llama-3 8B: 8.03 billion
    assert "mesh: {'pipe': 2, 'data': 2, 'tensor': 2}" in out


def fits_the_chip(_, data):
    report = data["report"]
    assert report["fits"] is True and report["headroom_bytes"] > 0
    assert report["needed_bytes"] == report["peak_bytes"]  # the compiler's own peak


def only_activations_cross_the_pipe_axis(_, data):
    """Over pipe: collective-permutes in the tick loop, each of one micro-batch's activation
    or gradient split over tensor; per step, sums no larger than all micro-batches' input
    gradients."""
    over_pipe = [c for c in data["report"]["collectives"] if "pipe" in c["axes"]]
    assert over_pipe
    # 1 row per micro-batch and replica, over data 2: one micro-batch on one device.
    activation = BATCH // MICROBATCHES // 2 * SEQ * WIDTH * 2  # bf16
    inputs = MICROBATCHES * activation
    for c in over_pipe:
        assert c["kind"] != "all-gather", c  # no stage's weights are gathered over pipe
        if c["in_loop"]:
            assert c["kind"] == "collective-permute", c
            assert c["bytes"] <= c["count"] * activation // TENSOR, c
        else:
            assert c["kind"] in ("all-reduce", "collective-permute"), c
            assert c["bytes"] <= c["count"] * inputs, c
