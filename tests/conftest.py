"""Gives every test 8 CPU host devices; the flags must be set before jax is imported.

CI machines have 2 cores for 8 device threads (times two pytest workers, plus subprocesses
in some tests), so a collective can wait on a starved thread for a long time: XLA CPU's
default of aborting a collective after 40 s turns that slowness into a crash. The tests
raise the limit to 10 minutes; a real deadlock still ends, later.

The tests check values, compiled HLO and XLA's buffer assignment, never speed, so LLVM
does not optimise the code it generates (``--xla_backend_optimization_level=0``): CPU
compiles take about a third less time, and the HLO and the CPU, TPU and GPU compilers'
``memory_analysis()`` are the same as at the default level (checked on
tests/test_fsdp_tensor.py's steps).
"""

import os

import pytest

PATIENT_COLLECTIVES = (
    " --xla_cpu_collective_timeout_seconds=600"
    " --xla_cpu_collective_call_terminate_timeout_seconds=600"
)

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
    + PATIENT_COLLECTIVES
    + " --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests run on the CPU; with jax's CUDA plugin installed (for the H100 compile-only
# targets), its start-up must not look for CUDA libraries or a GPU, whichever test runs
# first (jaxpipe.target sets the same when it is the first to start jax).
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Keeps ``--dist loadgroup`` (pyproject.toml) sending the tests of one ``xdist_group``
    to one worker, which then builds what they share once (a module fixture, a cached
    compile). A pytest-xdist worker marks a grouped test by renaming it ``<node id>@<group>``
    through the item's ``_nodeid``; from pytest 9.2 a node id is read from ``_id`` instead,
    the rename is lost, and the group's tests spread over the workers. Where the suffix is
    missing, this renames the test as the node id is read."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        groups = {
            str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
            for mark in item.iter_markers("xdist_group")
        }
        if groups and "@" not in item.nodeid and hasattr(item, "_id"):
            item._id = type(item._id).parse(f"{item.nodeid}@{'_'.join(sorted(groups))}")
