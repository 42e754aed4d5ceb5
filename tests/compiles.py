"""Which training steps a program compiled more than once, from ``JAX_LOG_COMPILES``.

A jitted step compiles again when its arguments come placed differently from the last call:
arrays made outside the step on one device come back from it on the mesh. Tests of the docs
and examples run them with ``LOG`` in the environment and assert ``step_recompiles(stderr)``
is empty.
"""

import re

LOG = {"JAX_LOG_COMPILES": "1"}
COMPILING = re.compile(
    r"Compiling jit\((\w*step\w*)\) with global shapes and types (.*?)\. Argument"
)


def step_recompiles(log: str) -> list[str]:
    """Names of ``*step*`` functions that the log shows compiled twice for the same shapes:
    the second compile came from arguments placed differently."""
    seen, again = set(), []
    for name, shapes in COMPILING.findall(log):
        if (name, shapes) in seen:
            again.append(name)
        seen.add((name, shapes))
    return again
