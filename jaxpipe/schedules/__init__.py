"""Pipeline schedules as data: generators, the `Schedule` table, validation and analysis.

This package imports no JAX. ``get(name, num_stages=S, num_microbatches=M, **options)``
returns a validated `Schedule`; ``names()`` lists every name.
"""

from jaxpipe.schedules import basic, pipedream, zero_bubble  # noqa: F401  (register generators)
from jaxpipe.schedules.core import BW, Action, B, F, Schedule, W, pack, validate
from jaxpipe.schedules.registry import get, names, register

__all__ = [
    "Action",
    "B",
    "BW",
    "F",
    "Schedule",
    "W",
    "get",
    "names",
    "pack",
    "register",
    "validate",
]
