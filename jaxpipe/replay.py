"""The meaning of a schedule, with the optimizer in it: a plain sequential replay of the table.

`replay` walks a `Schedule` tick by tick, device by device, on one device, with one
``jax.vjp`` per action and explicit per-stage weight versions. It is the definition
`jaxpipe.pipeline.Pipeline.train` is tested against, so it is written for reading, not for
speed, and it takes what the pipeline takes:

- ``stage_fn(params, x, **keywords) -> y`` is one stage, or a list of ``N`` such functions,
  function ``s`` for logical stage ``s``. ``x`` and ``y`` are arrays or pytrees of arrays.
  ``stage_params`` is a pytree whose leaves have a leading axis of length ``N`` (the number
  of logical stages): stage ``s`` is ``leaf[s]``.
- ``loss_fn(loss_params, y, target, **keywords) -> scalar`` is applied to the last stage's
  output, per micro-batch. ``loss_params`` are held fixed: they are not trained (put
  trainable layers in the stages), as in `Pipeline.train`.
- The keywords are the pipeline's, each passed if the function's signature names it
  (`jaxpipe.reference.keywords_of`): ``side``, the micro-batch's rows of ``side``; ``key``,
  ``fold_in(fold_in(key, m), s)`` for micro-batch ``m`` and logical stage ``s`` (the loss
  gets ``fold_in(fold_in(key, m), N)``, its own); ``stage``, ``s`` as an int32 scalar
  (``N - 1`` for the loss).
- ``opt`` is an optax ``GradientTransformation``; ``opt_states[s]`` is ``opt.init`` of
  stage ``s``'s parameters (`init_opt_states`). Each stage updates its own parameters.
- ``inputs``, ``targets`` and ``side`` are pytrees that hold the full batch on axis 0, split
  as the pipeline splits them (`split_microbatches`). With ``R`` data-parallel replicas,
  replica ``r`` runs the table on its ``r``-th block of ``B // R`` rows with the key
  ``fold_in(key, r)``; each micro-batch's loss and weight gradient is the mean over the
  replicas.

Weight versions, as in `jaxpipe.schedules.versions`: stage ``s`` starts with version 0 (its
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

from jaxpipe import stages
from jaxpipe.reference import keywords_of
from jaxpipe.schedules import BW, Action, B, F, Schedule, U, update_points

tree_map = jax.tree_util.tree_map


def split_microbatches(tree, num_microbatches: int, num_replicas: int = 1):
    """The pipeline's micro-batches of a batch.

    Args:
      tree: an array or a pytree of arrays, the batch on axis 0 (``B`` rows).
      num_microbatches: ``M``.
      num_replicas: ``R``, the data-parallel replicas the batch is shared among.

    Returns:
      ``tree`` with every leaf ``[B, ...] -> [M, B // M, ...]``: micro-batch ``m`` is the
      ``m``-th block of ``B // (R * M)`` rows of each replica's ``B // R`` rows, replica by
      replica (with one replica, the ``m``-th block of ``B // M`` rows).

    Raises:
      ValueError: if ``B`` is not a multiple of ``R * M``.
    """
    R, M = num_replicas, num_microbatches
    blocks = _blocks(tree, M, R)  # [R, M, rows, ...]
    return tree_map(lambda a: jnp.swapaxes(a, 0, 1).reshape(M, -1, *a.shape[3:]), blocks)


def _blocks(tree, num_microbatches: int, num_replicas: int):
    """Every leaf ``[B, ...] -> [R, M, B // (R * M), ...]``: replica, micro-batch, rows."""
    R, M = num_replicas, num_microbatches

    def split(a):
        if a.shape[0] % (R * M):
            raise ValueError(
                f"batch of {a.shape[0]} rows cannot be split into {M} equal micro-batches"
                + (f" on each of {R} replicas" if R > 1 else "")
                + f"; use a batch size that is a multiple of num_microbatches={M}"
                + (f" times num_replicas={R}" if R > 1 else "")
            )
        return a.reshape(R, M, a.shape[0] // (R * M), *a.shape[1:])

    return tree_map(split, tree)


def stage_slice(stage_params, stage: int):
    """The parameters of one stage.

    Args:
      stage_params: a pytree with leaves ``[N, ...]``.
      stage: the logical stage.

    Returns:
      ``leaf[stage]`` of every leaf (also of leaves split over an Explicit mesh axis, as
      ``pipe.logical`` returns them on such a mesh: `jaxpipe.stages.stage_slice`).
    """
    return stages.stage_slice(stage_params, stage)


def init_opt_states(opt: optax.GradientTransformation, stage_params) -> list:
    """One optimizer state per logical stage, for that stage's own parameters.

    Args:
      opt: the optimizer.
      stage_params: a pytree with leaves ``[N, ...]``.

    Returns:
      A list of ``N`` states, ``opt.init`` of each stage's slice.
    """
    num = jax.tree.leaves(stage_params)[0].shape[0]
    return [opt.init(stage_slice(stage_params, s)) for s in range(num)]


def _pick(fn, values: dict) -> dict:
    """The keywords among ``values`` that ``fn`` names; ``side`` and ``key`` only if given."""
    accepted = keywords_of(fn)
    return {k: v for k, v in values.items() if k in accepted and (v is not None or k == "stage")}


def _run_stage(stage_fn, loss_fn, params, x, keywords, loss_inputs):
    """One stage's forward; at the last stage (``loss_fn`` given) the micro-batch's loss."""
    y = stage_fn(params, x, **_pick(stage_fn, keywords))
    if loss_fn is None:
        return y
    loss_params, target, loss_key = loss_inputs
    return loss_fn(loss_params, y, target, **_pick(loss_fn, {**keywords, "key": loss_key}))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _forward(stage_fn, loss_fn, params, x, keywords, loss_inputs):
    return _run_stage(stage_fn, loss_fn, params, x, keywords, loss_inputs)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _backward(stage_fn, loss_fn, params, x, keywords, loss_inputs, output_grad):
    """``(d params, d x)``: the stage's vjp at ``(params, x)`` applied to ``output_grad``."""
    _, vjp = jax.vjp(
        lambda p, h: _run_stage(stage_fn, loss_fn, p, h, keywords, loss_inputs), params, x
    )
    return vjp(output_grad)


@functools.partial(jax.jit, static_argnums=0)
def _optimizer_step(opt, params, opt_state, grads):
    """Applies ``opt`` to ``params`` with the mean of the gradients in the tuple ``grads``."""
    mean_grad = tree_map(lambda *g: sum(g) / len(g), *grads)
    updates, opt_state = opt.update(mean_grad, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _mean(trees: list):
    return tree_map(lambda *leaves: sum(leaves) / len(leaves), *trees)


def replay(
    schedule: Schedule,
    stage_fn,
    loss_fn,
    stage_params,
    loss_params,
    opt: optax.GradientTransformation,
    opt_states,
    inputs,
    targets,
    *,
    side=None,
    key=None,
    num_replicas: int = 1,
):
    """Runs ``schedule`` once over one batch, updating weights where the schedule says.

    A forward stashes its input and the version it read; the backward takes ``jax.vjp`` of
    the stage at exactly those (recomputing the forward gives the numbers that keeping the
    forward's residuals would). Each action is jitted on its own, for speed only.

    Args:
      schedule: the table.
      stage_fn: ``(params, x, **keywords) -> y``, or a list of one such function per
        logical stage (module docstring).
      loss_fn: ``(loss_params, y, target, **keywords) -> scalar``.
      stage_params: logical stage parameters, leaves ``[N, ...]``: version 0.
      loss_params: the loss function's parameters (not trained).
      opt: the optimizer each stage applies to its own parameters.
      opt_states: one optimizer state per stage (`init_opt_states`).
      inputs: the batch of inputs, a pytree with rows on axis 0.
      targets: the batch of targets, a pytree with rows on axis 0.
      side: side inputs, a pytree with rows on axis 0, or None.
      key: a PRNG key, or None.
      num_replicas: ``R``, the data-parallel replicas the pipeline runs the batch on.

    Returns:
      ``(stage_params, opt_states, losses)``: the newest version of every stage, stacked as
      given; the list of per-stage optimizer states; and the loss of each micro-batch (the
      mean over replicas), shape ``(M,)``.

    Raises:
      ValueError: if the parameters or states do not have one entry per stage, if the batch
        does not split into ``R * M`` equal blocks, if the table names a weight version that
        is not alive, or if a backward names a version other than its forward's.
    """
    N = schedule.num_logical_stages
    M = schedule.num_microbatches
    R = num_replicas
    last = N - 1
    if len(jax.tree.leaves(stage_params)[0]) != N or len(opt_states) != N:
        raise ValueError(
            f"schedule {schedule.name!r} has {N} stages; stage_params leaves need a leading "
            f"axis of length {N} and opt_states {N} entries (init_opt_states), got "
            f"{len(jax.tree.leaves(stage_params)[0])} and {len(opt_states)}"
        )
    functions = list(stage_fn) if isinstance(stage_fn, list | tuple) else [stage_fn] * N
    if len(functions) != N:
        raise ValueError(
            f"stage_fn is a list of {len(functions)} functions; schedule {schedule.name!r} "
            f"has {N} logical stages: give one function per stage"
        )
    xs, ts = _blocks(inputs, M, R), _blocks(targets, M, R)
    sides = None if side is None else _blocks(side, M, R)
    keys = [
        None if key is None else (jax.random.fold_in(key, r) if R > 1 else key) for r in range(R)
    ]

    def rows(blocks, r: int, m: int):
        return None if blocks is None else tree_map(lambda a: a[r, m], blocks)

    def keywords(s: int, m: int, r: int) -> dict:
        """What stage ``s`` of micro-batch ``m`` on replica ``r`` may be passed."""
        k = keys[r]
        if k is not None:
            k = jax.random.fold_in(jax.random.fold_in(k, m), s)
        return {"side": rows(sides, r, m), "key": k, "stage": jnp.int32(s)}

    def stage_call(s: int, m: int, r: int):
        """The static functions and the loss inputs of stage ``s`` on micro-batch ``m``."""
        if s == last:  # the loss's own key: the one a stage N would get
            k = keys[r]
            k = k if k is None else jax.random.fold_in(jax.random.fold_in(k, m), N)
            return functions[s], loss_fn, (loss_params, rows(ts, r, m), k)
        return functions[s], None, None

    versions = [{0: stage_slice(stage_params, s)} for s in range(N)]  # stage -> {v: params}
    newest = [0] * N
    opt_states = list(opt_states)
    updates_at: dict[int, list[tuple[int, tuple[int, ...]]]] = {}  # tick -> [(stage, group)]
    for s, row in enumerate(update_points(schedule)):
        for tick, group in row:
            updates_at.setdefault(tick, []).append((s, group))

    # Per replica r: stage_input[(s, m, r)], the input of stage s; output_grad[(s, m, r)],
    # d loss / d output of stage s (the backward's cotangent); pending_w[(s, m, r)], the
    # weight gradient a B computed for its W. Shared: stashed[(s, m)], the version its F
    # read, until its last backward; weight_grad[(s, m)], the mean over replicas, until the
    # stage's update.
    stage_input = {(0, m, r): rows(xs, r, m) for m in range(M) for r in range(R)}
    stashed, output_grad, pending_w, weight_grad = {}, {}, {}, {}
    losses = [None] * M

    def read(action: Action):
        """The weights ``action`` reads: the version the table names, which must be alive."""
        if action.version not in versions[action.stage]:
            raise ValueError(
                f"{action} reads version {action.version} of stage {action.stage}, but the "
                f"versions alive are {sorted(versions[action.stage])}"
            )
        return versions[action.stage][action.version]

    for t, row in enumerate(schedule.ticks):
        # Devices run independently within a tick: every input an action needs was made in
        # an earlier tick (jaxpipe.schedules.validate), so the order of this loop does not
        # matter.
        for cell in row:
            for a in cell:
                if a.op == U:  # applied below, after every action of the tick
                    continue
                s, m = a.stage, a.microbatch
                if a.op == F:
                    outs = []
                    for r in range(R):
                        fn, loss, loss_inputs = stage_call(s, m, r)
                        out = _forward(
                            fn, loss, read(a), stage_input[(s, m, r)], keywords(s, m, r),
                            loss_inputs,
                        )  # fmt: skip
                        outs.append(out)
                        if s != last:
                            stage_input[(s + 1, m, r)] = out
                    if s == last:
                        losses[m] = _mean(outs)
                    stashed[(s, m)] = a.version
                    continue

                if a.version != stashed[(s, m)]:
                    raise ValueError(
                        f"tick {t}: {a} reads version {a.version} of stage {s}, but its "
                        f"forward read version {stashed[(s, m)]}; they must match "
                        f"(weight stashing)"
                    )
                grads = []
                for r in range(R):
                    if a.op in (BW, B):
                        fn, loss, loss_inputs = stage_call(s, m, r)
                        if s == last:
                            cotangent = jnp.ones_like(losses[m])
                        else:
                            cotangent = output_grad.pop((s, m, r))
                        grad_params, grad_input = _backward(
                            fn, loss, read(a), stage_input[(s, m, r)], keywords(s, m, r),
                            loss_inputs, cotangent,
                        )  # fmt: skip
                        if s > 0:
                            output_grad[(s - 1, m, r)] = grad_input
                        if a.op == B:
                            pending_w[(s, m, r)] = grad_params
                            continue
                    else:  # W
                        grad_params = pending_w.pop((s, m, r))
                    grads.append(grad_params)
                    del stage_input[(s, m, r)]
                if grads:
                    weight_grad[(s, m)] = _mean(grads)
                    del stashed[(s, m)]

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
    stacked = tree_map(lambda *leaves: jnp.stack(leaves), *final)
    return stacked, opt_states, jnp.stack(losses)
