"""The executor: one `Plan` compiled into one ``shard_map`` over the pipe axis and one
``lax.scan`` over ticks.

In every tick each device reads its row of the plan (a constant table), runs at most one
forward and one backward action of its own stages (``lax.switch`` on the action; no
collective inside a branch), writes results into fixed-size slot buffers, and then every
device takes part in the same ``ppermute`` calls: activations move toward the next stage,
input gradients toward the previous one.

Backward actions differentiate one stage explicitly with ``jax.vjp``. The residuals a forward
leaves for its backward are the vjp's own residual arrays, minus the parameters (read again
from the stage's weights); they are packed into the bytes of one slot of a single residual
pool shared by all stages, so a device whose stages hold different numbers of micro-batches
pays for its peak, not for the sum of per-stage peaks. A tick writes its forward's residuals
before its backward reads, so XLA updates the pool in place. Pool sizes come from the plan,
so activation memory is bounded by the schedule, not by the number of micro-batches. With
``remat=True`` only stage inputs are kept and the backward recomputes the forward.

This is the only module that issues collectives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxpipe.plan import COLUMN, BackwardOp, ForwardOp, Plan

tree_map = jax.tree_util.tree_map
PARAM, LOSS_PARAM, TARGET, KEPT = "param", "loss_param", "target", "kept"


@dataclasses.dataclass
class _Residuals:
    """How a stage's vjp residuals split into reused inputs and arrays to keep."""

    treedef: Any = None
    sources: list = dataclasses.field(default_factory=list)  # per leaf: (kind, index)
    kept: list = dataclasses.field(default_factory=list)  # ShapeDtypeStructs of kept leaves


def _classify(vjp_fn, named_inputs: dict[str, list]) -> tuple[Any, list, list]:
    """Splits vjp leaves into those that *are* an input leaf (by identity) and the rest."""
    leaves, treedef = jax.tree_util.tree_flatten(vjp_fn)
    sources, kept = [], []
    for leaf in leaves:
        for kind, inputs in named_inputs.items():
            hit = next((i for i, x in enumerate(inputs) if leaf is x), None)
            if hit is not None:
                sources.append((kind, hit))
                break
        else:
            sources.append((KEPT, len(kept)))
            kept.append(leaf)
    return treedef, sources, kept


def _rebuild(res: _Residuals, kept: list, named_inputs: dict[str, list]):
    leaves = [kept[i] if kind == KEPT else named_inputs[kind][i] for kind, i in res.sources]
    return jax.tree_util.tree_unflatten(res.treedef, leaves)


def _nbytes(structs) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in structs)


def _pack(leaves, size: int):
    """The leaves' bytes, concatenated and zero-padded to ``size`` (a ``uint8`` vector)."""
    parts = []
    for leaf in leaves:
        if leaf.dtype == jnp.bool_:
            leaf = leaf.astype(jnp.uint8)
        parts.append(lax.bitcast_convert_type(leaf, jnp.uint8).reshape(-1))
    used = sum(p.size for p in parts)
    parts.append(jnp.zeros((size - used,), jnp.uint8))
    return jnp.concatenate(parts)


def _unpack(packed, structs) -> list:
    """Inverse of `_pack` for leaves of the given shapes and dtypes."""
    leaves, offset = [], 0
    for struct in structs:
        dtype = np.dtype(struct.dtype)
        count = int(np.prod(struct.shape))
        raw = packed[offset : offset + count * dtype.itemsize]
        offset += count * dtype.itemsize
        if dtype == np.bool_:
            leaves.append(raw.reshape(struct.shape).astype(jnp.bool_))
        elif dtype.itemsize == 1:
            leaves.append(lax.bitcast_convert_type(raw.reshape(struct.shape), dtype))
        else:
            raw = raw.reshape(*struct.shape, dtype.itemsize)
            leaves.append(lax.bitcast_convert_type(raw, dtype))
    return leaves


def _slot_buffer(size: int, shape, dtype):
    """``size`` slots plus the junk slot."""
    return jnp.zeros((size + 1, *shape), dtype)


