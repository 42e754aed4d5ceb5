"""What each device ran in each tick, recorded from the values the tick executed.

A traced program (``Program.trace``) keeps, next to each buffer of the state, the
micro-batch of the value in each slot (`Tags`): a forward of stage 0 tags its output with
the input row it read, every other forward with the tag of the activation slot it read;
the tag travels with the value through every ``ppermute`` and into the residual, stash and
cotangent slots. The trace row of a tick (`record`) then says:

- the op code of the action that ran (returned by the action itself, not looked up in the
  plan);
- the logical stage whose weights it read (the chunk it indexed), or -1 where that is not
  the stage the plan's row names for the context;
- the micro-batch of the values it read: for a forward its input's, for a backward its
  residuals', or -1 where what it read disagrees (a B or BW whose cotangent, or a W whose
  stash, belongs to another micro-batch than its residuals).

A plan row that points at the wrong slot, or a tick that runs another action than its
row, so gives a trace that differs from the table (`Pipeline.expected_trace`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe._executor.plan import BackwardOp, ForwardOp, Plan

NONE = -1  # the tag of a slot nothing was written to


class Tags(NamedTuple):
    """One device's tags: per slot of each buffer, the micro-batch of the value in it.

    Attributes:
      activations: ``[act slots + junk]``.
      cotangents: ``[cot slots + junk]``.
      residuals: ``[res slots]``.
      stash: ``[stash slots]``.
      outbox: the micro-batch of the input gradient in the state's outbox.
    """

    activations: jax.Array
    cotangents: jax.Array
    residuals: jax.Array
    stash: jax.Array
    outbox: jax.Array


def initial(plan: Plan) -> Tags:
    """Tags of empty buffers sized by ``plan`` (at least one slot each: a plan without
    B's has no stash, yet a tick reads a tag where its row's column points)."""

    def empty(size):
        return jnp.full((max(size, 1),), NONE, jnp.int32)

    return Tags(
        activations=empty(plan.num_act_slots + 1),
        cotangents=empty(plan.num_cot_slots + 1),
        residuals=empty(plan.num_res_slots),
        stash=empty(plan.num_stash_slots),
        outbox=jnp.int32(NONE),
    )


def forward(tags: Tags, col) -> tuple[Tags, jax.Array]:
    """Before the tick's forward: the micro-batch of its input (the input row it reads, or
    the tag of the activation slot it reads); its residual slot, and on the last stage its
    loss gradient's cotangent slot, then hold that micro-batch's values.

    Returns:
      ``(tags, microbatch)``.
    """
    microbatch = jnp.where(col["f_from_input"] == 1, col["f_mb"], tags.activations[col["f_src"]])
    ran = col["f_op"] != ForwardOp.IDLE
    last = col["f_op"] == ForwardOp.LAST
    residuals = _masked_set(tags.residuals, col["f_res"], microbatch, ran)
    cotangents = _masked_set(tags.cotangents, col["f_cot"], microbatch, last)
    return tags._replace(residuals=residuals, cotangents=cotangents), microbatch


def backward(tags: Tags, col, slots, offsets, send) -> tuple[Tags, jax.Array]:
    """Before the tick's backward: the outbox's tag delivered as the outbox is (``send(x,
    offset)`` along each backward offset, into ``slots``); the micro-batch of the
    backward's residuals, or `NONE` where its cotangent (B, BW) or its stash (W) belongs to
    another one; a B's stash slot, and the outbox, then hold that micro-batch's values.

    Returns:
      ``(tags, microbatch)``.
    """
    cotangents = tags.cotangents
    for i, offset in enumerate(offsets):
        cotangents = cotangents.at[slots[i]].set(send(tags.outbox, offset))
    op = col["b_op"]
    microbatch = tags.residuals[col["b_res"]]
    reads_cotangent = (op == BackwardOp.FULL) | (op == BackwardOp.INPUT)
    agrees = jnp.where(reads_cotangent, cotangents[col["b_cot"]] == microbatch, True)
    agrees &= jnp.where(op == BackwardOp.WEIGHT, tags.stash[col["b_stash"]] == microbatch, True)
    microbatch = jnp.where(agrees, microbatch, NONE)
    stash = _masked_set(tags.stash, col["b_stash"], microbatch, op == BackwardOp.INPUT)
    return tags._replace(cotangents=cotangents, stash=stash, outbox=microbatch), microbatch


def forward_sent(tags: Tags, op, microbatch, slots, offsets, send) -> Tags:
    """After the tick: the forward's output tag (`NONE` if it was idle) delivered as the
    output is, along each forward offset into ``slots``."""
    sent = jnp.where(op != ForwardOp.IDLE, microbatch, NONE)
    activations = tags.activations
    for i, offset in enumerate(offsets):
        activations = activations.at[slots[i]].set(send(sent, offset))
    return tags._replace(activations=activations)


def record(plan: Plan, device, col, ran, microbatches, finite) -> jax.Array:
    """The tick's trace row, int32 ``[8]``: forward op, stage, micro-batch, backward op,
    stage, micro-batch, and whether the forward's and the backward's results are finite.

    Args:
      plan: the plan the program runs.
      device: this device's index on the pipe axis.
      col: this device's row of the plan, by column name.
      ran: the op codes of the forward and the backward action that ran.
      microbatches: the micro-batches of what they read (`forward`, `backward`).
      finite: whether their results are finite (bools).
    """
    stage_at = jnp.asarray(_stage_at(plan))
    row = []
    for op, prefix, microbatch in zip(ran, ("f", "b"), microbatches, strict=True):
        stage = stage_at[col[f"{prefix}_chunk"], device]
        stage = jnp.where(stage == col[f"{prefix}_stage"], stage, NONE)
        busy = op != 0
        row += [op, jnp.where(busy, stage, 0), jnp.where(busy, microbatch, 0)]
    return jnp.stack(row + [f.astype(jnp.int32) for f in finite])


def _stage_at(plan: Plan) -> np.ndarray:
    """``[v, S]``: the logical stage of chunk ``c`` of device ``d``."""
    schedule = plan.schedule
    return np.array([schedule.device_stages(d) for d in range(schedule.num_stages)], np.int32).T


def _masked_set(buffer: jax.Array, slot, tag, mask) -> jax.Array:
    return buffer.at[slot].set(jnp.where(mask, tag, buffer[slot]))
