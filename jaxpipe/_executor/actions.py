"""One function per kind of action, and the op-code tables the tick dispatches on.

An action computes; it does not write. Forward actions take ``(local, params, state, x,
col)`` and return a `ForwardResult`; backward actions take ``(local, params, state, stored,
col)`` and return a `BackwardResult` (``col`` maps the plan's column names, `plan.FIELDS`,
to this device's values in this tick). Each result names the action that produced it
(``op``), so that a trace records what ran rather than what the plan asked for. Every action
of a kind returns the same shapes, zeros where it has nothing, so that ``lax.switch`` can
choose among them; the tick then writes the results into the state
(`jaxpipe._executor.tick`). Keeping the buffers out of the switch keeps XLA from copying
them: a buffer passed through a conditional is copied whole (but by the TPU compiler, which
updates it in place: `jaxpipe._executor.local.updates_in_place`). The weight gradients pass
through (W and BW add to them; where the compiler would copy them, the tick runs the
backward actions as loops that carry them instead of a switch); so does the B-to-W stash
where the compiler updates it in place, and the tick then reads the backward's residuals
(``stored``) outside the switch; elsewhere ``stored`` is None and the action reads them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxpipe._executor.activations import float_leaves, read, with_floats, write
from jaxpipe._executor.local import Local
from jaxpipe._executor.plan import BackwardOp, ForwardOp
from jaxpipe._executor.state import State
from jaxpipe._jaxpr import residuals
from jaxpipe._jaxpr.slots import call_on_slot, read_slot

tree_map = jax.tree_util.tree_map


class ForwardResult(NamedTuple):
    """What a forward produces: the `ForwardOp` of the action that ran, its output ``y``
    (sent to the next stage), the residuals to keep (a list of arrays), and on the last
    stage its loss (float32), its ``aux`` (a list of float32 leaves), the loss gradient
    with respect to ``y`` (a list of float leaves), the loss parameters' gradient, and
    where the program asks for them the loss's gradients with respect to the float leaves
    of the micro-batch's side inputs and targets (lists; empty otherwise)."""

    op: jax.Array
    y: Any
    stored: list
    loss: jax.Array
    cotangent: list
    loss_grads: Any
    aux: list
    d_side: list
    d_target: list


class BackwardResult(NamedTuple):
    """What a backward produces: the `BackwardOp` of the action that ran, the input gradient
    (float leaves), the device's weight gradients with its own added (W and BW add in
    place; they pass through the switch), and the stash: where the compiler updates in
    place (``local.in_place``), the stash buffers with a B's slot written (unchanged
    otherwise); else the arrays a B stashes for its W (zeros otherwise), which the tick
    writes; and where the program asks for it, the stage's gradient with respect to the
    float leaves of the micro-batch's side inputs (BW and W; zeros otherwise)."""

    op: jax.Array
    dx: list
    grads: Any
    stash: list
    d_side: list


# ------------------------------------------------------------------------------ forward
def forward_idle(local: Local, params, state: State, x, col) -> ForwardResult:
    return _forward_result(local, ForwardOp.IDLE, local.activation.zeros(), _zero_residuals(local))


def forward_stage(local: Local, params, state: State, x, col) -> ForwardResult:
    """``y = stage(x)``, and in training the residuals its backward needs."""
    program = local.program
    p = local.weights(params, col["f_chunk"], col["f_version"])
    context = local.context(col["f_mb"], col["f_stage"])
    if not program.trains:
        return _forward_result(local, ForwardOp.STAGE, program.stage_fn(p, x, context), [])
    args = local.stage_args(p, context)
    y, stored = residuals.forward(local.residuals, local.stage_fn, args, x, context)
    return _forward_result(local, ForwardOp.STAGE, y, stored)


def forward_last(local: Local, params, state: State, x, col) -> ForwardResult:
    """The last stage: its output, and (unless the program returns outputs) its loss; in
    training also the gradients of the loss with respect to ``y`` and to the loss
    parameters."""
    program = local.program
    result = forward_stage(local, params, state, x, col)._replace(op=_op(ForwardOp.LAST))
    if program.outputs:
        return result
    m = col["f_mb"]
    context = local.loss_context(local.context(m, col["f_stage"]))
    target = local.target(m)

    def loss_of(loss_params, y, target_floats, side_floats):
        t = target if target_floats is None else with_floats(target, target_floats)
        c = context
        if side_floats is not None:
            c = context._replace(side=with_floats(context.side, side_floats))
        loss, aux = program.loss_fn(loss_params, y, t, c)
        return loss, [a.astype(jnp.float32) for a in jax.tree_util.tree_leaves(aux)]

    if not program.trains:
        loss, aux = loss_of(local.loss_params, result.y, None, None)
        return result._replace(loss=loss.astype(jnp.float32), aux=aux)
    target_floats = float_leaves(target) if program.target_grad else None
    side_floats = float_leaves(context.side) if program.side_grad else None
    loss, loss_vjp, aux = jax.vjp(
        loss_of, local.loss_params, result.y, target_floats, side_floats, has_aux=True
    )
    d_loss_params, dy, d_target, d_side = loss_vjp(local.seed[m].astype(loss.dtype))
    loss_grads = tree_map(_no_float0, d_loss_params, local.loss_params)
    if local.loss_split is not None:  # this device's share
        loss_grads = local.loss_split.scatter(loss_grads)
    return result._replace(
        loss=loss.astype(jnp.float32),
        cotangent=local.activation.float_cotangents(dy),
        loss_grads=loss_grads,
        aux=aux,
        d_side=d_side or [],
        d_target=d_target or [],
    )


