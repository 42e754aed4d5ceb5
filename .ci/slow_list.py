"""A pytest plugin for CI's newest-JAX run (``-p slow_list``, with ``.ci`` on the path): the
fast loop and a list of slow tests in one session, so that its two workers start once and
the fast tests fill in behind the slow ones.

``SLOW_LIST`` (space-separated) names the slow tests that run: files, or node ids and their
prefixes (``tests/test_moe.py::test_paired_ticks``). A slow test under none of them is
deselected; every test not marked slow runs. The files of the list run first, in its order
(the longest tests first: pytest-xdist hands tests out in the order collected, and a
minute-long compile handed out last runs on one worker while the other waits); the other
files follow in the order collected. A file's tests stay together, so a module fixture is
built once per worker.
"""

import os

import pytest


def pytest_collection_modifyitems(config, items):
    listed = os.environ.get("SLOW_LIST", "").split()
    if not listed:
        raise pytest.UsageError("-p slow_list needs SLOW_LIST: the slow tests to run")
    files = [entry.split("::")[0] for entry in listed]
    keep, drop = [], []
    for item in items:
        slow = item.get_closest_marker("slow") is not None
        if not slow or any(_under(item.nodeid, entry) for entry in listed):
            keep.append(item)
        else:
            drop.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)

    def place(item):
        path = item.nodeid.split("::")[0]
        return files.index(path) if path in files else len(files)

    items[:] = sorted(keep, key=place)  # stable: the order collected within each file


def _under(nodeid, entry):
    """Whether the test ``nodeid`` is ``entry``, one of its parametrized cases, or in it."""
    return nodeid == entry or any(nodeid.startswith(entry + c) for c in ("::", "[", "@"))
