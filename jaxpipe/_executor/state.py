"""The tick loop's carry: every buffer a device keeps between ticks, by name."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxpipe._executor import trace
from jaxpipe._executor.activations import float_leaves, slot_buffer, write
from jaxpipe._executor.local import Local
from jaxpipe._executor.versions import stack

tree_map = jax.tree_util.tree_map


class State(NamedTuple):
    """One device's buffers (lists hold one array per activation leaf or residual leaf).

    Attributes:
      tick: the tick counter.
      activations: received stage inputs, ``[slots + junk, ...]`` per activation leaf.
      cotangents: received output gradients (and the last stage's loss gradient),
        ``[slots + junk, ...]`` per float activation leaf.
      residuals: what forwards keep for backwards, ``[slots, ...]`` per stored leaf.
      stash: what a B keeps for its W (the cotangents at its weight-consuming operations,
        `jaxpipe._jaxpr.split`), ``[slots, ...]`` per stash leaf.
      grads: the weight gradients of this device's chunks, ``[v, ...]``, accumulating.
      loss_grads: the gradient of the loss parameters, accumulating.
      results: per-micro-batch losses ``[M]``, or outputs ``[M, ...]`` per activation leaf.
      input_grads: the model input's gradient ``[M + junk, ...]`` per float leaf.
      versions: weight versions (programs that update weights): leaves
        ``[slots, v, ...]``.
      opt_state: this device's optimizer state (programs that update weights).
      outbox: the input gradient of the previous tick's backward, per float activation
        leaf, not yet sent: it is sent during this tick's forward (see `make_tick`).
      outbox_slots: the cotangent slots it lands in on the receiving devices, one per
        backward offset of the plan (the junk slot before the first tick).
      tags: in a traced program, the micro-batch of the value in every slot
        (`jaxpipe._executor.trace.Tags`); else None.
      aux: where the loss has ``aux``, its leaves per micro-batch ``[M, ...]`` (float32).
      side_grads: where the program asks for them, the gradient with respect to the float
        leaves of this device's side inputs, ``[M, rows, ...]`` (the side inputs' own
        size): each backward of a stage, and the loss, adds its micro-batch's share.
      target_grads: where the program asks for them, the gradient with respect to the float
        leaves of the targets, ``[M + junk, rows, ...]``, written by the last stage's
        forward.
      gathered: where the tick gathers FSDP weights (`Local.gathers_outside`), the chunk
        this tick's forward runs, gathered during the previous tick; else None.
      pending: there, the previous tick's backward's weight gradient of its whole chunk (in
        the parameters' dtypes; zeros if it computed none), reduce-scattered and added to
        ``grads[pending_chunk]`` during this tick's forward; else None.
      pending_chunk: there, the local chunk ``pending`` belongs to.
    """

    tick: jax.Array
    activations: list
    cotangents: list
    residuals: list
    stash: list
    grads: Any
    loss_grads: Any
    results: Any
    input_grads: list
    versions: Any
    opt_state: Any
    outbox: list
    outbox_slots: jax.Array
    tags: Any = None
    aux: list = ()
    side_grads: list = ()
    target_grads: list = ()
    gathered: Any = None
    pending: Any = None
    pending_chunk: Any = None


def initial_state(local: Local, opt_state=None) -> State:
    """Zeroed buffers sized by the plan."""
    program, plan = local.program, local.program.plan
    M = local.num_microbatches
    act = local.activation
    trains = program.trains
    results = slot_buffer(M, act.leaves) if program.outputs else jnp.zeros((M,), jnp.float32)

    def accumulator(p):  # one micro-batch: nothing accumulates, no wider copy is held
        return jnp.zeros(p.shape, (program.grad_dtype if M > 1 else None) or p.dtype)

    versions = None
    if program.updates_weights:
        versions = stack(local.params, plan.num_version_slots)
    return State(
        tick=jnp.int32(0),
        activations=slot_buffer(plan.num_act_slots + 1, act.leaves),
        cotangents=slot_buffer(plan.num_cot_slots + 1, act.float_leaves) if trains else [],
        residuals=slot_buffer(plan.num_res_slots, local.residuals.structs) if trains else [],
        stash=slot_buffer(plan.num_stash_slots, local.stash_structs) if trains else [],
        grads=tree_map(accumulator, local.params) if trains else None,
        loss_grads=loss_accumulator(local, accumulator) if trains else None,
        results=results,
        input_grads=slot_buffer(M + 1, act.float_leaves) if program.input_grad else [],
        versions=versions,
        opt_state=opt_state,
        outbox=act.float_zeros() if trains else [],
        outbox_slots=jnp.full((len(plan.backward_offsets),), plan.num_cot_slots, jnp.int32),
        tags=trace.initial(plan) if program.trace else None,
        aux=slot_buffer(M, local.aux.leaves) if program.aux is not None else [],
        side_grads=[jnp.zeros_like(a) for a in float_leaves(local.side)]
        if program.side_grad
        else [],
        target_grads=slot_buffer(M + 1, [a[0] for a in float_leaves(local.targets)])
        if program.target_grad
        else [],
    )


def loss_accumulator(local: Local, accumulator):
    """Zeros for the loss parameters' gradient: ``accumulator`` of each (whole), or, where
    it is split (`jaxpipe._executor.sharding.LossGradSplit`), of this device's share, in
    the accumulation dtype (with one micro-batch, in the parameters' own)."""
    if local.loss_split is None:
        return tree_map(accumulator, local.loss_params)
    dtype = local.program.grad_dtype if local.num_microbatches > 1 else None
    return local.loss_split.zeros(local.loss_params, dtype)


def write_loss_results(local: Local, state: State, microbatch, last, result) -> State:
    """The last stage's ``aux`` (to row ``microbatch``, where ``last``) and, where the
    program asks for them, its loss's gradients with respect to the micro-batch's targets
    (to that row, else to the junk row) and side inputs (added)."""
    if local.program.aux is not None:
        aux = [
            b.at[microbatch].set(jnp.where(last, v, b[microbatch]))
            for b, v in zip(state.aux, result.aux, strict=True)
        ]
        state = state._replace(aux=aux)
    if local.program.target_grad:
        row = jnp.where(last, microbatch, local.num_microbatches)
        state = state._replace(target_grads=write(state.target_grads, row, result.d_target))
    if local.program.side_grad:
        d_side = [jnp.where(last, d, 0) for d in result.d_side]
        state = add_side_grads(state, microbatch, d_side)
    return state


def add_side_grads(state: State, microbatch, d_side: list) -> State:
    """``side_grads[microbatch] += d_side`` (a list per float side leaf; empty: unchanged)."""
    side_grads = [
        g.at[microbatch].add(d.astype(g.dtype))
        for g, d in zip(state.side_grads, d_side, strict=True)
    ]
    return state._replace(side_grads=side_grads)
