"""Argument checks for `jaxpipe.pipeline.Pipeline`: every error is raised before tracing and
says what was given, what is expected and how to fix it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe import schedules as schedules_lib
from jaxpipe.schedules import Schedule, validate

tree_map = jax.tree_util.tree_map


def functions(stage_fn, loss_fn) -> None:
    if not callable(stage_fn):
        raise TypeError(f"stage_fn must be callable, got {type(stage_fn).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")


def mesh(mesh, axis: str) -> None:
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.shape:
        raise ValueError(
            f"mesh has axes {tuple(mesh.shape)} but no axis named {axis!r}; build the mesh "
            f"with a pipe axis (e.g. jax.make_mesh((4,), ({axis!r},))) or pass axis=..."
        )


def one_of(name: str, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def flag(name: str, value) -> bool:
    """``value`` as a bool, refused unless it is one (a string such as ``"no"`` is truthy)."""
    if not isinstance(value, bool | np.bool_):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def grad_dtype(value):
    """The floating dtype gradients accumulate in, or None (the parameters' own)."""
    if value is None:
        return None
    try:
        dtype = jnp.dtype(value)
    except TypeError as error:
        raise ValueError(
            f"grad_dtype must be a floating dtype such as jnp.float32, or None, got {value!r}"
        ) from error
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"grad_dtype must be a floating dtype such as jnp.float32 (gradients accumulated "
            f"in {dtype} would be truncated), or None, got {value!r}"
        )
    return dtype


def remat_policy(value, remat: bool):
    """A ``jax.checkpoint`` policy (a callable), or None; None with ``remat``."""
    if value is not None and not callable(value):
        raise ValueError(
            "remat_policy must be a jax.checkpoint policy such as "
            f"jax.checkpoint_policies.dots_saveable, or None, got {value!r}"
        )
    if remat and value is not None:
        name = getattr(value, "__name__", repr(value))
        raise ValueError(
            f"remat=True and remat_policy={name} contradict each other: remat=True keeps "
            "only each stage's input and recomputes the whole stage in its backward, and a "
            "policy says what the backward keeps besides the input. Pass remat_policy alone "
            "to keep what it saves (remat=False), or remat=True alone to keep the input only"
        )
    return value


def schedule(
    schedule, mesh, axis: str, num_microbatches, options: Mapping[str, Any] | None
) -> Schedule:
    """The validated `Schedule` for a name or a given table, for the mesh's pipe axis."""
    num_stages = mesh.shape[axis]
    if options is not None and not isinstance(options, Mapping):
        raise ValueError(
            f"schedule_options must be a mapping of option names to values, such as "
            f"{{'virtual_stages': 2}}, or None, got {type(options).__name__} {options!r}; "
            "pass schedule_options=dict(virtual_stages=2)"
        )
    if isinstance(schedule, Schedule):
        if options:
            raise ValueError("schedule_options apply to a schedule name, not a Schedule")
        if schedule.num_stages != num_stages:
            raise ValueError(
                f"schedule {schedule.name!r} is for {schedule.num_stages} devices but mesh axis "
                f"{axis!r} has {num_stages}; build the schedule for {num_stages}"
            )
        if num_microbatches not in (None, schedule.num_microbatches):
            raise ValueError(
                f"num_microbatches={num_microbatches} but the schedule has "
                f"{schedule.num_microbatches}; leave num_microbatches out"
            )
        return validate(schedule)
    if isinstance(schedule, str):
        if num_microbatches is None:
            raise ValueError(
                f"num_microbatches is required with a schedule name: schedule={schedule!r} "
                f"was given without it; pass num_microbatches=M, the number of micro-batches "
                f"each batch is split into (a multiple of the {num_stages} stages, e.g. "
                f"{4 * num_stages}, keeps the bubble small)"
            )
        return schedules_lib.get(schedule, num_stages, num_microbatches, **dict(options or {}))
    raise TypeError(f"schedule must be a name or a Schedule, got {type(schedule).__name__}")


def costs(value) -> None:
    """Refuses ``costs`` other than None, a `jaxpipe.schedules.Costs`, ``"measure"`` or a
    `jaxpipe.target.Target` (an object with devices)."""
    if value is None or isinstance(value, schedules_lib.Costs):
        return
    if value == "measure" if isinstance(value, str) else getattr(value, "devices", None):
        return
    raise ValueError(
        "costs must be a jaxpipe.schedules.Costs, 'measure' or a jaxpipe.target.Target "
        "(jaxpipe.target.get('v5p:4x4x8')), or None, got "
        f"{value!r}: 'measure' times each action on this machine, a target gives its "
        "compiler's estimate, None packs the table for equal costs"
    )


