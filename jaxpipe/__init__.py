"""jaxpipe: pipeline parallelism for JAX, any schedule compiled into one XLA program.

```python
import jaxpipe
pipe = jaxpipe.Pipeline(stage_fn, loss_fn, mesh=mesh, schedule="1f1b", num_microbatches=8)
```

``jaxpipe.Pipeline`` is the entry point (`jaxpipe.pipeline`); ``jaxpipe.schedules`` builds,
validates and simulates schedule tables; ``jaxpipe.stages`` turns Flax modules into stages;
``jaxpipe.partition`` balances layers over stages; ``jaxpipe.reference`` is the same model
without a pipeline; ``jaxpipe.checkpoint`` (needs orbax), ``jaxpipe.costs``,
``jaxpipe.viz`` (needs matplotlib) and ``jaxpipe.distributed`` load on first use.
"""

import importlib

from jaxpipe import layout, partition, reference, schedules, stages
from jaxpipe.layout import Layout
from jaxpipe.pipeline import Pipeline

__version__ = "0.1.0"
__all__ = [
    "Layout",
    "Pipeline",
    "checkpoint",
    "costs",
    "distributed",
    "layout",
    "partition",
    "reference",
    "schedules",
    "stages",
    "viz",
]
_LAZY = ("checkpoint", "costs", "distributed", "viz")


def __getattr__(name):
    if name in _LAZY:
        return importlib.import_module(f"jaxpipe.{name}")
    raise AttributeError(f"module 'jaxpipe' has no attribute {name!r}")
