"""The whole step: one ``shard_map`` over the pipe axis (and the data axes) around one
``lax.scan`` over the ticks of the plan; the reductions that follow the schedule."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxpipe._executor.activations import float_leaves, with_floats
from jaxpipe._executor.local import Local, loss_grad_split, microbatch_weights
from jaxpipe._executor.program import Program
from jaxpipe._executor.sharding import constrain
from jaxpipe._executor.state import initial_state
from jaxpipe._executor.tick import make_tick, with_gathered_weights, without_pending
from jaxpipe._executor.versions import select

tree_map = jax.tree_util.tree_map


class Finished(NamedTuple):
    """What one run of a program leaves; None where the program computes nothing of it.

    Losses and loss gradients are the step's (summed over the pipe axis from the device
    that computes them, averaged over data axes), as are input gradients.

    Attributes:
      results: the micro-batch losses ``[M]`` (float32), or where the program returns
        outputs, the last stage's outputs as a list per activation leaf, ``[B, ...]``.
      grads: weight gradients in the layout ``[v, S, ...]``, in the parameters' dtypes.
      loss_grads: the loss parameters' gradient.
      input_grads: the gradient of ``inputs``' float leaves, a list, ``[B, ...]``.
      params: where the program updates weights, each device's newest version.
      opt_state: where the program updates weights, the optimizer state.
      trace: where the program traces, ``[T, S, 8]`` (`jaxpipe._executor.trace.record`).
      loss: where the program computes losses, the step's loss: the mean over replicas of
        the micro-batch losses weighted by `jaxpipe._executor.local.seeds`.
      aux: where the loss has ``aux``, its leaves combined with the same weights (a list).
      side_grads: the gradient of the side inputs' float leaves, a list, ``[B, ...]``.
      target_grads: the gradient of the targets' float leaves, a list, ``[B, ...]``.
    """

    results: Any
    grads: Any = None
    loss_grads: Any = None
    input_grads: list | None = None
    params: Any = None
    opt_state: Any = None
    trace: jax.Array | None = None
    loss: jax.Array | None = None
    aux: list | None = None
    side_grads: list | None = None
    target_grads: list | None = None


def run(
    program: Program,
    params,
    loss_params,
    inputs,
    targets=None,
    side=None,
    key=None,
    opt_state=None,
) -> Finished:
    """Runs ``program`` once.

    Args:
      program: what to run and what to compute.
      params: stage parameters in the device layout, leaves ``[v, S, ...]``
        (`jaxpipe.layout`).
      loss_params: parameters of ``loss_fn`` (replicated).
      inputs: a pytree whose leaves are batches ``[B, ...]``, rows split over the data
        axes, micro-batches in contiguous blocks of each replica's rows
        (`jaxpipe.pipeline.split_microbatches`).
      targets: as ``inputs``; None where the program returns outputs.
      side: as ``inputs``, or None.
      key: a PRNG key, folded per micro-batch and stage (`Context`), or None.
      opt_state: where the program updates weights, the optimizer state, leaves
        ``[1, S, ...]``.

    Returns:
      The `Finished` run.
    """
    axis, data = program.axis, program.data_axes
    plan = program.plan
    sched = plan.schedule
    last_device, first_device = sched.stage_device[-1], sched.stage_device[0]
    has_targets = targets is not None

    def body(params, loss_params, inputs, targets, side, key, opt_state):
        params = tree_map(lambda p: p[:, 0], params)  # this device's chunks, [v, ...]
        if key is not None and _replicas(program) > 1:
            key = jax.random.fold_in(key, _replica_index(program))  # its own random numbers
        M = plan.schedule.num_microbatches
        inputs, targets, side = (
            microbatches(tree, M) for tree in (inputs, targets, side)
        )  # this device's rows of every micro-batch, [M, rows, ...]: a reshape, no copy
        local = Local.build(program, params, loss_params, inputs, targets, side, key)
        if opt_state is not None:
            opt_state = tree_map(lambda x: x[0, 0], opt_state)
        state = with_gathered_weights(local, initial_state(local, opt_state))
        state, records = lax.scan(make_tick(local), state, None, length=plan.num_ticks)
        state = without_pending(local, state)
        return _finish(program, state, records, local, first_device, last_device)

    param_specs = program.weights.specs(params, axis)
    out_specs = Finished(
        results=_rows_spec(data) if program.outputs else P(),
        grads=param_specs if program.trains else None,
        loss_grads=loss_grad_specs(program, loss_params) if program.trains else None,
        input_grads=_rows_spec(data) if program.input_grad else None,
        params=P(None, axis) if program.updates_weights else None,
        opt_state=P(None, axis) if program.updates_weights else None,
        trace=P(None, axis) if program.trace else None,
        loss=None if program.outputs else P(),
        aux=P() if program.aux is not None and not program.outputs else None,
        side_grads=_rows_spec(data) if program.side_grad else None,
        target_grads=_rows_spec(data) if program.target_grad else None,
    )
    in_specs = (
        param_specs,
        P(),
        _rows_spec(data),
        _rows_spec(data) if has_targets else P(),
        _rows_spec(data),
        P(),
        P(None, axis),
    )
    sharded = jax.shard_map(
        body,
        mesh=program.mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names={axis, *data},
        check_vma=False,
    )
    args = (params, loss_params, inputs, targets, side, key, opt_state)
    if any(t == jax.sharding.AxisType.Explicit for t in program.mesh.axis_types):
        # Explicit axes: arguments must arrive as shard_map expects them, said explicitly.
        args = tuple(
            constrain(a, program.mesh, spec) for a, spec in zip(args, in_specs, strict=True)
        )
    out = jax.jit(sharded)(*args)  # eager shard_map mishandles axes left automatic
    if program.trains:  # gradients split like the parameters (tensor axes included)
        grads = constrain(out.grads, program.mesh, program.weights.placed_specs(params, axis))
        out = out._replace(grads=grads)
    return out


def _mean_over_replicas(program: Program, grads):
    """The weight gradients averaged over the batch axes (each replica summed its own
    rows): reduce-scattered over the axes a weight is split over (once, after the
    schedule, if it was gathered once; already, inside every backward, if per use), and
    averaged over the others. A weight split over an expert axis already holds the sum
    over that axis's replicas (the stage's all-to-all carried their tokens' gradients to
    it), so it is divided by the axis's size instead."""
    weights, data = program.weights, program.data_axes
    if weights.gather == "once":
        grads = weights.scatter_tree(grads, offset=1)
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    out = []
    for i, g in enumerate(leaves):
        scattered = weights.scattered_axes(i) + weights.kept_axes(i)
        rest = tuple(a for a in data if a not in scattered)
        if rest:
            g = lax.pmean(g, rest)
        if scattered:
            g = g / int(np.prod([program.mesh.shape[a] for a in scattered]))
        out.append(g)
    return treedef.unflatten(out)


