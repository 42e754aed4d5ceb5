"""The step of a one-device table (S = 1): plain gradient accumulation, no ticks.

With a single device there is nothing to send and no bubble, so the tick loop's machinery
(the per-tick dispatch, slot buffers, the residual store) is pure cost. `run` computes what
`jaxpipe._executor.loop.run` computes for a training program, as one ``lax.scan`` over the
micro-batches of the stages' forward and loss differentiated with ``jax.vjp``, gradients
added into the carry. It keeps the loop's seeds (loss weights), per-micro-batch and
per-stage key folding, replica means over the data axes, and the same `Finished` result.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxpipe._executor import loop
from jaxpipe._executor.activations import Activation, float_leaves, with_floats
from jaxpipe._executor.local import Local, chunk_of
from jaxpipe._executor.program import Program
from jaxpipe._executor.sharding import constrain

tree_map = jax.tree_util.tree_map


def accumulates(program: Program) -> bool:
    """Whether ``program`` runs as plain gradient accumulation: a training program whose
    table has one device (every logical stage on it, in order), weights neither split over
    the batch axes nor updated inside the loop, and no trace asked for."""
    sched = program.plan.schedule
    return (
        program.trains
        and sched.num_stages == 1
        and tuple(sched.device_stages(0)) == tuple(range(sched.num_logical_stages))
        and not program.weights.active
        and not program.updates_weights
        and not program.plan.updates_weights
        and not program.trace
        and not program.outputs
    )


def run(program: Program, params, loss_params, inputs, targets, side=None, key=None):
    """Runs a training ``program`` whose table has one device (`accumulates`).

    Arguments and result as for `jaxpipe._executor.loop.run`.
    """
    axis, data = program.axis, program.data_axes
    M = program.plan.schedule.num_microbatches
    N = program.plan.schedule.num_logical_stages

    def body(params, loss_params, inputs, targets, side, key):
        params = tree_map(lambda p: p[:, 0], params)  # the device's chunks, [v, ...]
        if key is not None and loop._replicas(program) > 1:
            key = jax.random.fold_in(key, loop._replica_index(program))
        inputs, targets, side = (loop.microbatches(t, M) for t in (inputs, targets, side))
        plain = dataclasses.replace(
            program, trains=False, input_grad=False, side_grad=False, target_grad=False
        )
        local = Local.build(plain, params, loss_params, inputs, targets, side, key)
        stage_fn = jax.checkpoint(program.stage_fn) if program.remat else program.stage_fn
        activation = Activation.like(tree_map(lambda a: a[0], inputs))

        def step_loss(params, loss_params, x_floats, t_floats, s_floats, m):
            x, target = local.input(m), local.target(m)
            if program.input_grad:
                x = with_floats(x, x_floats)
            if program.target_grad:
                target = with_floats(target, t_floats)
            for stage in range(N):
                context = local.context(m, jnp.int32(stage))
                if program.side_grad:
                    context = context._replace(side=with_floats(context.side, s_floats))
                x = stage_fn(chunk_of(params, stage), x, context)
            loss, aux = program.loss_fn(loss_params, x, target, local.loss_context(context))
            aux = [a.astype(jnp.float32) for a in jax.tree_util.tree_leaves(aux)]
            return loss, aux

        def one(total, m):
            x_floats = activation.floats(local.input(m)) if program.input_grad else []
            t_floats = float_leaves(local.target(m)) if program.target_grad else []
            s_floats = float_leaves(microbatch(side, m)) if program.side_grad else []
            loss, vjp_fn, aux = jax.vjp(
                lambda *a: step_loss(*a, m),
                params,
                loss_params,
                x_floats,
                t_floats,
                s_floats,
                has_aux=True,
            )
            d_params, d_loss, dx, d_target, d_side = vjp_fn(local.seed[m].astype(loss.dtype))
            grads, loss_grads = total
            grads = tree_map(lambda g, d: g + d.astype(g.dtype), grads, d_params)
            if local.loss_split is not None:
                # this device's share (`LossGradSplit`); the barrier keeps the TPU compiler
                # from moving the reduce-scatter out of the loop, which accumulates whole
                # again (and fails where a conversion stands between the collective and the
                # sum)
                d_loss = lax.optimization_barrier(local.loss_split.scatter(d_loss))
            loss_grads = tree_map(lambda g, d: g + d.astype(g.dtype), loss_grads, d_loss)
            per_microbatch = (loss.astype(jnp.float32), aux, dx, d_target, d_side)
            return (grads, loss_grads), per_microbatch

        if local.loss_split is None:
            loss_zeros = tree_map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), loss_params)
        else:  # this device's share
            loss_zeros = local.loss_split.zeros(loss_params, jnp.float32)
        zeros = (
            tree_map(lambda p: jnp.zeros(p.shape, program.grad_dtype or p.dtype), params),
            loss_zeros,
        )
        (grads, loss_grads), (losses, aux, dx, d_target, d_side) = lax.scan(
            one, zeros, jnp.arange(M, dtype=jnp.int32)
        )
        return _finish(program, local, params, grads, loss_grads, losses, aux, dx, d_target, d_side)

    rows = loop._rows_spec(data)
    param_specs = program.weights.specs(params, axis)
    out_specs = loop.Finished(
        results=P(),
        grads=param_specs,
        loss_grads=loop.loss_grad_specs(program, loss_params),
        input_grads=rows if program.input_grad else None,
        loss=P(),
        aux=P() if program.aux is not None else None,
        side_grads=rows if program.side_grad else None,
        target_grads=rows if program.target_grad else None,
    )
    in_specs = (param_specs, P(), rows, rows, rows, P())
    sharded = jax.shard_map(
        body,
        mesh=program.mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names={axis, *data},
        check_vma=False,
    )
    args = (params, loss_params, inputs, targets, side, key)
    if any(t == jax.sharding.AxisType.Explicit for t in program.mesh.axis_types):
        args = tuple(
            constrain(a, program.mesh, spec) for a, spec in zip(args, in_specs, strict=True)
        )
    out = jax.jit(sharded)(*args)
    grads = constrain(out.grads, program.mesh, program.weights.placed_specs(params, axis))
    return out._replace(grads=grads)


def microbatch(tree, m):
    """Micro-batch ``m`` of ``[M, rows, ...]`` leaves."""
    return tree_map(lambda a: lax.dynamic_index_in_dim(a, m, 0, keepdims=False), tree)


def _finish(program, local, params, grads, loss_grads, losses, aux, dx, d_target, d_side):
    """`loop.Finished` from the accumulated sums and per-micro-batch values, combined as
    `jaxpipe._executor.loop._finish` combines them."""
    data = program.data_axes
    replicas = loop._replicas(program)
    if program.loss_reduction == "mean":
        loss = jnp.mean(losses)
        aux = [jnp.mean(a, axis=0) for a in aux]
    else:
        loss = jnp.sum(local.seed * losses)
        aux = [jnp.tensordot(local.seed, a, 1) for a in aux]
    own_losses = losses
    if data:
        losses, loss, aux = lax.pmean((losses, loss, aux), data)
    loss_grads = loop.mean_loss_grads(local, loss_grads)
    grads = loop._mean_over_replicas(program, grads)
    out = loop.Finished(
        results=losses,
        loss=loss,
        aux=aux if program.aux is not None else None,
        grads=tree_map(lambda g, p: g.astype(p.dtype)[:, None], grads, params),
        loss_grads=tree_map(
            lambda g, p: g.astype(jnp.result_type(p)), loss_grads, local.loss_params
        ),
    )
    if program.input_grad:
        out = out._replace(input_grads=loop.rows_of([g / replicas for g in dx]))
    if program.side_grad:
        out = out._replace(side_grads=loop.rows_of([g / replicas for g in d_side]))
    if program.target_grad:
        target_grads = list(d_target)
        if callable(program.loss_reduction):
            target_grads = loop._add_weight_grads(program, local, target_grads, own_losses, loss)
        out = out._replace(target_grads=loop.rows_of([g / replicas for g in target_grads]))
    return out
