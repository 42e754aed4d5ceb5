"""A pytest plugin for CI (``-p slow_split``, with ``.ci`` on the path): CI's two sessions,
Python 3.11 with the jax pip resolves there (``oldest``) and the newest jax (``newest``), each
run every test not marked slow; each slow test runs in one of them, so that CI stays near
half an hour on two cores.

Environment:
    SLOW_SESSION: ``oldest`` or ``newest``, the session this is.
    SLOW_ON_OLDEST: the slow tests the oldest session runs, space-separated patterns; a
        pattern is pieces joined by ``+``, every one of which appears in the test's node id
        (``h100x8+per_use_fsdp_temp``). The newest session runs every other slow test.
    SLOW_FIRST: files whose tests are handed out first, in this order (the longest first:
        pytest-xdist hands tests out in the order collected, and a minute-long compile
        handed out last runs on one worker while the other waits); the other files follow
        in the order collected. A file's tests stay together, so a module fixture is built
        once per worker.
"""

import os

import pytest

SESSIONS = ("oldest", "newest")


def pytest_collection_modifyitems(config, items):
    session = os.environ.get("SLOW_SESSION", "")
    if session not in SESSIONS:
        raise pytest.UsageError(
            f"-p slow_split needs SLOW_SESSION, one of {SESSIONS}; got {session!r}"
        )
    patterns = [p.split("+") for p in os.environ.get("SLOW_ON_OLDEST", "").split()]
    first = os.environ.get("SLOW_FIRST", "").split()
    keep, drop = [], []
    for item in items:
        if item.get_closest_marker("slow") is None:
            keep.append(item)
            continue
        on_oldest = any(all(piece in item.nodeid for piece in p) for p in patterns)
        (keep if on_oldest == (session == "oldest") else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)

    def place(item):
        path = item.nodeid.split("::")[0]
        return first.index(path) if path in first else len(first)

    items[:] = sorted(keep, key=place)  # stable: the order collected within each file
