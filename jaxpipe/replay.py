"""The meaning of a schedule, with the optimizer in it: a plain sequential replay of the table.

`replay` walks a `Schedule` tick by tick, device by device, on one device, with one
``jax.vjp`` per action and explicit per-stage weight versions. It is the definition the
pipelined executor is tested against, so it is written for reading, not for speed.

Conventions:

- ``stage_fn(params, x) -> y`` is one stage; every stage runs the same function on its own
  parameters. ``stage_params`` is a pytree whose leaves have a leading axis of length
  ``N`` (the number of logical stages): stage ``s`` is ``leaf[s]``.
- ``loss_fn(loss_params, y, target) -> scalar`` is applied to the last stage's output, per
  micro-batch. ``loss_params`` are held fixed: they are not trained (put trainable layers
  in the stages). This matches the executor's training entry point, which returns stage
  parameters and optimizer states only.
- ``opt`` is an optax ``GradientTransformation``; ``opt_states[s]`` is ``opt.init`` of
  stage ``s``'s parameters (`init_opt_states`). Each stage updates its own parameters.
- ``inputs`` and ``targets`` hold the full batch on axis 0; micro-batch ``m`` is the
  ``m``-th block of ``B // M`` rows (`split_microbatches`), as in the pipeline.

Weight versions, as in `jaxpipe.schedules.pipedream`: stage ``s`` starts with version 0 (its
slice of ``stage_params``). An action reads the version named by ``Action.version``; a
forward stashes the version it read and the backward of the same micro-batch must name the
same one. At each of the stage's update points (its ``U`` actions; `update_points` gives
their ticks and micro-batches), after all actions of that tick, the optimizer is applied to
the newest version with the mean of the group's weight gradients, and the result becomes
the next version. A version is dropped as soon as it is neither the newest nor stashed by a
micro-batch whose backward has not run, so the versions kept match `weight_versions`.

Tables without ``U`` actions (``gpipe``, ``1f1b``, ...) have one update per stage after its
last backward: one synchronous optimizer step on the mean gradient of the micro-batches.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from jaxpipe.schedules import BW, Action, B, F, Schedule, U, update_points


def split_microbatches(x: jax.Array, num_microbatches: int) -> jax.Array:
    """``(B, ...) -> (M, B // M, ...)``: micro-batch ``m`` is the ``m``-th block of rows."""
    M = num_microbatches
    if x.shape[0] % M:
        raise ValueError(
            f"batch of {x.shape[0]} rows cannot be split into {M} equal micro-batches; "
            f"use a batch size that is a multiple of num_microbatches={M}"
        )
    return x.reshape(M, x.shape[0] // M, *x.shape[1:])


def stage_slice(stage_params, stage: int):
    """The parameters of one stage: ``leaf[stage]`` of every leaf."""
    return jax.tree.map(lambda leaf: leaf[stage], stage_params)


def init_opt_states(opt: optax.GradientTransformation, stage_params) -> list:
    """One optimizer state per logical stage, for that stage's own parameters."""
    num = jax.tree.leaves(stage_params)[0].shape[0]
    return [opt.init(stage_slice(stage_params, s)) for s in range(num)]


def _run_stage(stage_fn, loss_fn, params, x, loss_inputs):
    """One stage's forward; at the last stage (``loss_fn`` given) the micro-batch's loss."""
    y = stage_fn(params, x)
    if loss_fn is None:
        return y
    loss_params, target = loss_inputs
    return loss_fn(loss_params, y, target)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _forward(stage_fn, loss_fn, params, x, loss_inputs):
    return _run_stage(stage_fn, loss_fn, params, x, loss_inputs)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _backward(stage_fn, loss_fn, params, x, loss_inputs, output_grad):
    """``(d params, d x)``: the stage's vjp at ``(params, x)`` applied to ``output_grad``."""
    _, vjp = jax.vjp(lambda p, h: _run_stage(stage_fn, loss_fn, p, h, loss_inputs), params, x)
    return vjp(output_grad)


@functools.partial(jax.jit, static_argnums=0)
def _optimizer_step(opt, params, opt_state, grads):
    """Applies ``opt`` to ``params`` with the mean of the gradients in the tuple ``grads``."""
    mean_grad = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
    updates, opt_state = opt.update(mean_grad, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def replay(
    schedule: Schedule,
    stage_fn,
    loss_fn,
    stage_params,
    loss_params,
    opt: optax.GradientTransformation,
    opt_states,
    inputs: jax.Array,
    targets: jax.Array,
):
    """Runs ``schedule`` once over one batch, updating weights where the schedule says.

    Returns ``(stage_params, opt_states, losses)``: the newest version of every stage,
    stacked as given; the list of per-stage optimizer states; and the loss of each
    micro-batch, shape ``(M,)``. Raises ``ValueError`` if the table names a weight version
    that is not alive, or if a backward names a version other than its forward's.

    A forward stashes its input and the version it read; the backward takes ``jax.vjp`` of
    the stage at exactly those (recomputing the forward gives the numbers that keeping the
    forward's residuals would). Each action is jitted on its own, for speed only.
    """
    N = schedule.num_logical_stages
    M = schedule.num_microbatches
    last = N - 1
    if len(jax.tree.leaves(stage_params)[0]) != N or len(opt_states) != N:
        raise ValueError(
            f"schedule {schedule.name!r} has {N} stages; stage_params leaves need a leading "
            f"axis of length {N} and opt_states {N} entries (init_opt_states), got "
            f"{len(jax.tree.leaves(stage_params)[0])} and {len(opt_states)}"
        )
    xs = split_microbatches(inputs, M)
    ts = split_microbatches(targets, M)

    versions = [{0: stage_slice(stage_params, s)} for s in range(N)]  # stage -> {v: params}
    newest = [0] * N
    opt_states = list(opt_states)
    updates_at: dict[int, list[tuple[int, tuple[int, ...]]]] = {}  # tick -> [(stage, group)]
    for s, row in enumerate(update_points(schedule)):
        for tick, group in row:
            updates_at.setdefault(tick, []).append((s, group))

    stage_input = {(0, m): xs[m] for m in range(M)}  # (s, m) -> input of stage s
    stashed = {}  # (s, m) -> version its F read; removed by its last backward action
    output_grad = {}  # (s, m) -> d loss / d output of stage s (the backward's cotangent)
    pending_w = {}  # (s, m) -> weight gradient computed by B, recorded by W
    weight_grad = {}  # (s, m) -> weight gradient, waiting for the stage's update
    losses = [None] * M

    def read(action: Action):
        """The weights ``action`` reads: the version the table names, which must be alive."""
        if action.version not in versions[action.stage]:
            raise ValueError(
                f"{action} reads version {action.version} of stage {action.stage}, but the "
                f"versions alive are {sorted(versions[action.stage])}"
            )
        return versions[action.stage][action.version]

    def stage_call(s: int, m: int):
        """The static functions and the loss inputs of stage ``s`` on micro-batch ``m``."""
        if s == last:
            return stage_fn, loss_fn, (loss_params, ts[m])
        return stage_fn, None, None

    for t, row in enumerate(schedule.ticks):
        # Devices run independently within a tick: every input an action needs was made in
        # an earlier tick (Schedule.validate), so the order of this loop does not matter.
        for cell in row:
            for a in cell:
                if a.op == U:  # applied below, after every action of the tick
                    continue
                s, m = a.stage, a.microbatch
                fn, loss, loss_inputs = stage_call(s, m)
                if a.op == F:
                    out = _forward(fn, loss, read(a), stage_input[(s, m)], loss_inputs)
                    if s == last:
                        losses[m] = out
                    else:
                        stage_input[(s + 1, m)] = out
                    stashed[(s, m)] = a.version
                    continue

                if a.version != stashed[(s, m)]:
                    raise ValueError(
                        f"tick {t}: {a} reads version {a.version} of stage {s}, but its "
                        f"forward read version {stashed[(s, m)]}; they must match "
                        f"(weight stashing)"
                    )
                if a.op in (BW, B):
                    cotangent = jnp.ones_like(losses[m]) if s == last else output_grad.pop((s, m))
                    grad_params, grad_input = _backward(
                        fn, loss, read(a), stage_input[(s, m)], loss_inputs, cotangent
                    )
                    if s > 0:
                        output_grad[(s - 1, m)] = grad_input
                    if a.op == B:
                        pending_w[(s, m)] = grad_params
                        continue
                else:  # W
                    grad_params = pending_w.pop((s, m))
                weight_grad[(s, m)] = grad_params
                del stashed[(s, m)], stage_input[(s, m)]

        # Updates run after the tick's actions: a forward in this tick read the old version.
        for s, group in updates_at.get(t, []):
            grads = tuple(weight_grad.pop((s, m)) for m in group)
            newest_params = versions[s][newest[s]]
            new_params, opt_states[s] = _optimizer_step(opt, newest_params, opt_states[s], grads)
            newest[s] += 1
            versions[s][newest[s]] = new_params

        # Drop the versions no action will read again: keep the newest and the stashed ones.
        for s in range(N):
            keep = {newest[s]} | {v for (stage, _), v in stashed.items() if stage == s}
            versions[s] = {v: p for v, p in versions[s].items() if v in keep}

    final = [versions[s][newest[s]] for s in range(N)]
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *final)
    return stacked, opt_states, jnp.stack(losses)
