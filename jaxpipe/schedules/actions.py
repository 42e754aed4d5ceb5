"""The words of a schedule table: the action kinds, `Action`, and what an action waits for.

- **F**: the forward of one stage on one micro-batch.
- **BW**: the full backward of one stage on one micro-batch (input and weight gradients).
- **B**: the input-gradient half of a split backward (the zero-bubble family's "B").
- **W**: the weight-gradient half of a split backward; it needs the B of the same stage and
  micro-batch first.
- **U**: an optimizer update of one stage's weights, at the end of its tick (asynchronous
  schedules such as PipeDream). It averages the weight gradients (from BW or W) of that stage
  made since the stage's previous U, in this tick included, and makes the stage's next
  weight version. A table without U's updates nowhere inside the pipeline: its gradients are
  summed over the step and returned (synchronous training). U is not a compute action:
  `Schedule.actions` and `Schedule.timed_actions` leave it out unless asked.
- **stage**: a logical pipeline stage, ``0 .. num_logical_stages - 1``, applied in order.
  With ``v`` stages per device (interleaved, circular, V placements) there are ``S * v``.
- **device**: a position on the pipe mesh axis, ``0 .. num_stages - 1`` (``S`` of them).
- **tick**: one lock-step slot. Every device advances one tick together, as in one SPMD
  program; what a device produces in tick ``t`` reaches its consumer for tick ``t + 1``.

Nothing in this package imports JAX.
"""

from __future__ import annotations

from typing import NamedTuple

F, B, W, BW, U = "F", "B", "W", "BW", "U"
COMPUTE_OPS = (F, B, W, BW)
OPS = COMPUTE_OPS + (U,)
BACKWARD_OPS = (B, BW, W)
WEIGHT_GRADIENT_OPS = (BW, W)  # the actions that finish a stage's weight gradient
ANY_BACKWARD = "B|BW"  # a dependency met by either the B or the BW of a (stage, micro-batch)


class Action(NamedTuple):
    """One unit of work: ``op`` of logical ``stage`` on ``microbatch``.

    ``version`` is the weight version of ``stage`` the action reads: for F, the number of U's
    of its stage in earlier ticks; for B, W and BW, the version their F read (weight
    stashing); 0 throughout in a table without U's. A ``U`` action has ``microbatch`` 0 and
    ``version`` the version it updates (its index among the stage's U's); it makes
    ``version + 1``.
    """

    op: str
    stage: int
    microbatch: int
    version: int = 0


Cell = tuple[Action, ...]


def as_cell(item) -> Cell:
    """A cell from ``None`` (idle), one `Action`, or an iterable of actions."""
    if item is None:
        return ()
    if isinstance(item, Action):
        return (item,)
    return tuple(item)


def dependencies(action: Action, num_logical_stages: int) -> list[tuple]:
    """What must have run, in an earlier tick, before ``action`` can run.

    Args:
      action: a compute action or a ``U``.
      num_logical_stages: ``S * v``, the number of stages of the table.

    Returns:
      A list of ``(op, stage, microbatch)``; ``op`` is `ANY_BACKWARD` where either the B or
      the BW of that stage and micro-batch will do. Empty for a ``U``, and for the forward of
      stage 0.
    """
    if action.op == U:
        return []
    if action.op == F:
        return [(F, action.stage - 1, action.microbatch)] if action.stage > 0 else []
    if action.op == W:
        return [(B, action.stage, action.microbatch)]
    deps: list[tuple] = [(F, action.stage, action.microbatch)]
    if action.stage < num_logical_stages - 1:
        deps.append((ANY_BACKWARD, action.stage + 1, action.microbatch))
    return deps


def met_by(dependency: tuple) -> list[tuple]:
    """The ``(op, stage, microbatch)`` keys of which one having run meets ``dependency``."""
    if dependency[0] == ANY_BACKWARD:
        return [(B,) + dependency[1:], (BW,) + dependency[1:]]
    return [dependency]