def data_axes(data_axes, mesh, axis: str) -> tuple[str, ...]:
    """The axes the batch is split over: by default those of ``"data"`` and ``"fsdp"`` the
    mesh has."""
    if data_axes is None:
        data_axes = tuple(a for a in ("data", "fsdp") if a in mesh.shape)
    data_axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
    for name in data_axes:
        if name not in mesh.shape or name == axis:
            raise ValueError(
                f"data_axes={data_axes}: {name!r} is not a mesh axis other than the pipe "
                f"axis {axis!r}; mesh axes are {tuple(mesh.shape)}"
            )
    return data_axes


def expert_axis(expert_axis, mesh, axis: str) -> str | None:
    """The expert axis: one mesh axis other than the pipe axis, or None."""
    if expert_axis is None:
        return None
    if not isinstance(expert_axis, str) or expert_axis not in mesh.shape or expert_axis == axis:
        raise ValueError(
            f"expert_axis={expert_axis!r} is not a mesh axis other than the pipe axis "
            f"{axis!r}; mesh axes are {tuple(mesh.shape)}. Name one of them (for example a "
            'mesh made with an "expert" axis and expert_axis="expert"), or pass None'
        )
    return expert_axis


def expert_weights(params, specs, expert_axis: str, mesh, leading: int, named: bool) -> None:
    """Refuses expert dimensions that do not divide evenly over the expert axis and, with
    ``named``, an expert axis that no placement spec names.

    Args:
      params: a pytree of arrays (or shapes) with ``leading`` axes before the dimensions
        the specs describe (2 for the layout ``[v, S, ...]``, 1 for ``[S*v, ...]``).
      specs: one inner ``PartitionSpec`` (or None) per leaf, in leaf order.
    """
    size = mesh.shape[expert_axis]
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    found = False
    for (path, leaf), spec in zip(paths, specs, strict=True):
        for dim, entry in enumerate(tuple(spec or ())):
            names = entry if isinstance(entry, tuple) else (entry,)
            if expert_axis not in names:
                continue
            found = True
            if names[0] != expert_axis:
                order = (expert_axis, *(n for n in names if n != expert_axis))
                # (a, expert) puts expert x's share in blocks x, e + x, ...: not the
                # contiguous experts the all-to-all sends its tokens to
                raise ValueError(
                    f"stage weight {jax.tree_util.keystr(path)} is placed with {spec}: "
                    f"dimension {dim} names {names}, with the expert axis {expert_axis!r} "
                    f"after {names[0]!r}, so a device would hold experts that are not "
                    "consecutive, and the all-to-all would send tokens to the wrong ones. "
                    f"Put the expert axis first: {order}"
                )
            count = leaf.shape[leading + dim]
            if count % size:
                raise ValueError(
                    f"stage weight {jax.tree_util.keystr(path)} of shape "
                    f"{tuple(leaf.shape[leading:])} (one stage) is placed with {spec}: its "
                    f"dimension {dim} ({count} experts) does not divide over the expert axis "
                    f"{expert_axis!r} of size {size}. Use a number of experts that is a "
                    f"multiple of {size}, or a smaller expert axis"
                )
    if named and not found:
        raise ValueError(
            f"expert_axis={expert_axis!r}, but no placement spec names it, so no stage weight "
            "is split into experts over it and the stage's all-to-alls would exchange tokens "
            "with devices that hold the same experts. Place the experts' weights with their "
            f'expert dimension over the axis: pipe.place(params, specs) with P("{expert_axis}"'
            ", None, None) for a [experts, width, hidden] leaf (jaxpipe.moe.expert_specs "
            "makes them; docs/meshes.md)"
        )


def idle_axes_warning(mesh, axis: str, data_axes, specs, params) -> str | None:
    """A warning for mesh axes (of size > 1) with no role: not the pipe axis, not a data
    axis, named by no placement spec nor by the sharding of a parameter; None if none."""
    named = {axis, *data_axes}
    leaves = jax.tree_util.tree_leaves(params)
    for spec in [*specs, *(_spec_of(leaf) for leaf in leaves)]:
        for entry in tuple(spec or ()):
            named.update(entry if isinstance(entry, tuple) else (entry,))
    idle = [a for a in mesh.axis_names if a not in named and mesh.shape[a] > 1]
    if not idle:
        return None
    sizes = ", ".join(f"{a!r} (size {mesh.shape[a]})" for a in idle)
    return (
        f"mesh axis {sizes} has no role in this pipeline: it is not the pipe axis {axis!r}, "
        f"not a data axis (data_axes={tuple(data_axes)}) and no placement spec names it, so "
        "it is left to XLA's automatic sharding and its devices most likely repeat the same "
        f"work. For data parallelism pass data_axes=({', '.join(map(repr, idle))},) (axes "
        "named 'data' or 'fsdp' are data axes by default); to split weights over it, name it "
        "in the specs of `place` or `init` (tensor parallelism); or build the mesh without it."
    )


