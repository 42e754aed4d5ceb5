"""Save and restore pipeline training state with orbax, shard by shard.

```python
from jaxpipe import checkpoint
checkpoint.save("/ckpt", step, {"params": params, "opt": opt_state}, pipeline=pipe)
state = checkpoint.restore("/ckpt", target=abstract_state, pipeline=pipe)   # latest step
```

- ``state`` is any pytree of arrays (parameters, optax state, step counters). Arrays are
  written as they are sharded: every process writes the shards of its own devices; nothing
  is gathered to one host.
- Placed trees (`jaxpipe.Placed`: stage parameters from ``pipe.place`` or
  ``pipe.init``, their gradients and optimizer moments; and NNX variables that record the
  layout they were placed in, such as a module's state) are stored in *logical* stage order
  ``[S * v, ...]``, still sharded over the pipe axis, each read in its own layout, with or
  without ``pipeline=``. `restore` places them into the layout of ``pipeline=``, or without
  it of the matching `Placed` in ``target`` (``checkpoint.abstract`` of a state), so a
  checkpoint written under one schedule, ``S`` or mesh restores under another with the same
  number of logical stages, and never into the wrong order. Another number of logical
  stages is refused with one line saying what the checkpoint holds, unless ``recut=True``
  regroups stacked blocks (`jaxpipe.layout.recut`). With ``pipeline=`` of a pipeline with
  one stage per device in order, bare ``[1, S, ...]`` leaves are treated the same way.
- `restore` checks the checkpoint against ``target`` first and raises ``ValueError`` naming
  the first leaf whose path or shape differs ("checkpoint from a different model"). Leaves
  of another dtype than the target's are converted to it, with a ``UserWarning`` naming
  them and both dtypes (a bfloat16 checkpoint restored into float32 master weights).
- In a multi-process run every process calls `save` and `restore` with the same arguments.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe import layout as layout_lib
from jaxpipe.layout import Layout, Placed, inner_spec, is_placed

try:
    import orbax.checkpoint as ocp
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "jaxpipe.checkpoint needs orbax-checkpoint: pip install 'jaxpipe[checkpoint]'"
    ) from error

__all__ = ["save", "restore", "latest_step", "all_steps", "abstract", "info"]

STATE, INFO = "state", "jaxpipe"


def _manager(path) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        os.path.abspath(os.fspath(path)),
        item_names=(STATE, INFO),
        item_handlers={STATE: ocp.StandardCheckpointHandler(), INFO: ocp.JsonCheckpointHandler()},
    )


def save(path, step: int, state, pipeline=None) -> None:
    """Writes ``state`` as step ``step`` under the directory ``path``.

    Returns when the checkpoint is complete on disk; a checkpoint interrupted half way (a
    killed process) is never seen by `latest_step` or `restore`.

    Args:
      path: the checkpoint directory.
      step: a non-negative int.
      state: a pytree of arrays; its placed trees are stored in logical stage order (see
        the module docstring).
      pipeline: optionally, the `jaxpipe.pipeline.Pipeline` the state belongs to: its
        schedule is recorded, and its mesh used for the conversion.

    Raises:
      ValueError: ``step`` already exists there, ``state`` holds placed trees of
        different numbers of logical stages, or of another number than ``pipeline``'s.
    """
    step = _check_step(step)
    leaves, treedef, _ = _nodes(state, pipeline)
    for i, leaf in enumerate(leaves):
        if is_placed(leaf) and not jax.tree_util.tree_leaves(leaf.tree):
            leaves[i] = leaf.tree  # no arrays (plain SGD's state): nothing to reorder
    index = [i for i, leaf in enumerate(leaves) if is_placed(leaf)]
    layouts = [_layout(leaves[i], pipeline, None) for i in index]
    for i, layout in zip(index, layouts, strict=True):
        leaves[i] = layout.logical(leaves[i])
    state = treedef.unflatten(leaves)
    held = {"logical": bool(index)}
    if index:
        counts = {layout.num_logical_stages for layout in layouts}
        if len(counts) > 1:
            raise ValueError(
                f"state holds placed trees of {sorted(counts)} logical stages; a checkpoint "
                "holds one model: save each pipeline's state separately"
            )
        if pipeline is not None and counts != {pipeline.num_logical_stages}:
            raise ValueError(
                f"state holds placed trees of {counts.pop()} logical stages, but pipeline= "
                f"runs {pipeline.num_logical_stages} ({pipeline.schedule.name!r}, S="
                f"{pipeline.num_stages}); pass the pipeline that placed them"
            )
        held |= _describe(pipeline) if pipeline is not None else _describe_layout(layouts[0])
    with _manager(path) as manager:
        if step in manager.all_steps():
            raise ValueError(
                f"step {step} already exists in checkpoint directory {os.fspath(path)!r}; "
                "save under a new step or delete the old one"
            )
        items = {STATE: ocp.args.StandardSave(state), INFO: ocp.args.JsonSave(held)}
        manager.save(step, args=ocp.args.Composite(**items))
        manager.wait_until_finished()


def all_steps(path) -> list[int]:
    """The complete steps saved under ``path``.

    Args:
      path: the checkpoint directory.

    Returns:
      The steps, sorted; empty if there are none.
    """
    if not os.path.isdir(os.fspath(path)):
        return []
    with _manager(path) as manager:
        return sorted(manager.all_steps())


def latest_step(path) -> int | None:
    """The newest complete step under ``path``.

    Args:
      path: the checkpoint directory.

    Returns:
      The step, or None if there is none.
    """
    steps = all_steps(path)
    return steps[-1] if steps else None


def info(path, step: int | None = None) -> dict:
    """What a checkpoint holds.

    Args:
      path: the checkpoint directory.
      step: the step (default: the latest).

    Returns:
      A dict: ``logical`` (stage leaves in logical order), and then
      ``num_logical_stages``, ``num_stages``, ``stages_per_device`` and ``schedule`` (None
      when saved without ``pipeline=``).
    """
    path, step = _existing(path, step)
    with _manager(path) as manager:
        items = {INFO: ocp.args.JsonRestore()}
        return dict(manager.restore(step, args=ocp.args.Composite(**items))[INFO])


def abstract(state, mesh: jax.sharding.Mesh | None = None):
    """``state`` as abstract arrays, for `restore`.

    Args:
      state: a pytree of arrays (placed trees keep their order and specs).
      mesh: optionally, where leaves without a sharding (NumPy arrays, Python scalars,
        abstract arrays with ``sharding=None``) or on a single device (an optimizer's step
        count created outside ``jit``) go: replicated over it.

    Returns:
      ``state`` with ``jax.ShapeDtypeStruct`` leaves that keep their own shardings.
    """

    def convert(x):
        sharding = getattr(x, "sharding", None)
        single = isinstance(sharding, jax.sharding.SingleDeviceSharding)
        if (sharding is None or single) and mesh is not None:
            sharding = NamedSharding(mesh, P())
        dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
        return jax.ShapeDtypeStruct(np.shape(x), dtype, sharding=sharding)

    return jax.tree_util.tree_map(convert, state)


def restore(
    path,
    step: int | None = None,
    target: Any = None,
    mesh: jax.sharding.Mesh | None = None,
    pipeline=None,
    recut: bool = False,
):
    """Reads a checkpoint.

    Args:
      path: the checkpoint directory.
      step: the step (default: the latest).
      target: the state's structure with the wanted shardings: a pytree of arrays or of
        ``jax.ShapeDtypeStruct`` (for example ``checkpoint.abstract(state)``, or
        ``jax.eval_shape`` output with shardings set). Each array is read directly into its
        target sharding, by the processes that own its shards. The result has ``target``'s
        tree structure (optax state classes included).
      mesh: where target leaves without a sharding, or on a single device, go
        (replicated; default: the pipeline's mesh); with ``target=None``, every array is
        restored replicated over ``mesh``.
      pipeline: the pipeline to restore into. Placed trees in ``target``
        (`jaxpipe.Placed`) are read from the checkpoint's logical order and placed in
        its layout, on its mesh; without it, each in its own layout (``target``'s order).
        Either way with the specs the target's placed trees carry.
      recut: when the checkpoint holds another number of logical stages than the placed
        trees of ``target``, regroup its blocks: every stage leaf must be a stack of
        identical blocks ``[N, B, ...]`` (see `jaxpipe.layout.recut`), so that a run of
        ``N`` stages of ``B`` blocks resumes as ``N'`` stages of ``N * B / N'`` blocks, in
        the same block order. Placed trees without a block axis (``init_optimizer``'s
        per-stage step counts) are refused.

    Returns:
      The state, of ``target``'s structure (without a target, as saved).

    Warns:
      UserWarning: target leaves of another dtype than the checkpoint's, which are
        converted to the target's; the message names them and both dtypes.

    Raises:
      FileNotFoundError: no checkpoint, or no step ``step``, under ``path``.
      ValueError: the checkpoint's tree or shapes differ from ``target`` (a checkpoint from
        a different model), or its logical stages differ from ``pipeline``'s; bare
        ``[v, S, ...]`` target leaves where the checkpoint holds stage leaves in logical
        order, or, with ``pipeline=``, bare stage leaves where it holds bare arrays saved
        without ``pipeline=``. The message names what the checkpoint holds, what was
        asked, and what to pass instead.
    """
    path, step = _existing(path, step)
    held = info(path, step)
    if pipeline is not None:
        mesh = pipeline.mesh if mesh is None else mesh
    with _manager(path) as manager:
        metadata = _metadata_tree(manager.item_metadata(step)[STATE])
        saved, saved_dtypes = _leaf_shapes(metadata), _leaf_dtypes(metadata)
        if target is None:
            if mesh is None:
                return _restore(manager, step, None)
            target = _metadata_tree(manager.item_metadata(step)[STATE])
            target = jax.tree_util.tree_map(
                lambda m: jax.ShapeDtypeStruct(
                    tuple(m.shape), m.dtype, sharding=NamedSharding(mesh, P())
                ),
                target,
                is_leaf=_is_metadata,
            )
            return _restore(manager, step, target)
        target = abstract(target, mesh)
        targets, treedef, bare = _nodes(target, pipeline)
        index = [i for i, t in enumerate(targets) if is_placed(t) and _has_arrays(t)]
        empty = [i for i, t in enumerate(targets) if is_placed(t) and not _has_arrays(t)]
        if not index and not empty:
            _compare(saved, _leaf_shapes(target), path, step, held)
            _warn_dtypes(saved_dtypes, _leaf_dtypes(target), path, step)
            return _restore(manager, step, target)
        layouts = {
            i: pipeline.layout if pipeline is not None else _layout(targets[i], None, mesh)
            for i in index
        }
        asked = _describe(pipeline) if pipeline is not None else None
        given = jax.tree_util.tree_flatten_with_path(target, is_leaf=layout_lib.is_node)[0]
        for i in index:
            read_bare = bare[i] and not layout_lib.is_node(given[i][1])
            leaf = jax.tree_util.keystr(given[i][0]) or "<root>"
            _check_stages(held, layouts[i], asked, recut, path, step, leaf if read_bare else None)
        logical = list(targets)
        for i in index:
            logical[i] = _logical_structs(layouts[i], targets[i].tree, held, recut)
        for i in empty:  # saved as its bare tree (no arrays to reorder)
            logical[i] = targets[i].tree
        logical_target = treedef.unflatten(logical)
        _compare(saved, _leaf_shapes(logical_target), path, step, held)
        _warn_dtypes(saved_dtypes, _leaf_dtypes(logical_target), path, step)
        state = _restore(manager, step, logical_target)
    leaves = treedef.flatten_up_to(state)
    for i in index:
        tree = leaves[i]
        if layouts[i].num_logical_stages != held["num_logical_stages"]:
            tree = layout_lib.recut(tree, layouts[i].num_logical_stages)
        placed = layouts[i].place(tree, _specs(targets[i]))
        leaves[i] = placed.tree if bare[i] else placed
    for i in empty:
        order = pipeline.layout.order if pipeline is not None else targets[i].order
        leaves[i] = Placed(leaves[i], order)
    return treedef.unflatten(leaves)


# ------------------------------------------------------------------------------ internals
def _restore(manager, step, target):
    args = ocp.args.StandardRestore(target) if target is not None else ocp.args.StandardRestore()
    return manager.restore(step, args=ocp.args.Composite(**{STATE: args}))[STATE]


def _existing(path, step) -> tuple[str, int]:
    steps = all_steps(path)
    if not steps:
        raise FileNotFoundError(f"no checkpoint under {os.fspath(path)!r}")
    if step is None:
        return os.fspath(path), steps[-1]
    if _check_step(step) not in steps:
        raise FileNotFoundError(
            f"no step {step} in checkpoint directory {os.fspath(path)!r}; saved steps: {steps}"
        )
    return os.fspath(path), step


def _describe(pipeline) -> dict:
    return {
        "schedule": pipeline.schedule.name,
        "num_stages": pipeline.num_stages,
        "stages_per_device": pipeline.schedule.stages_per_device,
        "num_logical_stages": pipeline.num_logical_stages,
    }


def _describe_layout(layout) -> dict:
    return {
        "schedule": None,
        "num_stages": layout.num_stages,
        "stages_per_device": layout.stages_per_device,
        "num_logical_stages": layout.num_logical_stages,
    }


def _holds(held: dict) -> str:
    if not held.get("logical"):
        return "arrays as they were (no placed trees)"
    schedule = f"schedule {held['schedule']!r}, " if held.get("schedule") else ""
    return (
        f"{held['num_logical_stages']} logical stages ({schedule}"
        f"S={held['num_stages']}, v={held['stages_per_device']})"
    )


def _check_stages(held: dict, layout, asked, recut_blocks: bool, path, step, bare) -> None:
    """Refuses placed targets the checkpoint cannot fill; ``bare``: the path of a bare
    target leaf that ``pipeline=`` reads as stage leaves, or None."""
    if asked is None:
        asked = _describe_layout(layout)
    schedule = f"schedule {asked['schedule']!r}, " if asked.get("schedule") else ""
    if not held.get("logical") and bare is not None:
        raise ValueError(
            f"checkpoint {path!r} step {step} holds {_holds(held)}: it was saved without "
            "pipeline=, from bare arrays. With pipeline=, the target's bare [v, S, ...] "
            f"leaves split over the pipe axis ({bare}, ...) are read as stage leaves of the "
            f"pipeline ({schedule}S={asked['num_stages']}, v={asked['stages_per_device']}) "
            "and placed from logical stage order, which this checkpoint does not hold. "
            "Restore it without pipeline=, into the target it was saved from: "
            "checkpoint.restore(path, step, target=target); to restore into other layouts "
            "later, save with pipeline=pipe"
        )
    if not held.get("logical"):
        raise ValueError(
            f"checkpoint {path!r} step {step} holds {_holds(held)}: it was saved from bare "
            "arrays, which do not say which stage each holds, so it cannot be placed into "
            f"the target's placed trees ({schedule}S={asked['num_stages']}, "
            f"v={asked['stages_per_device']}). Restore it into a target of the bare arrays "
            "it was saved from, without pipeline="
        )
    if held["num_logical_stages"] != layout.num_logical_stages and not recut_blocks:
        raise ValueError(
            f"checkpoint {path!r} step {step} holds {_holds(held)}, but the target's placed "
            f"trees have {layout.num_logical_stages} ({schedule}S={layout.num_stages}, "
            f"v={layout.stages_per_device}); use a schedule and S with S*v = "
            f"{held['num_logical_stages']}, or, if every stage is a stack of identical "
            "blocks on axis 1 ([N, B, ...]), pass recut=True to regroup the blocks"
        )


def _specs(target: Placed):
    """The specs to place a restored tree with, a tree like ``target.tree`` in logical
    form: those the target was placed with, or where it records none, its leaves'
    shardings'."""
    leaves, treedef = jax.tree_util.tree_flatten(layout_lib.without_record(target.tree))
    if target.specs is None:
        return treedef.unflatten([inner_spec(getattr(t, "sharding", None)) for t in leaves])
    return treedef.unflatten(layout_lib.specs_of(target))


def _nodes(tree, pipeline):
    """``tree``'s leaves up to placed nodes, its treedef, and which leaves were bare stage
    leaves (NNX variables that record a layout, or ``[1, S, ...]`` leaves split over the
    pipe axis of a ``pipeline`` that takes bare arrays), now wrapped in a `Placed`."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=layout_lib.is_node)
    bare = [False] * len(leaves)
    for i, leaf in enumerate(leaves):
        if not is_placed(leaf) and layout_lib.is_node(leaf):  # an NNX variable's record
            leaves[i], bare[i] = layout_lib.as_placed(leaf), True
    layout = getattr(pipeline, "layout", None)
    if layout is not None and layout.takes_bare:
        for i, leaf in enumerate(leaves):
            staged = tuple(np.shape(leaf)[:2]) == layout.stage_at.shape
            if not is_placed(leaf) and staged and _over_pipe(leaf, layout.axis):
                leaves[i], bare[i] = Placed(leaf, layout.order), True
    return leaves, treedef, bare


def _has_arrays(node: Placed) -> bool:
    return bool(jax.tree_util.tree_leaves(node.tree))


def _over_pipe(leaf, axis: str) -> bool:
    """Whether ``leaf``'s sharding splits its second dimension over ``axis``, as placing
    puts a stage leaf's (a leaf without a named sharding: by its shape alone)."""
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return True
    spec = tuple(sharding.spec)
    entry = spec[1] if len(spec) > 1 else None
    return axis in (entry if isinstance(entry, tuple) else (entry,))


def _layout(node: Placed, pipeline, mesh) -> Layout:
    """The layout of ``node``: its order on the pipeline's mesh, else on the mesh and axis
    of its leaves' sharding, else on ``mesh``'s ``"pipe"`` axis."""
    stage_at = np.array(node.order.stage_at, np.int32)
    if pipeline is not None:
        return pipeline.layout.like(node.order)
    for leaf in jax.tree_util.tree_leaves(node.tree):
        sharding = getattr(leaf, "sharding", None)
        spec = getattr(sharding, "spec", ())
        if isinstance(sharding, NamedSharding) and len(spec) > 1 and isinstance(spec[1], str):
            return Layout(stage_at=stage_at, mesh=sharding.mesh, axis=spec[1])
    if mesh is None:
        raise ValueError(
            "placed trees whose arrays are not sharded over a pipe axis: pass pipeline= "
            "(or mesh=) to say where they go"
        )
    return Layout(stage_at=stage_at, mesh=mesh, axis="pipe")


def _logical_structs(layout, tree, held: dict, recut_blocks: bool):
    """Abstract logical forms of placed abstract leaves, as the checkpoint holds them:
    ``[N, ...]``, or with ``recut`` the checkpoint's ``[N_saved, B_saved, ...]``."""
    saved = held["num_logical_stages"]
    blocks_of = {}

    def convert(t):
        shape = (layout.num_logical_stages, *t.shape[2:])
        sharding = layout.logical_sharding(t)
        if saved != layout.num_logical_stages:
            if len(shape) < 2 or shape[0] * shape[1] % saved:
                blocks_of["bad"] = t.shape
                return t
            shape = (saved, shape[0] * shape[1] // saved, *shape[2:])
            if saved % layout.num_stages:
                sharding = NamedSharding(layout.mesh, P())
        return jax.ShapeDtypeStruct(shape, t.dtype, sharding=sharding)

    structs = layout_lib.without_record(jax.tree_util.tree_map(convert, tree))
    if "bad" in blocks_of:
        raise ValueError(
            f"recut=True: a placed leaf of shape {blocks_of['bad']} has no block axis whose "
            f"blocks split over the checkpoint's {saved} stages; recut needs every stage leaf "
            "[v, S, B, ...] (a stack of B identical blocks): leave per-stage values without a "
            "block axis (init_optimizer's step counts) out of the target and restore them "
            "separately, or start them anew"
        )
    return structs


def _check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return int(step)


def _metadata_tree(metadata) -> Any:
    return getattr(metadata, "tree", metadata)  # a TreeMetadata, or the tree itself


def _is_metadata(x) -> bool:
    """An array, or orbax's metadata of one: not a pytree node that has array-like
    attributes (an ``nnx.Variable`` holding its value is flattened like orbax stores it)."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        return False
    return jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(x))


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _leaf_shapes(tree) -> dict[tuple[str, ...], tuple[int, ...]]:
    """``{path: shape}``; a path is the tuple of key names, so a namedtuple (optax state)
    and the dict orbax stores for it give the same paths."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_metadata)[0]
    return {tuple(map(_key_name, path)): tuple(np.shape(leaf)) for path, leaf in leaves}


def _leaf_dtypes(tree) -> dict[tuple[str, ...], np.dtype]:
    """``{path: dtype}``, with the paths of `_leaf_shapes`."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_metadata)[0]
    return {tuple(map(_key_name, path)): np.dtype(leaf.dtype) for path, leaf in leaves}


def _warn_dtypes(saved: dict, wanted: dict, where: str, step: int) -> None:
    """Warns of target leaves whose dtype differs from the checkpoint's: restore converts
    them (a bfloat16 checkpoint into float32 master weights comes back rounded)."""
    differ = [p for p in wanted if p in saved and saved[p] != wanted[p]]
    if not differ:
        return
    listed = ", ".join(f"{_format(p)} {saved[p]} -> {wanted[p]}" for p in differ[:4])
    more = f" and {len(differ) - 4} more" if len(differ) > 4 else ""
    warnings.warn(
        f"checkpoint {where!r} step {step} holds {len(differ)} leaves in another dtype than "
        f"the target's, converted on restore (checkpoint -> target): {listed}{more}. A "
        "bfloat16 checkpoint restored into float32 master weights keeps only bfloat16's "
        "precision. If that is meant, nothing is wrong; else restore into a target of the "
        "checkpoint's dtypes (checkpoint.abstract of a state in them)",
        UserWarning,
        stacklevel=3,
    )


def _format(path: tuple[str, ...]) -> str:
    return "".join(f"[{p!r}]" if not p.isdigit() else f"[{p}]" for p in path) or "<root>"


def _compare(saved: dict, wanted: dict, where: str, step: int, held: dict) -> None:
    head = f"checkpoint from a different model ({where!r}, step {step}): "
    hint = ""
    if held.get("logical"):
        hint = (
            f" (the checkpoint holds {_holds(held)}: restore stage parameters into placed "
            "trees, e.g. target=checkpoint.abstract(state) of a state made with pipe.init "
            "or pipe.place)"
        )
    for path in [*wanted, *(p for p in saved if p not in wanted)]:  # target's order first
        if path not in saved:
            raise ValueError(
                head + f"leaf {_format(path)} (shape {wanted[path]}) is in the target but "
                "not in the checkpoint"
            )
        if path not in wanted:
            raise ValueError(
                head + f"leaf {_format(path)} (shape {saved[path]}) is in the checkpoint but "
                "not in the target"
            )
        shape, stages = wanted[path], held.get("num_logical_stages")  # None: none placed
        if len(shape) > 1 and shape[0] * shape[1] == stages and saved[path] == (stages, *shape[2:]):
            raise ValueError(
                f"checkpoint {where!r} step {step} holds leaf {_format(path)} in logical stage "
                f"order, shape {saved[path]}, as a stage leaf of {_holds(held)}; the target "
                f"gives it as bare arrays {shape} ([v, S, ...]), which do not say which layout "
                "they are in, so the checkpoint cannot be placed into them. Make the target "
                "from the placed state: target = checkpoint.abstract(state), its stage "
                "parameters (and their optimizer state) from pipe.place or pipe.init, with "
                "pipeline=pipe to place them in that pipeline's layout (with one stage per "
                "device in stage order, bare [1, S, ...] leaves split over the pipe axis are "
                "read as its stage leaves)"
            )
        if saved[path] != wanted[path]:
            raise ValueError(
                head + f"leaf {_format(path)} has shape {saved[path]} in the checkpoint but "
                f"{wanted[path]} in the target"
                + (hint if saved[path][:1] != wanted[path][:1] else "")
            )
