"""What the executor is asked to run: the `Program` (plan, functions, mode, mesh)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxpipe._executor.plan import Plan
from jaxpipe._executor.sharding import WeightSharding

MODES = ("train", "update", "loss", "forward")


class Context(NamedTuple):
    """What a stage application sees besides its parameters and input.

    ``side``: the micro-batch's side inputs (a pytree, or None); ``key``: its PRNG key,
    ``fold_in(fold_in(key, microbatch), stage)`` (or None; with several data-parallel
    replicas ``key`` is already ``fold_in(key, replica)``); ``stage``: the logical stage
    index (a traced int32); ``microbatch``: the micro-batch index (a traced int32).
    """

    side: Any
    key: Any
    stage: jax.Array
    microbatch: jax.Array


@dataclasses.dataclass(frozen=True)
class Program:
    """Everything the tick loop needs besides the arrays.

    Attributes:
      plan: the schedule's tables (`jaxpipe._executor.plan.make_plan`).
      stage_fn: ``(params_of_one_stage, x, context) -> y``, ``y`` of ``x``'s structure.
      loss_fn: ``(loss_params, y, target, context) -> scalar``, on the last stage.
      mesh, axis: the mesh and its pipe axis.
      mode: ``"train"`` (loss and gradients), ``"update"`` (weights updated inside the
        pipeline, as the plan says), ``"loss"`` (loss only) or ``"forward"`` (outputs).
      remat: keep only stage inputs between forward and backward and recompute.
      input_grad: also return the gradient with respect to the inputs.
      trace: also return what each device ran in each tick (`jaxpipe._executor.run`).
      optimizer: an optax ``GradientTransformation``, for mode ``"update"``.
      data_axes: mesh axes the batch is split over; manual, like the pipe axis.
      weights: which stage-weight dimensions are split over ``data_axes`` (FSDP) and when
        they are gathered (`jaxpipe._executor.sharding`).
      grad_dtype: the dtype gradients accumulate in across micro-batches (None: the
        parameters' own dtype).
    """

    plan: Plan
    stage_fn: Callable
    loss_fn: Callable | None
    mesh: jax.sharding.Mesh
    axis: str
    mode: str
    remat: bool = False
    input_grad: bool = False
    trace: bool = False
    optimizer: Any = None
    data_axes: tuple[str, ...] = ()
    weights: WeightSharding = WeightSharding()
    grad_dtype: Any = jnp.float32

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")

    @property
    def trains(self) -> bool:
        return self.mode in ("train", "update")