def _spec_of(leaf):
    """The ``PartitionSpec`` of a concrete array's sharding, else None (tracers too)."""
    if isinstance(leaf, jax.core.Tracer):
        return None
    return getattr(getattr(leaf, "sharding", None), "spec", None)


def batch(inputs, targets, side, num_microbatches: int, replicas: int) -> None:
    """Every leaf of ``inputs`` (and of ``targets`` and ``side``) has the same batch axis,
    which splits into ``M`` micro-batches (times the data-parallel replicas)."""
    M = num_microbatches
    leaves = jax.tree_util.tree_leaves_with_path(inputs)
    if not leaves or any(not hasattr(x, "shape") or jnp.ndim(x) == 0 for _, x in leaves):
        raise TypeError(
            "inputs must be an array, or a pytree of arrays, each with a leading batch axis; "
            f"got {jax.tree_util.tree_structure(inputs)}"
        )
    size = leaves[0][1].shape[0]
    for name, tree in (("inputs", inputs), ("targets", targets), ("side", side)):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] != size:
                raise ValueError(
                    f"{name}{jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)} but "
                    f"inputs have batch size {size}; every leaf of inputs, targets and side "
                    "needs the same leading batch axis"
                )
    if size % (M * replicas):
        unit = M * replicas
        below, above = size // unit * unit, (size // unit + 1) * unit
        nearest = f"{below} or {above}" if below else f"{above}"
        raise ValueError(
            f"batch size {size} does not split into num_microbatches={M} equal micro-batches"
            + (
                f" on each of {replicas} data-parallel replicas (M x replicas = {unit})"
                if replicas > 1
                else ""
            )
            + f"; use a batch size that is a multiple of {unit} (e.g. {nearest}), or another "
            "num_microbatches"
        )


def on_mesh(tree, mesh, what: str, fix: str) -> None:
    """Refuses arrays committed to other devices than ``mesh``'s: placed for another mesh,
    or put on one device with ``jax.device_put``. A step runs on its mesh's devices, and
    ``jax.jit`` would refuse them with its "incompatible devices" error.

    Args:
      tree: a pytree of arrays (tracers and uncommitted arrays pass: jit moves them).
      what: how the message names ``tree`` (``"stage_params"``).
      fix: how to move them, for the message.
    """
    devices = {d.id for d in mesh.devices.flat}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
            continue
        held = {d.id for d in leaf.sharding.device_set}
        if not leaf.committed or held == devices:
            continue
        theirs = getattr(leaf.sharding, "mesh", None)
        on = f"a mesh {dict(theirs.shape)} of " if isinstance(theirs, jax.sharding.Mesh) else ""
        raise ValueError(
            f"{what}{jax.tree_util.keystr(path)} is on {on}devices {_ids(held)}, but this "
            f"pipeline's mesh {dict(mesh.shape)} has devices {_ids(devices)}: a step runs on "
            "its mesh's devices and cannot take arrays committed to others. Move them once, "
            f"before the training loop: {fix}; or build the Pipeline on the mesh they are on "
            "(mesh=)"
        )


def _ids(ids) -> str:
    """Device ids, sorted: all of them, or the first and last few of many."""
    ids = sorted(ids)
    if len(ids) <= 8:
        return str(ids)
    return f"[{', '.join(map(str, ids[:4]))}, ..., {', '.join(map(str, ids[-2:]))}] ({len(ids)})"


def keywords(stage_accepts: set, loss_accepts: set, side, key) -> None:
    for name, value in (("side", side), ("key", key)):
        if value is not None and name not in stage_accepts | loss_accepts:
            raise ValueError(
                f"{name}= was given but neither stage_fn nor loss_fn takes a keyword "
                f"argument {name!r}; add `{name}` to stage_fn's (or loss_fn's) parameters, "
                f"e.g. def stage_fn(params, x, *, {name}): ..."
            )