@dataclasses.dataclass(frozen=True)
class Program:
    """Everything the tick loop needs besides the arrays: plan, functions, mode, mesh."""

    plan: Plan
    stage_fn: Callable
    loss_fn: Callable | None
    mesh: jax.sharding.Mesh
    axis: str
    mode: str  # "train" (loss and gradients), "update" (weights updated in the pipeline),
    # "loss" (loss only) or "forward" (outputs)
    remat: bool = False
    input_grad: bool = False
    trace: bool = False
    optimizer: Any = None  # an optax GradientTransformation, for mode "update"
    data_axes: tuple[str, ...] = ()  # mesh axes the batch is split over (manual, like pipe)
    skip_idle: bool = True  # lax.switch per action; False: run every branch and select


def run(program: Program, stage_params, loss_params, microbatches, targets, opt_state=None):
    """Runs the program; ``stage_params`` leaves are in *device* order ``[S, v, ...]``.

    ``microbatches`` is the batch viewed as ``[B // M, M, ...]`` (a free reshape; micro-batch
    ``m`` is ``microbatches[:, m]``), likewise ``targets`` (None in forward mode). Returns a
    dict with, depending on the mode: ``losses`` ``[M]``, ``stage_grads`` (device order
    ``[S, v, ...]``), ``loss_grads``, ``input_grads`` and ``outputs`` (``[M, B // M, ...]``),
    In mode ``"update"`` (asynchronous schedules) each stage applies ``program.optimizer``
    to its own weights where the plan says, reading the weight version each action names;
    the result then has ``stage_params`` (device order, newest versions) and ``opt_state``
    (leaves ``[S, ...]``, one state per device), and the loss params are not trained.
    ``trace`` (``[T, S, 8]``: forward code, stage, micro-batch, backward code, stage,
    micro-batch, then 1 if the forward's result and the backward's results so far are finite).
    """
    plan, axis = program.plan, program.axis
    sched = plan.schedule
    S, M, N = sched.num_stages, sched.num_microbatches, sched.num_logical_stages
    update_mode = program.mode == "update"
    train = program.mode in ("train", "update")
    forward_mode = program.mode == "forward"
    stage_fn, loss_fn = program.stage_fn, program.loss_fn
    last_device = sched.stage_device[N - 1]
    first_device = sched.stage_device[0]
    has_targets = targets is not None
    if not has_targets:  # forward mode: a placeholder the loss branches never read
        targets = jnp.zeros((1, M), jnp.int32)

    # Data-parallel axes are manual too: each device sees its own rows of every micro-batch,
    # so no collective over them runs inside a tick; loss and gradients are averaged over
    # them once, after the loop (this assumes loss_fn is a mean over rows).
    data = program.data_axes
    replicas = int(np.prod([program.mesh.shape[a] for a in data])) if data else 1
    rows = microbatches.shape[0] // replicas
    act = jax.ShapeDtypeStruct((rows, *microbatches.shape[2:]), microbatches.dtype)
    chunk_struct = tree_map(lambda p: jax.ShapeDtypeStruct(p.shape[2:], p.dtype), stage_params)
    target_rows = targets.shape[0] // replicas if has_targets else 1
    target_struct = jax.ShapeDtypeStruct((target_rows, *targets.shape[2:]), targets.dtype)

    def last_stage(p, lp, x, tgt):
        return loss_fn(lp, stage_fn(p, x), tgt)

    loss_dtype = jnp.float32
    if loss_fn is not None and not forward_mode:
        loss_dtype = jax.eval_shape(last_stage, chunk_struct, loss_params, act, target_struct).dtype

    mid_res, last_res = _Residuals(), _Residuals()
    if train and not program.remat:

        def probe_mid(p, x):
            y, vjp_fn = jax.vjp(stage_fn, p, x)
            named = {PARAM: jax.tree_util.tree_leaves(p)}
            mid_res.treedef, mid_res.sources, kept = _classify(vjp_fn, named)
            mid_res.kept = [jax.ShapeDtypeStruct(k.shape, k.dtype) for k in kept]
            return y

        def probe_last(p, lp, x, tgt):
            loss, vjp_fn = jax.vjp(lambda p, lp, x: last_stage(p, lp, x, tgt), p, lp, x)
            named = {
                PARAM: jax.tree_util.tree_leaves(p),
                LOSS_PARAM: jax.tree_util.tree_leaves(lp),
                TARGET: [tgt],
            }
            last_res.treedef, last_res.sources, kept = _classify(vjp_fn, named)
            last_res.kept = [jax.ShapeDtypeStruct(k.shape, k.dtype) for k in kept]
            return loss

        def probe(lp):
            """Records the residual structure; called inside the shard_map body, on its own
            loss params, so the recorded vjp is traced as the branches that use it are."""
            jax.eval_shape(probe_mid, chunk_struct, act)
            jax.eval_shape(probe_last, chunk_struct, lp, act, target_struct)

    elif train:
        mid_res.kept = [act]
        last_res.kept = [act]

    def chunk_params(params, c):
        return tree_map(lambda p: p[c], params)

    # The cotangent of each micro-batch's loss: the step's loss is their mean; in update
    # mode each update averages its own group's gradients instead.
    seed = jnp.asarray(1.0 if update_mode else 1.0 / M, jnp.float32)

    residual_bytes = [0]  # bytes of one residual slot; set in the body, after the probe

    def dispatch(index, branches, *operands):
        """``branches[index](*operands)``: a ``lax.switch`` that skips the work of the
        branches not taken, or, with ``skip_idle=False``, every branch run and the taken
        one's results selected, so that collectives XLA places inside a stage (tensor
        parallelism) run on every device in every tick."""
        if program.skip_idle:
            return lax.switch(index, branches, *operands)
        outs = [branch(*operands) for branch in branches]
        return tree_map(lambda *xs: lax.select_n(index, *map(jnp.asarray, xs)), *outs)

    # ---------------------------------------------------------------- forward branches
    def no_residuals():
        return jnp.zeros((residual_bytes[0],), jnp.uint8)

    def keep(leaves):
        return _pack(leaves, residual_bytes[0])

    def f_idle(params, lp, x, tgt, c):
        y = jnp.zeros(act.shape, act.dtype)
        return y, jnp.zeros((), jnp.float32), no_residuals(), 0

    def f_mid(params, lp, x, tgt, c):
        p = chunk_params(params, c)
        if not train:
            y = stage_fn(p, x)
            return y, jnp.zeros((), jnp.float32), no_residuals(), int(ForwardOp.MID)
        if program.remat:
            kept = [x]
            y = stage_fn(p, x)
        else:
            y, vjp_fn = jax.vjp(stage_fn, p, x)
            _, _, kept = _classify(vjp_fn, {PARAM: jax.tree_util.tree_leaves(p)})
        return y, jnp.zeros((), jnp.float32), keep(kept), int(ForwardOp.MID)

    def f_last(params, lp, x, tgt, c):
        p = chunk_params(params, c)
        if forward_mode:
            y = stage_fn(p, x)
            return y, jnp.zeros((), jnp.float32), no_residuals(), int(ForwardOp.LAST)
        y = jnp.zeros(act.shape, act.dtype)
        if not train:
            loss = last_stage(p, lp, x, tgt)
            return y, loss.astype(jnp.float32), no_residuals(), int(ForwardOp.LAST)
        if program.remat:
            loss, kept = last_stage(p, lp, x, tgt), [x]
        else:
            loss, vjp_fn = jax.vjp(lambda p, lp, x: last_stage(p, lp, x, tgt), p, lp, x)
            named = {
                PARAM: jax.tree_util.tree_leaves(p),
                LOSS_PARAM: jax.tree_util.tree_leaves(lp),
                TARGET: [tgt],
            }
            _, _, kept = _classify(vjp_fn, named)
        return y, loss.astype(jnp.float32), keep(kept), int(ForwardOp.LAST)

    forward_branches = [f_idle, f_mid, f_last]

    # --------------------------------------------------------------- backward branches
    def mid_vjp(p, packed):
        kept = _unpack(packed, mid_res.kept)
        if program.remat:
            return jax.vjp(stage_fn, p, kept[0])[1]
        return _rebuild(mid_res, kept, {PARAM: jax.tree_util.tree_leaves(p)})

    def last_vjp(p, lp, packed, tgt):
        kept = _unpack(packed, last_res.kept)
        if program.remat:
            return jax.vjp(lambda p, lp, x: last_stage(p, lp, x, tgt), p, lp, kept[0])[1]
        named = {
            PARAM: jax.tree_util.tree_leaves(p),
            LOSS_PARAM: jax.tree_util.tree_leaves(lp),
            TARGET: [tgt],
        }
        return _rebuild(last_res, kept, named)

    def accumulate(grads, c, dp):
        return tree_map(lambda g, d: g.at[c].add(d.astype(g.dtype)), grads, dp)

    def add(a, b):
        return tree_map(lambda x, y: x + y.astype(x.dtype), a, b)

    no_dx = jnp.zeros(act.shape, act.dtype)

    def make_backward(op: BackwardOp):
        def branch(params, lp, grads, dlp, packed, cot, dy_stash, tgt, c):
            if op == BackwardOp.IDLE:
                return no_dx, grads, dlp, 0
            p = chunk_params(params, c)
            if op in (BackwardOp.FULL_MID, BackwardOp.INPUT_MID, BackwardOp.WEIGHT_MID):
                vjp_fn = mid_vjp(p, packed)
                dp, dx = vjp_fn(dy_stash if op == BackwardOp.WEIGHT_MID else cot)
                if op == BackwardOp.INPUT_MID:
                    return dx, grads, dlp, int(op)
                if op == BackwardOp.WEIGHT_MID:
                    return no_dx, accumulate(grads, c, dp), dlp, int(op)
                return dx, accumulate(grads, c, dp), dlp, int(op)
            vjp_fn = last_vjp(p, lp, packed, tgt)
            dp, dlp_mb, dx = vjp_fn(seed.astype(loss_dtype))
            if op == BackwardOp.INPUT_LAST:
                return dx, grads, dlp, int(op)
            if op == BackwardOp.WEIGHT_LAST:
                return no_dx, accumulate(grads, c, dp), add(dlp, dlp_mb), int(op)
            return dx, accumulate(grads, c, dp), add(dlp, dlp_mb), int(op)

        return branch

    backward_branches = [make_backward(op) for op in BackwardOp]

    # ----------------------------------------------------------------------- tick loop
    def body(params, lp, xs_all, tg_all, opt_state):
        params = tree_map(lambda p: p[0], params)  # [v, ...]
        if train and not program.remat:
            probe(lp)
        device = lax.axis_index(axis)
        carry = {
            "act": _slot_buffer(plan.num_act_slots, act.shape, act.dtype),
            "out": (
                jnp.zeros((M + 1, *act.shape), act.dtype)
                if forward_mode
                else jnp.zeros((M + 1,), jnp.float32)
            ),
        }
        if train:
            carry["grad"] = _slot_buffer(plan.num_grad_slots, act.shape, act.dtype)
            carry["dy"] = _slot_buffer(plan.num_dy_slots, act.shape, act.dtype)
            # One pool of residual slots for all stages, each slot the bytes of the larger of
            # a mid stage's and the last stage's residuals.
            residual_bytes[0] = max(_nbytes(mid_res.kept), _nbytes(last_res.kept))
            carry["res"] = _slot_buffer(plan.num_res_slots, (residual_bytes[0],), jnp.uint8)
            carry["grads"] = tree_map(jnp.zeros_like, params)
            carry["dlp"] = tree_map(jnp.zeros_like, lp)
            if program.input_grad:
                carry["dx"] = jnp.zeros((M + 1, *act.shape), act.dtype)
        if update_mode:
            # Weight versions: one [v, ...] tree per slot, version 0 (the caller's) in slot 0.
            # Separate carries selected element-wise keep XLA from copying one stacked buffer
            # every tick.
            carry["versions"] = [params] + [
                tree_map(jnp.zeros_like, params) for _ in range(plan.num_version_slots - 1)
            ]
            carry["opt_state"] = tree_map(lambda x: x[0, 0], opt_state)  # device, chunk 0

        def tick(carry, _):
            # This device's row of the plan for this tick, read from a constant (no copy of
            # the table is materialised per device).
            row = lax.dynamic_slice(
                jnp.asarray(all_rows), (device, carry["tick"], 0), (1, 1, all_rows.shape[2])
            )[0, 0]
            carry = dict(carry, tick=carry["tick"] + 1)
            act_in = row[len(COLUMN) : len(COLUMN) + len(plan.forward_offsets)]
            grad_in = row[len(COLUMN) + len(plan.forward_offsets) :]
            col = {name: row[i] for name, i in COLUMN.items()}
            carry = dict(carry)
            x_in = lax.dynamic_index_in_dim(xs_all, col["f_mb"], axis=1, keepdims=False)
            x = jnp.where(col["f_from_input"] == 1, x_in, carry["act"][col["f_src"]])
            tgt_f = lax.dynamic_index_in_dim(tg_all, col["f_mb"], axis=1, keepdims=False)
            params_f = params_b = params
            if update_mode:
                params_f = _select(carry["versions"], col["f_version"])
                params_b = _select(carry["versions"], col["b_version"])
            y, loss, kept, f_code = dispatch(
                col["f_op"], forward_branches, params_f, lp, x, tgt_f, col["f_chunk"]
            )
            if forward_mode:
                carry["out"] = carry["out"].at[col["out_row"]].set(y)
            else:
                carry["out"] = carry["out"].at[col["out_row"]].set(loss)
            dx, b_code = no_dx, jnp.int32(0)
            if train:
                cot = carry["grad"][col["b_src"]]
                dy_stash = carry["dy"][col["b_dy_read"]]
                # Write this tick's residuals before the backward reads its own: the buffer
                # is then updated in place (the plan never reuses a slot within a tick).
                carry["res"] = carry["res"].at[col["f_res"]].set(kept)
                dx, carry["grads"], carry["dlp"], b_code = dispatch(
                    col["b_op"],
                    backward_branches,
                    params_b,
                    lp,
                    carry["grads"],
                    carry["dlp"],
                    carry["res"][col["b_res"]],
                    cot,
                    dy_stash,
                    lax.dynamic_index_in_dim(tg_all, col["b_mb"], axis=1, keepdims=False),
                    col["b_chunk"],
                )
                carry["dy"] = carry["dy"].at[col["b_dy_write"]].set(cot)
                if program.input_grad:
                    carry["dx"] = carry["dx"].at[col["b_dx_row"]].set(dx)
            if update_mode:
                # Only the new weights and optimizer state pass through the cond; the write
                # goes to the junk slot on ticks without an update.
                update = col["update"] == 1
                newest = tree_map(lambda p: p[0], _select(carry["versions"], col["update_from"]))
                new, carry["opt_state"] = dispatch(
                    update.astype(jnp.int32),
                    [lambda n, o, g, c: (n, o), apply_update],
                    newest,
                    carry["opt_state"],
                    carry["grads"],
                    col,
                )
                target = jnp.where(update, col["update_to"], -1)
                carry["versions"] = [
                    tree_map(lambda b, n, i=i: jnp.where(target == i, n[None], b), version, new)
                    for i, version in enumerate(carry["versions"])
                ]
                carry["grads"] = tree_map(lambda g: jnp.where(update, 0, g), carry["grads"])
            # Communication: every device joins every channel every tick.
            for i, offset in enumerate(plan.forward_offsets):
                received = _shift(y, offset, S, axis)
                carry["act"] = carry["act"].at[act_in[i]].set(received)
            if train:
                for i, offset in enumerate(plan.backward_offsets):
                    received = _shift(dx, offset, S, axis)
                    carry["grad"] = carry["grad"].at[grad_in[i]].set(received)
            record = None
            if program.trace:
                f_finite = jnp.all(jnp.isfinite(y)) & jnp.isfinite(loss)
                b_finite = jnp.all(jnp.isfinite(dx))
                if train:
                    b_finite &= _all_finite(carry["grads"]) & _all_finite(carry["dlp"])
                record = jnp.stack(
                    [
                        jnp.asarray(f_code, jnp.int32),
                        col["f_stage"],
                        col["f_mb"],
                        jnp.asarray(b_code, jnp.int32),
                        col["b_stage"],
                        col["b_mb"],
                        f_finite.astype(jnp.int32),
                        b_finite.astype(jnp.int32),
                    ]
                )
            return carry, record

        def apply_update(newest, opt_state, grads, col):
            """One optimizer step on this device's stage (one stage per device)."""
            size = col["update_size"].astype(jnp.float32)
            mean_grad = tree_map(lambda g: g[0] / size.astype(g.dtype), grads)
            updates, opt_state = program.optimizer.update(mean_grad, opt_state, newest)
            return optax.apply_updates(newest, updates), opt_state

        carry["tick"] = jnp.int32(0)
        carry, records = lax.scan(tick, carry, None, length=plan.table.shape[0])
        if data:  # the one data-parallel reduction of the step, after the schedule
            if not forward_mode:
                carry["out"] = lax.pmean(carry["out"], data)
            if train:
                carry["grads"] = lax.pmean(carry["grads"], data)
                carry["dlp"] = lax.pmean(carry["dlp"], data)
                if program.input_grad:
                    carry["dx"] = carry["dx"] / replicas
        result = {"out": carry["out"][None]}
        if train:
            result["grads"] = tree_map(lambda g: g[None], carry["grads"])
            result["dlp"] = tree_map(lambda g: g[None], carry["dlp"])
            if program.input_grad:
                result["dx"] = carry["dx"][None]
        if update_mode:
            final = jnp.asarray(plan.final_version)[device]
            result["params"] = tree_map(lambda p: p[None], _select(carry["versions"], final))
            result["opt_state"] = tree_map(lambda x: x[None, None], carry["opt_state"])
        if program.trace:
            result["trace"] = records[:, None]
        return result

    # One int32 constant [S, T, fields + channels]; each tick reads one row of it.
    all_rows = np.concatenate(
        [plan.table, plan.act_recv.transpose(1, 2, 0), plan.grad_recv.transpose(1, 2, 0)], axis=2
    ).transpose(1, 0, 2)
    batch_spec = data if data else None  # the rows axis of micro-batch buffers
    out_specs = {"out": P(axis, None, batch_spec) if forward_mode else P(axis)}
    if train:
        out_specs.update(grads=P(axis), dlp=P(axis))
        if program.input_grad:
            out_specs["dx"] = P(axis, None, batch_spec)
    if update_mode:
        out_specs.update(params=P(axis), opt_state=P(axis))
    if program.trace:
        out_specs["trace"] = P(None, axis)
    sharded = jax.shard_map(
        body,
        mesh=program.mesh,
        in_specs=(
            P(axis),
            P(),
            P(batch_spec),
            P(batch_spec) if has_targets else P(),
            P(axis),
        ),
        out_specs=out_specs,
        axis_names={axis, *data},
        check_vma=False,
    )
    raw = sharded(stage_params, loss_params, microbatches, targets, opt_state)
    result = {}
    if forward_mode:
        result["outputs"] = raw["out"][last_device, :M]
    else:
        result["losses"] = raw["out"][last_device, :M]
    if train:
        result["stage_grads"] = raw["grads"]
        result["loss_grads"] = tree_map(lambda g: g[last_device], raw["dlp"])
        if program.input_grad:
            result["input_grads"] = raw["dx"][first_device, :M]
    if update_mode:
        result["stage_params"] = raw["params"]
        result["opt_state"] = raw["opt_state"]
    if program.trace:
        result["trace"] = raw["trace"]
    return result


def _select(trees: list, index):
    """``trees[index]`` for a traced index, by element-wise selection."""
    out = trees[0]
    for i, tree in enumerate(trees[1:], start=1):
        out = tree_map(lambda a, b, i=i: jnp.where(index == i, b, a), out, tree)
    return out


def _all_finite(tree):
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def _shift(x, offset: int, num_devices: int, axis: str):
    """Sends ``x`` from every device ``d`` to device ``(d + offset) % S``."""
    if offset % num_devices == 0:
        return x
    perm = [(d, (d + offset) % num_devices) for d in range(num_devices)]
    return lax.ppermute(x, axis, perm)
