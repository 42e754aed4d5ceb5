"""The tick loop's carry: every buffer a device keeps between ticks, by name."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxpipe._executor import trace
from jaxpipe._executor.activations import slot_buffer
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


def initial_state(local: Local, opt_state=None) -> State:
    """Zeroed buffers sized by the plan."""
    program, plan = local.program, local.program.plan
    M = local.num_microbatches
    act = local.activation
    trains = program.trains
    results = slot_buffer(M, act.leaves) if program.outputs else jnp.zeros((M,), jnp.float32)

    def accumulator(p):
        return jnp.zeros(p.shape, program.grad_dtype or p.dtype)

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
        loss_grads=tree_map(accumulator, local.loss_params) if trains else None,
        results=results,
        input_grads=slot_buffer(M + 1, act.float_leaves) if program.input_grad else [],
        versions=versions,
        opt_state=opt_state,
        outbox=act.float_zeros() if trains else [],
        outbox_slots=jnp.full((len(plan.backward_offsets),), plan.num_cot_slots, jnp.int32),
        tags=trace.initial(plan) if program.trace else None,
    )