def _forward_result(local: Local, op: ForwardOp, y, stored: list) -> ForwardResult:
    return ForwardResult(
        op=_op(op),
        y=y,
        stored=stored,
        loss=jnp.float32(0),
        cotangent=local.activation.float_zeros() if local.program.trains else [],
        loss_grads=_loss_grad_zeros(local) if local.program.trains else None,
        aux=[] if local.program.aux is None else local.aux.float_zeros(),
        d_side=local.side_zeros(),
        d_target=local.target_zeros(),
    )


def _zero_residuals(local: Local) -> list:
    if not local.program.trains:
        return []
    return [jnp.zeros(s.shape, s.dtype) for s in local.residuals.structs]


# ----------------------------------------------------------------------------- backward
def backward_idle(local: Local, params, state: State, stored: list, col) -> BackwardResult:
    return BackwardResult(
        op=_op(BackwardOp.IDLE),
        dx=local.activation.float_zeros(),
        grads=state.grads,
        stash=_no_stash(local, state),
        d_side=local.side_zeros(),
    )


def backward_full(local: Local, params, state: State, stored: list, col) -> BackwardResult:
    """BW: input and weight gradients, from the cotangent in slot ``b_cot``."""
    args, context, stored = _backward_inputs(local, params, state, stored, col)
    cotangent = local.activation.cotangent(read(state.cotangents, col["b_cot"]))

    def full(stored, args, context, cotangent):
        x_like = local.x_like()
        return residuals.vjp(local.residuals, local.stage_fn, args, x_like, context, stored)(
            cotangent
        )

    d_args, dx = call_on_slot(full, stored, args, context, cotangent)
    d_params, d_side = local.args_grads(d_args)
    return BackwardResult(
        op=_op(BackwardOp.FULL),
        dx=local.activation.float_cotangents(dx),
        grads=local.accumulate(state.grads, col["b_chunk"], d_params),
        stash=_no_stash(local, state),
        d_side=d_side,
    )


def backward_input(local: Local, params, state: State, stored: list, col) -> BackwardResult:
    """B: the input gradient, and the stash its W needs (`jaxpipe._jaxpr.split`) for
    slot ``b_stash`` (written here where ``local.in_place``, else by the tick)."""
    args, context, stored = _backward_inputs(local, params, state, stored, col)
    cotangent = read(state.cotangents, col["b_cot"])
    dx, stash = call_on_slot(local.split.b_fn, stored, args, context, cotangent)
    if local.in_place:
        stash = write(state.stash, col["b_stash"], stash)
    return BackwardResult(
        op=_op(BackwardOp.INPUT), dx=dx, grads=state.grads, stash=stash, d_side=local.side_zeros()
    )


def backward_weight(local: Local, params, state: State, stored: list, col) -> BackwardResult:
    """W: the weight gradient, from the stash its B left in slot ``b_stash``."""
    args, context, stored = _backward_inputs(local, params, state, stored, col)
    stash = read(state.stash, col["b_stash"])
    d_args = call_on_slot(local.split.w_fn, stored, args, context, stash)
    d_params, d_side = local.args_grads(d_args)
    return BackwardResult(
        op=_op(BackwardOp.WEIGHT),
        dx=local.activation.float_zeros(),
        grads=local.accumulate(state.grads, col["b_chunk"], d_params),
        stash=_no_stash(local, state),
        d_side=d_side,
    )


def _backward_inputs(local: Local, params, state: State, stored, col):
    """What the stage is differentiated with respect to (`Local.stage_args`: chunk
    ``b_chunk``'s parameters, and with side gradients the side inputs of ``b_mb``), the
    context of ``b_mb``, its residuals (``stored``, or slot ``b_res`` read here where the
    tick passed None)."""
    p = local.weights(params, col["b_chunk"], col["b_version"])
    context = local.context(col["b_mb"], col["b_stage"])
    if stored is None:
        stored = read_slot(state.residuals, col["b_res"], local.scanned_residuals)
    return local.stage_args(p, context), context, stored


def _no_stash(local: Local, state: State) -> list:
    """The stash of an action other than B: the buffers unchanged, or zeros to write."""
    if local.in_place:
        return state.stash
    return [jnp.zeros(s.shape, s.dtype) for s in local.stash_structs]


def _loss_grad_zeros(local: Local):
    """Zeros of the loss parameters' gradient as `forward_last` gives it: whole, or this
    device's share where it is split (`jaxpipe._executor.sharding.LossGradSplit`)."""
    if local.loss_split is None:
        return tree_map(jnp.zeros_like, local.loss_params)
    return local.loss_split.zeros(local.loss_params)


def _no_float0(gradient, param):
    """``gradient``, or zeros like ``param`` where it is ``float0`` (an integer parameter's):
    what the other actions' branches give for it."""
    return jnp.zeros_like(param) if gradient.dtype == jax.dtypes.float0 else gradient


def _op(code: int) -> jax.Array:
    return jnp.int32(code)


FORWARD = {
    ForwardOp.IDLE: forward_idle,
    ForwardOp.STAGE: forward_stage,
    ForwardOp.LAST: forward_last,
}
BACKWARD = {
    BackwardOp.IDLE: backward_idle,
    BackwardOp.FULL: backward_full,
    BackwardOp.INPUT: backward_input,
    BackwardOp.WEIGHT: backward_weight,
}
