"""Two processes on loopback, each with 2 CPU host devices and gloo collectives, run one
pipeline as one 4-device mesh: the same losses as one process with 4 devices. A process that
dies makes its peer exit with an error within the heartbeat timeout instead of hanging."""

import json
import os
import socket
import subprocess
import sys
import time

import multihost_worker as worker
import numpy as np
import pytest
from conftest import PATIENT_COLLECTIVES

HERE = os.path.dirname(os.path.abspath(__file__))
NUM_PROCESSES = 2
TIMEOUT_S = 180  # a whole multi-process run, start-up and compilation included


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(mode, tmp_path, *flags):
    """Starts the worker processes; returns ``[(process, log_path, out_path)]``."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2" + PATIENT_COLLECTIVES
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    port = _free_port()
    procs = []
    for i in range(NUM_PROCESSES):
        log = tmp_path / f"{mode}{i}.log"
        out = tmp_path / f"{mode}{i}.json"
        command = [
            sys.executable,
            os.path.join(HERE, "multihost_worker.py"),
            mode,
            f"--process-id={i}",
            f"--num-processes={NUM_PROCESSES}",
            f"--port={port}",
            f"--out={out}",
            *flags,
        ]
        with open(log, "w") as f:
            proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=env)
        procs.append((proc, log, out))
    return procs


def _kill(procs):
    for proc, _, _ in procs:
        if proc.poll() is None:
            proc.kill()
    for proc, _, _ in procs:
        proc.wait(timeout=30)


def _logs(procs) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for _, log, _ in procs)


def _wait_all(procs, deadline):
    """Waits for every process until ``deadline``; returns their exit codes."""
    for proc, _, _ in procs:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    return [proc.returncode for proc, _, _ in procs]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(worker.CONFIGS))
def test_two_processes_match_one_process(name, tmp_path):
    deadline = time.monotonic() + TIMEOUT_S
    procs = _launch("train", tmp_path, "--configs", name)
    try:
        # The single-process reference (4 of this process's 8 host devices), computed while
        # the workers start up.
        shape, names, schedule, options = worker.CONFIGS[name]
        _, want = worker.train(worker.make_mesh(shape, names), schedule, options, worker.STEPS)
        codes = _wait_all(procs, deadline)
    except subprocess.TimeoutExpired:
        pytest.fail(f"multi-process run took more than {TIMEOUT_S} s\n{_logs(procs)}")
    finally:
        _kill(procs)
    assert codes == [0] * NUM_PROCESSES, _logs(procs)
    for i, (_, _, out) in enumerate(procs):
        result = json.loads(out.read_text())
        assert result["process"] == i and result["local_devices"] == 2
        assert len(result[name]) == worker.STEPS
        assert len(set(result[name])) == worker.STEPS  # training moves
        np.testing.assert_allclose(result[name], want, rtol=1e-6, err_msg=name)


@pytest.mark.slow
def test_a_dead_peer_makes_the_other_process_fail_instead_of_hang(tmp_path):
    """Process 1 exits abruptly after its first step while process 0 goes on into the next
    step's collectives; the coordination service misses process 1's heartbeats and
    terminates process 0 with an error within `HEARTBEAT_TIMEOUT_S` (plus slack)."""
    deadline = time.monotonic() + TIMEOUT_S
    procs = _launch("die", tmp_path)
    (survivor, _, _), (dying, _, _) = procs
    try:
        assert dying.wait(timeout=max(0.0, deadline - time.monotonic())) == 3, _logs(procs)
        died_at = time.monotonic()
        code = survivor.wait(timeout=max(0.0, deadline - time.monotonic()))
        waited = time.monotonic() - died_at
    except subprocess.TimeoutExpired:
        pytest.fail(f"the surviving process hung for more than {TIMEOUT_S} s\n{_logs(procs)}")
    finally:
        _kill(procs)
    assert code != 0, _logs(procs)
    assert waited < worker.HEARTBEAT_TIMEOUT_S + 45, waited
    log = procs[0][1].read_text()
    assert "step 0 loss" in log
    assert "kept training" not in log
