"""The executor: one `Plan` compiled into one ``shard_map`` over the pipe axis and one
``lax.scan`` over its ticks.

In every tick each device reads its row of the plan, runs at most one forward and one
backward action of its own stages (``lax.switch`` on the action), and then every device takes
part in the same ``ppermute`` calls: activations move toward the next stage, input
gradients toward the previous one. Stage parameters stay where the layout put them
(`jaxpipe.layout`): only activations and their gradients cross devices inside a step.

Backward actions differentiate one stage explicitly with ``jax.vjp``; the forward keeps only
the residuals that depend on its input (`jaxpipe._jaxpr.residuals`), in buffers whose
sizes come from the plan, so activation memory is bounded by the schedule, not by the
number of micro-batches.

Modules, one job each: `steps` (the entry points and their result types), `program` (what
to run), `plan` (a schedule's tables), `local` (one device's view), `state` (the carry),
`activations` (pytree buffers), `actions` (one function per action kind), `versions` (the
optimizer step and weight versions), `tick`, `trace` (what ran, per tick), `loop` (the
``shard_map`` and ``scan``), `sharding` (weights split over batch axes). This package is the
only code that issues collectives.
"""

from jaxpipe._executor import steps
from jaxpipe._executor.program import Context, Program

__all__ = ["Context", "Program", "steps"]
