"""What the executor is asked to run: the `Program` (plans, functions, mesh, and what the
run computes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxpipe._executor.plan import Plan
from jaxpipe._executor.sharding import WeightSharding


class Context(NamedTuple):
    """What a stage application sees besides its parameters and input.

    ``side``: the micro-batch's side inputs (a pytree, or None); ``key``: its PRNG key,
    ``fold_in(fold_in(key, microbatch), stage)``, the loss's ``fold_in(fold_in(key,
    microbatch), N)`` (or None; with several data-parallel replicas ``key`` is already
    ``fold_in(key, replica)``); ``stage``: the logical stage
    index (a traced int32); ``microbatch``: the micro-batch index (a traced int32).
    """

    side: Any
    key: Any
    stage: jax.Array
    microbatch: jax.Array


@dataclasses.dataclass(frozen=True)
class Program:
    """Everything the tick loop needs besides the arrays.

    The caller fills in the first group; the entry points of `jaxpipe._executor.steps`
    set the second, which says what one run computes.

    Attributes:
      plan: the tables this run scans over (`jaxpipe._executor.plan.make_plan`): the
        schedule's, with its backward actions.
      forward_plan: the tables of the schedule's forwards alone, which runs without
        gradients scan over instead.
      stage_fn: ``(params_of_one_stage, x, context) -> y``, ``y`` of ``x``'s structure.
      loss_fn: ``(loss_params, y, target, context) -> (loss, aux)``, on the last stage:
        a scalar loss and a pytree of numeric arrays (or None).
      aux: one micro-batch's ``aux`` as a tree of ``jax.ShapeDtypeStruct`` (or None);
        runs with a loss keep it per micro-batch, in float32, and combine it like the loss.
      loss_reduction: how micro-batch losses combine into the step's loss: ``"mean"``
        (over micro-batches and replicas), ``"sum"``, or ``weight_fn(target) -> scalar``,
        the weighted mean ``sum(w * loss) / sum(w)`` over micro-batches and replicas.
      mesh, axis: the mesh and its pipe axis.
      remat: keep only stage inputs between forward and backward and recompute.
      data_axes: mesh axes the batch is split over; manual, like the pipe axis.
      weights: which stage-weight dimensions are split over ``data_axes`` (FSDP), when
        they are gathered, and the specs the weights were placed with
        (`jaxpipe._executor.sharding`).
      grad_dtype: the dtype gradients accumulate in across micro-batches (None: the
        parameters' own dtype; with one micro-batch, where nothing accumulates, too).
      split_loss_grads: accumulate the loss parameters' gradient split over ``data_axes``,
        each micro-batch's reduce-scattered (`jaxpipe._executor.sharding.LossGradSplit`);
        False: whole, averaged over the replicas once, after the schedule.
      outputs: the last stage keeps its output for every micro-batch (no loss runs).
      trains: run the plan's backward actions: weight and loss-parameter gradients.
      input_grad: also the gradient with respect to the inputs.
      side_grad: also the gradient with respect to the float leaves of the side inputs:
        every stage's backward (and the loss) adds its micro-batch's share.
      target_grad: also the gradient with respect to the float leaves of the targets,
        from the loss on the last stage.
      optimizer: an optax ``GradientTransformation`` applied inside the loop where the
        plan's ``update`` column says; its presence makes the run keep weight versions.
      trace: also record what each device ran in each tick (`jaxpipe._executor.trace`).
    """

    plan: Plan
    forward_plan: Plan
    stage_fn: Callable
    loss_fn: Callable | None
    mesh: jax.sharding.Mesh
    axis: str
    remat: bool = False
    data_axes: tuple[str, ...] = ()
    weights: WeightSharding = WeightSharding()
    grad_dtype: Any = jnp.float32
    split_loss_grads: bool = False
    aux: Any = None
    loss_reduction: Any = "mean"
    outputs: bool = False
    trains: bool = False
    input_grad: bool = False
    side_grad: bool = False
    target_grad: bool = False
    optimizer: Any = None
    trace: bool = False

    def __post_init__(self):
        if self.outputs and self.trains:
            raise ValueError("a program returns outputs or trains, not both")
        if (self.input_grad or self.side_grad or self.target_grad) and not self.trains:
            raise ValueError("input gradients need a training program (trains=True)")
        if self.trains and not self.plan.has_backward:
            name = self.plan.schedule.name
            raise ValueError(
                f"schedule {name!r} has no backward actions (a forward-only table), so it "
                "gives losses and outputs (Pipeline.loss, Pipeline.forward) but no gradients; "
                "to train with it, give every stage and micro-batch a BW row (or a B and a W "
                "row) after its F, as in docs/custom_schedule.md"
            )
        if self.optimizer is not None and not (self.trains and self.plan.updates_weights):
            raise ValueError(
                "an optimizer runs inside the loop only in a training program whose plan "
                "updates weights (an update column)"
            )

    @property
    def updates_weights(self) -> bool:
        """Whether the loop applies the optimizer and keeps weight versions."""
        return self.optimizer is not None
