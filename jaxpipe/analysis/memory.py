"""Memory per device of a pipeline training step, predicted from shapes before compiling.

How much memory does each stage need? `predict` answers from the model's shapes, the mesh,
the schedule and the dtypes, with no arrays and no compile: it reads the shard shapes of the
parameters, gradients and optimizer state, traces the stage's vjp abstractly to find what
one micro-batch keeps between its forward and backward under the remat policy (and how the
tensor split divides it), and multiplies by the residual buffers the schedule's table needs
on a device; it adds the executor's buffers and the working set of the largest action (a
liveness walk of its jaxpr). The result is a `Memory` per device, whose ``total`` is to be
compared with the compiler's ``peak_memory_in_bytes`` (`jaxpipe.target.Report.peak_bytes`).
On a TPU mesh it models the TPU compiler's habit of keeping a product summed over a split
dimension split (a reduce-scatter) rather than whole. See docs/memory_prediction.md.

```python
from jaxpipe import memory
m = memory.predict(pipe, stage_params, loss_params, inputs, targets, side=side,
                   params=params, optimizer=optimizer, batch=(tokens, labels))
print(m)                  # a table per part; m.total is the predicted peak per device
```

Every argument is a tree of ``jax.ShapeDtypeStruct``s with ``NamedSharding``s on the
pipeline's mesh (arrays work too): ``stage_params`` as the pipeline's `loss` receives them
(placed, in the compute dtype), ``loss_params``, ``inputs``, ``targets`` and ``side`` as
well; ``params`` the weights the optimizer updates (float32 masters, say); ``batch`` the
step's other arguments (token ids, labels).
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe._executor.activations import float_leaves, with_floats
from jaxpipe._executor.plan import make_plan
from jaxpipe._executor.program import Context
from jaxpipe._jaxpr import equations
from jaxpipe._jaxpr import residuals as residuals_lib
from jaxpipe._jaxpr.split import narrows_stash, split_backward, stacks_stash

__all__ = ["Memory", "predict", "shard_bytes"]
GiB = 2**30


# ----------------------------------------------------------------------------- the result
@dataclasses.dataclass(frozen=True)
class Memory:
    """Predicted bytes per device of one training step (every device runs the same program;
    each figure is the largest over the pipe axis' devices, which hold equal shards).

    Attributes:
        params: this device's shards of the trained parameters (``params``).
        optimizer: its shards of the optimizer state.
        batch: its shards of the step's data arguments (``batch``).
        grads: the gradients of ``params`` (in their dtypes) while the update runs, beside
            the accumulators: 0 for a leaf whose accumulator is its gradient (the pipeline's
            own parameter, accumulated in its dtype).
        compute_params: copies of the pipeline's stage and loss parameters in their own
            dtype (bfloat16 copies of float32 masters), or 0 where they are ``params``.
        grad_accumulators: the pipeline's gradient accumulators (``grad_dtype``) of the
            stage and loss parameters, alive across the schedule: split like the
            parameters, but whole over the batch axes (reduce-scattered after the
            schedule) for the stage's with ``fsdp_gather="once"`` and for the loss
            parameters' unless ``split_loss_grads``.
        activations: ``residual_slots`` x ``residual_bytes``: what forwards keep for their
            backwards under the remat policy, in the schedule's residual buffers.
        buffers: the executor's other per-micro-batch buffers: received stage inputs and
            output gradients (one slot each per in-flight micro-batch, plus a spare),
            split-backward stashes, the pipeline's inputs, targets and side inputs (all
            micro-batches: they are the pipeline's arguments), the gradients of those of
            them that are asked for (``input_grads``, ``target_grads``, ``side_grads``), with
            ``fsdp_gather="once"`` the device's stage weights gathered for the step, and
            with ``"ahead"`` the chunk a tick's forward runs and one backward's whole
            weight gradient, which the tick carries.
        working: the transient of the largest single action: the backward of one
            micro-batch through the loss head (logits and their gradient in float32) or
            through one stage (its recomputed activations; with FSDP, plus one chunk's
            weights gathered: for the action, or with ``"ahead"`` for the next one; with
            ``"per_block"`` two blocks'), whichever is larger.
        residual_bytes: one micro-batch's residuals on this device (after the tensor split).
        residual_slots: residual buffers per device (the schedule's peak of in-flight
            micro-batches, per chunk).
        peak_in_flight: `jaxpipe.schedules.Schedule.peak_activations`, per device.
    """

    params: int
    optimizer: int
    batch: int
    grads: int
    compute_params: int
    grad_accumulators: int
    activations: int
    buffers: int
    working: int
    residual_bytes: int
    residual_slots: int
    peak_in_flight: tuple[int, ...]

    @property
    def arguments(self) -> int:
        """Parameters, optimizer state and batch: the step's arguments."""
        return self.params + self.optimizer + self.batch

    @property
    def during_schedule(self) -> int:
        """What the schedule's loop holds beside the arguments, at its largest action."""
        return (
            self.compute_params + self.grad_accumulators + self.activations + self.buffers
            + self.working
        )  # fmt: skip

    @property
    def during_update(self) -> int:
        """What the step holds beside the arguments after the schedule: the gradients and
        the accumulators they are made from (the optimizer updates the donated state in
        place)."""
        return self.grads + self.grad_accumulators

    @property
    def temporaries(self) -> int:
        """The larger of `during_schedule` and `during_update`: what the step allocates
        beside its arguments at its peak."""
        return max(self.during_schedule, self.during_update)

    @property
    def total(self) -> int:
        """The predicted peak per device: arguments + temporaries (compare with the
        compiler's ``peak_memory_in_bytes``)."""
        return self.arguments + self.temporaries

    def as_dict(self) -> dict:
        """Every field and derived figure, JSON-ready (bytes as integers)."""
        out = dataclasses.asdict(self)
        out.update(
            arguments=self.arguments,
            during_schedule=self.during_schedule,
            during_update=self.during_update,
            temporaries=self.temporaries,
            total=self.total,
        )
        return out

    def __str__(self) -> str:
        rows = [
            ("parameters", self.params),
            ("optimizer state", self.optimizer),
            ("batch", self.batch),
            ("  arguments", self.arguments),
            ("compute copies", self.compute_params),
            ("grad accumulators", self.grad_accumulators),
            (f"activations ({self.residual_slots} x {_size(self.residual_bytes)})",
             self.activations),
            ("pipeline buffers", self.buffers),
            ("working set", self.working),
            ("  during the schedule", self.during_schedule),
            ("gradients", self.grads),
            ("  during the update (+ accumulators)", self.during_update),
            ("total (peak)", self.total),
        ]  # fmt: skip
        lines = ["predicted memory per device:"]
        lines += [f"  {label:<36} {_size(b):>11}" for label, b in rows]
        lines.append(f"  in-flight micro-batches per device: {list(self.peak_in_flight)}")
        return "\n".join(lines)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


# ----------------------------------------------------------------------------- shards
def shard_bytes(tree) -> int:
    """Bytes one device holds of a tree.

    Args:
        tree: a pytree of arrays or ``jax.ShapeDtypeStruct``s (typed PRNG keys and Python
            scalars too), with shardings or not.

    Returns:
        The bytes of one device's shard of each leaf, summed; a leaf with no sharding
        counts whole.
    """
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        shape = tuple(np.shape(leaf))
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            shape = sharding.shard_shape(shape)
        dtype = getattr(leaf, "dtype", None) or jnp.result_type(leaf)
        total += math.prod(shape) * dtype.itemsize  # a typed key's dtype knows its bytes
    return int(total)


def _split_dims(leaf, ignore: tuple[str, ...] = ()) -> dict[int, int]:
    """``{dimension: ways}`` of a leaf's sharding (dimensions split over mesh axes other
    than ``ignore``)."""
    sharding = getattr(leaf, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return {}
    out = {}
    for dim, axes in enumerate(spec):
        if axes is None:
            continue
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        ways = math.prod(sharding.mesh.shape[a] for a in axes if a not in ignore)
        if ways > 1:
            out[dim] = ways
    return out


# ----------------------------------------------------------------------------- split propagation
# Which dimension of each value of a jaxpr is split (and how many ways), from the splits of
# its inputs: the way XLA's sharding propagation splits a Megatron-style block (a matrix
# product's output keeps the split of a free dimension; a product that contracts a split
# dimension, or a reduction over it, is whole afterwards). Primitives not modelled here
# produce whole values, so an unknown operation can only make the prediction larger.
Split = tuple[int, int] | None  # (dimension, ways)
# True while `predict` models a compiler (TPU's) that keeps such sums split
_REDUCE_SCATTER = contextvars.ContextVar("jaxpipe_memory_reduce_scatter", default=False)


_COMBINING = {  # outputs whole after combining a split dimension (contracting, reducing)
    "dot_general", "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax",
    "argmin", "scan", "while", "psum",
}  # fmt: skip


def _propagate(jaxpr, in_splits: list[Split]) -> tuple[list[Split], dict]:
    env: dict = {}
    for v, s in zip(jaxpr.invars, in_splits, strict=True):
        env[v] = s

    def read(v):
        return env.get(v) if equations.is_var(v) else None

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs = _rule(eqn, ins)
        # a whole output of the shape of a split input or sibling output (a broadcast mask
        # beside split scores) is split like it: XLA shards it to match what it meets
        known = {
            tuple(v.aval.shape): s
            for v, s in [*zip(eqn.invars, ins, strict=True), *zip(eqn.outvars, outs, strict=True)]
            if s is not None and hasattr(v.aval, "shape")
        }
        if eqn.primitive.name not in _COMBINING:
            outs = [
                known.get(tuple(getattr(v.aval, "shape", ()))) if s is None else s
                for v, s in zip(eqn.outvars, outs, strict=True)
            ]
        for v, s in zip(eqn.outvars, outs, strict=True):
            env[v] = s
    return [read(v) for v in jaxpr.outvars], env


def _rule(eqn, ins: list[Split]) -> list[Split]:
    name = eqn.primitive.name
    outs = eqn.outvars
    shape_in = [getattr(v.aval, "shape", ()) for v in eqn.invars]
    shape_out = [getattr(v.aval, "shape", ()) for v in outs]
    dims = equations.dot_dimensions(eqn)
    if dims is not None:
        (lc, rc), (lb, rb) = dims
        lhs, rhs = ins
        nl, nr = len(shape_in[0]), len(shape_in[1])
        lfree = [d for d in range(nl) if d not in lc and d not in lb]
        rfree = [d for d in range(nr) if d not in rc and d not in rb]
        for split, batch, free, offset in (
            (lhs, lb, lfree, len(lb)),
            (rhs, rb, rfree, len(lb) + len(lfree)),
        ):
            if split is None:
                continue
            dim, ways = split
            if dim in batch:
                return [(list(batch).index(dim), ways)]
            if dim in free:
                return [(offset + free.index(dim), ways)]
        contracted = [s[1] for s, c in ((lhs, lc), (rhs, rc)) if s is not None and s[0] in c]
        out_shape = shape_out[0]
        scattered = contracted and out_shape and out_shape[-1] % contracted[0] == 0
        if _REDUCE_SCATTER.get() and scattered:
            # the TPU compiler sums a product over a split dimension with a reduce-scatter:
            # the result stays split (over its last dimension) until it is read whole
            return [(len(out_shape) - 1, contracted[0])]
        return [None]
    scan = equations.scan(eqn)
    if scan is not None:
        carries = scan.carries
        body_in = [s if i < carries.stop else _shift(s, -1) for i, s in enumerate(ins)]
        body_out, _ = _propagate(scan.body, body_in)
        # a carry has one sharding for every step: the split its body gives it
        again = [
            o if s is None else s
            for o, s in zip(body_out[: scan.num_carry], body_in[carries], strict=True)
        ]
        if again != body_in[carries]:
            body_in[carries] = again
            body_out, _ = _propagate(scan.body, body_in)
        return [s if i < scan.num_carry else _shift(s, +1) for i, s in enumerate(body_out)]
    if name in ("dot_general", "scan"):  # params in a form not read: whole outputs
        return [None] * len(outs)
    inner = equations.body(eqn)
    if inner is not None and len(inner.invars) == len(ins):
        return _propagate(inner, ins)[0]
    perm = equations.permutation(eqn)
    if perm is not None:
        s = ins[0]
        return [None if s is None else (list(perm).index(s[0]), s[1])]
    dims = equations.broadcast_dimensions(eqn)
    if dims is not None:
        s = ins[0]
        return [None if s is None else (dims[s[0]], s[1])]
    if name == "reshape":
        return [_reshape(ins[0], shape_in[0], shape_out[0])]
    removed = equations.reduced_axes(eqn)
    if removed is None:
        removed = equations.squeezed_dimensions(eqn)
    if removed is not None:
        s = ins[0]
        if s is None or s[0] in removed:
            return [None]
        return [(s[0] - sum(a < s[0] for a in removed), s[1])]
    if name == "expand_dims":
        return [None]
    # elementwise and shape-keeping operations: the split of an input of the output's shape
    result = []
    for shape in shape_out:
        found = None
        for s, sin in zip(ins, shape_in, strict=True):
            if s is not None and tuple(sin) == tuple(shape):
                found = s
                break
        if found is None and name in ("concatenate", "slice", "dynamic_slice", "pad",
                                      "dynamic_update_slice", "select_n", "gather"):  # fmt: skip
            found = next(
                (s for s, sin in zip(ins, shape_in, strict=True)
                 if s is not None and len(sin) == len(shape)
                 and sin[s[0]] == shape[s[0]]),
                None,
            )  # fmt: skip
        result.append(found)
    return result


def _shift(s: Split, by: int) -> Split:
    if s is None or s[0] + by < 0:
        return None
    return (s[0] + by, s[1])


def _reshape(s: Split, before, after) -> Split:
    """The dimension of ``after`` that holds ``before``'s split dimension as its major part
    (splitting [.., heads * d] into [.., heads, d] keeps the split on heads)."""
    if s is None:
        return None
    dim, ways = s
    outer = math.prod(before[:dim])  # elements before the split dimension, as a stride
    acc = 1
    for i, n in enumerate(after):
        if acc == outer and n % ways == 0:
            return (i, ways)
        acc *= n
        if acc > outer:
            return None
    return None


# ----------------------------------------------------------------------------- the prediction
def _struct(a) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(a), a.dtype)


def _chunk(params, data_axes: tuple[str, ...]):
    """One device's one stage of placed parameters ``[v, S, ...]``: ``[...]``, the splits
    of its dimensions that the stage computes with (over the axes other than the pipe axis
    and ``data_axes``, whose splits are FSDP storage, gathered before use), and the bytes
    of the device's chunks once gathered over ``data_axes`` (0 where none is split over
    them): new buffers beside the stored shards."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    structs, splits, gathered = [], [], 0
    for leaf in leaves:
        structs.append(jax.ShapeDtypeStruct(np.shape(leaf)[2:], leaf.dtype))
        dims = {d - 2: w for d, w in _split_dims(leaf, data_axes).items() if d >= 2}
        splits.append(max(dims.items(), key=lambda kv: kv[1]) if dims else None)
        whole = math.prod(np.shape(leaf)) * np.dtype(leaf.dtype).itemsize
        kept = math.prod(_split_dims(leaf, data_axes).values())
        if whole // kept != shard_bytes([leaf]):  # split over data_axes: gathered for use
            gathered += whole // kept
    return jax.tree_util.tree_unflatten(treedef, structs), splits, gathered


def _blocks_of(params, data_axes) -> int:
    """The blocks a stage of placed parameters ``[v, S, ...]`` stacks, as
    ``fsdp_gather="per_block"`` gathers them: the leading inner dimension shared by every
    leaf split over ``data_axes``, where each has at least three inner dimensions and that
    one is not split (a stack of matrices); else 1."""
    leading = set()
    for leaf in jax.tree_util.tree_leaves(params):
        spec = tuple(getattr(getattr(leaf, "sharding", None), "spec", None) or ())
        split = {d for d, entry in enumerate(spec) if set(_axes_of(entry)) & set(data_axes)}
        if not split:
            continue
        if np.ndim(leaf) < 5 or 2 in split:
            return 1
        leading.add(np.shape(leaf)[2])
    return leading.pop() if len(leading) == 1 else 1


def _axes_of(entry) -> tuple:
    """The mesh axes one ``PartitionSpec`` entry names."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _microbatch(tree, num_microbatches: int, replicas: int):
    return jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(
            (np.shape(a)[0] // (num_microbatches * replicas), *np.shape(a)[1:]), a.dtype
        ),
        tree,
    )


def _nbytes(structs, splits=None) -> int:
    splits = splits or [None] * len(structs)
    return int(
        sum(
            math.prod(s.shape) * np.dtype(s.dtype).itemsize // (1 if sp is None else sp[1])
            for s, sp in zip(structs, splits, strict=True)
        )
    )


def _residual_splits(stage, chunk, chunk_splits, x, context) -> tuple[list, list]:
    """The stored residual leaves of one micro-batch (`jaxpipe._jaxpr.residuals`) and how
    the tensor split divides each."""
    spec = residuals_lib.analyse(stage, chunk, x, context)
    jaxpr = residuals_lib.leaves_jaxpr(stage, chunk, x, context)
    n_x = len(jax.tree_util.tree_leaves(x))
    n_p = len(jax.tree_util.tree_leaves(chunk))
    in_splits = [None] * n_x + list(chunk_splits) + [None] * (len(jaxpr.invars) - n_x - n_p)
    out_splits, _ = _propagate(jaxpr, in_splits)
    kept = [s for s, keep in zip(out_splits, spec.stored, strict=True) if keep]
    return list(spec.structs), kept


_MATERIALIZING = {
    "dot_general", "conv_general_dilated", "reduce_sum", "reduce_max", "reduce_min",
    "reduce_prod", "argmax", "argmin", "cumsum", "cumprod", "cummax", "sort", "gather",
    "scatter", "scatter-add", "scatter_add", "dynamic_slice", "dynamic_update_slice",
    "concatenate", "transpose", "pad", "rng_bit_generator", "threefry2x32", "all_gather",
    "psum", "reduce_scatter", "all_to_all", "ppermute", "optimization_barrier",
}  # fmt: skip


def _live_equations(jaxpr, used: list[bool] | None) -> tuple[list, dict]:
    """The equations that compute the used outputs (all, if ``used`` is None), and per
    nested-jaxpr equation which of its outputs are read: dead code, as XLA removes it."""
    outs = (
        jaxpr.outvars
        if used is None
        else [v for v, u in zip(jaxpr.outvars, used, strict=True) if u]
    )
    needed = {v for v in outs if equations.is_var(v)}
    kept, reads = [], {}
    for eqn in reversed(jaxpr.eqns):
        wanted = [v in needed for v in eqn.outvars]
        if not any(wanted) and not eqn.effects:
            continue
        kept.append(eqn)
        reads[id(eqn)] = wanted
        needed.update(v for v in eqn.invars if equations.is_var(v))
    return kept[::-1], reads


def _peak_live(jaxpr, splits: list[Split], used: list[bool] | None = None) -> int:
    """The most bytes of values alive at once while ``jaxpr`` runs in its order, beside its
    inputs (held elsewhere), after the splits; a nested jaxpr adds its own peak at its
    equation. Elementwise chains count as XLA fuses them: a value made by an elementwise
    operation and read only by one elementwise operation or reduction is never stored."""
    _, env = _propagate(jaxpr, splits)
    eqns, reads = _live_equations(jaxpr, used)
    consumers: dict = {}
    last_use: dict = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if equations.is_var(v):
                consumers.setdefault(v, []).append(eqn)
                last_use[v] = i
    outputs = {
        v
        for v, u in zip(jaxpr.outvars, used or [True] * len(jaxpr.outvars), strict=True)
        if u and equations.is_var(v)
    }

    def fusible(eqn) -> bool:
        return not equations.bodies(eqn) and eqn.primitive.name not in _MATERIALIZING

    def stored(v, eqn) -> bool:
        if v in outputs or not fusible(eqn):
            return True
        users = consumers.get(v, [])
        return len(users) != 1 or not (
            fusible(users[0]) or users[0].primitive.name.startswith("reduce_")
        )

    def nbytes(v) -> int:
        aval = v.aval
        if not hasattr(aval, "shape"):
            return 0
        s = env.get(v)
        return math.prod(aval.shape) * np.dtype(aval.dtype).itemsize // (s[1] if s else 1)

    live = peak = 0
    held: dict = {}
    for i, eqn in enumerate(eqns):
        inner_peak = 0
        scan = equations.scan(eqn)
        for inner in equations.bodies(eqn):
            inner_in = [env.get(v) if equations.is_var(v) else None for v in eqn.invars]
            if scan is not None:
                c = scan.carries.stop
                inner_in = [s if k < c else _shift(s, -1) for k, s in enumerate(inner_in)]
            if len(inner.invars) != len(inner_in):
                inner_in = [None] * len(inner.invars)
            inner_used = None
            if len(inner.outvars) == len(eqn.outvars):
                inner_used = list(reads[id(eqn)])
                if scan is not None:  # the carries are read by the next step
                    inner_used[: scan.num_carry] = [True] * scan.num_carry
            inner_peak = max(inner_peak, _peak_live(inner, inner_in, inner_used))
        made = {v: nbytes(v) for v in eqn.outvars if stored(v, eqn)}
        peak = max(peak, live + inner_peak + sum(made.values()))
        held.update(made)
        live += sum(made.values())
        for v in {v for v in eqn.invars if equations.is_var(v)}:
            if equations.is_var(v) and last_use.get(v) == i and v not in outputs:
                live -= held.pop(v, 0)
    return peak


def _action_peak(fn, args, in_splits) -> int:
    """`_peak_live` of ``fn(*args)``'s jaxpr: the working set of one action."""
    closed = jax.make_jaxpr(fn)(*args)
    return _peak_live(closed.jaxpr, list(in_splits))


def predict(
    pipe,
    stage_params,
    loss_params,
    inputs,
    targets,
    *,
    side=None,
    params=None,
    optimizer=None,
    opt_state=None,
    batch=None,
    input_grads: bool = False,
    target_grads: bool = False,
    side_grads: bool = False,
) -> Memory:
    """Predicted memory per device of a training step that runs ``pipe.loss(stage_params,
    loss_params, inputs, targets, side=side)``, takes its gradient with respect to
    ``params`` and updates them with ``optimizer``.

    Args:
        pipe: the `jaxpipe.Pipeline` (its mesh, schedule, stage and loss functions, remat
            settings, gradient dtype).
        stage_params: the pipeline's parameters as `Pipeline.loss` receives them (placed
            ``[v, S, ...]``, in the compute dtype), ``ShapeDtypeStruct``s with shardings.
        loss_params, inputs, targets, side: as `Pipeline.loss` receives them (whole batch).
        params: the parameters the optimizer updates (default: ``stage_params`` and
            ``loss_params``); their gradients are counted in their own dtypes.
        optimizer: an optax transformation; its state is ``jax.eval_shape(optimizer.init,
            params)``, each moment split like its parameter. Or give ``opt_state`` (with
            shardings) instead.
        batch: the step's other arguments (token ids, labels), counted as arguments.
        input_grads, target_grads, side_grads: whether the step also differentiates the
            pipeline's inputs, targets or side inputs (``jax.grad`` of ``pipe.loss`` with
            respect to them, as when the inputs come from an embedding; or
            ``Pipeline.grad(..., input_grads=True)``): the executor then holds a buffer of
            their gradients, and with ``side_grads`` differentiates the stage with respect
            to the side inputs too.

    Returns:
        a `Memory`. Its ``total`` is what to compare with the compiler's peak
        (``peak_memory_in_bytes``, arguments included) and with a device's memory.

    Raises:
        ValueError: a pipeline whose schedule updates weights inside it (weight versions),
            or one with an expert axis: neither is modelled.
    """
    if pipe.updates_weights:
        raise ValueError(
            f"memory.predict models a step with one gradient; schedule "
            f"{pipe.schedule.name!r} updates weights inside the pipeline (weight versions, "
            "their optimizer state), which it does not count; compile the step with "
            "jaxpipe.target for its memory"
        )
    if pipe.expert_axis is not None:
        raise ValueError(
            f"memory.predict does not model expert parallelism (expert_axis="
            f"{pipe.expert_axis!r}); compile the step with jaxpipe.target for its memory"
        )
    platform = pipe.mesh.devices.flat[0].platform
    token = _REDUCE_SCATTER.set(platform == "tpu")
    try:
        return _predict(pipe, stage_params, loss_params, inputs, targets, side, params,
                        optimizer, opt_state, batch,
                        (input_grads, target_grads, side_grads and side is not None))  # fmt: skip
    finally:
        _REDUCE_SCATTER.reset(token)


def _predict(
    pipe,
    stage_params,
    loss_params,
    inputs,
    targets,
    side,
    params,
    optimizer,
    opt_state,
    batch,
    wanted,
) -> Memory:
    input_grads, target_grads, side_grads = wanted
    if params is None:
        params = {"stage": stage_params, "loss": loss_params}
    schedule = pipe.schedule
    plan = make_plan(schedule)
    replicas = pipe.num_replicas
    M = schedule.num_microbatches
    param_bytes = shard_bytes(params)
    if opt_state is None and optimizer is not None:
        state = jax.eval_shape(optimizer.init, params)
        opt_bytes = _optimizer_bytes(optimizer, state, params)
    else:
        opt_bytes = shard_bytes(opt_state) if opt_state is not None else 0
    batch_bytes = shard_bytes(batch) if batch is not None else 0
    pipeline_params = {"stage": stage_params, "loss": loss_params}
    same = _same_leaves(pipeline_params, params)
    compute_bytes = 0 if same else shard_bytes(pipeline_params)
    grad_dtype = pipe.grad_dtype if M > 1 else None  # one micro-batch: nothing accumulates
    # gradients of params, in their dtypes, split like them, beside the accumulators: where
    # a leaf's accumulator has the parameter's dtype, the gradient is the accumulator
    grad_bytes = param_bytes
    if same:
        grad_bytes = shard_bytes(
            [a for a in jax.tree_util.tree_leaves(params) if (grad_dtype or a.dtype) != a.dtype]
        )
    gather = pipe.gather_mode(stage_params, inputs, side=side)
    once = gather == "once"

    def accumulator(a, whole: bool):
        sharding = getattr(a, "sharding", None)
        if whole and sharding is not None:  # whole over the batch axes until the schedule ends
            spec = [_without(entry, pipe.data_axes) for entry in sharding.spec]
            sharding = NamedSharding(sharding.mesh, P(*spec))
        return jax.ShapeDtypeStruct(np.shape(a), grad_dtype or a.dtype, sharding=sharding)

    # the stage's gathered once, and the loss parameters' unless split_loss_grads: whole
    accumulators = shard_bytes(
        [
            jax.tree_util.tree_map(lambda a: accumulator(a, once), stage_params),
            jax.tree_util.tree_map(
                lambda a: accumulator(a, not pipe.split_loss_grads), loss_params
            ),
        ]
    )

    # one micro-batch on one device
    x = _microbatch(inputs, M, replicas)
    tgt = _microbatch(targets, M, replicas)
    side_mb = None if side is None else _microbatch(side, M, replicas)
    chunk, chunk_splits, gathered = _chunk(
        pipe.layout.check_placed(stage_params), tuple(pipe.data_axes)
    )  # the stage sees the bare tree, as in the pipeline
    context = Context(
        side=side_mb, key=None, stage=jax.ShapeDtypeStruct((), np.int32),
        microbatch=jax.ShapeDtypeStruct((), np.int32),
    )  # fmt: skip
    stage, args, args_splits = pipe._stage_call, chunk, list(chunk_splits)
    if side_grads:  # differentiated like the parameters, as the executor's Local.stage_fn
        side_floats = [_struct(a) for a in float_leaves(side_mb)]
        args, args_splits = (chunk, side_floats), args_splits + [None] * len(side_floats)

        def stage(args, x, context, stage_call=pipe._stage_call):
            params, floats = args
            return stage_call(params, x, context._replace(side=with_floats(context.side, floats)))

    if pipe.remat:
        res_structs = [_struct(a) for a in jax.tree_util.tree_leaves(x)]
        res_splits = [None] * len(res_structs)
    else:
        res_structs, res_splits = _residual_splits(stage, args, args_splits, x, context)
    residual_bytes = _nbytes(res_structs, res_splits)
    activations = plan.num_res_slots * residual_bytes

    x_bytes = _nbytes([_struct(a) for a in jax.tree_util.tree_leaves(x)])
    float_x = [
        _struct(a) for a in jax.tree_util.tree_leaves(x) if jnp.issubdtype(a.dtype, jnp.inexact)
    ]
    stash = split_peak = 0
    if plan.num_stash_slots and schedule.splits_backward:
        one_stash, split_peak = _split_actions(
            pipe, stage, args, args_splits, x, context, res_splits, plan.num_stash_slots
        )
        stash = plan.num_stash_slots * one_stash
    float_t = [_struct(a) for a in float_leaves(tgt)]
    buffers = (
        (plan.num_act_slots + 1) * x_bytes
        + (plan.num_cot_slots + 1) * _nbytes(float_x)
        + stash
        + shard_bytes((inputs, targets, side))  # the pipeline's arguments
        # the gradients asked for: of the inputs and targets a row per micro-batch and a
        # spare, of the side inputs their own size (each stage adds its share)
        + (M + 1) * _nbytes(float_x) * input_grads
        + (M + 1) * _nbytes(float_t) * target_grads
        + shard_bytes(float_leaves(side)) * side_grads
    )

    # the working set: the largest of one stage's backward and the loss head's backward
    loss_splits = [
        max(_split_dims(a).items(), key=lambda kv: kv[1]) if _split_dims(a) else None
        for a in jax.tree_util.tree_leaves(loss_params)
    ]
    lp = jax.tree_util.tree_map(_struct, loss_params)
    loss_context = context

    def loss_backward(lp, y, t):
        def f(lp, y):
            return pipe._loss_call(lp, y, t, loss_context)

        return jax.grad(f, argnums=(0, 1))(lp, y)

    n_y = len(jax.tree_util.tree_leaves(x))
    n_t = len(jax.tree_util.tree_leaves(tgt))
    head = _action_peak(loss_backward, (lp, x, tgt), loss_splits + [None] * (n_y + n_t))

    if pipe.remat:
        spec = residuals_lib.Residuals(stored=(), structs=tuple(res_structs), remat=True)
    else:
        spec = residuals_lib.analyse(stage, args, x, context)

    def stage_backward(stored, p, ct):  # B and W at once, from the stored residuals
        return residuals_lib.vjp(spec, stage, p, x, context, stored)(ct)

    body = split_peak
    if any(a.op == "BW" for a in schedule.actions()):  # full backwards run too
        body = max(
            body,
            _action_peak(
                stage_backward,
                (list(spec.structs), args, x),
                res_splits + args_splits + [None] * n_y,
            ),
        )
    one_chunk = gathered // schedule.stages_per_device
    if gathered and once:  # every chunk gathered for the whole step
        buffers += gathered
    elif gathered and gather == "ahead":
        # the tick carries the chunk its forward runs and a backward's whole gradient, and
        # gathers another chunk beside its actions
        buffers += 2 * one_chunk
        body += one_chunk
    elif gathered and gather == "per_block":  # two blocks gathered at a time
        body += min(
            one_chunk,
            2 * one_chunk // _blocks_of(pipe.layout.check_placed(stage_params), pipe.data_axes),
        )
    elif gathered:  # one chunk gathered for the action that uses it
        body += one_chunk
    working = max(head, body)

    return Memory(
        params=param_bytes,
        optimizer=opt_bytes,
        batch=batch_bytes,
        grads=grad_bytes,
        compute_params=compute_bytes,
        grad_accumulators=accumulators,
        activations=activations,
        buffers=buffers,
        working=working,
        residual_bytes=residual_bytes,
        residual_slots=plan.num_res_slots,
        peak_in_flight=schedule.peak_activations(),
    )


def _without(entry, axes):
    """A ``PartitionSpec`` entry without ``axes``."""
    names = entry if isinstance(entry, tuple) else (entry,)
    kept = tuple(n for n in names if n is not None and n not in axes)
    return kept[0] if len(kept) == 1 else (kept or None)


def _same_leaves(a, b) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(
        np.shape(x) == np.shape(y) and x.dtype == y.dtype for x, y in zip(la, lb, strict=True)
    )


def _optimizer_bytes(optimizer, state, params) -> int:
    """Bytes of ``state`` with each parameter-shaped leaf split like its parameter."""
    try:
        import optax

        sharded = optax.tree_utils.tree_map_params(
            optimizer,
            lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=p.sharding),
            state,
            params,
            transform_non_params=lambda s: s,
        )
    except Exception as error:  # not an optax state: each leaf whole
        warnings.warn(
            f"memory.predict could not split the optimizer state like its parameters "
            f"({type(error).__name__}: {error}); it counts every leaf of it whole, which may "
            "overcount; pass opt_state with shardings instead",
            stacklevel=3,
        )
        sharded = state
    return shard_bytes(sharded)


def _split_actions(
    pipe, stage, chunk, chunk_splits, x, context, res_splits, num_slots: int
) -> tuple[int, int]:
    """For a schedule that splits backwards into B and W: the bytes one B keeps for its W
    (split like the values they are, narrowed as the executor narrows them for
    ``num_slots`` stash slots), and the working set of the larger of B and W. ``stage``
    is differentiated with respect to ``chunk`` (its parameters, and the side inputs'
    float leaves where those have gradients)."""
    spec = residuals_lib.analyse(stage, chunk, x, context, pipe.remat)
    float_x = [
        _struct(a) for a in jax.tree_util.tree_leaves(x) if jnp.issubdtype(a.dtype, jnp.inexact)
    ]

    def back(stored, params, context, cotangent):
        vjp_fn = residuals_lib.vjp(spec, stage, params, x, context, stored)
        d_params, dx = vjp_fn(jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(x),
                                                           cotangent))  # fmt: skip
        return d_params, dx

    stored = list(spec.structs)
    stacked = pipe.remat and stacks_stash(back, stored, chunk, context, float_x)
    narrow = narrows_stash(pipe.remat, num_slots, stacked)
    halves = split_backward(back, stored, chunk, context, float_x, narrow_stash=narrow)
    closed = jax.make_jaxpr(halves.b_fn)(stored, chunk, context, float_x)
    n_ctx = len(jax.tree_util.tree_leaves(context))
    in_splits = list(res_splits) + list(chunk_splits) + [None] * (n_ctx + len(float_x))
    out_splits, _ = _propagate(closed.jaxpr, in_splits)
    stash = list(halves.stash_structs)
    stash_splits = out_splits[len(out_splits) - len(stash) :]
    b_peak = _peak_live(closed.jaxpr, in_splits)
    w_closed = jax.make_jaxpr(halves.w_fn)(stored, chunk, context, stash)
    w_splits = list(res_splits) + list(chunk_splits) + [None] * n_ctx + list(stash_splits)
    w_peak = _peak_live(w_closed.jaxpr, w_splits)
    return _nbytes(stash, stash_splits), max(b_peak, w_peak)