def params(params) -> None:
    """Stage parameters are floating-point arrays the pipeline differentiates and updates:
    no PRNG keys, integers, or Flax state other than ``nnx.Param``."""
    from flax import nnx

    def where(path):
        return jax.tree_util.keystr(path) or "<root>"

    variables = jax.tree_util.tree_leaves_with_path(
        params, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    for path, leaf in variables:
        if isinstance(leaf, nnx.Variable) and not isinstance(leaf, nnx.Param):
            kind = type(leaf).__name__
            if isinstance(leaf, nnx.RngState):
                raise ValueError(
                    f"stage parameters hold an nnx.{kind} at {where(path)}: a stage's random "
                    "numbers come from the pipeline, not from an nnx.Rngs inside the stage. "
                    "Build the stage's nnx.Dropout with rngs=None, call it as "
                    "dropout(x, rngs=nnx.Rngs(dropout=key)) with the key stage_fn receives "
                    "(def stage_fn(params, x, *, key)), pass key= to pipe.loss, and split the "
                    "module with nnx.split(module, nnx.Param, ...)"
                )
            raise ValueError(
                f"stage parameters hold an nnx.{kind} at {where(path)}: jaxpipe stages hold "
                "parameters (nnx.Param) only, and state a forward pass updates (BatchNorm's "
                "statistics) would never be written back. Use nnx.LayerNorm or nnx.RMSNorm "
                "instead of BatchNorm, and split the module with nnx.split(module, nnx.Param, "
                "...) so that only Param state is passed"
            )
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        dtype = jnp.result_type(leaf) if not hasattr(leaf, "dtype") else leaf.dtype
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            raise ValueError(
                f"stage parameters hold a PRNG key at {where(path)}: keys are not parameters. "
                "Pass key= to pipe.loss (or forward, loss_and_grads, train) and take the "
                "keyword `key` in stage_fn: each stage and micro-batch gets its own key, "
                "fold_in(fold_in(key, microbatch), stage)"
            )
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"stage parameters must be floating-point arrays (they are differentiated and "
                f"updated), but {where(path)} is {dtype}: keep constants out of the "
                "parameters (close over them in stage_fn), and pass random keys as key= to "
                "pipe.loss rather than inside the parameters (a raw uint32 key there would "
                "give every micro-batch the same random numbers)"
            )


def stage_output(stage_call, chunk, x, context):
    """``y`` of one stage application, which must have ``x``'s structure, shapes and
    dtypes."""
    try:
        y = jax.eval_shape(stage_call, chunk, x, context)
    except Exception as error:
        raise ValueError(
            f"stage_fn failed on one micro-batch, raising {type(error).__name__}: "
            f"{_first_lines(error)}\n  parameters (one stage): {_summary(chunk)}\n  x: "
            f"{_summary(x)}\n  side: {_summary(context.side)}\n  key: {_summary(context.key)}"
            f"\n(x and side are the batch split into micro-batches along axis 0.) Fix: "
            + _stage_hint(error, chunk, x)
        ) from error
    x_struct, y_struct = jax.tree_util.tree_structure(x), jax.tree_util.tree_structure(y)
    same = x_struct == y_struct and all(
        (a.shape, a.dtype) == (b.shape, b.dtype)
        for a, b in zip(jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(y), strict=True)
    )
    if not same:
        raise ValueError(
            "stage_fn must return the structure, shapes and dtypes of its input, so every "
            f"stage can feed the next: input {_describe(x)}, output {_describe(y)}."
            + _output_hint(chunk, x, y, x_struct == y_struct)
        )
    return y


def _output_hint(chunk, x, y, same_structure: bool) -> str:
    """How to fix a stage output that differs from its input."""
    x_leaves, y_leaves = jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(y)
    shapes_agree = same_structure and all(
        a.shape == b.shape for a, b in zip(x_leaves, y_leaves, strict=True)
    )
    if not shapes_agree:
        return (
            " Move shape-changing layers (embedding, head) before the pipeline or into "
            "loss_fn; a stage must map its input to an output of the same shape"
        )
    x_types = {jnp.dtype(a.dtype) for a in x_leaves}
    wider = [
        (jax.tree_util.keystr(path) or "<root>", jnp.dtype(a.dtype))
        for path, a in jax.tree_util.tree_leaves_with_path(chunk)
        if jnp.issubdtype(a.dtype, jnp.floating)
        and all(jnp.promote_types(a.dtype, t) != t for t in x_types)
    ]
    activations = ", ".join(sorted(map(str, x_types)))
    if wider:
        listed = ", ".join(f"{k} ({t})" for k, t in wider[:3]) + (", ..." if len(wider) > 3 else "")
        low = sorted(x_types, key=lambda t: t.itemsize)[0]
        return (
            f" The activations are {activations} but stage parameters {listed} are wider, "
            "and JAX promotes the result to the wider type. Either cast the parameters to "
            f"the activations' dtype inside stage_fn (keeping float32 master weights: "
            f"p = jax.tree.map(lambda a: a.astype(jnp.{low}), p)), or build a Flax module's "
            f"layers with dtype=jnp.{low} (they compute in it from wider weights; stage_fn "
            f"from nnx_stage or linen_stage casts nothing), or store the parameters in {low}, "
            "or feed the pipeline activations of the parameters' dtype"
        )
    return (
        f" The activations are {activations} and the parameters are not wider: something "
        "inside stage_fn (a float32 constant, an explicit dtype=) changes the dtype. Cast the "
        "output back at the end of stage_fn: y.astype(x.dtype)"
    )


