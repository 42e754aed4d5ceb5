"""The fastest way to run a model that fits: `plan` chooses the mesh, schedule, table,
micro-batches, remat and FSDP gathering.

```python
plans = jaxpipe.plan(block_fn, block_params, 32, loss_fn, loss_params, inputs, targets,
                     target=jaxpipe.target.get("v5p:2x2x2"), block_specs=specs)
print(plans)                      # every plan ranked, best first, and why the others lost
best = plans[0]
mesh = best.mesh(jaxpipe.target.get("v5p:2x2x2").devices)   # or your own devices
pipe = jaxpipe.Pipeline(jaxpipe.stages.blocks(block_fn), loss_fn, mesh=mesh, schedule=best)
```

How it ranks, in three passes:

1. **Every candidate, by the step-time model, nothing compiled.** One block's F, B, W and
   BW are compiled once for one device of the target (`jaxpipe.costs.cost_analysis`: the
   TPU compiler's own time estimate, or a roofline of XLA's counts at the GPU's peaks), for
   each remat policy (where the block checkpoints itself, remat "none" also with its own
   checkpoints keeping everything), at one row of a micro-batch and one device's share of
   each tensor split (the weights its specs split over ``tensor``); a candidate's action
   costs are those times its blocks per stage and its rows per device. Remat "none" is
   compiled at the widest and narrowest splits and fitted as a / t + b between them; a
   split between is compiled once one of its plans is among the best (those packed and
   compiled, or within `FITTED_MARGIN` of the first), and its plans predicted again.
   Collectives are charged on the link they cross, none assumed hidden: FSDP gathers of the
   weights an action runs (and the reduce-scatter of its gradient) inside the action, two
   all-reduces of a block's input in its forward and two in its backward over ``tensor``
   (a Megatron-style split; the forward's again where the backward recomputes it), one
   send of a micro-batch's activation a tick over ``pipe``, the gradient's all-reduce over
   ``data`` once a step. The table runs in lock-step (`jaxpipe.schedules.simulate`).
   Computation is multiplied by the calibration of the target's platform
   (`jaxpipe.calibration`). Memory is predicted from shapes: weights, gradients and
   optimizer state split over pipe x fsdp (x tensor where a block's specs say so), the
   gathered weights the FSDP mode holds, and the residuals the table keeps alive
   (`Schedule.peak_activations`) under the remat policy.
2. **The best by time among those predicted to fit**, their tables also packed for the
   costs (`jaxpipe.schedules.fit`), kept where packing is faster.
3. **The best few, compiled** for the target (`jaxpipe.target`): re-ranked by the
   compiled program's own report (its peak memory, and the exposed time of the collectives
   it did not run behind computation), and only those whose compiled peak fits are
   returned as fitting. The program compiled runs a stage's blocks as
   ``jaxpipe.stages.blocks(block_fn, scan=scan_blocks)`` runs them, in a Python loop by
   default or in a ``lax.scan``: the form to build the plan's pipeline with, as the two
   may compile to different programs (for Llama-3 70B on 128 v5p chips, XLA kept the
   loop's activations whole over ``tensor`` and exposed twice the tensor collectives).

Pipe 1 (no pipeline: gradient accumulation over micro-batches with FSDP, data and tensor
parallelism) is one of the candidates, so a plan says when not to pipeline.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import inspect
import itertools
import math
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.schedules import Costs, Schedule, fit
from jaxpipe.schedules import get as get_schedule
from jaxpipe.schedules.actions import BW, B, F, W

__all__ = [
    "AXES",
    "FITTED_MARGIN",
    "GATHERS",
    "INNER_POLICIES",
    "REMATS",
    "SCHEDULES",
    "NothingFits",
    "Plan",
    "Plans",
    "plan",
    "stage_specs",
]

AXES = ("pipe", "data", "fsdp", "tensor")
# remat name -> (Pipeline's remat, remat_policy): what a stage's backward recomputes
REMATS = {
    "none": (False, None),  # keep every residual
    "dots": (False, jax.checkpoint_policies.dots_saveable),  # keep matmul results
    "full": (True, None),  # keep the stage input, recompute the stage
}
# what a block that checkpoints itself keeps where the plan overrides the block's own
# checkpoints (`Plan.inner_remat`): under remat "none" only, as the other remats wrap the
# stage in a checkpoint of their own, whose policy decides what the stage keeps, its
# blocks' checkpoints included
INNER_POLICIES = {"none": jax.checkpoint_policies.everything_saveable}
SCHEDULES = ("gpipe", "1f1b", "zb_h1", "interleaved_1f1b", "zbv", "circular", "dualpipev")
GATHERS = ("per_use", "per_block", "ahead", "once")
# A tensor split whose block costs are fitted (`_fitted`) is compiled where a plan at it is
# among those to compile, or predicted within this fraction of the best plan's time.
FITTED_MARGIN = 0.10
GiB = 2**30


# ----------------------------------------------------------------------------- the result
@dataclasses.dataclass(frozen=True)
class Plan:
    """One way to run the model, and what it is predicted (and, once compiled, read) to cost.

    Attributes:
        axes: mesh axis sizes, ``{"pipe": ..., "data": ..., "fsdp": ..., "tensor": ...}``.
        schedule: the table (`Schedule`), packed for the stage's costs where ``packed``.
        packed: whether the table was packed for the costs (`jaxpipe.schedules.fit`),
            perhaps holding one more live micro-batch (its options' ``extra_live``).
        remat: a name of `REMATS`.
        split_loss_grads: the loss parameters' gradient accumulates split over the batch
            axes (``Pipeline(split_loss_grads=True)``: a reduce-scatter each micro-batch),
            taken only where the whole accumulator does not fit.
        inner_remat: the remat policy also replaces the policy of the block's own
            checkpoints (a block that checkpoints itself; `INNER_POLICIES`), through
            ``Pipeline(inner_remat_policy=...)``; False: the block's own policies stand.
        fsdp_gather: how FSDP-split weights are gathered (None: no fsdp axis).
        step_seconds: the predicted step time (the compiled report's where ``compiled``).
        mfu: model FLOP utilisation at ``step_seconds``.
        breakdown: seconds per step of each part: ``compute`` (the blocks' actions in
            lock-step, calibrated), ``bubble`` (of ``compute``, the idle share), and the
            exposed collectives by axis (``pipe``, ``fsdp``, ``tensor``, ``data``), and
            ``update`` (the optimizer's pass over its state).
        memory_bytes: predicted peak bytes per device (the compiled peak where
            ``compiled``).
        fits: whether ``memory_bytes`` is within the budget.
        compiled: whether the figures are the compiled program's.
        costs: a stage's per-action computation (seconds, raw compiler estimates), what
            the table is packed for.
        action_seconds: raw seconds of F, the last stage's F (with the loss), B, W and BW.
        memory: the predicted bytes per device by part.
        predicted_seconds: the step time the model predicted before any compile.
        across: on a target of several TPU slices or GPU nodes, ``{axis: count}``: the
            axes whose groups span them (their collectives cross the slow link), each
            spanning ``count`` of them; None on one slice or node.
        note: why it ranks where it does against the plan before it.
    """

    axes: dict
    schedule: Schedule
    packed: bool
    remat: str
    fsdp_gather: str | None
    step_seconds: float
    mfu: float | None
    breakdown: dict
    memory_bytes: int
    fits: bool
    compiled: bool = False
    costs: Costs | None = None
    action_seconds: tuple = ()
    memory: dict = dataclasses.field(default_factory=dict)
    predicted_seconds: float | None = None
    across: dict | None = None
    inner_remat: bool = False
    split_loss_grads: bool = False
    note: str = ""
    _nodes: str = "nodes"  # what the target's slow link joins, to print
    _live_bytes: float = 0.0  # the residuals of one more live micro-batch a device

    @property
    def num_microbatches(self) -> int:
        return self.schedule.num_microbatches

    def mesh(self, devices=None) -> jax.sharding.Mesh:
        """A mesh of `axes` (every axis automatic): on a `jaxpipe.target.Target` (its
        ``mesh``, the axes of `across` spanning its slices or nodes), or on ``devices``
        (default ``jax.devices()``, taken as node by node where `across` is set)."""
        shape = tuple(self.axes[a] for a in AXES)
        if hasattr(devices, "mesh") and hasattr(devices, "devices"):  # a Target
            return devices.mesh(shape, AXES, across=self.across)
        devices = list(jax.devices() if devices is None else devices)
        needed = math.prod(shape)
        if len(devices) < needed:
            raise ValueError(f"plan's mesh {self.axes} needs {needed} devices, got {len(devices)}")
        auto = (jax.sharding.AxisType.Auto,) * len(AXES)
        if self.across:
            from jaxpipe.analysis.target import node_major_grid

            spans = tuple(self.across.get(a, 1) for a in AXES)
            within = tuple(self.axes[a] // n for a, n in zip(AXES, spans, strict=True))
            grid = node_major_grid(within, spans, devices[:needed])
            return jax.sharding.Mesh(grid, AXES, axis_types=auto)
        try:
            return jax.make_mesh(shape, AXES, axis_types=auto, devices=devices[:needed])
        except NotImplementedError:  # an axis that splits a physical one
            from jax.experimental import mesh_utils

            grid = mesh_utils.create_device_mesh(
                shape, devices[:needed], allow_split_physical_axes=True
            )
            return jax.sharding.Mesh(grid, AXES, axis_types=auto)

    def pipeline_options(self) -> dict:
        """The `jaxpipe.Pipeline` keywords this plan names (what ``schedule=plan`` sets)."""
        remat, policy = REMATS[self.remat]
        return {
            "schedule": self.schedule,
            "remat": remat,
            "remat_policy": policy,
            "inner_remat_policy": INNER_POLICIES[self.remat] if self.inner_remat else None,
            "split_loss_grads": self.split_loss_grads,
            "fsdp_gather": self.fsdp_gather or "per_use",
        }

    def as_dict(self) -> dict:
        """Every figure, JSON-ready (the table as its name, M and v)."""
        s = self.schedule
        return {
            "axes": dict(self.axes), "across": self.across, "schedule": s.name,
            "packed": self.packed, "extra_live": dict(s.options).get("extra_live", 0),
            "microbatches": s.num_microbatches,
            "virtual_stages": s.stages_per_device, "remat": self.remat,
            "inner_remat": self.inner_remat, "split_loss_grads": self.split_loss_grads,
            "fsdp_gather": self.fsdp_gather, "step_seconds": self.step_seconds, "mfu": self.mfu,
            "predicted_seconds": self.predicted_seconds, "memory_bytes": self.memory_bytes,
            "predicted_memory": {k: float(v) for k, v in self.memory.items()},
            "fits": self.fits, "compiled": self.compiled,
            "breakdown": {k: float(v) for k, v in self.breakdown.items()}, "note": self.note,
            "action_seconds": [float(a) for a in self.action_seconds],
        }  # fmt: skip

    def describe(self) -> str:
        """One line: mesh, schedule, M, v, remat, gathering."""
        mesh = " x ".join(f"{a} {n}" for a, n in self.axes.items())
        s = self.schedule
        extra = dict(s.options).get("extra_live", 0)
        table = f"{s.name}{' packed' if self.packed else ''}{f' +{extra} live' if extra else ''}"
        gather = f", fsdp {self.fsdp_gather}" if self.fsdp_gather else ""
        spans = ", ".join(f"{a} {n}" for a, n in (self.across or {}).items())
        across = f" (across {self._nodes}: {spans})" if spans else ""
        inner = " (the block's own checkpoints too)" if self.inner_remat else ""
        gather += ", loss gradients split" if self.split_loss_grads else ""
        return (f"{mesh}{across}: {table}, M {s.num_microbatches}, v {s.stages_per_device}, "
                f"remat {self.remat}{inner}{gather}")  # fmt: skip

    def __str__(self) -> str:
        kind = "compiled" if self.compiled else "predicted"
        mfu = "" if self.mfu is None else f", MFU {self.mfu:.1%}"
        parts = ", ".join(f"{k} {_seconds(v)}" for k, v in self.breakdown.items() if v)
        return (
            f"{self.describe()}\n  step {_seconds(self.step_seconds)}{mfu} ({kind}); "
            f"peak {self.memory_bytes / GiB:.2f} GiB a device"
            f"{'' if self.fits else ' (DOES NOT FIT)'}\n  {parts}"
            + (f"\n  {self.note}" if self.note else "")
        )


class Plans(list):
    """`Plan`s, best first (those that fit before those that do not), with a table as
    their text. ``budget_bytes``: the memory budget they were held to; ``searched``: how
    many candidates were ranked; ``rejected``: reason -> how many candidates it removed."""

    def __init__(self, plans, budget_bytes: int, searched: int, rejected: dict):
        super().__init__(plans)
        self.budget_bytes, self.searched, self.rejected = budget_bytes, searched, rejected

    def __str__(self) -> str:
        return self.table()

    def table(self, rows: int = 12) -> str:
        """The first ``rows`` plans as a table, and a count of the rest."""
        head = (f"{self.searched} candidates ranked, budget {self.budget_bytes / GiB:.2f} GiB "
                "a device; best first")  # fmt: skip
        lines = [f"{'#':>3} {'step':>10} {'MFU':>6} {'GiB':>7}  how", "-" * 96]
        for i, p in enumerate(self[:rows]):
            mark = ("c" if p.compiled else "p") + ("" if p.fits else "!")
            mfu = "" if p.mfu is None else f"{p.mfu:.1%}"
            lines.append(f"{i:>3} {_seconds(p.step_seconds):>10} {mfu:>6} "
                         f"{p.memory_bytes / GiB:>7.2f}{mark:<3}{p.describe()}")  # fmt: skip
            if p.note:
                lines.append(f"{'':>34}{p.note}")
        if len(self) > rows:
            lines.append(f"... and {len(self) - rows} more that fit")
        foot = ["c: compiled and read, p: predicted only, !: does not fit"]
        foot += [f"removed: {n} ({why})" for why, n in self.rejected.items() if n]
        return "\n".join([head, *lines, *foot])


def _seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.3f} s"


def _rank(p: Plan) -> tuple:
    """Faster first; of plans within a part in 10^6 of each other, the one holding less."""
    return (float(f"{p.step_seconds:.6g}"), p.memory_bytes)


# ----------------------------------------------------------------------------- the model
@dataclasses.dataclass(frozen=True)
class _Model:
    """What `plan` is given, checked."""

    block_fn: Callable
    block_params: Any  # one block, compute dtype, ShapeDtypeStructs
    num_blocks: int
    loss_fn: Callable
    loss_params: Any
    inputs: Any  # the whole batch
    targets: Any
    side: Any
    block_specs: Any  # PartitionSpec per leaf of one block (axis names of AXES), or None
    loss_specs: Any
    param_dtype: Any
    optimizer: Any
    kernel_flops: tuple[float, float] | None = None  # one row, whole width: (F, backward)
    scan_blocks: bool = False  # the compiled stage runs its blocks in a lax.scan

    @property
    def rows(self) -> int:
        return jax.tree.leaves(self.inputs)[0].shape[0]

    def one_row(self, tree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *a.shape[1:]), a.dtype), tree)

    @functools.cached_property
    def checkpoints_itself(self) -> bool:
        """Whether the block runs a ``jax.checkpoint`` of its own (``nnx.remat``...)."""
        from jaxpipe._jaxpr import checkpoints

        side = None if self.side is None else self.one_row(self.side)
        closed = jax.make_jaxpr(self.call_block)(
            self.block_params, self.one_row(self.inputs), side
        )  # fmt: skip
        return checkpoints.has_checkpoint(closed.jaxpr)

    def call_block(self, params, x, side):
        return self.block_fn(params, x, side=side) if _takes_side(self.block_fn) else (
            self.block_fn(params, x)
        )  # fmt: skip


def _takes_side(fn) -> bool:
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "side" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _structs(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def _spec_axes(spec) -> set:
    names = set()
    for entry in spec or ():
        names.update(entry if isinstance(entry, tuple) else (entry,))
    return names - {None}


def _split_bytes(tree, specs, sizes: dict, itemsize: int | None = None) -> float:
    """Bytes of ``tree``'s leaves each divided by the sizes of the mesh axes its spec names
    (``itemsize`` instead of each leaf's own where given)."""
    leaves = jax.tree.leaves(tree)
    spec_leaves = (
        [None] * len(leaves)
        if specs is None
        else jax.tree.leaves(specs, is_leaf=lambda s: s is None or isinstance(s, P))
    )
    total = 0.0
    for a, spec in zip(leaves, spec_leaves, strict=True):
        size = itemsize or np.dtype(a.dtype).itemsize
        split = math.prod(sizes.get(name, 1) for name in _spec_axes(spec))
        total += math.prod(a.shape) * size / split
    return total


def _nbytes(tree) -> int:
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


# ----------------------------------------------------------------------------- one block's costs
@dataclasses.dataclass
class _BlockCosts:
    """One block (and the loss) on one device of the target, for one row of a micro-batch:
    its costs at one device's share of each tensor split (its weights split as their specs
    name ``tensor``), its residuals and FLOPs at the whole width. Seconds are the raw
    compiler estimates. The splits between the widest and the narrowest start out fitted
    (`_fitted`) rather than compiled; `compile_splits` replaces a split's fit by its own
    compiled costs."""

    costs: dict  # ((remat, inner), tensor split) -> Costs of a device's share of one block
    fitted: set  # tensor splits whose costs are fitted from the widest and narrowest so far
    kept: dict  # (remat, inner) -> bytes one block keeps for its backward, whole width
    forward_flops: float  # one block's forward, whole width
    loss_seconds: float  # the loss, its backward included (the last stage's F adds it)
    loss_flops: float  # the loss's forward
    loss_work: int  # temporaries of the loss and its backward
    x_bytes: int  # one row of stage input
    source: str
    compile_splits: Callable[[set], None]  # compiles those fitted splits: their own costs


def _wrapped(call, remat: str, inner: bool = False):
    """``call`` under a remat policy of `REMATS` (with ``inner``, its own checkpoints too)."""
    if inner:
        from jaxpipe._jaxpr import checkpoints

        call = checkpoints.with_policy(call, INNER_POLICIES[remat])
    if remat == "none":
        return call
    policy = REMATS[remat][1] or jax.checkpoint_policies.nothing_saveable
    return jax.checkpoint(call, policy=policy)


_ACTIONS = ("forward", "backward_input", "backward_weight", "full_backward")


def _tensor_share(params, specs, t: int):
    """``params``' shapes as one device of a tensor split of ``t`` holds them (each
    dimension its spec names ``tensor`` divided by ``t``), or None where a dimension does
    not divide."""
    if t == 1:
        return params
    leaves, tree = jax.tree.flatten(params)
    spec_leaves = _spec_leaves(specs) if specs is not None else [None] * len(leaves)
    out = []
    for a, spec in zip(leaves, spec_leaves, strict=True):
        shape = list(a.shape)
        for d, entry in enumerate(spec or ()):
            if "tensor" in (entry if isinstance(entry, tuple) else (entry,)):
                if shape[d] % t:
                    return None
                shape[d] //= t
        out.append(jax.ShapeDtypeStruct(tuple(shape), a.dtype))
    return jax.tree.unflatten(tree, out)


def _fitted(wide: Costs, narrow: Costs, w: int, n: int, t: int) -> Costs:
    """An action's cost at split ``t`` between splits ``w`` < ``n``, fitted as a / t + b
    through its cost at both: the work the split divides, and what it does not (the
    norms, the residual, the row's attention over heads that do not split)."""
    out = []
    for action in _ACTIONS:
        at_w, at_n = getattr(wide, action), getattr(narrow, action)
        divided = (at_w - at_n) / (1 / w - 1 / n)
        out.append(divided / t + at_w - divided / w)
    return Costs(*out)


def _block_costs(model: _Model, target, variants, tensors=(1,), lazy: bool = True) -> _BlockCosts:
    """The block's costs under each remat variant (``(remat, inner)``: a name of `REMATS`,
    and whether it replaces the block's own checkpoints' policy) at each tensor split of
    ``tensors``, compiled for one device of the target: every variant at the widest split,
    the first at the narrowest and (without ``lazy``) at every split, the others scaled as
    it scales (`_share_costs`). With ``lazy``, the first variant's costs at the splits
    between are fitted (`_fitted`) until `_BlockCosts.compile_splits` compiles them. A
    block that cannot be traced at a split's shapes (its code fixes a width) is charged its
    whole width's costs over the split."""
    from jaxpipe.analysis import costs as costs_lib
    from jaxpipe.analysis import kernels

    p = _structs(model.block_params)
    x1, t1 = model.one_row(model.inputs), model.one_row(model.targets)
    s1 = None if model.side is None else model.one_row(model.side)
    device = target.devices[0] if target.platform == "tpu" else None

    def seconds(counts) -> Costs:
        if target.platform == "tpu":
            return costs_lib.compiler_seconds(counts)
        return costs_lib.roofline(counts, target.peaks)

    tracing = threading.Lock()

    def one(variant, t):  # counts of one device's share of one block, or None
        share = _tensor_share(p, model.block_specs, t)
        stage = _wrapped(lambda p, xs: model.call_block(p, xs[0], xs[1]), *variant)
        if share is None:
            return None
        try:
            with tracing:  # traced one at a time, compiled side by side
                lowered = costs_lib._lowered_actions(stage, share, (x1, s1), device=device)
        except Exception:  # noqa: BLE001 - a block whose code fixes its width
            if t == 1:
                raise
            return None
        return costs_lib._counts(lowered, costs_lib._precision_of((share, x1)))

    counts: dict = {}

    def compile_pairs(pairs):
        # the compiles release Python's lock: one thread a core (a 70B block takes a minute)
        threads = max(1, min(len(pairs), os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            counts.update(zip(pairs, pool.map(lambda rt: one(*rt), pairs), strict=True))

    splits = sorted(set(tensors))
    base = variants[0]  # compiled at the widest and narrowest splits; the others at the widest
    ends = splits[1:] if not lazy else splits[-1:] if len(splits) > 1 else []
    compile_pairs([(v, splits[0]) for v in variants] + [(base, t) for t in ends])
    wide = [(v, 1) for v in variants if counts[v, splits[0]] is None]
    if wide:  # a split its code cannot take: the whole width
        compile_pairs(wide)
    fitted = set(splits) - {t for v, t in counts if v == base}
    if fitted and None in (counts.get((base, splits[0])), counts.get((base, splits[-1]))):
        # nothing to fit to: compile them
        compile_pairs([(base, t) for t in sorted(fitted)])
        fitted = set()
    with tracing:
        kept = {v: _nbytes(costs_lib._stage_actions(_wrapped(
            lambda p, xs: model.call_block(p, xs[0], xs[1]), *v), p, (x1, s1)).kept)
            for v in variants}  # fmt: skip
    first = next(k for k, c in counts.items() if c is not None)
    flops = counts[first]["forward"]["flops"] * first[1]
    how = ("the TPU compiler's optimal_seconds" if target.platform == "tpu" else
           f"XLA's counts at the {target.peaks.name}'s peaks")  # fmt: skip
    if model.kernel_flops is not None:  # a fused kernel the estimate does not see
        flops += model.kernel_flops[0]
        how += f", plus the kernel's FLOPs at {kernels.EFFICIENCY:.0%} of the chip's peak"
    per_pair: dict = {}

    def fill():  # every (variant, split)'s costs from what is compiled so far
        shared = {(v, t): seconds(c) for (v, t), c in counts.items() if c is not None}
        w, n = splits[0], splits[-1]
        for t in fitted:
            shared[base, t] = _fitted(shared[base, w], shared[base, n], w, n, t)
        for v in variants:
            for t in splits:
                c = _share_costs(shared, v, t, base)
                if model.kernel_flops is not None:  # remat keeps no kernel output: again
                    forward, backward = model.kernel_flops
                    k = kernels.costs_of_flops(forward / t, backward / t,
                                               peak_flops=target.peaks.peak_flops,
                                               recompute_forward=v[0] != "none")  # fmt: skip
                    c = Costs(*(getattr(c, a) + getattr(k, a) for a in _ACTIONS))
                per_pair[v, t] = c

    def compile_splits(ts):
        todo = sorted(set(ts) & fitted)
        compile_pairs([(base, t) for t in todo])
        fitted.difference_update(todo)
        fill()

    fill()
    lp = _structs(model.loss_params)
    on = None if device is None else jax.sharding.SingleDeviceSharding(device)
    placed = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on),
                          (lp, x1, t1))  # fmt: skip
    both = jax.jit(jax.value_and_grad(model.loss_fn, argnums=(0, 1))).lower(*placed).compile()
    alone = jax.jit(model.loss_fn).lower(*placed).compile()
    work = both.memory_analysis()
    return _BlockCosts(
        costs=per_pair,
        fitted=fitted,
        kept=kept,
        forward_flops=flops,
        loss_seconds=_seconds_of(_cost(both), target),
        loss_flops=float(_cost(alone).get("flops", 0.0)),
        loss_work=int(getattr(work, "temp_size_in_bytes", 0)),
        x_bytes=_nbytes(x1),
        source=f"{how} of one device's share of one block (its tensor split) and of the "
        "loss, one row of a micro-batch",
        compile_splits=compile_splits,
    )


def _share_costs(shared: dict, variant, t: int, base) -> Costs:
    """A variant's costs at tensor split ``t``: compiled where ``shared`` has them, else its
    widest compiled share's, scaled action by action as the ``base`` variant's costs scale
    from that split to ``t`` (the matrix products shrink alike under every policy), or
    split evenly where the base has no such pair."""
    if (variant, t) in shared:
        return shared[variant, t]
    w = min(u for v, u in shared if v == variant)
    own, to, at = shared[variant, w], shared.get((base, t)), shared.get((base, w))
    ratios = [
        getattr(to, a) / getattr(at, a) if to and at and getattr(at, a) > 0 else w / t
        for a in _ACTIONS
    ]  # fmt: skip
    return Costs(*(getattr(own, a) * r for a, r in zip(_ACTIONS, ratios, strict=True)))


def _seconds_of(analysis: dict, target) -> float:
    """The TPU compiler's time estimate, or a roofline of XLA's counts at the GPU's peaks."""
    if target.platform == "tpu" and analysis.get("optimal_seconds", -1) >= 0:
        return float(analysis["optimal_seconds"])
    flops, traffic = analysis.get("flops", 0.0), analysis.get("bytes accessed", 0.0)
    return max(flops / target.peaks.peak_flops, traffic / target.peaks.memory_bandwidth)


def _cost(compiled) -> dict:
    analysis = compiled.cost_analysis()
    return analysis[0] if isinstance(analysis, list) else (analysis or {})


# ----------------------------------------------------------------------------- a table, fast
class _LockStep:
    """A table's lock-step time for any per-action costs, from counts: for each tick and
    device how many F (of the last logical stage apart), B, W and BW it runs, and which
    ticks send to another device (what `jaxpipe.schedules.simulate` in ``"lockstep"`` mode
    computes for costs without all-to-alls)."""

    KINDS = ("F", "F_last", "B", "W", "BW")

    def __init__(self, schedule: Schedule):
        from jaxpipe.schedules.simulate import _sends_across

        last = schedule.num_logical_stages - 1
        T, S = schedule.num_ticks, schedule.num_stages
        self.counts = np.zeros((T, S, len(self.KINDS)))
        self.crosses = np.zeros(T, bool)
        index = {F: 0, B: 2, W: 3, BW: 4}
        for t, row in enumerate(schedule.ticks):
            for d, cell in enumerate(row):
                for a in cell:
                    if a.op not in index:
                        continue
                    k = 1 if a.op == F and a.stage == last else index[a.op]
                    self.counts[t, d, k] += 1
                    self.crosses[t] |= _sends_across(schedule, a)
        self.sends = int(self.crosses.sum())
        self.live = max(schedule.peak_activations())  # the most a device keeps at once
        self.work = self.counts.sum(axis=1)  # per tick, actions of each kind on all devices

    def makespan(self, per_kind: np.ndarray, communication: float = 0.0) -> float:
        """Seconds of the table at ``per_kind`` (seconds of F, F_last, B, W, BW)."""
        return float((self.counts @ per_kind).max(axis=1).sum() + self.sends * communication)

    def busy(self, per_kind: np.ndarray) -> float:
        """Mean seconds a device computes."""
        return float((self.work @ per_kind).sum() / self.counts.shape[1])


@functools.lru_cache(maxsize=4096)
def _table(name: str, num_stages: int, num_microbatches: int, options: tuple):
    """(table, its `_LockStep`), or the reason it cannot be built."""
    try:
        table = get_schedule(name, num_stages, num_microbatches, **dict(options))
    except ValueError as error:
        return str(error).split(";")[0]
    return table, _LockStep(table)


# ----------------------------------------------------------------------------- the candidates
@dataclasses.dataclass(frozen=True)
class _Candidate:
    axes: tuple  # sizes of AXES
    schedule: str
    options: tuple
    microbatches: int
    remat: str
    gather: str | None
    across: tuple | None = None  # ((axis, nodes its groups span), ...)
    inner: bool = False  # the remat policy replaces the block's own checkpoints' too
    split_loss: bool = False  # the loss parameters' gradient accumulates split

    @property
    def sizes(self) -> dict:
        return dict(zip(AXES, self.axes, strict=True))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _meshes(model: _Model, devices: int, fixed: dict, max_tensor: int):
    """Axis sizes (pipe, data, fsdp, tensor) using every device."""
    named = set().union(*(_spec_axes(s) for s in _spec_leaves(model.block_specs)))
    for pipe in _divisors(devices):
        for tensor in _divisors(devices // pipe):
            if tensor > 1 and ("tensor" not in named or tensor > max_tensor):
                continue
            for fsdp in _divisors(devices // pipe // tensor):
                if fsdp > 1 and "fsdp" not in named:
                    continue
                sizes = dict(pipe=pipe, data=devices // pipe // tensor // fsdp, fsdp=fsdp,
                             tensor=tensor)  # fmt: skip
                if all(sizes[a] == n for a, n in fixed.items()):
                    yield sizes


def _spec_leaves(specs):
    if specs is None:
        return []
    return jax.tree.leaves(specs, is_leaf=lambda s: s is None or isinstance(s, P))


def _schedule_options(name: str, num_stages: int) -> list[tuple]:
    if num_stages == 1:
        return [()] if name == "1f1b" else []
    if name == "interleaved_1f1b":
        return [(("virtual_stages", 2),)]
    return [()]


def _candidates(model, devices, fixed, names, microbatches, remats, gathers, max_tensor, nodes=1):
    for sizes in _meshes(model, devices, fixed, max_tensor):
        for across in _spanning(sizes, nodes):
            yield from _settings(model, sizes, names, microbatches, remats, gathers, across)


def _spanning(sizes: dict, nodes: int) -> list:
    """The ways the mesh's axes can span ``nodes`` slices or nodes (None: one node), each
    ``((axis, count), ...)``, the counts' product ``nodes``: one for each set of axes that
    can cross the slow link (the predictor charges an axis the slow link whatever its
    count), the earlier axes of `AXES` spanning as many nodes as they can."""
    if nodes == 1:
        return [None]
    found: dict = {}

    def assign(i: int, left: int, chosen: tuple):
        if left == 1:
            found.setdefault(frozenset(a for a, _ in chosen), chosen)
        elif i < len(AXES):
            a = AXES[i]
            for n in sorted(_divisors(left), reverse=True):
                if n > 1 and sizes[a] % n == 0:
                    assign(i + 1, left // n, (*chosen, (a, n)))
            assign(i + 1, left, chosen)

    assign(0, nodes, ())
    return list(found.values())


def _settings(model, sizes, names, microbatches, remats, gathers, across):
    """Every schedule, micro-batch count, remat (over the block's own checkpoints too,
    where it has some) and gathering of one mesh."""
    inner = model.checkpoints_itself
    replicas = sizes["data"] * sizes["fsdp"]
    if model.rows % replicas:
        return
    S = sizes["pipe"]
    counts = microbatches or sorted({S * m for m in (1, 2, 4, 8)} | {1, 2, 4, 8})
    modes = [g for g in gathers if sizes["fsdp"] > 1] or [None]
    axes = tuple(sizes[a] for a in AXES)
    for name in names:
        for options in _schedule_options(name, S):
            for M in (m for m in counts if (model.rows // replicas) % m == 0):
                for remat in remats:
                    inners = (False, True) if inner and remat in INNER_POLICIES else (False,)
                    for gather, over in itertools.product(modes, inners):
                        yield _Candidate(axes, name, options, M, remat, gather, across, over)


# ----------------------------------------------------------------------------- the prediction
class _Links:
    """The link each mesh axis crosses on the target: the slow one (between TPU slices,
    between GPU nodes) for the axis that spans them, the fast one for the others."""

    def __init__(self, target, across: tuple | None):
        links, crossing = target.links, {a for a, _ in across or ()}
        self.of = {a: links.across if a in crossing else links.within for a in AXES}

    def seconds(self, axis: str, traffic: float) -> float:
        return traffic / self.of[axis].bandwidth


def _predict(model: _Model, bc: _BlockCosts, target, c: _Candidate, calibration, budget):
    """The candidate's `Plan` by the model (nothing compiled), or why it cannot run."""
    sizes, S = c.sizes, c.axes[0]
    built = _table(c.schedule, S, c.microbatches, c.options)
    if isinstance(built, str):
        return f"schedule cannot be built ({built})"
    table, lockstep = built
    chunks = table.num_logical_stages
    if model.num_blocks % chunks:
        return f"{model.num_blocks} blocks do not split into {chunks} stages"
    k = model.num_blocks // chunks
    t, f, d = sizes["tensor"], sizes["fsdp"], sizes["data"]
    rows = model.rows // (c.microbatches * d * f)  # one device's rows of a micro-batch
    links = _Links(target, c.across)
    scale = 1.0 if calibration is None else calibration.compute_scale
    variant = _variant(c)
    one = bc.costs[variant, t]
    loss_split = t if "tensor" in _named(model.loss_specs) else 1
    per = k * rows * scale
    compute = np.array([one.forward * per, one.forward * per, one.backward_input * per,
                        one.backward_weight * per, one.full_backward * per])  # fmt: skip
    compute[1] += bc.loss_seconds * rows / loss_split * scale
    comm = np.zeros(5)
    block_whole = _split_bytes(model.block_params, model.block_specs, {"tensor": t})
    grad_whole = _split_bytes(model.block_params, model.block_specs, {"tensor": t}, 4)
    fsdp_action = tensor_action = 0.0
    if f > 1 and c.gather != "once":
        gather = links.seconds("fsdp", k * block_whole * (f - 1) / f)
        scatter = links.seconds("fsdp", k * grad_whole * (f - 1) / f)
        comm += [gather, gather, gather, gather + scatter, gather + scatter]
        fsdp_action = gather
    if t > 1:  # two all-reduces of a block's input in its forward, two in its backward
        tensor_action = links.seconds("tensor", k * 2 * bc.x_bytes * rows * 2 * (t - 1) / t)
        again = tensor_action if variant[0] == "full" else 0.0  # the forward's, recomputed
        comm += [tensor_action, tensor_action, tensor_action + again, again,
                 tensor_action + again]  # fmt: skip
    send = links.seconds("pipe", bc.x_bytes * rows) if S > 1 else 0.0
    makespan = lockstep.makespan(compute + comm, send)
    loss_axis, loss_scatter = "data", 0.0
    if c.split_loss:  # each micro-batch's loss gradient reduce-scattered over the batch axes
        r = d * f
        scattered = _split_bytes(model.loss_params, model.loss_specs, {"tensor": t}) * (r - 1) / r
        loss_axis = max((a for a in ("data", "fsdp") if sizes[a] > 1),
                        key=lambda a: links.seconds(a, scattered))  # fmt: skip
        with_scatter = comm + np.array([0.0, links.seconds(loss_axis, scattered), 0, 0, 0])
        loss_scatter = lockstep.makespan(compute + with_scatter, send) - makespan
        makespan += loss_scatter
    compute_span = lockstep.makespan(compute)
    busy = lockstep.busy(compute)
    per_device = model.num_blocks // S
    shard_f32 = per_device * _split_bytes(
        model.block_params, model.block_specs, {"tensor": t, "fsdp": f}, 4
    ) + _split_bytes(model.loss_params, model.loss_specs, {"tensor": t, "fsdp": f}, 4)
    data = links.seconds("data", shard_f32 * 2 * (d - 1) / d) if d > 1 else 0.0
    once = 0.0
    if f > 1 and c.gather == "once":
        once = links.seconds("fsdp", per_device * (block_whole + grad_whole) * (f - 1) / f)
    memory, live_bytes = _memory(model, bc, c, lockstep.live, k, rows)
    update = 4 * memory["optimizer"] / target.peaks.memory_bandwidth
    exposed = makespan - compute_span
    fsdp_share = fsdp_action / (fsdp_action + tensor_action) if fsdp_action else 0.0
    ticks_send = lockstep.sends * send
    breakdown = {
        "compute": compute_span,
        "bubble": compute_span - busy,
        "pipe": ticks_send,
        "fsdp": (exposed - ticks_send) * fsdp_share + once,
        "tensor": (exposed - ticks_send) * (1 - fsdp_share) if tensor_action else 0.0,
        "data": data,
        "update": update,
    }
    breakdown[loss_axis] += loss_scatter
    step = makespan + data + once + update
    flops = 3 * model.rows * (model.num_blocks * bc.forward_flops + bc.loss_flops)
    mfu = flops / (math.prod(c.axes) * target.peaks.peak_flops * step)
    total = sum(memory.values())
    return Plan(
        axes=sizes, schedule=table, packed=False, remat=c.remat, fsdp_gather=c.gather,
        inner_remat=c.inner, split_loss_grads=c.split_loss,
        step_seconds=step, mfu=mfu, breakdown=breakdown, memory_bytes=int(total),
        fits=total <= budget, costs=Costs(*(compute[[0, 2, 3, 4]] / scale)),
        action_seconds=tuple(compute / scale), memory=memory, predicted_seconds=step,
        across=None if c.across is None else dict(c.across),
        _nodes="slices" if target.links.by_slice else "nodes",
        _live_bytes=live_bytes,
    )  # fmt: skip


def _splits_loss(result, c: _Candidate, model: _Model) -> bool:
    """Whether to try ``c`` again with the loss parameters' gradient split over the batch
    axes: it was predicted over the budget, it has batch axes, and the loss has float
    parameters."""
    if isinstance(result, str) or result.fits or c.split_loss:
        return False
    sizes = c.sizes
    floats = [
        a for a in jax.tree.leaves(model.loss_params) if jnp.issubdtype(a.dtype, jnp.floating)
    ]
    return sizes["data"] * sizes["fsdp"] > 1 and bool(floats)


def _variant(c: _Candidate) -> tuple[str, bool]:
    """(remat, inner) the candidate's stage runs: per-block gathering recomputes each
    block (its gathered weights are not kept), so remat "none" runs as "full" there."""
    remat = "full" if c.gather == "per_block" and c.remat == "none" else c.remat
    return remat, c.inner and remat in INNER_POLICIES


def _named(specs) -> set:
    return set().union(*(_spec_axes(s) for s in _spec_leaves(specs)))


def _memory(model: _Model, bc: _BlockCosts, c: _Candidate, live: int, k: int, rows: int):
    """(Predicted bytes per device by part, the residuals of one more live micro-batch)."""
    sizes, S = c.sizes, c.axes[0]
    t, f = sizes["tensor"], sizes["fsdp"]
    split = {"tensor": t, "fsdp": f}
    per_device = model.num_blocks // S
    item = np.dtype(model.param_dtype).itemsize
    masters = per_device * _split_bytes(model.block_params, model.block_specs, split, item)
    masters += _split_bytes(model.loss_params, model.loss_specs, split, item)
    copy = per_device * _split_bytes(model.block_params, model.block_specs, split)
    copy += _split_bytes(model.loss_params, model.loss_specs, split)
    whole = _split_bytes(model.block_params, model.block_specs, {"tensor": t})
    gathered = 0.0
    if f > 1:
        grads = _split_bytes(model.block_params, model.block_specs, {"tensor": t}, 4)
        gathered = {"per_use": k * whole, "ahead": 2 * k * whole, "per_block": 2 * whole,
                    "once": per_device * (whole + grads)}[c.gather]  # fmt: skip
    x = bc.x_bytes * rows
    remat, inner = _variant(c)

    def kept(name):  # one block's residuals at this tensor split: its input whole
        r = bc.kept[name, inner and name in INNER_POLICIES] * rows
        return min(r, x) + max(r - x, 0.0) / t

    # remat "full" keeps a stage's input, and recomputes one stage's residuals at a time
    one = x if remat == "full" else k * kept(remat)  # a live micro-batch's residuals
    residuals = live * x + k * kept("none") if remat == "full" else live * one
    loss_split = t if "tensor" in _named(model.loss_specs) else 1
    work = kept("none") + 4 * x + bc.loss_work * rows / loss_split
    batch = (_nbytes(model.inputs) + _nbytes(model.targets)) / (sizes["data"] * f)
    # the loss parameters' gradient accumulates whole over the batch axes, in float32
    # (`Pipeline`'s default), their final gradient split as the parameters are
    loss_masters = _split_bytes(model.loss_params, model.loss_specs, split, item)
    loss_accumulator = _split_bytes(model.loss_params, model.loss_specs, {"tensor": t}, 4)
    if c.split_loss:  # split over the batch axes as it accumulates
        loss_accumulator /= sizes["data"] * f
    return {
        "params": masters,
        "gradients": masters - loss_masters + loss_accumulator,
        "optimizer": masters * _optimizer_factor(model),
        "compute copy": copy,
        "gathered": gathered,
        "residuals": residuals,
        "working": work,
        "batch": batch,
    }, one


@functools.lru_cache(maxsize=64)
def _optimizer_factor_of(optimizer, shapes) -> float:
    if optimizer is None:
        return 2.0  # Adam's two moments
    params = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    state = jax.eval_shape(optimizer.init, params)
    floats = [a for a in jax.tree.leaves(state) if jnp.issubdtype(a.dtype, jnp.floating)]
    return _nbytes(floats) / max(1, _nbytes(params))


def _optimizer_factor(model: _Model) -> float:
    shapes = tuple((tuple(a.shape), np.dtype(model.param_dtype).name)
                   for a in jax.tree.leaves(model.block_params))  # fmt: skip
    return _optimizer_factor_of(model.optimizer, shapes)


# ----------------------------------------------------------------------------- packed tables
def _packed(plan: Plan, budget: float) -> Plan:
    """The plan with its table packed for its costs where that runs faster in lock-step:
    as it is, or holding one more live micro-batch where that fits ``budget``."""
    if plan.schedule.num_stages == 1:
        return plan
    seconds = np.asarray(plan.action_seconds)
    before = _LockStep(plan.schedule).makespan(seconds)
    scale = plan.breakdown["compute"] / max(before, 1e-30)
    best, best_gain = plan, 0.0
    for extra in (0, 1):
        more = extra * plan._live_bytes
        if plan.memory_bytes + more > budget:
            continue
        try:
            table = fit(plan.schedule, plan.costs, extra_live=extra)
        except ValueError:  # a table fit does not repack
            break
        gain = (before - _LockStep(table).makespan(seconds)) * scale
        if gain <= best_gain:
            continue
        breakdown = dict(plan.breakdown)
        breakdown["compute"] -= gain
        breakdown["bubble"] = max(0.0, breakdown["bubble"] - gain)
        memory = dict(plan.memory, residuals=plan.memory["residuals"] + more)
        step = plan.step_seconds - gain
        best_gain, best = gain, dataclasses.replace(
            plan, schedule=table, packed=True, step_seconds=step, breakdown=breakdown,
            mfu=None if plan.mfu is None else plan.mfu * plan.step_seconds / step,
            predicted_seconds=step, memory=memory, memory_bytes=int(plan.memory_bytes + more),
        )  # fmt: skip
    return best


# ----------------------------------------------------------------------------- compiled
def _step_program(model: _Model, plan: Plan, target):
    """(jitted training step, its abstract arguments): the plan's pipeline of the model's
    blocks (in a ``lax.scan`` over a stage's blocks, or a loop), the loss inside it,
    gradients of every parameter and an optimizer update."""
    import optax

    from jaxpipe import stages
    from jaxpipe.analysis.target import abstract
    from jaxpipe.pipeline import Pipeline

    mesh = plan.mesh(target)
    stage = stages.blocks(model.block_fn, scan=model.scan_blocks)
    pipe = Pipeline(stage, model.loss_fn, mesh=mesh, **plan.pipeline_options())
    k = model.num_blocks // plan.schedule.num_logical_stages
    dtype = model.param_dtype
    specs = stage_specs(model.block_specs)

    def init_stage(key):
        return jax.tree.map(lambda a: jnp.zeros((k, *a.shape), dtype), model.block_params)

    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    blocks = jax.eval_shape(lambda key: pipe.init(init_stage, key, specs), key)
    blocks = abstract(blocks, pipe.layout.shardings(blocks, specs))
    loss_specs = model.loss_specs
    if loss_specs is None:
        loss_specs = jax.tree.map(lambda a: P(), model.loss_params)
    loss_params = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, dtype, sharding=NamedSharding(mesh, s)),
        model.loss_params, loss_specs,
    )  # fmt: skip
    rows = NamedSharding(mesh, P(pipe.data_axes))
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rows),
                         (model.inputs, model.targets, model.side))  # fmt: skip
    params = (blocks, loss_params)
    optimizer = model.optimizer or optax.adam(1e-4)
    replicated = NamedSharding(mesh, P())
    state_shardings = optax.tree_utils.tree_map_params(
        optimizer, lambda _, p: p.sharding, jax.eval_shape(optimizer.init, params), params,
        transform_non_params=lambda leaf: replicated,
    )  # fmt: skip
    opt_state = abstract(jax.eval_shape(optimizer.init, params), state_shardings)
    compute = jax.tree.leaves(model.block_params)[0].dtype

    def step(params, opt_state, inputs, targets, side):
        def loss(params):
            blocks, loss_params = jax.tree.map(lambda a: a.astype(compute), params)
            return pipe.loss(blocks, loss_params, inputs, targets, side=side)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return jax.jit(step, donate_argnums=(0, 1)), (params, opt_state, *batch)


def stage_specs(block_specs):
    """A stage's specs (leaves ``[blocks, ...]``, as `jaxpipe.stages.blocks` takes them) from
    one block's: each ``PartitionSpec`` with the blocks' axis whole in front (None: None)."""
    if block_specs is None:
        return None
    return jax.tree.map(lambda s: P(None, *(s or ())), block_specs,
                        is_leaf=lambda s: s is None or isinstance(s, P))  # fmt: skip


def _compiled(model: _Model, plan: Plan, target, calibration, budget) -> Plan:
    """The plan re-read from its compiled step (`jaxpipe.target`)."""
    from jaxpipe.analysis.target import DoesNotFit

    step, args = _step_program(model, plan, target)
    try:
        report = target.compile(step, *args)
    except DoesNotFit:
        refused = "the target's compiler refused it: does not fit"
        return dataclasses.replace(plan, fits=False, compiled=True, note=refused)
    step, breakdown, peak = _read(report, plan, calibration)
    mfu = None if plan.mfu is None else plan.mfu * plan.step_seconds / step
    return dataclasses.replace(
        plan, step_seconds=step, mfu=mfu, breakdown=breakdown, memory_bytes=int(peak),
        fits=peak <= budget, compiled=True,
    )  # fmt: skip


def _read(report, plan: Plan, calibration) -> tuple:
    """(step seconds, breakdown, peak bytes) of a compiled step: the report's exposed
    collectives and peak, with the plan's computation per tick."""
    table, seconds = _LockStep(plan.schedule), np.asarray(plan.action_seconds)
    tick = table.makespan(seconds) / plan.schedule.num_ticks
    st = report.step_time(tick, "the planner's per-action estimates in lock-step",
                          ticks=plan.schedule.num_ticks, calibration=calibration)  # fmt: skip
    compute = st.compute_scale * tick * st.ticks
    idle = compute - st.compute_scale * table.busy(seconds)
    breakdown = {"compute": compute, "bubble": max(0.0, idle)}
    for entry in st.tick_exposed:
        axis = ",".join(entry["axes"]) or "-"
        breakdown[axis] = breakdown.get(axis, 0.0) + entry["seconds"] * st.trips  # as listed
    for entry in st.step_exposed:
        axis = ",".join(entry["axes"]) or "-"
        breakdown[axis] = breakdown.get(axis, 0.0) + entry["seconds"]
    breakdown["update"] = st.compute_scale * st.step_compute_seconds
    return st.step_seconds, breakdown, report.needed_bytes


# ----------------------------------------------------------------------------- plan
class NothingFits(ValueError):
    """No candidate fits the budget; ``closest`` is the plan nearest to fitting."""

    def __init__(self, message: str, closest: Plan | None):
        super().__init__(message)
        self.closest = closest


def plan(
    block_fn: Callable,
    block_params: Any,
    num_blocks: int,
    loss_fn: Callable,
    loss_params: Any,
    inputs: Any,
    targets: Any,
    *,
    target,
    side: Any = None,
    block_specs: Any = None,
    loss_specs: Any = None,
    param_dtype: Any = jnp.float32,
    optimizer: Any = None,
    memory_budget: int | None = None,
    fixed: dict | None = None,
    schedules: Sequence[str] = SCHEDULES,
    microbatches: Sequence[int] | None = None,
    remats: Sequence[str] = tuple(REMATS),
    gathers: Sequence[str] = GATHERS,
    max_tensor: int | None = None,
    kernel_flops: tuple[float, float] | None = None,
    compile_top: int = 3,
    scan_blocks: bool = False,
    calibrated: bool = True,
    log: Callable[[str], None] | None = None,
) -> Plans:
    """Ranks the ways to run a model of ``num_blocks`` blocks on ``target``; best first.

    The model is a stack of ``num_blocks`` blocks of one structure followed by a loss:
    ``loss_fn(loss_params, block_fn(...block_fn(block_params_0, x)...), targets)``. Nothing
    runs: shapes suffice. See the module docstring for how candidates are ranked.

    Args:
        block_fn: ``block_fn(block_params, x, side=None) -> x`` (``side`` only if it takes
            it), as `jaxpipe.stages.blocks` runs it. Its costs are XLA's estimates: a Pallas
            kernel inside it (a custom call) counts as almost nothing there, so give its
            FLOPs as ``kernel_flops``, or plan with XLA's version of the block.
        block_params: one block's parameters in the compute dtype (arrays or
            ``jax.ShapeDtypeStruct``s).
        num_blocks: blocks in the model.
        loss_fn: ``loss_fn(loss_params, y, targets) -> scalar`` (a mean over rows).
        loss_params: the loss's parameters (a head), compute dtype.
        inputs, targets, side: one step's whole batch of stage inputs, targets and side
            inputs (rows first).
        target: a `jaxpipe.target.Target` with peak and link figures (a TPU or GPU).
        block_specs: a ``PartitionSpec`` per leaf of one block, naming ``"fsdp"`` and
            ``"tensor"`` for the dimensions they split (as a Megatron split of a
            transformer block); None: no FSDP and no tensor parallelism are considered.
        loss_specs: the same for ``loss_params`` (None: replicated).
        param_dtype: the dtype of the trained (master) parameters.
        optimizer: an optax transformation (default ``optax.adam``) for the optimizer's
            state.
        memory_budget: bytes a device may hold (default: the target's device memory).
        fixed: axis sizes to keep, e.g. ``{"tensor": 4}``.
        schedules: schedule names to consider (pipe 1 always runs ``1f1b``: micro-batch
            gradient accumulation).
        microbatches: micro-batch counts to consider (default S, 2S, 4S, 8S and 1, 2, 4, 8).
        remats: names of `REMATS` to consider.
        gathers: FSDP gathering modes to consider (`jaxpipe.Pipeline`'s ``fsdp_gather``).
        max_tensor: the largest tensor axis (default: a GPU node's devices, else 8).
        kernel_flops: (forward, backward) FLOPs of the work inside one block that the
            compiler's estimate does not see, for one row of a micro-batch at the whole
            width: a fused attention kernel's, by `jaxpipe.kernels.attention_flops`
            with ``rows=1``. Charged at `jaxpipe.kernels.EFFICIENCY` of the
            target's peak, split over tensor like the block, the forward again in B, W and
            BW under remat "dots" and "full" (which keep no kernel output).
        compile_top: how many of the best predicted plans that fit to compile and re-rank
            by their compiled report (0: none).
        scan_blocks: the form of stage compiled, the one to build the plan's pipeline
            with: ``jaxpipe.stages.blocks(block_fn, scan=scan_blocks)``, its blocks in a
            ``lax.scan`` (True) or a Python loop. The compiler may make different programs
            of the two (module docstring). A block that runs a ``shard_map`` (a Pallas
            kernel's wrapper) in a scan aborted jax 0.10.2's TPU compiler (an SPMD
            partitioner check), so the loop is the default.
        calibrated: multiply computation by `jaxpipe.calibration`'s figure for the
            target's platform.
        log: called with a line on each phase's progress (``print``, say), or None.

    Returns:
        `Plans`, best first: the compiled ones that fit, by their compiled step time, then
        the other predicted ones that fit, each with a note on why it is behind the first.

    Raises:
        NothingFits: no candidate fits ``memory_budget``; it names the closest.
        ValueError: a target without peak or link figures, or arguments not as above.
    """
    from jaxpipe.analysis import calibration as calibration_lib

    if target.peaks is None or target.links is None:
        raise ValueError(
            f"target {target.name!r} has no peak or link figures to predict time with; plan "
            "for a TPU or GPU target, such as jaxpipe.target.get('v5p:2x2x2') or 'h100x8'"
        )
    fixed = dict(fixed or {})
    unknown = sorted(set(fixed) - set(AXES)) + sorted(set(remats) - set(REMATS))
    unknown += sorted(set(gathers) - set(GATHERS))
    if unknown:
        raise ValueError(f"unknown axes, remats or gathers {unknown}; known: {AXES}, "
                         f"{tuple(REMATS)}, {GATHERS}")  # fmt: skip
    if not isinstance(num_blocks, int) or num_blocks < 1:
        raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
    if kernel_flops is not None and (
        len(kernel_flops) != 2 or min(kernel_flops) < 0 or not all(map(math.isfinite, kernel_flops))
    ):
        raise ValueError(
            f"kernel_flops is (forward, backward) FLOPs, each finite and >= 0; got {kernel_flops!r}"
        )
    model = _Model(block_fn, _structs(block_params), num_blocks, loss_fn, _structs(loss_params),
                   _structs(inputs), _structs(targets), None if side is None else _structs(side),
                   block_specs, loss_specs, param_dtype, optimizer,
                   None if kernel_flops is None else tuple(map(float, kernel_flops)),
                   bool(scan_blocks))  # fmt: skip
    budget = memory_budget if memory_budget is not None else target.memory_per_device
    calibration = calibration_lib.get(target.platform) if calibrated else None
    if max_tensor is None:
        max_tensor = 8 if target.platform == "tpu" else (target.links.devices_per_node or 8)
    # "none" always: what a block keeps without remat sizes the working memory
    needed = {*remats, "none"} | ({"full"} if "per_block" in gathers else set())
    needed = [r for r in REMATS if r in needed]
    variants = [(r, False) for r in needed]
    if model.checkpoints_itself:  # the plan may replace the block's own policies
        variants += [(r, True) for r in needed if r in INNER_POLICIES]
    say = _Clock(log)
    tensors = {m["tensor"] for m in _meshes(model, len(target.devices), fixed, max_tensor)}
    costs = _block_costs(model, target, variants, tensors or {1})
    say(f"one block's costs compiled for {target.name}")
    ranked, rejected, searched = [], {}, 0  # ranked: (candidate, its Plan)
    for c in _candidates(model, len(target.devices), fixed, list(schedules), microbatches,
                         list(remats), list(gathers), max_tensor, target.nodes):  # fmt: skip
        searched += 1
        result = _predict(model, costs, target, c, calibration, budget)
        if _splits_loss(result, c, model):  # over budget: the loss gradient split instead
            c = dataclasses.replace(c, split_loss=True)
            result = _predict(model, costs, target, c, calibration, budget)
        if isinstance(result, str):
            reason = result.split(" (")[0]
            rejected[reason] = rejected.get(reason, 0) + 1
        else:
            ranked.append((c, result))
    fitting = sorted((p for _, p in ranked if p.fits), key=_rank)
    say(f"{searched} candidates ranked, {len(fitting)} predicted to fit")
    while costs.fitted and fitting:  # the leading plans' splits compiled: their own costs
        near = [
            p for p in fitting if p.step_seconds <= (1 + FITTED_MARGIN) * fitting[0].step_seconds
        ]
        splits = {p.axes["tensor"] for p in fitting[: max(2 * compile_top, 8)] + near}
        splits &= costs.fitted
        if not splits:
            break
        costs.compile_splits(splits)
        say(f"one block's share at tensor {', '.join(map(str, sorted(splits)))} compiled")
        ranked = [(c, _predict(model, costs, target, c, calibration, budget)
                   if c.sizes["tensor"] in splits else p) for c, p in ranked]  # fmt: skip
        fitting = sorted((p for _, p in ranked if p.fits), key=_rank)
    if not fitting:
        closest = min((p for _, p in ranked), key=lambda p: p.memory_bytes, default=None)
        over = ""
        if closest is not None:
            excess = (closest.memory_bytes - budget) / GiB
            over = (
                f"; the closest, {closest.describe()}, is predicted at "
                f"{closest.memory_bytes / GiB:.2f} GiB a device, {excess:.2f} GiB over"
            )
        raise NothingFits(
            f"none of {searched} candidates fits {budget / GiB:.2f} GiB a device{over}. Add "
            "devices, shorten the batch's rows, or allow remat 'full' and fsdp per_block",
            closest,
        )
    rejected["predicted over the memory budget"] = len(ranked) - len(fitting)
    head = sorted((_packed(p, budget) for p in fitting[: max(2 * compile_top, 8)]), key=_rank)
    fitting = head + fitting[len(head) :]
    compiled, tried = [], 0
    while len(compiled) < compile_top and tried < min(len(fitting), 3 * compile_top):
        result = _compiled(model, fitting[tried], target, calibration, budget)
        tried += 1
        fit_text = "fits" if result.fits else "does not fit"
        say(f"compiled {result.describe()}: {_seconds(result.step_seconds)}, {fit_text}")
        if result.fits:
            compiled.append(result)
        else:
            rejected["compiled over the memory budget"] = (
                rejected.get("compiled over the memory budget", 0) + 1
            )
    compiled.sort(key=_rank)
    rest = fitting[tried:]
    return Plans(_with_notes(compiled + rest, costs.fitted), budget, searched, rejected)


class _Clock:
    """Calls ``log`` with a line and the seconds since the search began."""

    def __init__(self, log):
        import time

        self.log, self.now, self.start = log, time.perf_counter, time.perf_counter()

    def __call__(self, line: str) -> None:
        if self.log is not None:
            self.log(f"[{self.now() - self.start:6.1f} s] {line}")


def _with_notes(plans: list, fitted=frozenset()) -> list:
    """Each plan after the first says how far behind the first it is, and where: compiled
    plans by their compiled figures, the others by the predictions of both, and whether
    its block costs are fitted (its tensor split in ``fitted``) rather than compiled."""
    if not plans:
        return plans
    best, out = plans[0], [plans[0]]
    for p in plans[1:]:
        worse = {k: p.breakdown.get(k, 0.0) - best.breakdown.get(k, 0.0)
                 for k in set(p.breakdown) | set(best.breakdown)}  # fmt: skip
        top = sorted(worse.items(), key=lambda kv: -kv[1])[:2]
        parts = ", ".join(f"{k} +{_seconds(v)}" for k, v in top if v > 0) or "even"
        if p.compiled or not best.compiled:
            slower = p.step_seconds / best.step_seconds - 1
            note = f"{slower:+.1%} against #0 ({parts})"
        else:
            slower = p.predicted_seconds / best.predicted_seconds - 1
            note = f"not compiled: {slower:+.1%} against #0's prediction ({parts}, predicted)"
        if not p.compiled and p.axes["tensor"] in fitted:
            note += f"; its block costs at tensor {p.axes['tensor']} fitted, not compiled"
        out.append(dataclasses.replace(p, note=note))
    return out
