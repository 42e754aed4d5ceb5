"""Pipeline schedules as data: generators, the `Schedule` table, validation and analysis.

This package imports no JAX. ``get(name, num_stages=S, num_microbatches=M, **options)``
returns a validated `Schedule`; ``names()`` lists every name.
"""

from jaxpipe.schedules import basic, pipedream, zero_bubble  # noqa: F401  (register generators)
from jaxpipe.schedules.core import (
    BW,
    Action,
    B,
    F,
    Schedule,
    U,
    W,
    add_updates,
    pack,
    stamp_versions,
    update_points,
    validate,
)
from jaxpipe.schedules.io import from_csv, from_csv_text, to_chrome_trace, to_csv
from jaxpipe.schedules.registry import get, names, register
from jaxpipe.schedules.simulate import BubbleReport, Costs, Timeline, bubble_fraction, simulate

__all__ = [
    "Action",
    "B",
    "BW",
    "F",
    "Schedule",
    "U",
    "W",
    "add_updates",
    "get",
    "names",
    "pack",
    "register",
    "validate",
    "BubbleReport",
    "Costs",
    "Timeline",
    "bubble_fraction",
    "from_csv",
    "from_csv_text",
    "simulate",
    "stamp_versions",
    "update_points",
    "to_chrome_trace",
    "to_csv",
]
