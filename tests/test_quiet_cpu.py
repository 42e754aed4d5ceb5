"""With the compile-only extras installed (libtpu, jax's CUDA plugin), an ordinary CPU run
under the switch docs/compile_only.md gives (``JAX_PLATFORMS=cpu``) prints no CUDA or TPU
traceback or warning."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

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
