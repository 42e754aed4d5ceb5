"""The executor's entry points: one function per kind of run, each with its own result type.

Each takes a `Program` whose configuration (plans, functions, mesh, weight sharding) the
caller filled in, sets what its run computes, and returns a `NamedTuple` of final values:
losses averaged, outputs and input gradients in the structure of the inputs, gradients in
the device layout. Stage parameters come and go as bare ``[v, S, ...]`` trees; the caller
checks their layout once and keeps their `jaxpipe.layout.Placed` wrapper.

`loss` is the differentiable one: a ``jax.custom_vjp`` whose forward pass runs `gradients`,
so ``jax.grad`` of any function that calls it gets the gradients of the schedule's own
backward order. `update` is the one optimizer path: the optimizer runs per stage where the
plan's ``update`` column says, and for a plan without one, once after the schedule.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxpipe._executor import accumulate, versions
from jaxpipe._executor.loop import run
from jaxpipe._executor.program import Program
from jaxpipe._executor.sharding import constrain

tree_map = jax.tree_util.tree_map


class Outputs(NamedTuple):
    """What `forward` returns.

    Attributes:
      outputs: the last stage's outputs, a pytree of ``inputs``' structure, ``[B, ...]``.
    """

    outputs: Any


class Losses(NamedTuple):
    """What `losses` returns.

    Attributes:
      loss: the step's loss (float32): the micro-batch losses combined as
        ``Program.loss_reduction`` says.
      losses: the ``M`` micro-batch losses.
      aux: the loss's ``aux``, combined like the loss (None without one).
    """

    loss: jax.Array
    losses: jax.Array
    aux: Any = None


class Gradients(NamedTuple):
    """What `gradients` returns.

    Attributes:
      loss: the step's loss (float32), as in `Losses`.
      losses: the ``M`` micro-batch losses.
      grads: the stage parameters' gradient, ``[v, S, ...]``, split like the parameters.
      loss_grads: the loss parameters' gradient.
      input_grads: the gradient with respect to ``inputs``, of its structure (None for
        integer and boolean leaves); None unless asked for.
      aux: the loss's ``aux``, combined like the loss (None without one).
      side_grads: the gradient with respect to ``side``, as ``input_grads``.
      target_grads: the gradient with respect to ``targets``, as ``input_grads``.
    """

    loss: jax.Array
    losses: jax.Array
    grads: Any
    loss_grads: Any
    input_grads: Any = None
    aux: Any = None
    side_grads: Any = None
    target_grads: Any = None


class Updated(NamedTuple):
    """What `update` returns.

    Attributes:
      params: the stage parameters after the step's updates, ``[v, S, ...]``.
      opt_state: the optimizer state after them.
      losses: the ``M`` micro-batch losses.
      aux: the loss's ``aux``, combined like the loss (None without one).
    """

    params: Any
    opt_state: Any
    losses: jax.Array
    aux: Any = None


def forward(program: Program, params, inputs, side=None, key=None) -> Outputs:
    """The schedule's forwards alone, keeping the last stage's outputs."""
    program = dataclasses.replace(program, plan=program.forward_plan, outputs=True)
    finished = run(program, params, None, inputs, None, side, key)
    return Outputs(jax.tree_util.tree_structure(inputs).unflatten(finished.results))


def losses(program: Program, params, loss_params, inputs, targets, side=None, key=None):
    """The schedule's forwards alone, keeping the losses; returns `Losses`."""
    program = dataclasses.replace(program, plan=program.forward_plan)
    finished = run(program, params, loss_params, inputs, targets, side, key)
    return Losses(finished.loss, finished.results, _aux(program, finished))


def gradients(
    program: Program,
    params,
    loss_params,
    inputs,
    targets,
    side=None,
    key=None,
    input_grads: bool = False,
    side_grads: bool = False,
    target_grads: bool = False,
) -> Gradients:
    """The whole schedule: losses and gradients (with ``input_grads``, ``side_grads``,
    ``target_grads``, those of the float leaves of ``inputs``, ``side``, ``targets`` too)."""
    program = dataclasses.replace(
        program,
        trains=True,
        input_grad=bool(input_grads),
        side_grad=bool(side_grads) and side is not None,
        target_grad=bool(target_grads),
    )
    if accumulate.accumulates(program):  # one device: plain gradient accumulation
        finished = accumulate.run(program, params, loss_params, inputs, targets, side, key)
    else:
        finished = run(program, params, loss_params, inputs, targets, side, key)
    return Gradients(
        loss=finished.loss,
        losses=finished.results,
        grads=finished.grads,
        loss_grads=finished.loss_grads,
        input_grads=_float_tree(inputs, finished.input_grads) if input_grads else None,
        aux=_aux(program, finished),
        side_grads=_float_tree(side, finished.side_grads) if program.side_grad else None,
        target_grads=_float_tree(targets, finished.target_grads) if target_grads else None,
    )


def _float_tree(like, floats: list):
    """A tree of ``like``'s structure holding ``floats`` at its float leaves, None at the
    others."""
    flat = iter(floats)
    return tree_map(lambda x: next(flat) if _is_float(x) else None, like)


def _aux(program: Program, finished):
    """The combined ``aux`` in its tree structure (None where the loss has none)."""
    if program.aux is None:
        return None
    return jax.tree_util.tree_structure(program.aux).unflatten(finished.aux)