def loss_output(loss_call, loss_params, y, target, context, has_aux: bool = False):
    """Checks ``loss_fn`` on one micro-batch: a float scalar loss, and with ``has_aux`` an
    ``aux`` of numeric arrays.

    Returns:
      The ``aux`` of one micro-batch as a tree of ``jax.ShapeDtypeStruct`` (None without).
    """
    try:
        loss = jax.eval_shape(loss_call, loss_params, y, target, context)
    except Exception as error:
        raise ValueError(
            f"loss_fn failed on one micro-batch: loss_fn(loss_params, y, target) with y "
            f"{_describe(y)} (the last stage's output) and target {_describe(target)} (the "
            f"targets split into micro-batches along axis 0, like the inputs) raised "
            f"{type(error).__name__}: {_first_lines(error)}."
            + _target_hint(y, target)
            + f"\n  loss_params: {_summary(loss_params)}\n  side: {_summary(context.side)}"
            f"\n  key: {_summary(context.key)}"
        ) from error
    loss, aux = _loss_and_aux(loss, has_aux)
    if not isinstance(loss, jax.ShapeDtypeStruct) or loss.shape != ():
        got = loss.shape if isinstance(loss, jax.ShapeDtypeStruct) else type(loss)
        raise ValueError(
            f"loss_fn must return a scalar per micro-batch, got {got}; reduce it "
            "(e.g. jnp.mean) inside loss_fn"
        )
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise ValueError(
            f"loss_fn must return a float scalar per micro-batch, got {loss.dtype}; "
            "return e.g. jnp.mean(nll) as a float"
        )
    for path, leaf in jax.tree_util.tree_leaves_with_path(aux):
        numeric = isinstance(leaf, jax.ShapeDtypeStruct) and (
            jnp.issubdtype(leaf.dtype, jnp.number) or leaf.dtype == jnp.bool_
        )
        if not numeric:
            what = leaf.dtype if isinstance(leaf, jax.ShapeDtypeStruct) else type(leaf).__name__
            raise ValueError(
                f"the aux loss_fn returns has a leaf aux{jax.tree_util.keystr(path)} of "
                f"{what}, which cannot be combined over micro-batches and replicas (they are "
                "averaged, or combined as loss_reduction says); return metrics as numeric "
                "arrays (a key or other value belongs outside the aux)"
            )
    return aux


def _loss_and_aux(out, has_aux: bool):
    """``(loss, aux)`` of what loss_fn returned, as ``loss_has_aux`` says, or the error."""
    if has_aux:
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise ValueError(
                "loss_has_aux=True, so loss_fn must return a pair (loss, aux), got "
                f"{jax.tree_util.tree_structure(out)}; return (loss, aux), or construct "
                "the Pipeline without loss_has_aux"
            )
        return out[0], out[1]
    if isinstance(out, tuple | list):
        raise ValueError(
            f"loss_fn returned a {type(out).__name__} of {len(out)} items where a scalar loss "
            "is expected; if it returns (loss, aux) with metrics in aux, pass "
            "loss_has_aux=True to the Pipeline (as jax.value_and_grad(..., has_aux=True))"
        )
    return out, None


def loss_reduction(reduction):
    """``reduction`` if it is ``"mean"``, ``"sum"`` or a callable, else the error."""
    if callable(reduction) or reduction in ("mean", "sum"):
        return reduction
    raise ValueError(
        f"loss_reduction must be 'mean', 'sum' or a function weight_fn(target) -> scalar "
        f"(the weight of a micro-batch in a weighted mean), got {reduction!r}"
    )


def loss_weights(weight_fn, target) -> None:
    """Checks that ``weight_fn`` (a ``loss_reduction``) maps one micro-batch of targets to
    a real scalar; refuses a step without targets, which it cannot weigh."""
    if target is None:
        raise ValueError(
            "loss_reduction is a weight function of each micro-batch's targets, "
            "weight_fn(target), but this step has no targets (targets=None): pass the "
            "targets, or build the Pipeline with loss_reduction='mean' or 'sum'"
        )
    try:
        weight = jax.eval_shape(weight_fn, target)
    except Exception as error:
        raise ValueError(
            f"loss_reduction (a weight function) failed on one micro-batch of targets "
            f"{_describe(target)}, raising {type(error).__name__}: {_first_lines(error)}. "
            "It is called as weight_fn(target) with the micro-batch's targets"
        ) from error
    if not (
        isinstance(weight, jax.ShapeDtypeStruct)
        and weight.shape == ()
        and (jnp.issubdtype(weight.dtype, jnp.number) or weight.dtype == jnp.bool_)
    ):
        got = weight.shape if isinstance(weight, jax.ShapeDtypeStruct) else type(weight)
        raise ValueError(
            f"loss_reduction's weight_fn(target) must return a real scalar per micro-batch "
            f"(e.g. the count of its scored tokens, jnp.sum(target['mask'])), got {got}"
        )


