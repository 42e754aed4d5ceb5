"""With the compile-only extras installed (libtpu, jax's CUDA plugin), an ordinary CPU run
under the switch docs/compile_only.md gives (``JAX_PLATFORMS=cpu``) prints no CUDA or TPU
traceback or warning; and jaxpipe, importing jax first on a machine without a GPU, drops the
CUDA plugin's "Could not find cuda drivers" lines, which no setting silences."""

import glob
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

from jaxpipe import _quiet

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOISE = (
    "Traceback",
    "Unable to load CUDA",
    "plugin configuration error",
    "TPU_ACCELERATOR_TYPE",
    "TPU_WORKER_HOSTNAMES",
    "host bounds",
)
JOB = """
import jax, jax.numpy as jnp
import jaxpipe
mesh = jax.make_mesh((2,), ("pipe",), axis_types=(jax.sharding.AxisType.Auto,),
                     devices=jax.devices()[:2])
pipe = jaxpipe.Pipeline(lambda p, x: x + jnp.tanh(x @ p), lambda _, y, t: jnp.mean((y - t) ** 2),
                        mesh=mesh, schedule="1f1b", num_microbatches=2)
params = pipe.place(0.1 * jnp.ones((2, 3, 3)))
print(float(jax.jit(jax.grad(pipe.loss))(params, None, jnp.ones((4, 3)), jnp.zeros((4, 3))).sum()))
"""


def _run(code, **env):
    """``code`` in a fresh interpreter with none of the jax, TPU or CUDA settings of this
    one (the tests' own switch included), and ``env``."""
    prefixes = ("JAX_", "TPU_", "CUDA_", "ALLOW_MULTIPLE_LIBTPU", "XLA_")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    clean["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    clean["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    return subprocess.run(
        [sys.executable, "-c", code], env=clean | env, capture_output=True, text=True, timeout=600
    )


def _noise(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if any(n in line for n in NOISE)]


def test_a_cpu_run_under_the_documented_switch_prints_no_cuda_or_tpu_traceback():
    job = _run(JOB, JAX_PLATFORMS="cpu")
    assert job.returncode == 0, job.stderr
    assert float(job.stdout.split()[-1]) != 0.0
    assert _noise(job.stderr) == [], job.stderr
    installed = importlib.util.find_spec("libtpu") or importlib.util.find_spec("jax_plugins")
    if installed:  # without the switch the extras do print: what the switch is for
        assert _noise(_run("import jax; jax.devices()").stderr)
    else:
        pytest.skip("neither libtpu nor jax's CUDA plugin is installed: nothing to silence")


def test_jaxpipe_imports_jax_without_the_cuda_driver_lines():
    """On a machine without a GPU, jax's CUDA plugin logs "Could not find cuda drivers"
    when jax is imported, whatever the settings; jaxpipe, importing jax first, drops those
    lines (they printed at the first use of ``jaxpipe.Pipeline``) and keeps the others."""
    if importlib.util.find_spec("jax_cuda12_plugin") is None or glob.glob("/dev/nvidia[0-9]*"):
        pytest.skip("needs jax's CUDA plugin on a machine without a GPU")
    noise = "Could not find cuda drivers"
    if noise not in _run("import jax").stderr:  # jax 0.12's plugin prints none
        pytest.skip("this jax's CUDA plugin prints no driver lines at import: nothing to drop")
    job = _run("import sys, jaxpipe; print('jax' in sys.modules); jaxpipe.Pipeline")
    assert job.returncode == 0, job.stderr
    assert job.stdout.split() == ["False"]  # import jaxpipe alone imports no jax
    assert noise not in job.stderr and "absl::InitializeLog" not in job.stderr, job.stderr


def test_only_the_driver_lines_are_dropped():
    header = "WARNING: All log messages before absl::InitializeLog() is called are written\n"
    driver = "I0000 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU ...\n"
    other = "W0000 other.cc:1] something else\n"
    text = header + driver + header + other + "a warning\n" + driver
    assert _quiet._without_noise(text) == header + other + "a warning\n"
