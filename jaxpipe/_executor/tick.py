"""One tick: read this device's row of the plan, run its forward and backward actions, write
their results into the state, and take part in every ``ppermute`` of the tick.

A tick runs its forward, then its backward. The forward's output is sent as soon as the
forward is done, so the transfer runs while the backward computes. The backward's input
gradient is sent at the start of the next tick, while that tick's forward computes (no
forward reads a cotangent), and lands in its slot before that tick's backward: the plan's
timing (what is sent in tick ``t`` is read from tick ``t + 1`` on) is kept, and each
transfer has a stage's computation to hide behind wherever the tick holds both kinds.

The row is read from a constant ``[S, T, columns]`` table (one dynamic slice; no copy of
the table per device). Actions are chosen by ``lax.switch`` on their op codes, one branch
per kind of action that occurs in the plan; they return values, and the writes happen here,
outside the switch, masked by whether the action ran (a write of the old value otherwise,
which XLA fuses into an in-place update). Communication is unconditional: every device joins
every channel every tick, and a value nobody needs lands in a junk slot.

The weight gradients, which W and BW add to, are the one buffer an action updates. A
switch's result is a new buffer: the GPU and CPU compilers copy the gradients into it and
back, every tick, which holds one more gradient-sized buffer for the step. There each kind
of backward action is instead a ``lax.while_loop`` of one trip or none, carrying the
gradients, which a loop updates in place.

On the TPU compiler (`jaxpipe._executor.local.updates_in_place`), two things differ. The
backward's residuals are read here, outside the switch, and passed to it: read inside a
branch where the branches want the residual buffer in different layouts (a B reads a
residual elementwise, a W as a matrix product's operand), the whole ``[slots, ...]`` buffer
is relaid out in the branch, every tick. And the B-to-W stash passes through the switch, B
writing its slot in place: returned by value it would add a micro-batch's stash (the
switch's result) and, with one slot, a masked copy of the whole buffer. The GPU and CPU
compilers copy a buffer passed through a switch and need no relayout, so there the
residuals are read in the branch and the stash written here.

With FSDP weights gathered ``"ahead"`` (`jaxpipe._executor.local.gathers_outside_actions`),
the tick, not the actions, moves them: the chunk a tick's forward runs was gathered during
the previous tick (``state.gathered``); with several chunks per device the backward's is
gathered during the forward, and the next forward's after the forward (an optimization
barrier orders it), so at most two gathered chunks are live; with one chunk per device
the forward and backward share it. A backward returns its chunk's whole weight gradient
(``state.pending``), which the next tick reduce-scatters and adds to the gradients while
its forward computes. Outside the switch, a compiler can run these collectives while an
action computes; inside a branch, they wait for it.

Where the plan pairs a forward with a backward in one device's tick and the stage exchanges
tokens over an expert axis, both actions run in one branch (`_PairDispatch`), so that each
one's all-to-alls can run while the other computes; the transfers between stages then run
between the ticks' computations. There, on every compiler, the backward's residuals are
read outside the branch and the forward writes its own inside, in place.

A traced program also keeps the micro-batch of the value in every slot and records what
each tick ran (`jaxpipe._executor.trace`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpipe._executor import trace, versions
from jaxpipe._executor.actions import BACKWARD, FORWARD, BackwardResult, ForwardResult
from jaxpipe._executor.activations import read, write
from jaxpipe._executor.local import Local, add_to_chunk, chunk_of
from jaxpipe._executor.plan import COLUMN, FIELDS, BackwardOp, ForwardOp
from jaxpipe._executor.state import State, add_side_grads, write_loss_results
from jaxpipe._jaxpr.slots import read_slot

tree_map = jax.tree_util.tree_map


def make_tick(local: Local):
    """``tick(state, _) -> (state, record)`` for ``lax.scan``; ``record`` is the trace row
    (`jaxpipe._executor.trace.record`) when the program traces, else None."""
    program, plan = local.program, local.program.plan
    rows = plan.rows()
    device = lax.axis_index(program.axis)
    forward = _Dispatch(FORWARD, plan.table[:, :, COLUMN["f_op"]])
    backward = _Dispatch(BACKWARD, plan.table[:, :, COLUMN["b_op"]])
    channels = len(FIELDS)
    one_chunk = plan.schedule.stages_per_device == 1  # forward and backward share it
    paired = _PairDispatch.of(local)

    def send(x, offset):
        return _shift(x, offset, program)

    def tick(state: State, _):
        row = lax.dynamic_slice(jnp.asarray(rows), (device, state.tick, 0), (1, 1, rows.shape[2]))
        row = row[0, 0]
        col = {name: row[i] for name, i in COLUMN.items()}
        act_in = row[channels : channels + len(plan.forward_offsets)]
        cot_in = row[channels + len(plan.forward_offsets) :]
        next_chunk = _forward_chunk(rows, device, state.tick + 1)
        state = state._replace(tick=state.tick + 1)
        params = state.versions if program.updates_weights else local.params
        f_params = b_params = params
        if local.gathers_outside:  # the weights this tick's actions run, gathered
            state = _reduce_pending(local, state)  # behind the forward
            f_params = b_params = state.gathered
            if not one_chunk:  # the backward's chunk, gathered behind the forward
                b_params = _gather_chunk(local, col["b_chunk"])
        tags, f_mb, b_mb = state.tags, None, None
        if program.trace:
            tags, f_mb = trace.forward(tags, col)

        x = _forward_input(local, state, col)
        if paired is not None:  # the forward and the backward in one computation
            state, f_result, b_result, y, gathered, tags, b_mb = _run_paired(
                paired, local, state, (f_params, b_params), x, col, (next_chunk, cot_in, tags)
            )
        else:
            f_result = forward(col["f_op"], local, f_params, state, x, col)
            state = _write_forward(local, state, col, f_result)
            y = jax.tree_util.tree_leaves(f_result.y)
            if local.gathers_outside:  # the next tick's forward chunk, gathered behind this tick
                y, gathered = _gather_next(local, next_chunk, y, after_forward=not one_chunk)
            b_result = None
            if program.trains:
                if program.trace:
                    offsets = plan.backward_offsets
                    tags, b_mb = trace.backward(tags, col, state.outbox_slots, offsets, send)
                y, state = _deliver(program, state, y)  # the previous tick's input gradient
                stored = None  # read by the backward, or here where the switch updates in place
                if local.in_place:
                    stored = read_slot(state.residuals, col["b_res"], local.scanned_residuals)
                b_state = state
                if local.gathers_outside:  # the backward returns its chunk's gradient alone
                    b_state = state._replace(grads=tree_map(jnp.zeros_like, state.pending))
                if local.in_place:
                    b_result = backward(col["b_op"], local, b_params, b_state, stored, col)
                else:
                    b_result = backward.carrying_grads(col["b_op"], local, b_params, b_state, col)
                state = _write_backward(local, state, col, b_result)
                state = state._replace(outbox=b_result.dx, outbox_slots=cot_in)
        if program.updates_weights:
            new = versions.update(
                program.optimizer, state.versions, state.opt_state, state.grads, col
            )
            state = state._replace(versions=new[0], opt_state=new[1], grads=new[2])
        if local.gathers_outside:
            state = state._replace(gathered=gathered)

        for i, offset in enumerate(plan.forward_offsets):
            received = [_shift(a, offset, program) for a in y]
            state = state._replace(activations=write(state.activations, act_in[i], received))
        if not program.trace:
            return state, None
        tags = trace.forward_sent(tags, f_result.op, f_mb, act_in, plan.forward_offsets, send)
        state = state._replace(tags=tags)
        return state, _record(local, device, state, col, f_result, b_result, (f_mb, b_mb), y)

    return tick


class _Dispatch:
    """``lax.switch`` over the action functions whose op codes occur in ``codes``: a device
    runs only its own action, and collectives XLA places inside a stage (tensor or FSDP
    parallelism) run in the branch, among the devices of one pipe position, which all take
    the same branch."""

    def __init__(self, table: dict, codes: np.ndarray):
        present = sorted({0, *np.unique(codes).tolist()})
        self.branch_of = np.zeros(max(table) + 1, np.int32)
        self.branch_of[present] = np.arange(len(present))
        self.functions = [table[op] for op in present]

    def __call__(self, code, local, *operands):
        """The result of the action of op code ``code``."""
        branches = [functools.partial(f, local) for f in self.functions]
        return lax.switch(jnp.asarray(self.branch_of)[code], branches, *operands)

    def carrying_grads(self, code, local, params, state, col):
        """As `__call__`, each kind of action a ``lax.while_loop`` of one trip or none
        instead of a switch branch, carrying the weight gradients: a loop updates its carry
        in place, where a switch's result is a new buffer (the GPU and CPU compilers copy
        the gradients into it and back, every tick)."""
        branch = jnp.asarray(self.branch_of)[code]
        result = self.functions[0](local, params, state, None, col)
        for k, function in enumerate(self.functions[1:], start=1):

            def body(carry, function=function):
                _, result = carry
                ran = function(local, params, state._replace(grads=result.grads), None, col)
                return jnp.bool_(False), ran

            result = lax.while_loop(lambda carry: carry[0], body, (branch == k, result))[1]
        return result


class _PairDispatch:
    """The forward and the backward of a tick run by one action function per (forward op,
    backward op) pair that occurs in the plan: both actions in one computation, which a
    compiler can interleave, so that the all-to-alls of expert parallelism inside one
    action's stage run while the other action computes. Across the boundary of a
    conditional or a loop, no compiler overlaps anything.

    Used for plans that pair a forward with a backward in one device's tick (fused cells)
    in programs whose stage weights are split over an expert axis. The price: the
    transfers between stages, which the separate dispatch runs behind the tick's other
    action, wait for both (the backward reads the cotangent sent in the previous tick, and
    the forward's output is sent after both); without all-to-alls to hide, a program keeps
    the separate dispatch.

    On the TPU compiler (``local.in_place``) a ``lax.switch`` chooses the pair; elsewhere
    each pair is a ``lax.while_loop`` of one trip or none that carries both results, the
    weight gradients and the residual buffers among them, which a loop updates in place
    (as `_Dispatch.carrying_grads`). The forward writes its residuals inside, in place
    (`__call__`)."""

    def __init__(self, f_codes: np.ndarray, b_codes: np.ndarray):
        occurring = {(int(f), int(b)) for f, b in zip(f_codes.flat, b_codes.flat, strict=True)}
        self.pairs = sorted({(ForwardOp.IDLE, BackwardOp.IDLE), *occurring})
        self.branch_of = np.zeros((len(ForwardOp), len(BackwardOp)), np.int32)
        for k, pair in enumerate(self.pairs):
            self.branch_of[pair] = k

    @classmethod
    def of(cls, local: Local) -> _PairDispatch | None:
        """The dispatch for ``local``'s program, or None where it keeps the separate
        dispatch: no tick of its plan pairs a forward with a backward on one device, no
        stage weight is split over an expert axis, or it does not train."""
        program = local.program
        table = program.plan.table
        f_codes, b_codes = table[:, :, COLUMN["f_op"]], table[:, :, COLUMN["b_op"]]
        pairs = ((f_codes != ForwardOp.IDLE) & (b_codes != BackwardOp.IDLE)).any()
        if not (program.trains and program.weights.kept and pairs):
            return None
        return cls(f_codes, b_codes)

    def __call__(self, local: Local, params: tuple, state: State, x, stored, col):
        """``(forward result, backward result)`` of this device's pair of actions: the
        forward on ``params[0]``, the backward on ``params[1]`` (with ``stored``, its
        residuals, read outside), both on ``state`` (the backward's: no forward reads
        the state, and one copy of it passes the switch). The forward's ``stored`` is the
        residual buffers with its residuals written to slot ``f_res``: written inside,
        where the switch or loop updates the buffers in place, one micro-batch's residuals
        are not held beside the backward's working set as a result of their own."""
        branch = jnp.asarray(self.branch_of)[col["f_op"], col["b_op"]]

        def pair_function(f_op, b_op):
            def run(f_params, b_params, state, x, stored, col):
                with jax.named_scope("forward"):  # in the program's op names
                    f_result = FORWARD[f_op](local, f_params, state, x, col)
                residuals = state.residuals  # the forward's written here, in place
                if f_op != ForwardOp.IDLE:
                    residuals = write(residuals, col["f_res"], f_result.stored)
                f_result = f_result._replace(stored=residuals)
                with jax.named_scope("backward"):
                    return f_result, BACKWARD[b_op](local, b_params, state, stored, col)

            return run

        functions = [pair_function(*pair) for pair in self.pairs]
        operands = (*params, state, x, stored, col)
        if local.in_place:
            # each branch returns the backward's result first: with that order, the TPU
            # compiler's scheduler starts the backward's chain of computations and
            # all-to-alls ahead of the forward's and alternates the two, so that an
            # all-to-all of one action has the other's computation in its window rather
            # than only its own action's
            backward_first = [lambda *a, run=run: run(*a)[::-1] for run in functions]
            b_result, f_result = lax.switch(branch, backward_first, *operands)
            return f_result, b_result
        result = functions[0](*operands)
        for k, function in enumerate(functions[1:], start=1):

            def body(carry, function=function):
                _, (f_result, b_result) = carry
                carried = state._replace(grads=b_result.grads, residuals=f_result.stored)
                return jnp.bool_(False), function(*params, carried, x, stored, col)

            result = lax.while_loop(lambda carry: carry[0], body, (branch == k, result))[1]
        return result


def _run_paired(paired: _PairDispatch, local: Local, state: State, params, x, col, extra):
    """The tick's actions where the plan pairs forwards with backwards (`_PairDispatch`):
    the previous tick's input gradient delivered first (the backward may read it), the
    backward's residuals read outside on every compiler (read inside, from the buffers the
    forward writes in place there, they would have to be read before that write, and the
    GPU compiler then runs the two actions one after the other), then both actions, then
    their writes. Returns ``(state, f_result, b_result, y, gathered,
    tags, b_mb)``: ``y`` the forward's output leaves, ``gathered`` the next forward's
    chunk where the tick gathers FSDP weights (else None), ``tags`` and ``b_mb`` the
    trace's (None untraced)."""
    program = local.program
    next_chunk, cot_in, tags = extra
    b_mb = gathered = None
    if program.trace:
        offsets = program.plan.backward_offsets
        send = functools.partial(_shift, program=program)
        tags, b_mb = trace.backward(tags, col, state.outbox_slots, offsets, send)
    _, state = _deliver(program, state, [])
    # before the forward writes the buffers
    stored = read_slot(state.residuals, col["b_res"], local.scanned_residuals)
    b_state = state
    if local.gathers_outside:  # the backward returns its chunk's gradient alone
        b_state = state._replace(grads=tree_map(jnp.zeros_like, state.pending))
    f_result, b_result = paired(local, params, b_state, x, stored, col)
    state = _write_forward(local, state._replace(residuals=f_result.stored), col, f_result, True)
    y = jax.tree_util.tree_leaves(f_result.y)
    if local.gathers_outside:  # the next tick's forward chunk, gathered after both
        one_chunk = program.plan.schedule.stages_per_device == 1
        y, gathered = _gather_next(local, next_chunk, y, after_forward=not one_chunk)
    state = _write_backward(local, state, col, b_result)
    state = state._replace(outbox=b_result.dx, outbox_slots=cot_in)
    return state, f_result, b_result, y, gathered, tags, b_mb


def with_gathered_weights(local: Local, state: State) -> State:
    """``state`` before the first tick, where the tick gathers FSDP weights: the first
    tick's forward chunk gathered, no gradient pending."""
    if not local.gathers_outside:
        return state
    rows = local.program.plan.rows()
    gathered = _gather_chunk(local, _forward_chunk(rows, lax.axis_index(local.program.axis), 0))
    pending = tree_map(jnp.zeros_like, gathered) if local.program.trains else None
    return state._replace(gathered=gathered, pending=pending, pending_chunk=jnp.int32(0))


def without_pending(local: Local, state: State) -> State:
    """``state`` after the last tick, the last backward's gradient reduce-scattered and
    added (where the tick gathers FSDP weights)."""
    if not (local.gathers_outside and local.program.trains):
        return state
    return _reduce_pending(local, state)


def _forward_chunk(rows: np.ndarray, device, tick):
    """The local chunk of ``device``'s forward in ``tick`` (the last tick's past the end)."""
    tick = jnp.minimum(tick, rows.shape[1] - 1)
    start = (device, tick, COLUMN["f_chunk"])
    return lax.dynamic_slice(jnp.asarray(rows), start, (1, 1, 1))[0, 0, 0]


def _gather_chunk(local: Local, chunk):
    """Chunk ``chunk`` of this device's weights, gathered over the batch axes."""
    return local.whole(chunk_of(local.params, chunk))


def _gather_next(local: Local, chunk, y: list, after_forward: bool):
    """``(y, gathered)``: chunk ``chunk`` gathered for the next tick's forward. The gather
    runs outside the actions' switch, so a compiler can run it while this tick's actions
    compute. With ``after_forward`` its operand passes an optimization barrier with the
    forward's output ``y``: it starts once the forward is done (its weights are then
    dead), and runs behind the backward, so that at most two gathered chunks are live."""
    shards = chunk_of(local.params, chunk)
    if after_forward and local.program.trains:
        y, shards = lax.optimization_barrier((y, shards))
    return y, local.whole(shards)


def _reduce_pending(local: Local, state: State) -> State:
    """The pending weight gradient (the previous tick's backward's) reduce-scattered over
    the batch axes and added to its chunk's gradients, outside the actions' switch: issued
    at the start of a tick, it runs while the tick's forward computes."""
    if state.pending is None:
        return state
    scattered = local.program.weights.scatter_tree(state.pending, offset=0, one_by_one=False)
    return state._replace(grads=add_to_chunk(state.grads, state.pending_chunk, scattered))


def _forward_input(local: Local, state: State, col):
    """The forward's input: micro-batch ``f_mb`` of the model input for stage 0, else the
    activation received into slot ``f_src``."""
    received = local.activation.unflatten(read(state.activations, col["f_src"]))
    from_input = col["f_from_input"] == 1
    return tree_map(lambda a, b: jnp.where(from_input, a, b), local.input(col["f_mb"]), received)


def _masked_write(buffers: list, slot, values: list, mask) -> list:
    """``buffers[slot] = values`` where ``mask``, else unchanged (one in-place update)."""
    return [
        b.at[slot].set(jnp.where(mask, v.astype(b.dtype), b[slot]))
        for b, v in zip(buffers, values, strict=True)
    ]


def _write_forward(
    local: Local, state: State, col, result: ForwardResult, residuals_written: bool = False
) -> State:
    """Residuals to slot ``f_res`` (unless ``residuals_written``); on the last stage its
    loss (or output) to row ``f_mb`` and its loss gradient to cotangent slot ``f_cot``."""
    program = local.program
    ran = col["f_op"] != ForwardOp.IDLE
    last = col["f_op"] == ForwardOp.LAST
    m = col["f_mb"]
    if program.outputs:
        y = jax.tree_util.tree_leaves(result.y)
        return state._replace(results=_masked_write(state.results, m, y, last))
    (losses,) = _masked_write([state.results], m, [result.loss], last)
    state = write_loss_results(local, state._replace(results=losses), m, last, result)
    if not program.trains:
        return state
    residuals = state.residuals
    if not residuals_written:
        residuals = _masked_write(residuals, col["f_res"], result.stored, ran)
    return state._replace(
        residuals=residuals,
        cotangents=_masked_write(state.cotangents, col["f_cot"], result.cotangent, last),
        loss_grads=tree_map(
            lambda g, d: g + d.astype(g.dtype), state.loss_grads, result.loss_grads
        ),
    )


def _write_backward(local: Local, state: State, col, result: BackwardResult) -> State:
    """The accumulated weight gradients; the stash (updated in the switch, or a B's arrays
    written to slot ``b_stash`` here); stage 0's input gradient to row ``b_mb`` of the input
    gradients."""
    op = col["b_op"]
    stash = result.stash
    if not local.in_place:
        stash = _masked_write(state.stash, col["b_stash"], stash, op == BackwardOp.INPUT)
    if local.gathers_outside:
        state = state._replace(pending=result.grads, pending_chunk=col["b_chunk"], stash=stash)
    else:
        state = state._replace(grads=result.grads, stash=stash)
    if local.program.side_grad:
        state = add_side_grads(state, col["b_mb"], result.d_side)
    if local.program.input_grad:
        has_dx = (op == BackwardOp.FULL) | (op == BackwardOp.INPUT)
        to_input = has_dx & (col["b_to_input"] == 1)
        row = jnp.where(to_input, col["b_mb"], local.num_microbatches)  # else the junk row
        state = state._replace(input_grads=write(state.input_grads, row, result.dx))
    return state


def _deliver(program, state: State, y: list) -> tuple[list, State]:
    """Sends the outbox (the previous tick's input gradient) along every backward offset
    into the cotangent slots its tick named; returns the forward's output ``y`` and the
    state. Called after the forward, which reads no cotangent, so the transfer can run
    while the forward computes. ``y`` passes an optimization barrier with what arrives:
    its own sends start after these end, so no compiler merges a send of ``y`` with one
    of these into a transfer that waits for the forward (XLA's GPU compiler combines
    transfers between the same devices)."""
    offsets = program.plan.backward_offsets
    received = [[_shift(a, offset, program) for a in state.outbox] for offset in offsets]
    y, received = lax.optimization_barrier((y, received))
    cotangents = state.cotangents
    for i, values in enumerate(received):
        cotangents = write(cotangents, state.outbox_slots[i], values)
    return y, state._replace(cotangents=cotangents)


def _shift(x, offset: int, program):
    """Sends ``x`` from every device ``d`` to device ``(d + offset) % S``."""
    S = program.plan.schedule.num_stages
    if offset % S == 0:
        return x
    return lax.ppermute(x, program.axis, [(d, (d + offset) % S) for d in range(S)])


def _all_finite(leaves) -> jax.Array:
    flags = [jnp.all(jnp.isfinite(x)) for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.bool_(True)


def _record(local: Local, device, state: State, col, f_result, b_result, microbatches, y):
    """The trace row (`jaxpipe._executor.trace.record`): what ran, on which stage and
    micro-batch, and whether its results (and the gradients so far) are finite."""
    program = local.program
    f_finite = _all_finite(y)
    if not program.outputs:
        f_finite &= jnp.isfinite(state.results).all()
    if program.trains:  # the last stage's forward makes the loss parameters' gradient
        f_finite &= _all_finite(jax.tree_util.tree_leaves(state.loss_grads))
    b_finite, b_op, b_mb = jnp.bool_(True), jnp.int32(BackwardOp.IDLE), jnp.int32(0)
    if b_result is not None:
        # the gradients so far, and (weights gathered by the tick) this backward's own,
        # which waits a tick before it is reduce-scattered into them
        made = (state.grads, state.pending if local.gathers_outside else None)
        b_finite = _all_finite(b_result.dx) & _all_finite(jax.tree_util.tree_leaves(made))
        b_op, b_mb = b_result.op, microbatches[1]
    return trace.record(
        program.plan,
        device,
        col,
        (f_result.op, b_op),
        (microbatches[0], b_mb),
        (f_finite, b_finite),
    )
