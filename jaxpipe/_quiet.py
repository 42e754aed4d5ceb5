"""jax imported without the start-up lines of its CUDA plugin on a machine without a GPU.

With jax's CUDA plugin installed (it compiles for GPUs ahead of time, `jaxpipe.target`),
``import jax`` loads the plugin's libraries, and on a machine without a GPU each logs
"Could not find cuda drivers on your machine, GPU will not be used." to the process's
standard error, under a line about absl's log. No setting silences them, so when jaxpipe is
the first to import jax on such a machine it imports it with standard error held back, and
writes back every other line.
"""

from __future__ import annotations

import glob
import os
import sys
import tempfile

NOISE = "Could not find cuda drivers on your machine"
HEADER = "WARNING: All log messages before absl::InitializeLog() is called"


def import_jax() -> None:
    """Imports jax, dropping the CUDA plugin's driver lines where the machine has no GPU;
    does nothing once jax is imported."""
    if "jax" in sys.modules:
        return
    try:  # with a GPU, a missing driver is worth seeing
        quiet = sys.stderr is not None and not glob.glob("/dev/nvidia[0-9]*")
        saved = os.dup(2) if quiet else None
    except OSError:  # no standard error to hold back
        saved = None
    if saved is None:
        import jax  # noqa: F401

        return
    sys.stderr.flush()
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            import jax  # noqa: F401
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            sys.stderr.write(_without_noise(held.read().decode(errors="replace")))
            sys.stderr.flush()


def _without_noise(text: str) -> str:
    """``text`` without the driver lines and the absl line announcing each."""
    lines = text.splitlines(keepends=True)
    kept = []
    for i, line in enumerate(lines):
        following = lines[i + 1] if i + 1 < len(lines) else ""
        if NOISE in line or (HEADER in line and NOISE in following):
            continue
        kept.append(line)
    return "".join(kept)