def update(
    program: Program,
    optimizer: optax.GradientTransformation,
    params,
    opt_state,
    loss_params,
    inputs,
    targets,
    side=None,
    key=None,
) -> Updated:
    """One training step with the optimizer applied per stage (`versions.step`).

    Where the plan has an ``update`` column (weight versions) the loop applies it at the
    ticks the column names, each from the mean gradient of the micro-batches since the
    stage's previous update; for any other plan, once per stage after the schedule, from
    the gradient of the step's loss (combined as ``loss_reduction`` says).

    Args:
      program: the configured program.
      optimizer: the optax transformation.
      params: the stage parameters, ``[v, S, ...]``.
      opt_state: the per-stage optimizer state, ``[v, S, ...]`` leaves.
      loss_params, inputs, targets, side, key: as for `gradients`.

    Returns:
      `Updated`.
    """
    if program.plan.updates_weights:
        program = dataclasses.replace(program, trains=True, optimizer=optimizer)
        finished = run(program, params, loss_params, inputs, targets, side, key, opt_state)
        aux = _aux(program, finished)
        return Updated(finished.params, finished.opt_state, finished.results, aux)
    result = gradients(program, params, loss_params, inputs, targets, side, key)
    per_stage = jax.vmap(jax.vmap(functools.partial(versions.step, optimizer)))
    new, opt_state = per_stage(result.grads, opt_state, params)
    return Updated(new, opt_state, result.losses, result.aux)


def trace(program: Program, params, loss_params, inputs, targets, side=None, key=None):
    """The whole schedule with its per-tick record: ``[T, S, 8]`` int32
    (`jaxpipe._executor.trace.record`). Weight versions, if the plan has them, are not
    kept: every action reads the given weights."""
    program = dataclasses.replace(program, trains=True, trace=True)
    return run(program, params, loss_params, inputs, targets, side, key).trace


def loss(program: Program, params, loss_params, inputs, targets, side=None, key=None):
    """``(loss, aux)``: the step's loss and the loss's combined ``aux`` (None without one).
    The loss is differentiable with respect to ``params``, ``loss_params`` and the float
    leaves of ``inputs``, ``targets`` and ``side``: its gradient runs `gradients`, which
    computes the input gradients that are asked for (``jax.grad`` perturbs their leaves).
    ``aux`` has no gradient: differentiating through it raises a ``TypeError``."""
    return _differentiable_loss(program)(params, loss_params, inputs, targets, side, key)


def _differentiable_loss(program: Program):
    @jax.custom_vjp
    def pipeline_loss(params, loss_params, inputs, targets, side, key):
        result = losses(program, params, loss_params, inputs, targets, side, key)
        return result.loss, result.aux

    def fwd(params, loss_params, inputs, targets, side, key):
        # symbolic_zeros=True wraps every leaf in a CustomVJPPrimal(value, perturbed).
        def values(tree):
            return tree_map(lambda p: p.value, tree, is_leaf=_is_primal)

        def perturbed(tree):
            primals = jax.tree_util.tree_leaves(tree, is_leaf=_is_primal)
            return any(p.perturbed for p in primals if _is_float(p.value))

        result = gradients(
            program,
            values(params),
            values(loss_params),
            values(inputs),
            values(targets),
            values(side),
            values(key),
            input_grads=perturbed(inputs),
            side_grads=perturbed(side),
            target_grads=perturbed(targets),
        )
        saved = (result.grads, result.loss_grads, result.input_grads)
        return (result.loss, result.aux), saved + (result.target_grads, result.side_grads)

    def bwd(saved, cotangents):
        g, g_aux = cotangents
        _refuse_aux_cotangent(g_aux)
        grads, loss_grads, input_grads, target_grads, side_grads = saved
        if _is_zero(g):
            g = jnp.float32(0)

        def scale(tree):
            return tree_map(lambda x: (x * g).astype(x.dtype), tree)

        specs = program.weights.placed_specs(grads, program.axis)
        grads = constrain(scale(grads), program.mesh, specs)  # split like the parameters
        scaled = (scale(loss_grads), scale(input_grads), scale(target_grads), scale(side_grads))
        return grads, *scaled, None

    pipeline_loss.defvjp(fwd, bwd, symbolic_zeros=True)
    return pipeline_loss


def _is_zero(x) -> bool:
    return isinstance(x, jax.custom_derivatives.SymbolicZero)


def _refuse_aux_cotangent(g_aux) -> None:
    """Raises where a gradient flows into ``aux``, which the pipeline cannot carry back."""
    leaves = jax.tree_util.tree_leaves(g_aux, is_leaf=_is_zero)
    if not all(_is_zero(g) for g in leaves):
        raise TypeError(
            "a gradient flows into the aux that loss_fn returns (loss_has_aux=True), but the "
            "pipeline differentiates the loss only: aux is for metrics. Compute what must be "
            "differentiated inside the loss, or use jax.lax.stop_gradient(aux) where the aux "
            "enters the function being differentiated (jax.value_and_grad(f, has_aux=True) "
            "passes aux through without a gradient)"
        )


def _is_primal(x) -> bool:
    return isinstance(x, jax.custom_derivatives.CustomVJPPrimal)


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)
