"""The user's entry point: `Pipeline`, a layer stack run under any schedule.

```python
import jaxpipe
pipe = jaxpipe.Pipeline(stage_fn, loss_fn, mesh=mesh, schedule="1f1b", num_microbatches=8)
params = pipe.place(logical_params)        # once: [S*v, ...] -> the device layout [v, S, ...]
loss = pipe.loss(params, loss_params, inputs, targets)    # differentiable scalar
outputs = pipe.forward(params, inputs)                     # inference
```

- ``stage_fn(params_of_one_stage, x) -> y`` with ``y`` of the structure, shapes and dtypes
  of ``x`` (an array or a pytree of arrays). It may also take the keywords ``key`` (a PRNG
  key per micro-batch and stage: ``fold_in(fold_in(key, m), s)`` for micro-batch ``m`` and
  logical stage ``s``), ``side`` (the micro-batch's side inputs) and ``stage`` (the logical
  stage index); each is passed if the function's signature names it. With data-parallel
  replicas (data axes of total size ``R > 1``), replica ``r`` folds its index in first,
  ``fold_in(fold_in(fold_in(key, r), m), s)``, so replicas draw different random numbers
  for their different rows.
- ``loss_fn(loss_params, y, target) -> scalar`` runs on the last stage (head and loss); it
  may take ``key`` and ``side`` the same way.
- Stage parameters live in the pipeline's device layout (`jaxpipe.layout`): leaves
  ``[v, S, ...]`` with the ``S`` axis sharded over the pipe axis, so each device holds its own
  stages only. `Pipeline.place` and `Pipeline.logical` convert from and to logical stage
  order ``[S*v, ...]``; `Pipeline.init` creates parameters directly in the layout. Both
  return a `jaxpipe.layout.Placed`, which carries its layout through ``jit``, ``grad`` and
  ``optax``; every method takes placed parameters, refuses those of another layout
  (convert with `Pipeline.place`), and returns placed gradients.
- ``inputs``, ``targets`` and ``side`` are pytrees of full batches, split into ``M``
  micro-batches along axis 0 in contiguous blocks: micro-batch ``m`` holds rows
  ``m * B // M`` to ``(m + 1) * B // M - 1`` (`split_microbatches`). With ``R`` data-parallel
  replicas, replica ``r`` holds the ``r``-th block of ``B // R`` rows and micro-batch ``m``
  is the ``m``-th block of ``B // (R * M)`` rows of every replica's block: no row leaves
  its replica, and no copy of the batch is made (the split is a reshape). ``loss`` is the
  mean of ``loss_fn`` over micro-batches.

``jax.grad`` of any function that calls `Pipeline.loss` runs the schedule's own forward and
backward order (a ``jax.custom_vjp`` boundary): gradients with respect to stage parameters,
loss parameters and float inputs are exact, and stage-parameter gradients stay in the
layout.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpipe import _checks as checks
from jaxpipe import _executor as executor
from jaxpipe import reference
from jaxpipe._executor import Context
from jaxpipe._executor.plan import COLUMN, make_plan
from jaxpipe._executor.sharding import GATHER_MODES, WeightSharding, constrain
from jaxpipe.layout import Layout, Placed, flat_specs, inner_spec, is_placed
from jaxpipe.schedules import Schedule

tree_map = jax.tree_util.tree_map


def split_microbatches(x, num_microbatches: int, num_replicas: int = 1):
    """``[B, ...] -> [M, B // M, ...]``, the pipeline's micro-batches of a batch: with one
    replica, micro-batch ``m`` is the ``m``-th block of ``B // M`` rows; with ``R``
    data-parallel replicas, the ``m``-th block of ``B // (R * M)`` rows of each replica's
    ``B // R`` rows, replica by replica."""
    R, M = num_replicas, num_microbatches
    x = x.reshape(R, M, x.shape[0] // (R * M), *x.shape[1:])
    return jnp.swapaxes(x, 0, 1).reshape(M, x.shape[0] * x.shape[2], *x.shape[3:])


class Pipeline:
    """A stack of ``S * v`` stages run on the mesh axis ``axis`` under a pipeline schedule.

    Args:
      stage_fn: ``(params_of_one_stage, x, **keywords) -> y``, structure, shape and dtype
        preserving (see the module docstring for the keywords). A list of ``S * v`` such
        functions, one per logical stage (all taking parameters of one structure), runs
        function ``s`` on stage ``s`` (a ``lax.switch`` on the keyword ``stage``).
      loss_fn: ``(loss_params, y, target, **keywords) -> scalar``, run on the last stage.
        Needed by `loss`; `forward` does without it.
      mesh: a ``jax.sharding.Mesh`` with an axis named ``axis`` (its size is ``S``).
      schedule: a name from ``jaxpipe.schedules.names()`` or a `Schedule` (for example one
        loaded from CSV) whose ``num_stages`` equals the axis size.
      num_microbatches: ``M``; taken from the schedule when one is given.
      axis: the pipe axis name.
      schedule_options: options for ``jaxpipe.schedules.get`` (``virtual_stages=2``, ...).
      remat: keep only each stage's input between its forward and backward and recompute
        the forward in the backward (less memory, about one more forward of compute).
        Where the schedule holds W's back (zero-bubble schedules: more than one
        micro-batch waiting for its W), each such micro-batch then keeps only narrow
        cotangents (a block's output's) and W recomputes the wide ones from them (an MLP's
        hidden layer's: one more matrix product per block); see
        `jaxpipe._jaxpr.split.narrows_stash`.
      data_axes: mesh axes the batch is split over (data parallelism). Default: those of
        ``"data"`` and ``"fsdp"`` the mesh has. Inside the pipeline they are manual like the
        pipe axis: each replica runs the schedule on its own rows, and loss and gradients
        are averaged over the replicas once, after the schedule. This assumes ``loss_fn`` is
        a mean over the rows of its micro-batch (for a token-weighted loss see
        docs/transformers.md, "Losses that are not a mean over rows"). A stage weight whose
        placement spec (`place`'s ``specs``) splits a dimension over one of these axes is
        stored split (FSDP, ZeRO-3) and gathered when needed (``fsdp_gather``). Other axes
        (``tensor``) stay under XLA's automatic sharding inside each stage. With more than
        one replica, each gets its own ``key`` (``fold_in(key, r)`` for replica ``r``, see
        the module docstring).
      fsdp_gather: ``"per_use"`` (default): every action gathers the one chunk it needs
        and reduce-scatters its weight gradient (least memory); ``"once"``: the device's
        chunks are gathered once per step and kept, their gradients reduce-scattered once
        after the schedule (fewest collectives).
      remat_policy: a ``jax.checkpoint`` policy applied to each stage: between a stage's
        forward and its backward the pipeline keeps what the policy saves (and the stage
        input) and the backward recomputes the rest. The default,
        ``jax.checkpoint_policies.dots_saveable``, keeps the results of matrix
        multiplications and recomputes the elementwise work between them, which is what XLA
        does within a plain training step; ``jax.checkpoint_policies.everything_saveable``
        keeps every residual, ``None`` does what ``jax.vjp`` does (the same, unfused), and
        ``remat=True`` keeps only the stage input.
      grad_dtype: the dtype weight and loss-parameter gradients accumulate in across
        micro-batches (default float32, whatever the parameters' dtype; None: the
        parameters' own). Gradients are returned in the parameters' dtypes.
    """

    def __init__(
        self,
        stage_fn: Callable,
        loss_fn: Callable | None = None,
        *,
        mesh: jax.sharding.Mesh,
        schedule: str | Schedule = "1f1b",
        num_microbatches: int | None = None,
        axis: str = "pipe",
        schedule_options: Mapping[str, Any] | None = None,
        remat: bool = False,
        data_axes: str | tuple[str, ...] | None = None,
        fsdp_gather: str = "per_use",
        remat_policy: Callable | None = jax.checkpoint_policies.dots_saveable,
        grad_dtype: Any = jnp.float32,
    ):
        checks.mesh(mesh, axis)
        schedule = checks.schedule(schedule, mesh, axis, num_microbatches, schedule_options)
        if isinstance(stage_fn, list | tuple):
            stage_fn = _switch_stages(stage_fn, schedule.num_logical_stages)
        checks.functions(stage_fn, loss_fn)
        self.data_axes = checks.data_axes(data_axes, mesh, axis)
        self.schedule = schedule
        self._plan = make_plan(schedule)
        self._forward_plan = make_plan(schedule.forward_only())
        self.updates_weights = self._plan.updates_weights
        if self.data_axes and self.updates_weights:
            raise ValueError(
                f"schedule {schedule.name!r} updates weights inside the pipeline, which is not "
                f"supported together with data-parallel axes {self.data_axes}; use a mesh "
                "without them (data_axes=()) or a schedule without weight updates"
            )
        if remat:
            remat_policy = None  # the stage input only, recomputed whole
        self.stage_fn = stage_fn
        self.loss_fn = loss_fn
        self.mesh = mesh
        self.axis = axis
        self.remat = bool(remat)
        self.remat_policy = remat_policy
        self.fsdp_gather = checks.one_of("fsdp_gather", fsdp_gather, GATHER_MODES)
        self._weight_specs = None  # (treedef, flat inner specs) recorded by place / init
        self._probed = set()  # stage signatures checked by checks.stage_data_movement
        self._warned_idle_axes = False
        self.grad_dtype = grad_dtype
        self.num_replicas = int(np.prod([mesh.shape[a] for a in self.data_axes]))
        self.layout = Layout.of(schedule, mesh, axis)
        self._stage_keywords = reference.keywords_of(stage_fn)
        self._loss_keywords = reference.keywords_of(loss_fn) if loss_fn is not None else set()
        self._loss = self._make_loss()

    # ---------------------------------------------------------------- properties
    @property
    def num_stages(self) -> int:
        """``S``: devices on the pipe axis."""
        return self.schedule.num_stages

    @property
    def num_logical_stages(self) -> int:
        """``S * v``: the number of stages the model is cut into."""
        return self.schedule.num_logical_stages

    @property
    def num_microbatches(self) -> int:
        return self.schedule.num_microbatches

    # ---------------------------------------------------------------- parameters
    def place(self, logical_params, specs=None):
        """Logical stage order ``[S*v, ...]`` -> the device layout ``[v, S, ...]``, sharded.

        Returns a `jaxpipe.layout.Placed`. Call once, before training (not inside a step).
        Given a tree holding `Placed` nodes of another layout (parameters, optimizer state,
        restored from a checkpoint or placed by another pipeline), moves each into this
        pipeline's layout. ``specs``: per leaf (or one for all)
        a ``PartitionSpec`` of the dimensions after the stage axis, e.g. ``P(None, "tensor")``.
        Dimensions split over a batch axis (``"fsdp"``, ``"data"``) are stored split (FSDP)
        and gathered when a stage needs them; the pipeline remembers the specs for the steps
        that take these parameters. See `jaxpipe.layout.Layout.place`.
        """
        if not any(map(is_placed, jax.tree_util.tree_leaves(logical_params, is_placed))):
            checks.params(logical_params)  # logical parameters, not optimizer state
        placed = self.layout.place(logical_params, specs)
        if isinstance(placed, Placed):
            if isinstance(logical_params, Placed):  # converted: the specs it was placed with
                specs = tree_map(lambda x: inner_spec(x.sharding), placed.tree)
            self._remember_specs(placed.tree, specs)
        return placed

    def logical(self, params):
        """Placed parameters (a `jaxpipe.layout.Placed`, read in its own layout) -> logical
        stage order ``[S*v, ...]`` (for export and inspection; not inside a step)."""
        return self.layout.logical(params)

    def init(self, init_stage: Callable, key, specs=None):
        """Parameters created directly in the device layout (a `jaxpipe.layout.Placed`):
        ``init_stage(key)`` builds one
        stage's; logical stage ``s`` uses ``jax.random.split(key, S*v)[s]``. ``specs`` as in
        `place`.

        With JAX's default ``threefry2x32`` keys, ``pipe.logical(pipe.init(f, key))`` equals
        ``jax.vmap(f)(jax.random.split(key, S*v))`` under every schedule and mesh. ``rbg`` and
        ``unsafe_rbg`` keys draw other bits under ``vmap`` than one key at a time, and which
        ones depends on the batch of keys: the values then depend on the schedule's
        placement. To start runs with different layouts from the same values, build the
        logical parameters once and `place` them."""
        checks.params(jax.eval_shape(init_stage, key))
        placed = self.layout.init(init_stage, key, specs)
        self._remember_specs(placed.tree, specs)
        return placed

    def _remember_specs(self, placed, specs) -> None:
        treedef = jax.tree_util.tree_structure(placed)
        self._weight_specs = (treedef, tuple(flat_specs(placed, specs)))

    # ---------------------------------------------------------------- steps
    def loss(self, params, loss_params, inputs, targets, *, side=None, key=None):
        """Mean over micro-batches of ``loss_fn`` on the last stage's outputs; differentiable
        with respect to ``params``, ``loss_params`` and the float leaves of ``inputs``."""
        self._check_synchronous("loss")
        self._check(params, inputs, loss_params, targets, side, key)
        return self._loss(params, loss_params, inputs, targets, side, key)

    def loss_and_grads(
        self, params, loss_params, inputs, targets, input_grads=False, *, side=None, key=None
    ):
        """``(loss, (grads, loss_grads[, input_grads]))`` by the schedule, no autodiff.

        ``grads`` are in the device layout; ``input_grads`` has the structure of ``inputs``
        (None for integer and boolean leaves).
        """
        self._check_synchronous("loss_and_grads")
        self._check(params, inputs, loss_params, targets, side, key)
        out = self._run(
            self._plan,
            "train",
            params,
            loss_params,
            inputs,
            targets,
            side,
            key,
            input_grad=input_grads,
        )
        grads = (out["grads"], out["loss_grads"])
        if input_grads:
            grads += (out["input_grads"],)
        return out["loss"], grads

    def forward(self, params, inputs, *, side=None, key=None):
        """The last stage's outputs for the whole batch (``[B, ...]`` leaves), forward only."""
        self._check(params, inputs, side=side, key=key)
        return self._run(self._forward_plan, "forward", params, None, inputs, None, side, key)[
            "outputs"
        ]

    def init_optimizer(self, optimizer: optax.GradientTransformation, params):
        """One optimizer state per stage (leaves ``[v, S, ...]``, a `Placed` if ``params``
        is), for `train`, in the parameters' layout: moments sharded like their parameters,
        per-stage counters ``[v, S]`` over the pipe axis (so each device holds its own
        stages' state)."""
        init = jax.vmap(jax.vmap(optimizer.init))
        given, params = params, self.layout.check_placed(params, "params")
        leaves = jax.tree_util.tree_leaves(params)
        if any(isinstance(x, jax.core.Tracer) for x in leaves):  # the caller's jit decides
            return self._like(init(params), given)
        stage_sharding = self.layout.sharding()  # P(None, pipe): [v, S] and anything else
        abstract = jax.eval_shape(init, params)
        try:  # moments (parameter-shaped subtrees) sharded like the parameters
            shardings = optax.tree_utils.tree_map_params(
                optimizer,
                lambda _, p: p.sharding,
                abstract,
                params,
                transform_non_params=lambda x: tree_map(lambda _: stage_sharding, x),
            )
        except Exception:  # an init that needs real shapes: every leaf over the pipe axis
            shardings = tree_map(lambda _: stage_sharding, abstract)
        # A bare jit would put the state on one device: init reads no parameter values.
        return self._like(self.layout._jit(init, shardings)(params), given)

    def train(
        self,
        optimizer: optax.GradientTransformation,
        params,
        opt_state,
        loss_params,
        inputs,
        targets,
        *,
        side=None,
        key=None,
    ):
        """One training step with the optimizer applied per stage, as the schedule says.

        Returns ``(params, opt_state, losses)`` with ``losses`` the ``M`` micro-batch losses.
        Each stage owns its optimizer state (from `init_optimizer`) and updates its own
        parameters: element-wise optimizers (SGD, Adam, ...) then match a global ``optax``
        step; ones that look at all parameters at once (global-norm clipping) act per stage
        here. Loss parameters are not trained by this method.

        - Schedules without weight updates in their table (``1f1b``, ...): one update per
          stage from the step's mean gradient, as ``optax.update`` after `loss_and_grads`.
        - Schedules with weight updates (``pipedream``, ``pipedream_2bw``): each stage updates
          where the table says, with the mean gradient of the micro-batches since its
          previous update, each computed at the weight version its forward read.

        The semantics are defined by `jaxpipe.replay.replay`, which replays the same table
        on one device; tests hold this method to it.
        """
        self._check(params, inputs, loss_params, targets, side, key)
        tree = self.layout.check_placed(params)
        state = self.layout.check_placed(opt_state, "opt_state", allow_empty=True)
        if not self.updates_weights:
            out = self._run(self._plan, "train", params, loss_params, inputs, targets, side, key)
            updates, state = jax.vmap(jax.vmap(optimizer.update))(
                self.layout.check_placed(out["grads"]), state, tree
            )
            new = optax.apply_updates(tree, updates)
            return self._like(new, params), self._like(state, opt_state), out["losses"]
        out = self._run(
            self._plan,
            "update",
            params,
            loss_params,
            inputs,
            targets,
            side,
            key,
            opt_state=opt_state,
            optimizer=optimizer,
        )
        new, state = out["params"], out["opt_state"]
        return self._like(new, params), self._like(state, opt_state), out["losses"]

    # ---------------------------------------------------------------- inspection
    def trace(self, params, loss_params, inputs, targets, *, side=None, key=None) -> np.ndarray:
        """What each device executed in each tick, read back from the compiled program.

        For schedules with weight updates the traced program is the one without them (same
        table, versions ignored). Returns an int array ``[T, S, 6]``: forward op code,
        stage, micro-batch, backward op code, stage, micro-batch (codes from
        `jaxpipe._executor.plan.ForwardOp` / ``BackwardOp``; 0 is idle). Compare with
        `expected_trace`.
        """
        self._check(params, inputs, loss_params, targets, side, key)
        trace = self._traced_run(params, loss_params, inputs, targets, side, key)
        return trace[:, :, :6]

    def expected_trace(self) -> np.ndarray:
        """The trace `trace` must return, computed from the schedule's table alone."""
        table = self._plan.table
        cols = ["f_op", "f_stage", "f_mb", "b_op", "b_stage", "b_mb"]
        return np.stack([table[:, :, COLUMN[c]] for c in cols], axis=-1)

    def first_nonfinite(
        self, params, loss_params, inputs, targets, *, side=None, key=None
    ) -> dict | None:
        """Where the first NaN or infinity appears, or None if loss and gradients are finite.

        Runs the schedule once more with a finiteness check after every action (a separate
        program: the normal path is not slowed) and returns the earliest offending action as
        ``{"tick", "device", "op", "stage", "microbatch"}`` with ``op`` ``"F"`` (its output or
        loss) or ``"backward"`` (its input gradient, or the weight gradients it accumulated).
        Not jittable: it returns Python values.
        """
        self._check(params, inputs, loss_params, targets, side, key)
        trace = self._traced_run(params, loss_params, inputs, targets, side, key)
        for tick in range(trace.shape[0]):
            for device in range(trace.shape[1]):
                row = trace[tick, device]
                for code, stage, mb, finite, op in ((0, 1, 2, 6, "F"), (3, 4, 5, 7, "backward")):
                    if row[code] and not row[finite]:
                        return dict(
                            tick=tick,
                            device=device,
                            op=op,
                            stage=int(row[stage]),
                            microbatch=int(row[mb]),
                        )
        return None

    # ---------------------------------------------------------------- internals
    def _traced_run(self, *args) -> np.ndarray:
        """The training program with its per-tick record, compiled (never eager: an eager
        ``shard_map`` cannot take weights split over an automatic axis such as tensor)."""
        run = jax.jit(lambda *a: self._run(self._plan, "train", *a, trace=True)["trace"])
        return np.asarray(run(*args))

    def _program(self, plan, mode, params, **options) -> executor.Program:
        weights = self._weights(params)
        return executor.Program(
            plan=plan,
            stage_fn=self._stage_call,
            loss_fn=self._loss_call,
            mesh=self.mesh,
            axis=self.axis,
            mode=mode,
            remat=self.remat,
            data_axes=self.data_axes,
            weights=weights,
            grad_dtype=self.grad_dtype,
            **options,
        )

    def _stage_call(self, params, x, context: Context):
        """The user's stage_fn with the keywords its signature names."""
        fn = self.stage_fn
        if self.remat_policy is not None:
            fn = jax.checkpoint(fn, policy=self.remat_policy)
        return fn(params, x, **self._pass(self._stage_keywords, context))

    def _loss_call(self, loss_params, y, target, context: Context):
        return self.loss_fn(loss_params, y, target, **self._pass(self._loss_keywords, context))

    @staticmethod
    def _pass(accepted: set, context: Context) -> dict:
        values = {"key": context.key, "side": context.side, "stage": context.stage}
        return {
            k: v for k, v in values.items() if k in accepted and (v is not None or k == "stage")
        }

    def _run(
        self,
        plan,
        mode,
        params,
        loss_params,
        inputs,
        targets,
        side,
        key,
        input_grad=False,
        trace=False,
        opt_state=None,
        optimizer=None,
    ):
        given, params = params, self.layout.check_placed(params)
        if opt_state is not None:
            opt_state = self.layout.check_placed(opt_state, "opt_state", allow_empty=True)
        program = self._program(
            plan, mode, params, input_grad=input_grad, trace=trace, optimizer=optimizer
        )

        out = executor.run(
            program, params, loss_params, inputs, targets, side, key, opt_state=opt_state
        )
        result = dict(out)
        if "grads" in result:
            result["grads"] = self._like(result["grads"], given)
        if mode == "forward":
            treedef = jax.tree_util.tree_structure(inputs)
            result["outputs"] = treedef.unflatten(out["results"])
        else:
            result["losses"] = out["results"]
            result["loss"] = jnp.mean(out["results"])
        if input_grad:
            grads = iter(out["input_grads"])
            result["input_grads"] = tree_map(
                lambda x: next(grads) if jnp.issubdtype(x.dtype, jnp.inexact) else None, inputs
            )
        return result

    def _make_loss(self):
        pipe = self

        @jax.custom_vjp
        def pipeline_loss(params, loss_params, inputs, targets, side, key):
            out = pipe._run(
                pipe._forward_plan, "loss", params, loss_params, inputs, targets, side, key
            )
            return out["loss"]

        def fwd(params, loss_params, inputs, targets, side, key):
            # symbolic_zeros=True wraps every leaf in a CustomVJPPrimal(value, perturbed).
            def values(tree):
                return tree_map(lambda p: p.value, tree, is_leaf=_is_primal)

            perturbed = [
                p.perturbed
                for p in jax.tree_util.tree_leaves(inputs, is_leaf=_is_primal)
                if jnp.issubdtype(p.value.dtype, jnp.inexact)
            ]
            input_grad = any(perturbed)
            out = pipe._run(
                pipe._plan,
                "train",
                values(params),
                values(loss_params),
                values(inputs),
                values(targets),
                values(side),
                values(key),
                input_grad=input_grad,
            )
            saved = (out["grads"], out["loss_grads"], out.get("input_grads"))
            return out["loss"], saved

        def bwd(saved, g):
            grads, loss_grads, input_grads = saved

            def scale(tree):
                return tree_map(lambda x: (x * g).astype(x.dtype), tree)

            grads = pipe._split_like_params(scale(grads))
            return grads, scale(loss_grads), scale(input_grads), None, None, None

        pipeline_loss.defvjp(fwd, bwd, symbolic_zeros=True)
        return pipeline_loss

    def _split_like_params(self, grads):
        """``grads`` constrained to the sharding their parameters were placed with."""
        tree = self.layout.check_placed(grads, "grads")
        specs = self._weights(tree).placed_specs(tree, self.axis)
        return self._like(constrain(tree, self.mesh, specs), grads)

    def _like(self, tree, given):
        """``tree`` (``[v, S, ...]`` leaves) as a `Placed` if ``given`` was one."""
        return Placed(tree, self.layout.order) if isinstance(given, Placed) else tree

    def _weights(self, params) -> WeightSharding:
        """How ``params``' leaves are split (the specs `place` or `init` recorded)."""
        treedef = jax.tree_util.tree_structure(params)
        specs = (None,) * treedef.num_leaves
        if self._weight_specs is not None and self._weight_specs[0] == treedef:
            specs = self._weight_specs[1]
        return WeightSharding.of(treedef, specs, self.data_axes, self.fsdp_gather)

    def _check_synchronous(self, method):
        if self.updates_weights:
            raise ValueError(
                f"schedule {self.schedule.name!r} updates weights inside the pipeline (weight "
                f"versions), so it has no single gradient for {method}(); use "
                "Pipeline.train(optimizer, params, opt_state, loss_params, inputs, targets), "
                "or a schedule without weight updates such as '1f1b'"
            )

    def _warn_idle_axes(self, params) -> None:
        """Warns once per pipeline about mesh axes with no role (see `checks`)."""
        if self._warned_idle_axes:
            return
        self._warned_idle_axes = True
        specs = self._weight_specs[1] if self._weight_specs is not None else ()
        message = checks.idle_axes_warning(self.mesh, self.axis, self.data_axes, specs, params)
        if message:
            warnings.warn(message, stacklevel=4)

    def _check(self, params, inputs, loss_params=None, targets=None, side=None, key=None):
        """Raises a clear error, before tracing, for inputs the pipeline cannot run."""
        params = self.layout.check_placed(params)
        checks.params(params)
        self._warn_idle_axes(params)
        checks.batch(inputs, targets, side, self.num_microbatches, self.num_replicas)
        checks.keywords(self._stage_keywords, self._loss_keywords, side, key)
        chunk = tree_map(lambda p: jax.ShapeDtypeStruct(p.shape[2:], p.dtype), params)
        M = self.num_microbatches
        x = _one_microbatch(inputs, M)
        context = Context(
            side=_one_microbatch(side, M),
            key=None if key is None else jax.random.fold_in(key, 0),
            stage=jnp.int32(0),
            microbatch=jnp.int32(0),
        )
        y = checks.stage_output(self._stage_call, chunk, x, context)
        probe = (jax.tree_util.tree_structure(chunk), str(chunk), str(x))
        if probe not in self._probed:
            checks.stage_data_movement(
                self._stage_call,
                chunk,
                x,
                context,
                self.mesh,
                self._weights(params).inner,
                {self.axis, *self.data_axes},
            )
            self._probed.add(probe)
        if loss_params is not None or targets is not None:
            if self.loss_fn is None:
                raise ValueError("this Pipeline has no loss_fn; pass one to use loss()")
            checks.loss_output(
                self._loss_call, loss_params, y, _one_microbatch(targets, M), context
            )


def _switch_stages(functions, num_logical_stages: int) -> Callable:
    """One ``stage_fn`` from a list of per-stage functions: ``lax.switch`` on the stage."""
    functions = list(functions)
    if len(functions) != num_logical_stages or not all(map(callable, functions)):
        raise ValueError(
            f"stage_fn is a list of {len(functions)} items; a list of per-stage functions "
            f"needs one callable per logical stage, {num_logical_stages} for this schedule "
            "(pipe.num_logical_stages), each taking (params, x) and returning x's structure"
        )
    accepted = [reference.keywords_of(f) for f in functions]

    def stage_fn(params, x, *, stage, **keywords):
        branches = [
            lambda p, x, kw, f=f, a=a: f(p, x, **{k: v for k, v in kw.items() if k in a})
            for f, a in zip(functions, accepted, strict=True)
        ]
        keywords = dict(keywords, stage=stage)
        return jax.lax.switch(stage, branches, params, x, keywords)

    return stage_fn


def _is_primal(x) -> bool:
    return isinstance(x, jax.custom_derivatives.CustomVJPPrimal)


def _one_microbatch(tree, num_microbatches):
    return tree_map(
        lambda a: jax.ShapeDtypeStruct((a.shape[0] // num_microbatches, *a.shape[1:]), a.dtype),
        tree,
    )