def loss_weights_total(weight_fn, targets, num_blocks: int) -> None:
    """Refuses weights that sum to zero over the step (every micro-batch of every replica:
    ``num_blocks`` blocks of rows), where ``targets`` are concrete arrays: the weighted mean
    would divide by zero. Traced targets (a jitted step), or a ``weight_fn`` that reads
    traced values, are not read."""
    leaves = jax.tree_util.tree_leaves(targets)
    if not leaves or any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        return
    try:  # concrete targets inside a jit trace (closed over): evaluate now, not staged
        with jax.ensure_compile_time_eval():
            blocks = tree_map(lambda a: jnp.reshape(a, (num_blocks, -1, *a.shape[1:])), targets)
            weighted = jax.vmap(lambda t: jnp.asarray(weight_fn(t), jnp.float32))(blocks)
            weights = np.asarray(weighted)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return  # weight_fn reads a traced value: its sum is known when the step runs
    if weights.sum() == 0:
        raise ValueError(
            f"loss_reduction's weights, weight_fn(target) of each of the step's {num_blocks} "
            "micro-batches (over all replicas), sum to 0, so the weighted mean of the "
            "micro-batch losses, sum(w * loss) / sum(w), divides by zero; pass a batch with a "
            "nonzero weight (a scored token, say), or skip the step"
        )


def _target_hint(y, target) -> str:
    """What targets loss_fn likely expects, from the shapes it was given."""
    y_leaves = jax.tree_util.tree_leaves(y)
    t_leaves = jax.tree_util.tree_leaves(target)
    if not t_leaves:
        return " targets is empty (None?): pass the targets loss_fn scores the output against"
    structure = jax.tree_util.tree_structure(target)
    if structure.num_leaves > 1 or structure.num_nodes > 1:
        kind = type(target).__name__
        return (
            f" targets is a {kind} of {structure.num_leaves} arrays: loss_fn receives it "
            f"whole, as a {kind} of this micro-batch's rows of each array, so unpack it "
            "inside loss_fn (e.g. labels, mask = target), or pass a single array"
        )
    if len(y_leaves) == 1:
        (t,), (out,) = t_leaves, y_leaves
        if t.ndim < out.ndim - 1:
            per_position = (t.shape[0], *out.shape[1:-1])
            return (
                f" target has {t.ndim} axes where y has {out.ndim}: a target per position of "
                f"y (all axes of y but its last, features) would be {per_position} per "
                f"micro-batch, so targets of shape (batch, {', '.join(map(str, out.shape[1:-1]))})"
                "; check that the targets passed are the ones loss_fn expects"
            )
    return (
        " Check that targets (split along axis 0 like the inputs) have the shape loss_fn "
        "expects for one micro-batch"
    )


def _first_lines(error, count: int = 3) -> str:
    """The first ``count`` non-empty lines of an error's message."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return "\n".join(lines[:count]) + (" ..." if len(lines) > count else "")


def _summary(tree, most: int = 4) -> str:
    """Shapes and dtypes of a pytree's leaves, one per leaf path, at most ``most`` listed."""
    if tree is None:
        return "None"
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    if not leaves:
        return "empty"

    def one(path, leaf):
        name = jax.tree_util.keystr(path) or "<array>"
        return f"{name} {tuple(leaf.shape)} {jnp.dtype(leaf.dtype)}"

    listed = ", ".join(one(path, leaf) for path, leaf in leaves[:most])
    rest = len(leaves) - most
    return listed + (f", ... ({len(leaves)} leaves)" if rest > 0 else "")


def _stage_hint(error, chunk, x) -> str:
    """How to fix a stage that failed on what the pipeline gave it."""
    text = str(error)
    if "carry" in text and ("dtype" in text or "type" in text):
        floats = {jnp.dtype(a.dtype) for a in jax.tree_util.tree_leaves(x)}
        return (
            "a lax.scan inside stage_fn changed its carry's dtype: the activations are "
            f"{', '.join(sorted(map(str, floats)))} and a wider parameter promotes them. "
            "Cast the parameters to the activations' dtype inside stage_fn "
            "(p = jax.tree.map(lambda a: a.astype(x.dtype), p)), or store them in that "
            "dtype (docs/errors.md, mixed precision)"
        )
    if "Incorrect number of leaves" in text:
        held = _nnx_state_beyond_params(error) or (
            "variables that are not nnx.Param, such as BatchNorm's running mean and var "
            "(nnx.BatchStat)"
        )
        return (
            f"nnx.merge needs more state than the parameters hold: the stage's module has "
            f"{held}, and nnx.state(module, nnx.Param) left them out. The pipeline "
            "trains parameters only and keeps no state a stage updates: use a norm without "
            "running statistics (nnx.LayerNorm, nnx.RMSNorm) in stages, or split the module "
            "with nnx.split(module, nnx.Param, ...) and close over the rest in stage_fn"
        )
    return (
        "make stage_fn accept one micro-batch of these shapes (a side input leaf has the "
        "micro-batch's rows on axis 0, like x)"
    )