def loss_grad_specs(program: Program, loss_params):
    """The ``shard_map`` out-specs of the loss parameters' gradient: whole (``P()``), or
    each leaf split as `jaxpipe._executor.sharding.LossGradSplit` keeps it."""
    split = loss_grad_split(program, loss_params)
    return P() if split is None else split.specs(loss_params)


def mean_loss_grads(local: Local, loss_grads):
    """The accumulated loss-parameter gradient (this replica's rows' sum, or this device's
    share of the sum over the replicas) averaged over the replicas."""
    if local.loss_split is not None:
        return local.loss_split.mean(loss_grads)
    data = local.program.data_axes
    return lax.pmean(loss_grads, data) if data else loss_grads


def _replicas(program: Program) -> int:
    """The number of data-parallel replicas (the product of the data axes' sizes)."""
    return int(np.prod([program.mesh.shape[a] for a in program.data_axes]))


def _replica_index(program: Program) -> jax.Array:
    """This device's replica, ``0 .. _replicas - 1``, the data axes read in order (the
    order in which they split the batch's rows)."""
    index = jnp.int32(0)
    for a in program.data_axes:
        index = index * program.mesh.shape[a] + lax.axis_index(a)
    return index


def _add_weight_grads(program: Program, local: Local, target_grads, losses, loss):
    """The target gradients plus what flows through the weight function of a weighted
    loss: the step's loss is ``sum(w * losses) / W`` over micro-batches and replicas, so
    ``d loss / d w`` is ``(losses - loss) / W`` for this replica's ``losses`` (``R`` times
    that before the division by the replicas that follows)."""
    weight_fn = program.loss_reduction
    weights = microbatch_weights(weight_fn, local.targets)
    total = jnp.sum(weights)
    if program.data_axes:
        total = lax.psum(total, program.data_axes)
    d_weights = _replicas(program) * (losses - loss) / total

    def weights_of(floats):
        return microbatch_weights(weight_fn, with_floats(local.targets, floats))

    _, weights_vjp = jax.vjp(weights_of, float_leaves(local.targets))
    (extra,) = weights_vjp(d_weights)
    return [g + e.astype(g.dtype) for g, e in zip(target_grads, extra, strict=True)]


