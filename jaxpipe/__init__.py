"""jaxpipe: pipeline parallelism for JAX, any schedule compiled into one XLA program.

```python
import jaxpipe
pipe = jaxpipe.Pipeline(stage_fn, loss_fn, mesh=mesh, schedule="1f1b", num_microbatches=8)
```

The public API is what ``jaxpipe.__all__`` names:

- `Pipeline` (module ``jaxpipe.pipeline``), `Placed` and `Layout` (``jaxpipe.layout``),
  `split_microbatches`, `SplitFallbackWarning`: the training-step façade.
- `plan` and `Plan` (module ``jaxpipe.planner``): the fastest mesh, schedule, table,
  micro-batches, remat and FSDP gathering that fit a target, ranked by the step-time model
  and checked on the compiled step.
- ``jaxpipe.schedules``: schedule tables, their generators, validation and simulation.
- ``jaxpipe.stages`` (Flax modules as stages), ``jaxpipe.partition`` (layers to stages),
  ``jaxpipe.reference`` (the same model without a pipeline), ``jaxpipe.replay`` (a table
  replayed on one device), ``jaxpipe.checkpoint`` (needs orbax), ``jaxpipe.distributed``,
  ``jaxpipe.viz`` (needs matplotlib), ``jaxpipe.moe`` (a mixture-of-experts layer with
  expert parallelism, needs flax).
- ``jaxpipe.costs``, ``jaxpipe.memory``, ``jaxpipe.target``, ``jaxpipe.calibration`` and
  ``jaxpipe.kernels``: the analysis modules of ``jaxpipe.analysis`` (per-action costs, memory
  predicted from shapes, compiling for a TPU or GPU ahead of time, the step-time correction
  fitted on published runs, the time of fused attention kernels no compiler estimates).

Modules and packages whose names start with an underscore are internal and may change in
any release. Every name loads on first use, so the schedule tools work without jax.
"""

import importlib

from jaxpipe import _quiet

__version__ = "0.1.0"

_MODULES = {
    "analysis": "jaxpipe.analysis",
    "calibration": "jaxpipe.analysis.calibration",
    "checkpoint": "jaxpipe.checkpoint",
    "costs": "jaxpipe.analysis.costs",
    "distributed": "jaxpipe.distributed",
    "kernels": "jaxpipe.analysis.kernels",
    "layout": "jaxpipe.layout",
    "memory": "jaxpipe.analysis.memory",
    "moe": "jaxpipe.moe",
    "partition": "jaxpipe.partition",
    "pipeline": "jaxpipe.pipeline",
    "planner": "jaxpipe.planner",
    "reference": "jaxpipe.reference",
    "replay": "jaxpipe.replay",
    "schedules": "jaxpipe.schedules",
    "stages": "jaxpipe.stages",
    "target": "jaxpipe.analysis.target",
    "viz": "jaxpipe.viz",
}
_NAMES = {
    "Layout": "jaxpipe.layout",
    "Pipeline": "jaxpipe.pipeline",
    "Placed": "jaxpipe.layout",
    "Plan": "jaxpipe.planner",
    "plan": "jaxpipe.planner",
    "SplitFallbackWarning": "jaxpipe._jaxpr.split",
    "split_microbatches": "jaxpipe.pipeline",
}
__all__ = sorted([*_NAMES, *_MODULES])


def __getattr__(name):
    """Loads a public module or name on first use (``jaxpipe.schedules`` imports no jax)."""
    if name in (*_MODULES, *_NAMES) and name != "schedules":
        _quiet.import_jax()  # without the CUDA plugin's lines on a machine without a GPU
    if name in _MODULES:
        module = importlib.import_module(_MODULES[name])
    elif name in _NAMES:
        module = getattr(importlib.import_module(_NAMES[name]), name)
    else:
        raise AttributeError(
            f"module 'jaxpipe' has no attribute {name!r}; its public names are {__all__}"
        )
    globals()[name] = module
    return module


def __dir__():
    return sorted([*__all__, "__version__"])