def _nnx_state_beyond_params(error) -> str | None:
    """The modules of the failing ``nnx.merge``'s graph that hold variables other than
    ``nnx.Param``, e.g. ``"BatchNorm (nnx.BatchStat)"``; None if no graph is found.

    The graph is the ``nnx.GraphDef`` in the failing call's frames; its nodes list each
    module, then the variables it holds."""
    from flax import nnx

    tb, graphdef = error.__traceback__, None
    while tb is not None and graphdef is None:
        graphdef = next(
            (v for v in tb.tb_frame.f_locals.values() if isinstance(v, nnx.GraphDef)), None
        )
        tb = tb.tb_next
    held, module = {}, None
    for node in getattr(graphdef, "nodes", ()):
        kind = getattr(node, "type", None)
        if not isinstance(kind, type):
            continue
        if issubclass(kind, nnx.Module):
            module = kind.__name__
        elif issubclass(kind, nnx.Variable) and not issubclass(kind, nnx.Param) and module:
            held.setdefault(module, set()).add(f"nnx.{kind.__name__}")
    if not held:
        return None
    return "modules with state other than nnx.Param: " + ", ".join(
        f"{name} ({', '.join(sorted(kinds))})" for name, kinds in held.items()
    )


def _describe(tree) -> str:
    leaves = jax.tree_util.tree_leaves(tree)
    if len(leaves) == 1 and jax.tree_util.tree_structure(tree).num_nodes == 1:
        return f"{leaves[0].shape} {leaves[0].dtype}"
    return str(tree_map(lambda a: f"{a.shape} {a.dtype}", tree))


def stage_data_movement(stage_call, chunk, x, context, mesh, inner_specs, manual_axes) -> None:
    """Refuses, on CPU host devices, stage weights split so that XLA moves data between
    their shards with collective-permutes inside the stage (a dimension that does not divide
    evenly over its axis, such as one key/value head over ``tensor`` 2).

    Inside the pipeline a stage runs in a ``lax.switch`` branch that only the devices of one
    pipe rank take, while XLA's CPU runtime waits for every device a collective-permute
    names, on every pipe rank: the step would hang. Compiles one stage's forward and
    backward with its weights split as placed (``inner_specs``, the automatic axes only).
    """
    automatic = {a for a, n in mesh.shape.items() if a not in manual_axes and n > 1}
    if not automatic or mesh.devices.flat[0].platform != "cpu":
        return

    def keep_automatic(spec):
        entries = []
        for entry in tuple(spec or ()):
            names = entry if isinstance(entry, tuple) else (entry,)
            names = tuple(n for n in names if n in automatic)
            entries.append(names or None)
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*entries))

    leaves, treedef = jax.tree_util.tree_flatten(chunk)
    specs = inner_specs or (None,) * len(leaves)
    chunk = treedef.unflatten(
        [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=keep_automatic(s))
            for a, s in zip(leaves, specs, strict=True)
        ]
    )

    def forward_and_backward(chunk, x, context):
        y, pullback = jax.vjp(lambda p: stage_call(p, x, context), chunk)
        return pullback(y)

    text = jax.jit(forward_and_backward).lower(chunk, x, context).compile().as_text()
    if "collective-permute(" in text:
        named = ", ".join(
            f"{jax.tree_util.keystr(path)}: {spec}"
            for (path, _), spec in zip(
                jax.tree_util.tree_flatten_with_path(chunk)[0], specs, strict=True
            )
            if spec is not None
        )
        raise ValueError(
            "a stage's weights are split so that XLA exchanges pieces of them between "
            f"devices of the {sorted(automatic)} axes with collective-permutes inside the "
            "stage (a split dimension that does not divide evenly, e.g. fewer key/value heads "
            "than the tensor axis has devices). On CPU host devices such a collective inside "
            "the pipeline's per-device branch waits for devices that never come, and the "
            f"step would hang. Placement specs: {named}. Split only dimensions that divide "
            "evenly into whole heads or units (replicate the key/value projections when there "
            "are fewer key/value heads than tensor devices: spec None for them)"
        )


