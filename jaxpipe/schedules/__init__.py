"""Pipeline schedules as data: generators, the `Schedule` table, and free functions over it.

This package imports no JAX. ``get(name, num_stages=S, num_microbatches=M, **options)``
returns a validated `Schedule`; ``names()`` lists every name. Its modules, each with one
job, import the table and never the other way round:

- `actions`: the action kinds (F, B, W, BW, U) and `Action`; `core`: the `Schedule` table.
- `validation` (`validate`), `versions` (`update_points`, `stamp_versions`,
  `add_updates`, `weight_versions`), `packing` (`pack`), `display` (text grids).
- `simulate` (`simulate`, `bubble_fraction`, `Costs`), `fitting` (`fit`: a table packed
  for given costs; `describe_fit`), `io` (`to_csv`, `from_csv`,
  `to_chrome_trace`).
- `registry` (`get`, `names`, `register`) and the generators: `basic`, `zero_bubble`,
  `pipedream`.
"""

from jaxpipe.schedules import basic, pipedream, zero_bubble  # noqa: F401  (register generators)
from jaxpipe.schedules.actions import BW, Action, B, F, U, W
from jaxpipe.schedules.core import Schedule
from jaxpipe.schedules.fitting import describe_costs, describe_fit, fit
from jaxpipe.schedules.io import from_csv, from_csv_text, to_chrome_trace, to_csv
from jaxpipe.schedules.packing import pack
from jaxpipe.schedules.registry import get, names, register
from jaxpipe.schedules.simulate import BubbleReport, Costs, Timeline, bubble_fraction, simulate
from jaxpipe.schedules.validation import validate
from jaxpipe.schedules.versions import add_updates, stamp_versions, update_points, weight_versions

__all__ = [
    "Action",
    "B",
    "BW",
    "F",
    "Schedule",
    "U",
    "W",
    "add_updates",
    "describe_costs",
    "describe_fit",
    "fit",
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
    "weight_versions",
    "to_chrome_trace",
    "to_csv",
]
