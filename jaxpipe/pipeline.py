"""The user's entry point: `Pipeline`, a layer stack run under any schedule.

```python
from jaxpipe import pipeline
pipe = pipeline.Pipeline(stage_fn, loss_fn, mesh=mesh, schedule="1f1b", num_microbatches=8)
loss = pipe.loss(stage_params, loss_params, inputs, targets)     # differentiable scalar
outputs = pipe.forward(stage_params, inputs)                     # inference
```

- ``stage_fn(params_of_one_stage, x) -> y`` with ``y`` of the same shape and dtype as ``x``.
- ``loss_fn(loss_params, y, target) -> scalar`` runs on the last stage (head and loss).
- ``stage_params``: leaves with a leading axis of length ``S * v`` in logical stage order.
- ``inputs`` / ``targets``: full batches, split into ``M`` micro-batches along axis 0;
  micro-batch ``m`` holds rows ``m, m + M, m + 2M, ...`` (so a batch sharded over a data
  axis stays sharded inside every micro-batch). ``loss`` is the mean of ``loss_fn`` over
  micro-batches.

``jax.grad`` of any function that calls `Pipeline.loss` runs the schedule's own forward and
backward order (a ``jax.custom_vjp`` boundary): gradients with respect to stage parameters,
loss parameters and inputs are exact, and stage-parameter gradients stay sharded over the
pipe axis.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpipe import executor, schedules
from jaxpipe.plan import make_plan
from jaxpipe.schedules import Schedule

tree_map = jax.tree_util.tree_map
ASYNCHRONOUS = ("pipedream", "pipedream_2bw")  # schedules whose tables carry weight versions


def split_microbatches(x, num_microbatches: int):
    """``[B, ...] -> [M, B // M, ...]``; micro-batch ``m`` holds rows ``m, m + M, ...``."""
    batch = x.shape[0]
    x = x.reshape(batch // num_microbatches, num_microbatches, *x.shape[1:])
    return jnp.swapaxes(x, 0, 1)


def merge_microbatches(x):
    """Inverse of `split_microbatches`: ``[M, B // M, ...] -> [B, ...]``."""
    x = jnp.swapaxes(x, 0, 1)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _is_primal(x) -> bool:
    return isinstance(x, jax.custom_derivatives.CustomVJPPrimal)


class Pipeline:
    """A stack of ``S * v`` stages run on the mesh axis ``axis`` under a pipeline schedule.

    Args:
      stage_fn: ``(params_of_one_stage, x) -> y``, shape and dtype preserving.
      loss_fn: ``(loss_params, y, target) -> scalar``, run on the last stage. Needed by
        `loss`; `forward` does without it.
      mesh: a ``jax.sharding.Mesh`` with an axis named ``axis`` (its size is ``S``).
        Other mesh axes are left to XLA's automatic sharding.
      schedule: a name from ``jaxpipe.schedules.names()`` or a `Schedule` (for example one
        loaded from CSV) whose ``num_stages`` equals the axis size.
      num_microbatches: ``M``; taken from the schedule when one is given.
      axis: the pipe axis name.
      schedule_options: options for ``jaxpipe.schedules.get`` (``virtual_stages=2``, ...).
      remat: keep only each stage's input between its forward and backward and recompute
        the forward in the backward (less memory, about one more forward of compute).
      data_axes: mesh axes the batch is split over (data parallelism). Default: ``"data"``
        if the mesh has such an axis. Inside the pipeline they are manual like the pipe
        axis: each replica runs the schedule on its own rows, and loss and gradients are
        averaged over the replicas once, after the schedule. This assumes ``loss_fn`` is a
        mean over the rows of its micro-batch. Other axes (``tensor``, ``fsdp``) stay under
        XLA's automatic sharding.
      remat_policy: a ``jax.checkpoint`` policy (e.g.
        ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``) applied to each stage:
        a stage's backward keeps what the policy saves and recomputes the rest. Finer than
        ``remat``, which keeps only the stage input.
      skip_idle: run each tick's action with ``lax.switch``, so a device computes only its
        own action (the default). ``False`` runs every kind of action and keeps the one the
        table names: several times the compute, but every collective XLA places inside a
        stage (a stage weight sharded over ``tensor``) then runs on every device in every
        tick, which CPU host devices need (their collectives wait for all devices).
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
        skip_idle: bool = True,
        remat_policy: Callable | None = None,
    ):
        if not callable(stage_fn):
            raise TypeError(f"stage_fn must be callable, got {type(stage_fn).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")
        if not isinstance(mesh, jax.sharding.Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        if axis not in mesh.shape:
            raise ValueError(
                f"mesh has axes {tuple(mesh.shape)} but no axis named {axis!r}; build the mesh "
                f"with a pipe axis (e.g. jax.make_mesh((4,), ({axis!r},))) or pass axis=..."
            )
        num_stages = mesh.shape[axis]
        if isinstance(schedule, Schedule):
            if schedule_options:
                raise ValueError("schedule_options apply to a schedule name, not a Schedule")
            if schedule.num_stages != num_stages:
                raise ValueError(
                    f"schedule {schedule.name!r} is for {schedule.num_stages} devices but mesh "
                    f"axis {axis!r} has {num_stages}; build the schedule for {num_stages}"
                )
            if num_microbatches not in (None, schedule.num_microbatches):
                raise ValueError(
                    f"num_microbatches={num_microbatches} but the schedule has "
                    f"{schedule.num_microbatches}; leave num_microbatches out"
                )
            schedule.validate()
        elif isinstance(schedule, str):
            if num_microbatches is None:
                raise ValueError("num_microbatches is required with a schedule name")
            schedule = schedules.get(
                schedule, num_stages, num_microbatches, **dict(schedule_options or {})
            )
        else:
            raise TypeError(f"schedule must be a name or a Schedule, got {type(schedule)}")
        self.asynchronous = schedule.name in ASYNCHRONOUS or any(
            a.version for a in schedule.actions()
        )
        if self.asynchronous and schedule.stages_per_device != 1:
            raise ValueError("asynchronous schedules need one stage per device")
        if data_axes is None:
            data_axes = ("data",) if "data" in mesh.shape else ()
        data_axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
        for name in data_axes:
            if name not in mesh.shape or name == axis:
                raise ValueError(
                    f"data_axes={data_axes}: {name!r} is not a mesh axis other than the pipe "
                    f"axis {axis!r}; mesh axes are {tuple(mesh.shape)}"
                )
        if data_axes and self.asynchronous:
            raise ValueError(
                f"schedule {schedule.name!r} updates weights inside the pipeline, which is not "
                f"supported together with data-parallel axes {data_axes}; use a mesh without "
                "them (data_axes=()) or a synchronous schedule"
            )
        self.data_axes = data_axes
        self.skip_idle = bool(skip_idle)
        self.num_replicas = int(np.prod([mesh.shape[a] for a in data_axes]))
        if remat_policy is not None:
            if remat:
                raise ValueError("pass remat=True or a remat_policy, not both")
            stage_fn = jax.checkpoint(stage_fn, policy=remat_policy)
        self.stage_fn = stage_fn
        self.loss_fn = loss_fn
        self.mesh = mesh
        self.axis = axis
        self.schedule = schedule
        self.remat = bool(remat)
        self._plan = make_plan(schedule)
        self._forward_plan = make_plan(schedule.forward_only())
        order = np.concatenate([schedule.device_stages(d) for d in range(num_stages)])
        self._device_order = order  # device-major position -> logical stage
        self._logical_order = np.argsort(order)
        self._loss = self._make_loss()

    # ---------------------------------------------------------------- properties
    @property
    def num_stages(self) -> int:
        """``S``: devices on the pipe axis."""
        return self.schedule.num_stages

    @property
    def num_logical_stages(self) -> int:
        """``S * v``: the length of the stage axis of ``stage_params``."""
        return self.schedule.num_logical_stages

    @property
    def num_microbatches(self) -> int:
        return self.schedule.num_microbatches

    # ---------------------------------------------------------------- public API
    def loss(self, stage_params, loss_params, inputs, targets):
        """Mean over micro-batches of ``loss_fn`` on the last stage's outputs; differentiable."""
        self._check_synchronous("loss")
        self._check(stage_params, inputs, loss_params=loss_params, targets=targets)
        return self._loss(stage_params, loss_params, inputs, targets)

    def loss_and_grads(self, stage_params, loss_params, inputs, targets, input_grads=False):
        """``(loss, (stage_grads, loss_grads[, input_grads]))`` by the schedule, no autodiff."""
        self._check_synchronous("loss_and_grads")
        self._check(stage_params, inputs, loss_params=loss_params, targets=targets)
        out = self._run(
            self._plan, "train", stage_params, loss_params, inputs, targets, input_grad=input_grads
        )
        grads = (out["stage_grads"], out["loss_grads"])
        if input_grads:
            grads += (out["input_grads"],)
        return out["loss"], grads

    def forward(self, stage_params, inputs):
        """The last stage's outputs for the whole batch (``[B, ...]``), forward only."""
        self._check(stage_params, inputs)
        out = self._run(self._forward_plan, "forward", stage_params, None, inputs, None)
        return out["outputs"]

    def trace(self, stage_params, loss_params, inputs, targets) -> np.ndarray:
        """What each device executed in each tick, read back from the compiled program.

        For asynchronous schedules the traced program is the synchronous one (same table,
        weight versions ignored). Returns an int array ``[T, S, 6]``: forward op code, stage,
        micro-batch, backward op code, stage, micro-batch (codes from
        `jaxpipe.plan.ForwardOp` / ``BackwardOp``; 0 is idle). Compare with `expected_trace`.
        """
        self._check(stage_params, inputs, loss_params=loss_params, targets=targets)
        out = self._run(self._plan, "train", stage_params, loss_params, inputs, targets, trace=True)
        return np.asarray(out["trace"])[:, :, :6]

    def init_optimizer(self, optimizer: optax.GradientTransformation, stage_params):
        """One optimizer state per stage (leaves ``[S*v, ...]``), for `train`."""
        return jax.vmap(optimizer.init)(stage_params)

    def train(
        self,
        optimizer: optax.GradientTransformation,
        stage_params,
        opt_state,
        loss_params,
        inputs,
        targets,
    ):
        """One training step with the optimizer applied per stage, as the schedule says.

        Returns ``(stage_params, opt_state, losses)`` with ``losses`` the ``M`` micro-batch
        losses. Each stage owns its optimizer state (from `init_optimizer`) and updates its
        own parameters: element-wise optimizers (SGD, Adam, ...) then match a global
        ``optax`` step; ones that look at all parameters at once (global-norm clipping) act
        per stage here. Loss parameters are not trained by this method.

        - Synchronous schedules (``1f1b``, ...): one update per stage from the step's mean
          gradient, as ``optax.update`` after `loss_and_grads` would do.
        - ``pipedream``: stage ``s`` updates after every backward, with weight stashing (a
          micro-batch's backward uses the weights its forward used).
        - ``pipedream_2bw``: one update per group of ``update_interval`` micro-batches, with
          their mean gradient; at most two weight versions per stage.

        The semantics are defined by `jaxpipe.replay.replay`, which replays the same table
        on one device; tests hold this method to it.
        """
        self._check(stage_params, inputs, loss_params=loss_params, targets=targets)
        if not self.asynchronous:
            out = self._run(self._plan, "train", stage_params, loss_params, inputs, targets)
            step = jax.vmap(optimizer.update)
            updates, opt_state = step(out["stage_grads"], opt_state, stage_params)
            return optax.apply_updates(stage_params, updates), opt_state, out["losses"]
        out = self._run(
            self._plan,
            "update",
            stage_params,
            loss_params,
            inputs,
            targets,
            opt_state=opt_state,
            optimizer=optimizer,
        )
        return out["stage_params"], out["opt_state"], out["losses"]

    def first_nonfinite(self, stage_params, loss_params, inputs, targets) -> dict | None:
        """Where the first NaN or infinity appears, or None if loss and gradients are finite.

        Runs the schedule once more with a finiteness check after every action (a separate
        program: the normal path is not slowed) and returns the earliest offending action as
        ``{"tick", "device", "op", "stage", "microbatch"}`` with ``op`` ``"F"`` (its output or
        loss) or ``"backward"`` (its input gradient, or the weight gradients it accumulated).
        Not jittable: it returns Python values.
        """
        self._check(stage_params, inputs, loss_params=loss_params, targets=targets)
        out = self._run(self._plan, "train", stage_params, loss_params, inputs, targets, trace=True)
        trace = np.asarray(out["trace"])
        for tick in range(trace.shape[0]):
            for device in range(trace.shape[1]):
                row = trace[tick, device]
                if row[0] and not row[6]:
                    return dict(
                        tick=tick, device=device, op="F", stage=int(row[1]), microbatch=int(row[2])
                    )
                if row[3] and not row[7]:
                    return dict(
                        tick=tick,
                        device=device,
                        op="backward",
                        stage=int(row[4]),
                        microbatch=int(row[5]),
                    )
        return None

    def expected_trace(self) -> np.ndarray:
        """The trace `trace` must return, computed from the schedule's table alone."""
        from jaxpipe.plan import COLUMN

        table = self._plan.table
        cols = ["f_op", "f_stage", "f_mb", "b_op", "b_stage", "b_mb"]
        out = np.stack([table[:, :, COLUMN[c]] for c in cols], axis=-1)
        idle_f = out[:, :, 0] == 0
        idle_b = out[:, :, 3] == 0
        out[idle_f, 1:3] = table[idle_f][:, [COLUMN["f_stage"], COLUMN["f_mb"]]]
        out[idle_b, 4:6] = table[idle_b][:, [COLUMN["b_stage"], COLUMN["b_mb"]]]
        return out

    # ---------------------------------------------------------------- internals
    def _to_device_order(self, stage_params):
        S, v = self.num_stages, self.schedule.stages_per_device
        identity = np.array_equal(self._device_order, np.arange(S * v))

        def place(p):
            p = p if identity else jnp.take(p, self._device_order, axis=0)
            return p.reshape(S, v, *p.shape[1:])

        return tree_map(place, stage_params)

    def _to_logical_order(self, grads):
        S, v = self.num_stages, self.schedule.stages_per_device
        identity = np.array_equal(self._device_order, np.arange(S * v))

        def unplace(g):
            g = g.reshape(S * v, *g.shape[2:])
            return g if identity else jnp.take(g, self._logical_order, axis=0)

        return tree_map(unplace, grads)

    def _run(
        self,
        plan,
        mode,
        stage_params,
        loss_params,
        inputs,
        targets,
        input_grad=False,
        trace=False,
        opt_state=None,
        optimizer=None,
    ):
        M = self.num_microbatches
        program = executor.Program(
            plan=plan,
            stage_fn=self.stage_fn,
            loss_fn=self.loss_fn,
            mesh=self.mesh,
            axis=self.axis,
            mode=mode,
            remat=self.remat,
            input_grad=input_grad,
            trace=trace,
            optimizer=optimizer,
            data_axes=self.data_axes,
            skip_idle=self.skip_idle,
        )

        def view(x):  # [B, ...] -> [B // M, M, ...]: free; micro-batch m is [:, m]
            return x.reshape(x.shape[0] // M, M, *x.shape[1:])

        out = executor.run(
            program,
            self._to_device_order(stage_params),
            loss_params,
            view(inputs),
            None if targets is None else view(targets),
            opt_state=None if opt_state is None else self._to_device_order(opt_state),
        )
        result = dict(out)
        if "losses" in out:
            result["loss"] = jnp.mean(out["losses"])
        if "stage_params" in out:
            result["stage_params"] = self._to_logical_order(out["stage_params"])
            result["opt_state"] = self._to_logical_order(out["opt_state"])
        if "stage_grads" in out:
            result["stage_grads"] = self._to_logical_order(out["stage_grads"])
        if "input_grads" in out:
            result["input_grads"] = merge_microbatches(out["input_grads"])
        if "outputs" in out:
            result["outputs"] = merge_microbatches(out["outputs"])
        return result

    def _make_loss(self):
        pipe = self

        @jax.custom_vjp
        def pipeline_loss(stage_params, loss_params, inputs, targets):
            out = pipe._run(pipe._forward_plan, "loss", stage_params, loss_params, inputs, targets)
            return out["loss"]

        def fwd(stage_params, loss_params, inputs, targets):
            # symbolic_zeros=True wraps every leaf in a CustomVJPPrimal(value, perturbed).
            def values(tree):
                return tree_map(lambda p: p.value, tree, is_leaf=_is_primal)

            out = pipe._run(
                pipe._plan,
                "train",
                values(stage_params),
                values(loss_params),
                inputs.value,
                targets.value,
                input_grad=inputs.perturbed,
            )
            saved = (out["stage_grads"], out["loss_grads"], out.get("input_grads"))
            return out["loss"], saved

        def bwd(saved, g):
            stage_grads, loss_grads, input_grads = saved

            def scale(tree):
                return tree_map(lambda x: (x * g).astype(x.dtype), tree)

            dx = None if input_grads is None else scale(input_grads)
            return scale(stage_grads), scale(loss_grads), dx, None

        pipeline_loss.defvjp(fwd, bwd, symbolic_zeros=True)
        return pipeline_loss

    def _check_synchronous(self, method):
        if self.asynchronous:
            raise ValueError(
                f"schedule {self.schedule.name!r} updates weights inside the pipeline (weight "
                f"versions), so it has no single gradient for {method}(); use "
                "Pipeline.train(optimizer, stage_params, opt_state, loss_params, inputs, "
                "targets), or a synchronous schedule such as '1f1b'"
            )

    def _check(self, stage_params, inputs, loss_params=None, targets=None):
        """Raises a clear error, before tracing, for inputs the pipeline cannot run."""
        N, M = self.num_logical_stages, self.num_microbatches
        leaves = jax.tree_util.tree_leaves(stage_params)
        if not leaves:
            raise ValueError("stage_params has no arrays")
        for path, leaf in jax.tree_util.tree_leaves_with_path(stage_params):
            if jnp.ndim(leaf) == 0 or leaf.shape[0] != N:
                raise ValueError(
                    f"stage_params leaf {jax.tree_util.keystr(path)} has shape "
                    f"{jnp.shape(leaf)}; every leaf needs a leading stage axis of length "
                    f"S*v = {self.num_stages}*{self.schedule.stages_per_device} = {N}"
                )
        if not hasattr(inputs, "shape") or jnp.ndim(inputs) == 0:
            raise TypeError(f"inputs must be an array with a batch axis, got {type(inputs)}")
        batch, replicas = inputs.shape[0], self.num_replicas
        if batch % (M * replicas):
            raise ValueError(
                f"batch size {batch} does not split into num_microbatches={M} equal "
                f"micro-batches"
                + (f" over {replicas} data-parallel replicas" if replicas > 1 else "")
                + f"; use a batch size that is a multiple of {M * replicas}"
            )
        if targets is not None and (jnp.ndim(targets) == 0 or targets.shape[0] != batch):
            raise ValueError(
                f"targets have shape {jnp.shape(targets)} but inputs have batch size {batch}; "
                "targets need the same leading batch axis"
            )
        one_stage = tree_map(lambda p: jax.ShapeDtypeStruct(p.shape[1:], p.dtype), stage_params)
        x = jax.ShapeDtypeStruct((batch // M, *inputs.shape[1:]), inputs.dtype)
        y = jax.eval_shape(self.stage_fn, one_stage, x)
        if not isinstance(y, jax.ShapeDtypeStruct) or (y.shape, y.dtype) != (x.shape, x.dtype):
            got = (y.shape, y.dtype) if isinstance(y, jax.ShapeDtypeStruct) else type(y)
            raise ValueError(
                f"stage_fn must return one array of the shape and dtype of its input, so every "
                f"stage can feed the next: input {x.shape} {x.dtype}, output {got}. Move "
                "shape-changing layers (embedding, head) before the pipeline or into loss_fn"
            )
        if loss_params is not None or targets is not None:
            if self.loss_fn is None:
                raise ValueError("this Pipeline has no loss_fn; pass one to use loss()")
            t = jax.ShapeDtypeStruct((batch // M, *targets.shape[1:]), targets.dtype)
            loss = jax.eval_shape(self.loss_fn, loss_params, y, t)
            if not isinstance(loss, jax.ShapeDtypeStruct) or loss.shape != ():
                got = loss.shape if isinstance(loss, jax.ShapeDtypeStruct) else type(loss)
                raise ValueError(
                    f"loss_fn must return a scalar per micro-batch, got {got}; reduce it "
                    "(e.g. jnp.mean) inside loss_fn"
                )