_DIFFERENTIATION_TRACERS = ("JVPTracer", "LinearizeTracer")


def closed_over_gradients(call, args, functions, what: str, fix: str) -> None:
    """Refuses a function that closes over a value being differentiated.

    The pipeline runs stages and the loss inside its own backward (a ``jax.custom_vjp``),
    which cannot carry gradients to values a function closes over: JAX would fail later,
    outside the pipeline, with a bare ``UnexpectedTracerError``. Values closed over inside
    a ``jit`` without being differentiated are fine.

    Args:
      call: the function as the pipeline calls it.
      args: example arguments (arrays or ``jax.ShapeDtypeStruct``).
      functions: ``(label, user function)`` pairs, searched for the name of the value.
      what: how the message names the function (``"stage_fn"``, ``"loss_fn"``).
      fix: where such a value goes instead, for the message.
    """
    try:
        consts = jax.make_jaxpr(call)(*args).consts
    except Exception:  # the function's own error is reported by the other checks
        return
    traced = [c for c in consts if type(c).__name__ in _DIFFERENTIATION_TRACERS]
    if not traced:
        return
    names = _closure_names(functions, traced)
    described = ", ".join(
        names or [f"a {jnp.dtype(c.dtype).name}{list(jnp.shape(c))} value" for c in traced]
    )
    raise ValueError(
        f"{what} closes over {described}, which jax.grad (or jax.value_and_grad) around "
        "the pipeline is differentiating: the pipeline runs it inside its own backward "
        "(a jax.custom_vjp), which cannot send gradients to values a function closes "
        "over, and JAX would fail later with a bare UnexpectedTracerError. Fix: pass the "
        f"value in as an argument: {fix}; or wrap it in jax.lax.stop_gradient inside "
        f"{what} if its gradient is not wanted"
    )


def _closure_names(functions, traced) -> list[str]:
    """``"name (label)"`` for each variable a function closes over (or reads as a global)
    that is, or holds as a pytree leaf, one of the ``traced`` values."""
    found = []
    for label, fn in functions:
        code = getattr(fn, "__code__", None)
        if code is None:
            continue
        cells = {}
        closure = getattr(fn, "__closure__", None) or ()
        for name, cell in zip(code.co_freevars, closure, strict=False):
            try:
                cells[name] = cell.cell_contents
            except ValueError:  # an empty cell
                continue
        scope = getattr(fn, "__globals__", {})
        cells |= {name: scope[name] for name in code.co_names if name in scope}
        for name, value in cells.items():
            try:
                leaves = jax.tree_util.tree_leaves_with_path(value)
            except Exception:
                continue
            for path, leaf in leaves:
                if any(leaf is c for c in traced):
                    dtype = f"{jnp.dtype(leaf.dtype).name}{list(jnp.shape(leaf))}"
                    found.append(f"`{name}{jax.tree_util.keystr(path)}` ({dtype}, {label})")
    return found


def optimizer_state(opt_state, expected, num_logical_stages: int) -> None:
    """Refuses optimizer state that is not one state per stage in the device layout, as
    ``Pipeline.init_optimizer`` builds it (``expected``: its abstract form)."""
    given = jax.tree_util.tree_leaves_with_path(opt_state)
    wanted = jax.tree_util.tree_leaves(expected)
    fix = (
        "Fix: opt_state = pipe.init_optimizer(optimizer, params), with the placed "
        "parameters: every stage keeps its own state, moments [v, S, ...] like its "
        "parameters and step counts [v, S]"
    )
    if len(given) != len(wanted):
        raise ValueError(
            f"opt_state has {len(given)} arrays where pipe.init_optimizer(optimizer, params) "
            f"gives {len(wanted)}: it was built for other parameters or another optimizer. " + fix
        )
    mismatches = []
    for (path, leaf), want in zip(given, wanted, strict=True):
        shape = tuple(jnp.shape(leaf))
        if shape == want.shape:
            continue
        if shape and shape[0] == num_logical_stages and shape[1:] == want.shape[2:]:
            cause = (
                "it was built from parameters in logical stage order [S*v, ...] "
                "(optimizer.init(logical_params)), not from the placed ones"
            )
        elif shape == want.shape[2:]:
            cause = "it is one state for all stages (optimizer.init(params))"
        else:
            cause = "it was built for other parameters"
        where = jax.tree_util.keystr(path) or "<root>"
        mismatches.append((not cause.startswith("it was built from"), where, shape, want, cause))
    if mismatches:
        _, where, shape, want, cause = min(mismatches, key=lambda m: m[0])
        raise ValueError(
            f"opt_state leaf {where} has shape {shape} where pipe.train needs {want.shape}: "
            f"{cause}. {fix}"
        )