def microbatches(tree, num_microbatches: int):
    """``[rows, ...]`` leaves as ``[M, rows // M, ...]``: micro-batch ``m`` is the ``m``-th
    block of rows (a reshape: no copy, and slicing one micro-batch reads contiguous
    memory, so no compiler relays the whole batch out for the loop)."""
    M = num_microbatches
    return tree_map(lambda a: a.reshape(M, a.shape[0] // M, *a.shape[1:]), tree)


def rows_of(tree):
    """The inverse of `microbatches`: ``[M, rows, ...] -> [M * rows, ...]``."""
    return tree_map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), tree)


def _rows_spec(data_axes):
    return P(data_axes) if data_axes else P()


def _finish(program: Program, state, records, local: Local, first_device, last_device):
    """The step's results from the final state: losses, outputs and the loss and input
    gradients moved from the device that has them to every device (a sum over the pipe
    axis of one device's values), then averaged over the data axes."""
    axis, data = program.axis, program.data_axes
    device = lax.axis_index(axis)
    M = local.num_microbatches

    def from_device(tree, owner):
        return tree_map(lambda x: lax.psum(jnp.where(device == owner, x, 0), axis), tree)

    if program.outputs:
        out = Finished(results=rows_of(from_device(state.results, last_device)))
    else:
        own_results = from_device(state.results, last_device)  # this replica's
        if program.loss_reduction == "mean" or program.updates_weights:
            loss = jnp.mean(own_results)
            aux = [jnp.mean(a, axis=0) for a in state.aux]
        else:  # each micro-batch weighted by its seed (which holds ``R``)
            loss = jnp.sum(local.seed * own_results)
            aux = [jnp.tensordot(local.seed, a, 1) for a in state.aux]
        aux = from_device(aux, last_device)
        results = own_results
        if data:
            results, loss, aux = lax.pmean((results, loss, aux), data)
        out = Finished(results=results, loss=loss, aux=aux if program.aux is not None else None)
    if program.trains:
        grads = _mean_over_replicas(program, state.grads)
        loss_grads = mean_loss_grads(local, from_device(state.loss_grads, last_device))
        out = out._replace(
            grads=tree_map(lambda g, p: g.astype(p.dtype)[:, None], grads, local.params),
            loss_grads=tree_map(
                lambda g, p: g.astype(jnp.result_type(p)), loss_grads, local.loss_params
            ),
        )
    if program.input_grad:
        replicas = _replicas(program)
        input_grads = [g[:M] / replicas for g in state.input_grads]
        out = out._replace(input_grads=rows_of(from_device(input_grads, first_device)))
    replicas = _replicas(program)
    if program.side_grad:  # every stage's share, from every device
        side_grads = [lax.psum(g, axis) / replicas for g in state.side_grads]
        out = out._replace(side_grads=rows_of(side_grads))
    if program.target_grad:
        target_grads = [g[:M] for g in state.target_grads]
        if callable(program.loss_reduction):
            target_grads = _add_weight_grads(program, local, target_grads, own_results, loss)
        target_grads = [g / replicas for g in target_grads]
        out = out._replace(target_grads=rows_of(from_device(target_grads, last_device)))
    if program.updates_weights:
        final = jnp.asarray(program.plan.final_version)[device]
        out = out._replace(
            params=tree_map(lambda p: p[:, None], select(state.versions, final)),
            opt_state=tree_map(lambda x: x[None, None], state.opt_state),
        )
    if program.trace:
        out = out._replace(trace=records[:, None])
    return out
