"""jaxpipe: pipeline parallelism for JAX, any schedule compiled into one XLA program.

```python
import jaxpipe
pipe = jaxpipe.Pipeline(stage_fn, loss_fn, mesh=mesh, schedule="1f1b", num_microbatches=8)
```

``jaxpipe.Pipeline`` is the entry point (`jaxpipe.pipeline`); ``jaxpipe.schedules`` builds,
validates and simulates schedule tables; ``jaxpipe.stages`` turns Flax modules into stages;
``jaxpipe.partition`` balances layers over stages; ``jaxpipe.reference`` is the same model
without a pipeline; ``jaxpipe.checkpoint`` (needs orbax), ``jaxpipe.costs``,
``jaxpipe.viz`` (needs matplotlib), ``jaxpipe.distributed``, ``jaxpipe.target`` (compile
for a TPU topology ahead of time, on any machine) and ``jaxpipe.memory`` (memory per device
of a training step, predicted from shapes before compiling); every name loads on first
use, so the schedule tools work without jax.
"""

import importlib

__version__ = "0.1.0"
__all__ = [
    "Layout",
    "Pipeline",
    "checkpoint",
    "costs",
    "distributed",
    "layout",
    "memory",
    "partition",
    "reference",
    "schedules",
    "stages",
    "target",
    "viz",
]
_MODULES = ("checkpoint", "costs", "distributed", "layout", "memory", "partition")
_MODULES += ("reference",)
_MODULES += ("schedules", "stages", "target", "viz")
_CLASSES = {"Layout": "jaxpipe.layout", "Pipeline": "jaxpipe.pipeline"}


def __getattr__(name):
    """Loads submodules on first use, so ``import jaxpipe.schedules`` never imports jax."""
    if name in _MODULES:
        return importlib.import_module(f"jaxpipe.{name}")
    if name in _CLASSES:
        return getattr(importlib.import_module(_CLASSES[name]), name)
    raise AttributeError(f"module 'jaxpipe' has no attribute {name!r}")
