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
- ``loss_fn(loss_params, y, target) -> scalar`` runs on the last stage (head and loss), once
  per micro-batch; it may take ``key`` and ``side`` the same way, its key its own:
  ``fold_in(fold_in(key, m), N)`` for ``N`` logical stages (the key a stage ``N`` would get;
  so a dropout in the head does not repeat the last stage's mask). With
  ``loss_has_aux=True`` it returns ``(loss, aux)``, as a function given to
  ``jax.value_and_grad(..., has_aux=True)`` does: ``aux`` is a pytree of numeric arrays
  (metrics such as accuracy), combined over micro-batches and replicas like the loss, in
  float32, and returned beside it; it has no gradient.
- ``loss_reduction`` says how the micro-batch losses make the step's loss: ``"mean"`` (the
  default) their mean over micro-batches and replicas, the whole-batch value of a
  ``loss_fn`` that is a mean over rows; ``"sum"`` their sum, the whole-batch value of a
  ``loss_fn`` that sums over rows; or a function ``weight_fn(target) -> scalar``, the
  weighted mean ``sum(w * loss) / sum(w)``, the whole-batch value of a ``loss_fn`` that is a
  mean over ``w`` units (``weight_fn = lambda t: jnp.sum(t["mask"])`` for a token-weighted
  cross-entropy that is each micro-batch's mean over its scored tokens). ``aux`` is combined
  with the same weights. Weights summing to 0 over the step are refused (a ValueError)
  where the targets are concrete arrays; inside ``jax.jit`` their values are not known
  before the step runs, and its loss is then NaN (``0 / 0``).
- Stage parameters live in the pipeline's device layout (`jaxpipe.layout`): leaves
  ``[v, S, ...]`` with the ``S`` axis sharded over the pipe axis, so each device holds its own
  stages only. `Pipeline.place` and `Pipeline.logical` convert from and to logical stage
  order ``[S*v, ...]``; `Pipeline.init` creates parameters directly in the layout. Both
  return a `jaxpipe.Placed`, which carries its layout and its placement specs
  through ``jit``, ``grad`` and ``optax``; every method takes placed parameters, refuses
  those of another layout (convert with `Pipeline.place`), compiles for the specs they
  carry, and returns gradients placed like them. Bare ``[1, S, ...]`` arrays (one stage per
  device in stage order) run as their ``NamedSharding`` splits them where the pipeline sees
  it (concrete arrays; traced ones on a mesh of explicit axes), and are refused where it is
  no layout of the pipeline; traced on a mesh of automatic axes, they show none: their
  gradients are left for the compiler to split as the parameters, and a split over a data
  axis, which the pipeline cannot see, is gathered for the step, with a warning
  (docs/meshes.md).
- ``inputs``, ``targets`` and ``side`` are pytrees of full batches, split into ``M``
  micro-batches along axis 0 in contiguous blocks: micro-batch ``m`` holds rows
  ``m * B // M`` to ``(m + 1) * B // M - 1`` (`split_microbatches`). With ``R`` data-parallel
  replicas, replica ``r`` holds the ``r``-th block of ``B // R`` rows and micro-batch ``m``
  is the ``m``-th block of ``B // (R * M)`` rows of every replica's block: no row leaves
  its replica, and no copy of the batch is made (the split is a reshape). NumPy arrays are
  read as ``jax.jit`` reads them: float64 as float32 unless x64 is enabled. With data axes
  each replica runs the schedule on its own rows, and loss and gradients are combined over
  the replicas once, after the schedule, as ``loss_reduction`` says (docs/meshes.md,
  docs/transformers.md).
- Between a stage's forward and its backward the pipeline keeps the stage input and what
  ``remat_policy`` saves, and the backward recomputes the rest: by default
  (``jax.checkpoint_policies.dots_saveable``) the results of matrix multiplications, as XLA
  keeps within a plain step; ``everything_saveable`` keeps every residual, None what
  ``jax.vjp`` keeps, and ``remat=True`` the stage input only. A ``lax.scan`` (or
  ``nnx.scan``) over the stage's blocks runs as a Python loop over them, so that each
  block's values are kept as a loop's would be (not stacked over the blocks), where the
  loop written out stays small (at most 256 equations: two transformer blocks, say); a
  scan over more stays a scan, so that compile time does not grow with the blocks, and
  keeps a scan's memory.

- Sharding constraints inside ``stage_fn`` and ``loss_fn`` (``with_sharding_constraint``,
  Flax's logical constraints under ``nn.logical_axis_rules``) keep their entries on the
  mesh's automatic axes (``tensor``) and drop those on the pipe and data axes, which are
  manual inside the pipeline; a ``NamedSharding`` of another mesh (the one a module was
  built on) is moved onto the pipeline's mesh, and a bare ``PartitionSpec`` is read on the
  pipeline's mesh (docs/own_models.md).
- A jitted step compiles again when its arguments arrive placed otherwise than at the
  previous call; the pipeline warns once when that happens. `Pipeline.replicate` and
  `Pipeline.place_batch` put loss parameters and batches on the mesh before the first step.

``jax.grad`` of any function that calls `Pipeline.loss` runs the schedule's own forward and
backward order (a ``jax.custom_vjp`` boundary): gradients with respect to stage parameters,
loss parameters and the float leaves of ``inputs``, ``targets`` and ``side`` are exact, and
stage-parameter gradients stay in the layout. A side input's gradient is added up by the
backward of every stage that reads it (and by the loss), per micro-batch, in a buffer of the
side input's size; a target's comes from the loss on the last stage. Integer, boolean and
key leaves have JAX's zero cotangent (``float0``); a gradient into ``aux`` is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpipe import _checks as checks
from jaxpipe import reference
from jaxpipe import schedules as schedules_lib
from jaxpipe._executor import Context, Program, steps
from jaxpipe._executor.plan import COLUMN, make_plan
from jaxpipe._executor.sharding import GATHER_MODES, WeightSharding
from jaxpipe._jaxpr import blockwise, checkpoints, constraints, unroll
from jaxpipe.analysis import costs as costs_lib
from jaxpipe.layout import (
    Layout,
    Placed,
    flat_specs,
    is_bare,
    is_placed,
    placed_like,
    recorded_specs,
    specs_of,
)
from jaxpipe.schedules import Costs, Schedule

tree_map = jax.tree_util.tree_map


def split_microbatches(x, num_microbatches: int, num_replicas: int = 1):
    """The pipeline's micro-batches of a batch.

    Args:
      x: an array ``[B, ...]``.
      num_microbatches: ``M``.
      num_replicas: ``R``, the data-parallel replicas.

    Returns:
      ``[M, B // M, ...]``: with one replica, micro-batch ``m`` is the ``m``-th block of
      ``B // M`` rows; with ``R`` replicas, the ``m``-th block of ``B // (R * M)`` rows of
      each replica's ``B // R`` rows, replica by replica.
    """
    R, M = num_replicas, num_microbatches
    x = x.reshape(R, M, x.shape[0] // (R * M), *x.shape[1:])
    return jnp.swapaxes(x, 0, 1).reshape(M, x.shape[0] * x.shape[2], *x.shape[3:])


class _DefaultPolicy:
    """``remat_policy``'s default: ``dots_saveable``, or none with ``remat=True``; told
    apart from a policy the caller gives, which ``remat=True`` refuses."""

    def __repr__(self) -> str:
        return "jax.checkpoint_policies.dots_saveable"


_DEFAULT_POLICY = _DefaultPolicy()


def _from_plan(plan, mesh, num_microbatches, remat, remat_policy, inner_remat_policy,
               fsdp_gather, split_loss_grads):  # fmt: skip
    """(table, remat, remat_policy, inner_remat_policy, fsdp_gather, split_loss_grads) of a
    `jaxpipe.Plan`, checked against the mesh and against the arguments given beside it."""
    defaults = inspect.signature(Pipeline.__init__).parameters
    given = {
        "remat": remat is not defaults["remat"].default,
        "remat_policy": remat_policy is not _DEFAULT_POLICY,
        "inner_remat_policy": inner_remat_policy is not None,
        "split_loss_grads": split_loss_grads is not False,
        "fsdp_gather": fsdp_gather != defaults["fsdp_gather"].default,
        "num_microbatches": num_microbatches is not None,
    }
    clash = [name for name, was_given in given.items() if was_given]
    if clash:
        raise ValueError(
            f"schedule is a jaxpipe.Plan, which sets the table, remat, remat_policy, "
            f"inner_remat_policy, fsdp_gather and split_loss_grads; {clash} were given too. "
            "Drop them, or change the plan (dataclasses.replace(plan, remat=...)) and pass that"
        )
    mismatch = {a: (n, mesh.shape.get(a, 1)) for a, n in plan.axes.items()
                if mesh.shape.get(a, 1) != n}  # fmt: skip
    if mismatch:
        raise ValueError(
            f"the plan's mesh is {plan.axes}; this mesh is {dict(mesh.shape)} (axis: (plan, "
            f"mesh) {mismatch}). Build the mesh with plan.mesh(devices)"
        )
    options = plan.pipeline_options()
    names = ("schedule", "remat", "remat_policy", "inner_remat_policy", "fsdp_gather",
             "split_loss_grads")  # fmt: skip
    return tuple(options[n] for n in names)


class Pipeline:
    """A stack of ``S * v`` stages run on the mesh axis ``axis`` under a pipeline schedule.

    Args:
      stage_fn: ``(params_of_one_stage, x, **keywords) -> y`` of ``x``'s structure, shapes
        and dtypes (keywords: module docstring), or a list of ``S * v`` such functions.
      loss_fn: ``(loss_params, y, target, **keywords) -> scalar``, run on the last stage;
        needed by all but `forward`. With ``loss_has_aux``, it returns ``(loss, aux)``.
        Python and NumPy numbers it returns are taken as arrays, as ``jax.jit`` takes them.
      mesh: a ``jax.sharding.Mesh`` with an axis named ``axis`` (its size is ``S``).
      schedule: a name from ``jaxpipe.schedules.names()`` or a `Schedule` for ``S`` devices;
        or a `jaxpipe.Plan` (from `jaxpipe.plan`), which sets the table, ``remat``,
        ``remat_policy`` and ``fsdp_gather`` (leave those at their defaults) and whose
        axis sizes the mesh must have (`Plan.mesh` builds it).
      num_microbatches: ``M``; taken from the schedule when one is given.
      axis: the pipe axis name.
      schedule_options: a mapping of options for ``jaxpipe.schedules.get``
        (``{"virtual_stages": 2}``, ...).
      remat: keep only each stage's input between its forward and backward, and recompute
        the whole stage in its backward. A ``remat_policy`` given with it is refused: a
        policy says what the backward keeps besides the input, and remat keeps nothing.
      data_axes: mesh axes the batch is split over (default: ``"data"`` and ``"fsdp"``, if
        the mesh has them); see docs/meshes.md.
      fsdp_gather: ``"auto"``, ``"per_use"``, ``"once"``, ``"ahead"`` or ``"per_block"``:
        when stage weights split over data axes are gathered (docs/meshes.md).
        ``"per_block"``: a stage that runs its blocks in a ``lax.scan`` or a loop over
        stacked weights gathers each block's just before the block runs, and
        reduce-scatters its gradient just after the block's backward. ``"auto"``: on a
        mesh of GPUs, ``"per_block"`` where the stage takes a weight split over a data
        axis apart along a dimension it is not split over (a scan or a loop over stacked
        blocks, as `jaxpipe.stages.blocks`, `jaxpipe.partition.stack_layers` and a
        ``lax.scan`` or ``nnx.scan`` over stacked weights run them; a slice of a weight);
        else ``"per_use"``, and on TPUs and CPUs always ``"per_use"``. `gather_mode` says
        which a step runs. (By the compiled reports of Llama-style steps, pipe 2 x fsdp 4,
        1f1b, 8 blocks: on 8 H100s ``"per_block"`` held 10.88 against 12.57 GiB and was
        predicted at 219 against 342 ms a step at width 4096, and held less in the same
        time at width 1024; on 8 v5p chips it held less in the same time at width 1024,
        but at width 4096, 9.69 against 11.32 GiB, was predicted at 1248 against 1201 ms,
        its in-loop reduce-scatters exposed; docs/meshes.md.) Weights not split over a
        data axis are gathered in no mode.
      expert_axis: a mesh axis for expert parallelism (docs/meshes.md), or None. Stage
        weights whose placement spec names it on a dimension (the experts' dimension,
        ``P("expert", ...)``) stay split over it inside the stage, never gathered: a
        device holds its own experts, and the stage exchanges tokens over the axis
        (`jaxpipe.moe.MoE`, ``jax.lax.all_to_all``). For everything else it is a data
        axis: the batch is split over it (it is added to ``data_axes``) and the other
        weights' gradients are averaged over it.
      remat_policy: the ``jax.checkpoint`` policy of each stage: what its backward keeps
        besides the stage input (default ``jax.checkpoint_policies.dots_saveable``; None:
        what ``jax.vjp`` keeps). Not with ``remat=True``, which keeps the input only. It
        cannot change what the stage's own checkpoints save (a ``jax.checkpoint``,
        ``nnx.remat`` or ``nn.remat`` around each block): see ``inner_remat_policy``.
      inner_remat_policy: a ``jax.checkpoint`` policy that replaces the policy of every
        checkpoint inside the stage (around its blocks, in a scan or a loop, at any depth;
        not inside a custom derivative rule), so the stage's blocks keep what it saves
        (``jax.checkpoint_policies.dots_saveable``: their matrix products;
        ``everything_saveable``: all, as if they were not checkpointed). It decides what
        the stage keeps with ``remat_policy=None`` only: a ``remat_policy`` wraps the
        stage in a checkpoint of its own, and the outermost checkpoint's policy decides
        for every checkpoint inside it (JAX's nesting). None: the stage's own policies
        stand.
      grad_dtype: the dtype gradients accumulate in across micro-batches (None: the
        parameters' own; with one micro-batch nothing accumulates, and the parameters'
        own is used); they are returned in the parameters' dtypes.
      split_loss_grads: accumulate the gradient of the loss parameters (a language model's
        head) split over the data axes: each micro-batch's is reduce-scattered over them as
        the loss computes it, and a device adds up only its ``1 / replicas`` share of each
        leaf (along the leaf's largest dimension that divides among the replicas; a leaf
        that has none, or is not float, stays whole). It trades memory for communication:
        a device holds ``1 / replicas`` of the loss parameters' ``grad_dtype`` accumulator
        (for a Llama head over fsdp 2, 250 of 500 MiB), and the step runs a reduce-scatter
        of their gradient per micro-batch over the data axes where the default runs one
        all-reduce after the schedule. False (default): the accumulator is whole on every
        device, averaged over the replicas once. Without data axes there is nothing to split.
      costs: what the stage's actions cost, to pack the table for
        (`jaxpipe.schedules.fit`): a `jaxpipe.schedules.Costs`; ``"measure"``, each action
        timed on this machine (`jaxpipe.costs.measure`); or a `jaxpipe.target.Target`, its
        compiler's own estimate (`jaxpipe.costs.of_stage`). ``"measure"`` and a target are
        read from the shapes of the first call's parameters and inputs, and the table is
        packed then (`schedule` holds the default table until that call; `costs` the costs
        used, once known); with ``remat``, a B and a W cost their forward again, as they
        run it. None: the table packed for equal costs.
      loss_has_aux: ``loss_fn`` returns ``(loss, aux)``, ``aux`` a pytree of numeric arrays
        (metrics); `loss` and `loss_and_grads` then return ``(loss, aux)`` where they
        return the loss, and `train` ``(losses, aux)``.
      loss_reduction: ``"mean"``, ``"sum"`` or ``weight_fn(target) -> scalar``: how the
        micro-batch losses (and ``aux``) combine over micro-batches and data-parallel
        replicas into the step's (module docstring). Schedules that update weights inside
        the pipeline take ``"mean"`` only.

    Raises:
      ValueError: for an argument the pipeline cannot run, saying what to pass instead;
        ``loss_fn`` is checked on the first call (a float scalar loss, a pair with
        ``loss_has_aux``, an ``aux`` of numeric arrays, a scalar weight per micro-batch).
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
        fsdp_gather: str = "auto",
        expert_axis: str | None = None,
        remat_policy: Callable | None = _DEFAULT_POLICY,
        inner_remat_policy: Callable | None = None,
        grad_dtype: Any = jnp.float32,
        split_loss_grads: bool = False,
        loss_has_aux: bool = False,
        loss_reduction: str | Callable = "mean",
        costs: Costs | str | Any = None,
    ):
        checks.mesh(mesh, axis)
        checks.costs(costs)
        if isinstance(schedule, str) and schedule == "auto":
            raise ValueError(
                'schedule="auto": a Pipeline is built before it sees the model\'s shapes, and '
                "a plan needs them; call jaxpipe.plan(block_fn, block_params, num_blocks, "
                "loss_fn, loss_params, inputs, targets, target=...) and pass its best Plan as "
                "schedule= (docs/planning.md)"
            )
        if callable(getattr(schedule, "pipeline_options", None)):  # a jaxpipe.Plan
            planned = _from_plan(schedule, mesh, num_microbatches, remat, remat_policy,
                                 inner_remat_policy, fsdp_gather, split_loss_grads)  # fmt: skip
            (schedule, remat, remat_policy, inner_remat_policy, fsdp_gather,
             split_loss_grads) = planned  # fmt: skip
        schedule = checks.schedule(schedule, mesh, axis, num_microbatches, schedule_options)
        self.costs = costs if isinstance(costs, Costs) else None
        self._costs_source = None if costs is None or self.costs is not None else costs
        if self.costs is not None:
            schedule = schedules_lib.fit(schedule, self.costs)
        self._stage_functions = [("stage_fn, every stage", stage_fn)]
        if isinstance(stage_fn, list | tuple):
            self._stage_functions = [(f"logical stage {s}", f) for s, f in enumerate(stage_fn)]
            stage_fn = _switch_stages(stage_fn, schedule.num_logical_stages)
        checks.functions(stage_fn, loss_fn)
        self.data_axes = checks.data_axes(data_axes, mesh, axis)
        self.expert_axis = checks.expert_axis(expert_axis, mesh, axis)
        if self.expert_axis is not None and self.expert_axis not in self.data_axes:
            self.data_axes = (*self.data_axes, self.expert_axis)
        if self.expert_axis is not None and self._costs_source is not None:
            raise ValueError(
                f"costs={costs!r} times a stage on its own, outside the mesh, where the "
                f"expert axis {self.expert_axis!r} of its all-to-alls does not exist; pass "
                "a jaxpipe.schedules.Costs (or None) together with expert_axis"
            )
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
        remat = checks.flag("remat", remat)
        if remat_policy is _DEFAULT_POLICY:  # with remat, the stage input only
            remat_policy = None if remat else jax.checkpoint_policies.dots_saveable
        remat_policy = checks.remat_policy(remat_policy, remat)
        if inner_remat_policy is not None and not callable(inner_remat_policy):
            raise ValueError(
                "inner_remat_policy must be a jax.checkpoint policy such as "
                f"jax.checkpoint_policies.dots_saveable, or None, got {inner_remat_policy!r}"
            )
        self.inner_remat_policy = inner_remat_policy
        self.stage_fn = stage_fn
        self.loss_fn = loss_fn
        self.mesh = mesh
        self.axis = axis
        self.remat = remat
        self.remat_policy = remat_policy
        self.fsdp_gather = checks.one_of("fsdp_gather", fsdp_gather, ("auto", *GATHER_MODES))
        self._gathers = {}  # with "auto": (stage signature, specs) -> the mode it picked
        self._probed = set()  # stage signatures checked by checks.stage_data_movement
        self._warned_idle_axes = False
        self._warned_unseen_split = False
        self._traced = set()  # (call site, argument shapes) of steps traced under a transform
        self._warned_retrace = False
        self.grad_dtype = checks.grad_dtype(grad_dtype)
        self.split_loss_grads = checks.flag("split_loss_grads", split_loss_grads)
        self.num_replicas = int(np.prod([mesh.shape[a] for a in self.data_axes]))
        self.layout = Layout.of(schedule, mesh, axis)
        self.loss_has_aux = checks.flag("loss_has_aux", loss_has_aux)
        self.loss_reduction = checks.loss_reduction(loss_reduction)
        if self.updates_weights and self.loss_reduction != "mean":
            raise ValueError(
                f"schedule {schedule.name!r} updates weights inside the pipeline from each "
                f"micro-batch's own gradient, so loss_reduction={loss_reduction!r} has no "
                "step loss to act on; use loss_reduction='mean' (and scale inside loss_fn), "
                "or a schedule without weight updates such as '1f1b'"
            )
        self._stage_keywords = reference.keywords_of(stage_fn)
        self._loss_keywords = reference.keywords_of(loss_fn) if loss_fn is not None else set()
        # sharding constraints inside stage and loss keep the automatic axes only
        manual = {axis, *self.data_axes}
        # a scan over the stage's blocks runs as a loop: per-block values, not stacks,
        # cross the pipeline's buffers (`jaxpipe._jaxpr.unroll`)
        if inner_remat_policy is not None:  # the stage's own checkpoints under it
            stage_fn = checkpoints.with_policy(stage_fn, inner_remat_policy)
        # written out, a scan of blocks lets the GPU compiler gather every block's weights
        # at once under fsdp_gather="per_block" (the TPU compiler gathers them in turn):
        # there, on GPUs, the stage's own scans run (`_per_block_stage_call`)
        self._rolled_stage_fn = constraints.fit(stage_fn, mesh, manual)
        self._fitted_stage_fn = unroll.unrolled(self._rolled_stage_fn)
        self._fitted_loss_fn = None if loss_fn is None else constraints.fit(loss_fn, mesh, manual)

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
        """``M``: micro-batches per step."""
        return self.schedule.num_microbatches

    # ---------------------------------------------------------------- parameters
    def place(self, logical_params, specs=None):
        """Logical stage order ``[S*v, ...]`` -> the device layout ``[v, S, ...]``, sharded.

        Call once, before training (not inside a step). Dimensions split over a batch axis
        (``"fsdp"``, ``"data"``) are stored split (FSDP) and gathered when a stage needs them.

        Args:
          logical_params: a pytree of ``[S*v, ...]`` arrays; or a tree holding `Placed`
            nodes of another layout (parameters, optimizer state, restored from a
            checkpoint or placed by another pipeline), each moved into this pipeline's
            layout with the specs given for it, or else those it was placed with. Arrays on
            other devices than this pipeline's mesh (placed by a pipeline on another mesh)
            are copied onto it.
          specs: per leaf (or one for all) a ``PartitionSpec`` of the dimensions after the
            stage axis, e.g. ``P(None, "tensor")``; they travel with the result. For a tree
            holding `Placed` nodes: one for all their leaves, or a pytree of the tree's
            structure up to the nodes with, per node, its specs (None: those it was placed
            with), as `jaxpipe.layout.Layout.place` takes them.

        Returns:
          A `jaxpipe.Placed` (or the tree with its `Placed` nodes converted).

        Raises:
          ValueError: a spec that names an axis the mesh does not have (or the pipe axis),
            has more entries than a leaf has dimensions after the stage axis, or splits a
            dimension over axes whose size does not divide it; the message names the leaf,
            its shape, the spec and the mesh's axes.
        """
        if not any(map(is_placed, jax.tree_util.tree_leaves(logical_params, is_placed))):
            checks.params(logical_params)  # logical parameters, not optimizer state
            if self.expert_axis is not None:
                flat = flat_specs(logical_params, specs)
                checks.expert_weights(logical_params, flat, self.expert_axis, self.mesh, 1, False)
        return self.layout.place(logical_params, specs)

    def logical(self, params):
        """The device layout -> logical stage order, for export and inspection.

        Args:
          params: a `jaxpipe.Placed` (read in its own layout), or a tree holding them.

        Returns:
          The same tree with ``[S*v, ...]`` leaves in logical stage order.
        """
        return self.layout.logical(params)

    def init(self, init_stage: Callable, key, specs=None):
        """Parameters created directly in the device layout.

        With JAX's default ``threefry2x32`` keys, ``pipe.logical(pipe.init(f, key))`` equals
        ``jax.vmap(f)(jax.random.split(key, S*v))`` under every schedule and mesh. ``rbg``
        and ``unsafe_rbg`` keys draw other bits under ``vmap``, depending on the batch of
        keys, so the values then depend on the schedule's placement: to start runs with
        different layouts from the same values, build the logical parameters once and
        `place` them.

        Args:
          init_stage: ``init_stage(key)`` builds one stage's parameters; logical stage ``s``
            uses ``jax.random.split(key, S*v)[s]``.
          key: a PRNG key.
          specs: as in `place`.

        Returns:
          A `jaxpipe.Placed`.

        Raises:
          ValueError: as `place`; with an expert axis, an experts' dimension its size does
            not divide, naming the experts.
        """
        one_stage = jax.eval_shape(init_stage, key)
        checks.params(one_stage)
        if self.expert_axis is not None:
            flat = flat_specs(one_stage, specs)
            checks.expert_weights(one_stage, flat, self.expert_axis, self.mesh, 0, False)
        return self.layout.init(init_stage, key, specs)

    # ---------------------------------------------------------------- steps
    def loss(self, params, loss_params, inputs, targets, *, side=None, key=None):
        """The step's loss: ``loss_fn`` on the last stage's outputs, combined over
        micro-batches and replicas as ``loss_reduction`` says (by default their mean).

        ``jax.grad`` of any function that calls it runs the schedule's own forward and
        backward order. Gradients with respect to float leaves of ``inputs``, ``targets``
        and ``side`` are computed when ``jax.grad`` asks for them (each stage's backward
        adds its share of a side input's gradient); integer, boolean and key leaves get
        JAX's zero (``float0``) cotangent.

        Args:
          params: stage parameters in this pipeline's layout (from `place` or `init`).
          loss_params: ``loss_fn``'s parameters.
          inputs: a pytree of ``[B, ...]`` arrays (split as the module docstring says).
          targets: a pytree of ``[B, ...]`` arrays, passed to ``loss_fn``.
          side: side inputs, a pytree of ``[B, ...]`` arrays, or None.
          key: a PRNG key, or None.

        Returns:
          A float32 scalar, differentiable with respect to ``params``, ``loss_params`` and
          the float leaves of ``inputs``, ``targets`` and ``side``; with ``loss_has_aux``,
          the pair ``(loss, aux)``, ``aux`` combined like the loss (float32 leaves), to be
          used with ``jax.value_and_grad(..., has_aux=True)``.

        Raises:
          TypeError: when differentiated through ``aux`` (it has no gradient; wrap it in
            ``jax.lax.stop_gradient`` where it enters a differentiated value).
        """
        self._check_synchronous("loss")
        tree, program = self._prepare(params, inputs, loss_params, targets, side, key)
        loss, aux = steps.loss(program, tree, loss_params, inputs, targets, side, key)
        return (loss, aux) if self.loss_has_aux else loss

    def loss_and_grads(
        self,
        params,
        loss_params,
        inputs,
        targets,
        input_grads=False,
        *,
        side=None,
        key=None,
        side_grads=False,
        target_grads=False,
    ):
        """The loss and its gradients by the schedule, without autodiff.

        The gradients are those ``jax.grad`` of `loss` gives, with None where it gives a
        ``float0`` zero (integer, boolean and key leaves).

        Args:
          params, loss_params, inputs, targets, side, key: as in `loss`.
          input_grads: also return the gradient with respect to ``inputs``.
          side_grads: also return the gradient with respect to ``side`` (None without
            side inputs).
          target_grads: also return the gradient with respect to ``targets``.

        Returns:
          ``(loss, (grads, loss_grads[, input_grads][, side_grads][, target_grads]))``, each
          optional entry present when asked for: ``grads`` placed like ``params``, the
          others of the structure of ``inputs``, ``side`` and ``targets`` (None for their
          integer and boolean leaves); with ``loss_has_aux``, ``loss`` is the pair ``(loss,
          aux)`` (as ``jax.value_and_grad(..., has_aux=True)`` returns it).
        """
        self._check_synchronous("loss_and_grads")
        tree, program = self._prepare(params, inputs, loss_params, targets, side, key)
        result = steps.gradients(
            program, tree, loss_params, inputs, targets, side, key,
            input_grads=input_grads, side_grads=side_grads, target_grads=target_grads,
        )  # fmt: skip
        grads = (placed_like(result.grads, params), result.loss_grads)
        asked = (
            (input_grads, result.input_grads),
            (side_grads, result.side_grads),
            (target_grads, result.target_grads),
        )
        grads += tuple(value for wanted, value in asked if wanted)
        value = (result.loss, result.aux) if self.loss_has_aux else result.loss
        return value, grads

    def gather_mode(self, params, inputs, *, side=None, key=None) -> str:
        """The `fsdp_gather` mode a step on these arguments (as `loss` takes them; shapes
        and dtypes with shardings will do) runs: `fsdp_gather`, or with ``"auto"`` the mode
        it picks for them, ``"per_block"`` or ``"per_use"`` (class docstring)."""
        if self.fsdp_gather != "auto":
            return self.fsdp_gather
        tree, specs, seen = self._specs(params)
        experts = () if self.expert_axis is None else (self.expert_axis,)
        treedef = jax.tree_util.tree_structure(tree)
        weights = WeightSharding.of(treedef, specs, self.data_axes, "per_use", experts, seen=seen)
        chunk, x, context = self._one_call(tree, inputs, side, key)
        return self._auto_gather(weights, chunk, x, context).gather

    def forward(self, params, inputs, *, side=None, key=None):
        """The last stage's outputs for the whole batch, forward only.

        Differentiable in reverse mode like `loss`. Forward mode (``jax.jvp``) runs with
        respect to ``inputs``; with respect to ``params`` only for stages without a
        ``lax.scan`` over stacked weights (see `jaxpipe._jaxpr.unroll`).

        Args:
          params, inputs, side, key: as in `loss`.

        Returns:
          A pytree of ``inputs``' structure with ``[B, ...]`` leaves.
        """
        tree, program = self._prepare(params, inputs, side=side, key=key, loss=False)
        return steps.forward(program, tree, inputs, side, key).outputs

    def init_optimizer(self, optimizer: optax.GradientTransformation, params):
        """One optimizer state per stage, for `train`, in the parameters' layout.

        Args:
          optimizer: an optax transformation.
          params: stage parameters in this pipeline's layout.

        Returns:
          The state, leaves ``[v, S, ...]`` (a `Placed` if ``params`` is): moments sharded
          like their parameters (and placed with their specs), per-stage counters ``[v, S]``
          over the pipe axis, so each device holds its own stages' state.
        """
        init = jax.vmap(jax.vmap(optimizer.init))
        tree = self.layout.check_placed(params, "params")
        structs = tree_map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), tree)
        abstract = jax.eval_shape(init, structs)
        owner = _parameter_of(optimizer, abstract, structs)  # per state leaf, or -1
        param_specs = specs_of(params)
        specs = recorded_specs([param_specs[i] if i >= 0 else None for i in owner])
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree)):
            state = init(tree)  # the caller's jit decides
        else:
            # A bare jit would put the state on one device: init reads no parameter values.
            stage_sharding = self.layout.sharding()  # P(None, pipe): [v, S] and anything else
            params_sharding = [p.sharding for p in jax.tree_util.tree_leaves(tree)]
            treedef = jax.tree_util.tree_structure(abstract)
            shardings = treedef.unflatten(
                [params_sharding[i] if i >= 0 else stage_sharding for i in owner]
            )
            state = self.layout._jit(init, shardings)(tree)
        return Placed(state, self.layout.order, specs) if is_placed(params) else state

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

        Each stage owns its optimizer state and updates its own parameters: element-wise
        optimizers (SGD, Adam, ...) match a global ``optax`` step; ones that look at all
        parameters at once (global-norm clipping) act per stage here. Schedules without
        weight updates in their table (``1f1b``, ...) update once per stage from the gradient
        of the step's loss (the micro-batches' losses combined as ``loss_reduction``
        says: by default their mean); those with them (``pipedream``, ``pipedream_2bw``)
        where the table says, with the mean gradient of the micro-batches since the
        stage's previous update, each computed at the weight version its forward read.
        `jaxpipe.replay.replay` defines the semantics on one device; tests hold this method
        to it.

        Args:
          optimizer: an optax transformation.
          params: stage parameters in this pipeline's layout.
          opt_state: the state from `init_optimizer`.
          loss_params, inputs, targets, side, key: as in `loss` (loss parameters are not
            trained here).

        Returns:
          ``(params, opt_state, losses)``, with ``losses`` the ``M`` micro-batch losses;
          with ``loss_has_aux``, ``losses`` is the pair ``(losses, aux)``, ``aux``
          combined as in `loss`.
        """
        tree, program = self._prepare(params, inputs, loss_params, targets, side, key)
        structs = tree_map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), tree)
        expected = jax.eval_shape(jax.vmap(jax.vmap(optimizer.init)), structs)
        checks.optimizer_state(opt_state, expected, self.num_logical_stages)
        fix = "opt_state = pipe.place(opt_state)"
        checks.on_mesh(_unplaced(opt_state), self.mesh, "opt_state", fix)
        state = self.layout.check_placed(opt_state, "opt_state", allow_empty=True)
        result = steps.update(
            program, optimizer, tree, state, loss_params, inputs, targets, side, key
        )
        losses = (result.losses, result.aux) if self.loss_has_aux else result.losses
        return (
            placed_like(result.params, params),
            placed_like(result.opt_state, opt_state),
            losses,
        )

    # ---------------------------------------------------------------- inspection
    def trace(self, params, loss_params, inputs, targets, *, side=None, key=None) -> np.ndarray:
        """What each device executed in each tick, read back from the compiled program.

        Each row is what ran (the action's own op code, the stage whose weights it read, the
        micro-batch of the values it read; -1 where these disagree with each other), not a
        copy of the plan. For schedules with weight updates the
        traced program is the one without them (same table, versions ignored).

        Args:
          params, loss_params, inputs, targets, side, key: as in `loss`.

        Returns:
          An int array ``[T, S, 6]``: forward op code, stage, micro-batch, backward op code,
          stage, micro-batch. Forward codes: 1 a stage, 2 the last stage with its loss;
          backward codes: 1 BW, 2 B, 3 W; 0 is idle. Compare with `expected_trace`.
        """
        tree, program = self._prepare(params, inputs, loss_params, targets, side, key)
        trace = self._traced_run(program, tree, loss_params, inputs, targets, side, key)
        return trace[:, :, :6]

    def expected_trace(self) -> np.ndarray:
        """The trace `trace` must return, computed from the schedule's table alone.

        Returns:
          An int array ``[T, S, 6]`` (see `trace`).
        """
        table = self._plan.table
        cols = ["f_op", "f_stage", "f_mb", "b_op", "b_stage", "b_mb"]
        return np.stack([table[:, :, COLUMN[c]] for c in cols], axis=-1)

    def first_nonfinite(
        self, params, loss_params, inputs, targets, *, side=None, key=None
    ) -> dict | None:
        """Where the first NaN or infinity appears.

        Runs the schedule once more with a finiteness check after every action (a separate
        program: the normal path is not slowed). Not jittable: it returns Python values.

        Args:
          params, loss_params, inputs, targets, side, key: as in `loss`.

        Returns:
          None if loss and gradients are finite; else the earliest offending action as
          ``{"tick", "device", "op", "stage", "microbatch"}`` with ``op`` ``"F"`` (its
          output, or the loss and the loss parameters' gradient) or ``"backward"`` (its
          input gradient, or the weight gradients it accumulated).
        """
        tree, program = self._prepare(params, inputs, loss_params, targets, side, key)
        trace = self._traced_run(program, tree, loss_params, inputs, targets, side, key)
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
    def _prepare(
        self, params, inputs, loss_params=None, targets=None, side=None, key=None, *, loss=True
    ):
        """Checks the arguments of a step before tracing, raising a clear error for what the
        pipeline cannot run; the one check of ``params``' layout per call. ``loss``: the
        step runs ``loss_fn`` (every step but `forward`), which is then checked too, also
        when ``loss_params`` and ``targets`` are both None.

        Returns:
          ``(tree, program)``: the ``[v, S, ...]`` tree of ``params``, and the program for
          the specs ``params`` were placed with.
        """
        place = "params = pipe.place(params) (and opt_state = pipe.place(opt_state))"
        checks.on_mesh(_unplaced(params), self.mesh, "stage_params", place)
        tree, specs, seen = self._specs(params)
        checks.params(tree)
        if seen:  # else the parameters' own shardings may name any axis
            self._warn_idle_axes(tree, specs)
        else:
            self._warn_unseen_split()
        self._warn_retrace((tree, loss_params, inputs, targets, side, key), specs)
        treedef = jax.tree_util.tree_structure(tree)
        experts = () if self.expert_axis is None else (self.expert_axis,)
        gather = "per_use" if self.fsdp_gather == "auto" else self.fsdp_gather
        weights = WeightSharding.of(treedef, specs, self.data_axes, gather, experts, seen=seen)
        if experts:
            checks.expert_weights(tree, specs, self.expert_axis, self.mesh, 2, named=True)
        fix = "loss_params = pipe.replicate(loss_params)"
        checks.on_mesh(loss_params, self.mesh, "loss_params", fix)
        for name, batch in (("inputs", inputs), ("targets", targets), ("side", side)):
            checks.on_mesh(batch, self.mesh, name, f"{name} = pipe.place_batch({name})")
        checks.batch(inputs, targets, side, self.num_microbatches, self.num_replicas)
        checks.keywords(self._stage_keywords, self._loss_keywords, side, key)
        chunk, x, context = self._one_call(tree, inputs, side, key)
        stage_call = self._expert_bound(self._stage_call, weights)
        y = checks.stage_output(stage_call, chunk, x, context)
        checks.closed_over_gradients(
            stage_call, (chunk, x, context), self._stage_functions, "stage_fn",
            "stage parameters in params (one value per stage), or a side input (side=, "
            "split into micro-batches like the inputs)",
        )  # fmt: skip
        weights = self._auto_gather(weights, chunk, x, context)
        if self._costs_source is not None:
            self._fit_schedule(chunk, x, context)
        probe = (treedef, str(chunk), str(x), tuple(specs))
        if probe not in self._probed:
            manual = {self.axis, *self.data_axes}
            checks.stage_data_movement(
                stage_call, chunk, x, context, self.mesh, weights.inner, manual
            )
            self._probed.add(probe)
        aux = None  # one micro-batch's aux: its structure, shapes and dtypes
        if loss:
            if self.loss_fn is None:
                raise ValueError("this Pipeline has no loss_fn; pass one to use loss()")
            target = _one_microbatch(targets, self.num_microbatches)
            aux = checks.loss_output(
                self._loss_fn_call, loss_params, y, target, context, self.loss_has_aux
            )
            if callable(self.loss_reduction):
                checks.loss_weights(self.loss_reduction, target)
                M = self.num_microbatches
                checks.loss_weights_total(self.loss_reduction, targets, M * self.num_replicas)
            checks.closed_over_gradients(
                self._loss_call, (loss_params, y, target, context),
                [("loss_fn", self.loss_fn)], "loss_fn",
                "loss_params (the head's parameters, differentiated like the stages')",
            )  # fmt: skip
        stage_fn = self._stage_call
        if weights.per_block:
            stage_fn = blockwise.per_block(
                self._per_block_stage_call, weights, dict(self.mesh.shape)
            )
        program = Program(
            plan=self._plan,
            forward_plan=self._forward_plan,
            stage_fn=stage_fn,
            loss_fn=self._loss_and_aux_call,
            mesh=self.mesh,
            axis=self.axis,
            remat=self.remat,
            data_axes=self.data_axes,
            weights=weights,
            grad_dtype=self.grad_dtype,
            split_loss_grads=self.split_loss_grads,
            aux=aux,
            loss_reduction=self.loss_reduction,
        )
        return tree, program

    def _specs(self, params):
        """``(tree, specs, seen)``: the ``[v, S, ...]`` tree of placed ``params``, the
        inner placement spec of each leaf, and whether those are the parameters' own
        (`WeightSharding`)."""
        tree = self.layout.check_placed(params)
        specs, seen = specs_of(params), True
        if is_bare(params):  # placed by hand: run them as their shardings say
            carried = self.layout.carried_specs(tree)
            specs, seen = (specs, False) if carried is None else (carried, True)
        return tree, specs, seen

    def _one_call(self, tree, inputs, side, key):
        """``(chunk, x, context)``: one stage's parameters, one micro-batch's inputs and a
        context, as shapes and dtypes (of ``key``, its first micro-batch's)."""
        chunk = tree_map(lambda p: jax.ShapeDtypeStruct(p.shape[2:], p.dtype), tree)
        M = self.num_microbatches
        context = Context(
            side=_one_microbatch(side, M),
            key=None if key is None else jax.random.fold_in(key, 0),
            stage=jnp.int32(0),
            microbatch=jnp.int32(0),
        )
        return chunk, _one_microbatch(inputs, M), context

    def _auto_gather(self, weights: WeightSharding, chunk, x, context) -> WeightSharding:
        """With ``fsdp_gather="auto"``, ``weights`` (built ``"per_use"``) gathered
        ``"per_block"`` on GPUs where the stage takes a weight split over a data axis apart
        along a dimension it is not split over (`blockwise.takes_blocks`: a scan or a loop
        over stacked blocks); else ``weights`` as they are."""
        if self.fsdp_gather != "auto" or not weights.active:
            return weights
        if self.mesh.devices.flat[0].platform != "gpu":
            return weights
        signature = (weights, str(_shapes(chunk)), str(_shapes((x, context))))
        if signature not in self._gathers:
            blockwise_weights = dataclasses.replace(weights, gather="per_block")
            takes = blockwise.takes_blocks(
                self._per_block_stage_call, blockwise_weights, chunk, x, context
            )
            self._gathers[signature] = "per_block" if takes else "per_use"
        return dataclasses.replace(weights, gather=self._gathers[signature])

    def _fit_schedule(self, chunk, x, context: Context) -> None:
        """Packs the table for the costs of ``self._costs_source`` (`costs` in the class
        docstring), read from one stage of ``chunk``'s shapes on a micro-batch ``x``."""

        key = context.key
        if key is not None:  # a concrete key of the same kind: the stage is run on its own
            typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
            key = jax.random.key(0) if typed else jax.random.PRNGKey(0)

        def stage(params, inputs):
            x, side = inputs
            return self._stage_call(params, x, context._replace(side=side, key=key))

        if self.remat:  # B and W compute the forward again, as the executor's do
            stage = jax.checkpoint(stage)
        self.costs = costs_lib.of_stage(self._costs_source, stage, chunk, (x, context.side))
        self._costs_source = None
        schedule = schedules_lib.fit(self.schedule, self.costs)
        self.schedule = schedule
        self._plan = make_plan(schedule)
        self._forward_plan = make_plan(schedule.forward_only())

    def _expert_bound(self, stage_call, weights: WeightSharding):
        """``stage_call`` as the checks run it, on one stage's whole parameters: with an
        expert axis, inside a ``shard_map`` over it, so that the stage sees its own experts
        and its all-to-alls have their axis, as inside the pipeline."""
        if self.expert_axis is None:
            return stage_call
        P = jax.sharding.PartitionSpec

        def bound(chunk, x, context):
            leaves, treedef = jax.tree_util.tree_flatten(chunk)
            specs = treedef.unflatten(
                [P(*[axes or None for axes in weights.kept[i]]) for i in range(len(leaves))]
            )
            return jax.shard_map(
                stage_call,
                mesh=self.mesh,
                in_specs=(specs, P(), P()),
                out_specs=P(),
                axis_names={self.expert_axis},
                check_vma=False,
            )(chunk, x, context)

        return bound

    def _traced_run(self, program: Program, *args) -> np.ndarray:
        """The training program with its per-tick record, compiled (never eager: an eager
        ``shard_map`` cannot take weights split over an automatic axis such as tensor)."""
        return np.asarray(jax.jit(functools.partial(steps.trace, program))(*args))

    def _stage_call(self, params, x, context: Context, rolled: bool = False):
        """The user's stage_fn with the keywords its signature names (its short scans written
        out as loops, `jaxpipe._jaxpr.unroll`, unless ``rolled``)."""
        fn = self._rolled_stage_fn if rolled else self._fitted_stage_fn
        if self.remat_policy is not None:
            fn = jax.checkpoint(fn, policy=self.remat_policy)
        return fn(params, x, **self._pass(self._stage_keywords, context))

    def _per_block_stage_call(self, params, x, context: Context):
        """`_stage_call` as ``fsdp_gather="per_block"`` runs it: on GPUs with the stage's
        scans kept, whose compiler would otherwise gather every block's weights at once
        (compiled on 4 H100s, pipe 1 x fsdp 4, 8 scanned blocks: 399 against 495 MiB at
        the peak; on v5p the written-out blocks hold less, 669 against 732 MiB at pipe 2)."""
        rolled = self.mesh.devices.flat[0].platform == "gpu"
        return self._stage_call(params, x, context, rolled=rolled)

    def _loss_fn_call(self, loss_params, y, target, context: Context):
        """The user's loss_fn (its sharding constraints fitted to the stage) with the
        keywords its signature names."""
        keywords = self._pass(self._loss_keywords, context)
        return self._fitted_loss_fn(loss_params, y, target, **keywords)

    def _loss_and_aux_call(self, loss_params, y, target, context: Context):
        """``(loss, aux)`` of the user's loss_fn (``aux`` None without ``loss_has_aux``),
        as arrays: a Python or NumPy scalar (a loss that does not read ``y``) becomes one, as
        ``jax.jit`` would make it."""
        out = self._loss_fn_call(loss_params, y, target, context)
        loss, aux = out if self.loss_has_aux else (out, None)
        return jnp.asarray(loss), tree_map(jnp.asarray, aux)

    def _loss_call(self, loss_params, y, target, context: Context):
        """The user's loss_fn's loss alone."""
        return self._loss_and_aux_call(loss_params, y, target, context)[0]

    @staticmethod
    def _pass(accepted: set, context: Context) -> dict:
        values = {"key": context.key, "side": context.side, "stage": context.stage}
        return {
            k: v for k, v in values.items() if k in accepted and (v is not None or k == "stage")
        }

    def _check_synchronous(self, method):
        if self.updates_weights:
            raise ValueError(
                f"schedule {self.schedule.name!r} updates weights inside the pipeline (weight "
                f"versions), so it has no single gradient for {method}(); use "
                "Pipeline.train(optimizer, params, opt_state, loss_params, inputs, targets), "
                "or a schedule without weight updates such as '1f1b'"
            )

    def replicate(self, tree):
        """``tree`` put on the pipeline's mesh, every leaf whole on every device.

        A jitted step returns arrays on the mesh; arguments made elsewhere (loss
        parameters from ``jax.random`` or ``jnp``, on one device) arrive placed otherwise at
        the first call than at the next, so the step compiles twice. Put them on the mesh
        once, before the first step.

        Args:
          tree: a pytree of arrays (loss parameters, optimizer state of them).

        Returns:
          ``tree`` with every leaf on ``self.mesh``, replicated.
        """
        sharding = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        return jax.device_put(tree, sharding)

    def place_batch(self, tree):
        """Batch arrays put on the mesh as the pipeline reads them: rows split over the data
        axes, whole on the other axes (see `replicate` for why).

        Args:
          tree: a pytree of ``[B, ...]`` arrays (inputs, targets, side inputs).

        Returns:
          ``tree`` on ``self.mesh``, axis 0 split over ``self.data_axes``.
        """
        spec = jax.sharding.PartitionSpec(self.data_axes or None)
        return jax.device_put(tree, jax.sharding.NamedSharding(self.mesh, spec))

    def _warn_retrace(self, arguments, specs) -> None:
        """Warns once when a step is traced again from the same line for the same shapes
        under the same transformations: JAX traces a jitted function again when its
        arguments arrive placed differently from before, and compiles it again. (A loss
        traced once under ``jax.jit`` and once under ``jax.grad`` inside another is two
        programs, not a retrace: its tracers' kinds differ.)"""
        leaves = jax.tree_util.tree_leaves(arguments)
        tracers = sorted({type(a).__name__ for a in leaves if isinstance(a, jax.core.Tracer)})
        if self._warned_retrace or not tracers:
            return
        shapes = [(jnp.shape(a), str(getattr(a, "dtype", type(a)))) for a in leaves]
        structure = str(jax.tree_util.tree_structure(arguments))
        signature = (_call_site(), structure, str(shapes), str(specs), str(tracers))
        if signature not in self._traced:
            self._traced.add(signature)
            return
        self._warned_retrace = True
        file, line = signature[0]
        warnings.warn(
            f"the pipeline step called at {file}:{line} is traced again for the same shapes, "
            "so it compiles again. A jitted step is traced again when its arguments arrive "
            "placed differently from the previous call: arrays made off the mesh (loss "
            "parameters from jax.random or jnp live on one device) come back from the step "
            "on the mesh. Put them on the mesh once, before the first step: "
            "loss_params = pipe.replicate(loss_params), inputs = pipe.place_batch(inputs) "
            "(stage parameters: pipe.place or pipe.init; optimizer state: "
            "pipe.init_optimizer). If the step is not jitted, wrap it in jax.jit, or make "
            "the jitted function once and call it every step.",
            stacklevel=4,
        )

    def _warn_unseen_split(self) -> None:
        """Warns once per pipeline that bare parameters traced on a mesh of automatic axes
        are read whole over the data axes, where a split over one is not seen."""
        data = {a: self.mesh.shape[a] for a in self.data_axes if self.mesh.shape[a] > 1}
        if self._warned_unseen_split or not data:
            return
        self._warned_unseen_split = True
        axes = ", ".join(f"{a!r}: {n}" for a, n in data.items())
        warnings.warn(
            "stage_params are bare arrays traced on a mesh of automatic axes (inside "
            "jax.jit), where their shardings do not show: the pipeline reads each of them "
            f"whole over its data axes ({axes}), so a weight split over one is gathered for "
            "the step (splits over the other axes are kept). To keep FSDP, place them once, "
            "before the step: params = pipe.place(logical_params, specs), a jaxpipe.Placed "
            "that carries its specs through jit.",
            stacklevel=4,
        )

    def _warn_idle_axes(self, params, specs) -> None:
        """Warns once per pipeline about mesh axes with no role (see `checks`)."""
        if self._warned_idle_axes:
            return
        self._warned_idle_axes = True
        message = checks.idle_axes_warning(self.mesh, self.axis, self.data_axes, specs, params)
        if message:
            warnings.warn(message, stacklevel=4)


def _call_site() -> tuple[str, int]:
    """The file and line of the innermost caller outside jaxpipe and jax."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(("jaxpipe", "jax", "flax", "optax", "contextlib", "functools")):
            return frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back
    return "<unknown>", 0


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


def _parameter_of(optimizer, state, params) -> list[int]:
    """Per leaf of the optimizer ``state`` (of parameters ``params``), the index of the
    parameter leaf it has the shape of (a moment), or -1 (a counter, or an optimizer whose
    state cannot be matched to its parameters)."""
    num_leaves = len(jax.tree_util.tree_leaves(state))
    index = jax.tree_util.tree_structure(params).unflatten(
        range(len(jax.tree_util.tree_leaves(params)))
    )
    try:
        owners = optax.tree_utils.tree_map_params(
            optimizer, lambda _, i: i, state, index, transform_non_params=lambda _: -1
        )
    except Exception:  # an init that needs real shapes: no leaf is a moment
        return [-1] * num_leaves
    owners = jax.tree_util.tree_leaves(owners)
    return owners if len(owners) == num_leaves else [-1] * num_leaves


def _unplaced(tree):
    """The tree a `Placed` holds (``tree`` itself if it is none)."""
    return tree.tree if is_placed(tree) else tree


def _shapes(tree):
    """``tree``'s leaves as shapes and dtypes."""
    return tree_map(lambda a: (jnp.shape(a), getattr(a, "dtype", type(a))), tree)


def _one_microbatch(tree, num_microbatches):
    """One micro-batch's shapes and dtypes, as ``jax.jit`` reads them (a NumPy float64
    array is float32 unless x64 is enabled)."""
    return tree_map(
        lambda a: jax.ShapeDtypeStruct(
            (a.shape[0] // num_microbatches, *a.shape[1:]),
            jax.dtypes.canonicalize_dtype(a.dtype),
        ),
        tree,
    )
