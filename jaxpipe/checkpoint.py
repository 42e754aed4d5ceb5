"""Save and restore pipeline training state with orbax, shard by shard.

```python
from jaxpipe import checkpoint
checkpoint.save("/ckpt", step, {"params": params, "opt": opt_state}, pipeline=pipe)
state = checkpoint.restore("/ckpt", target=abstract_state, pipeline=pipe)   # latest step
```

- ``state`` is any pytree of arrays (parameters, optax state, step counters). Arrays are
  written as they are sharded: every process writes the shards of its own devices; nothing
  is gathered to one host.
- With ``pipeline=``, every leaf whose leading axes are the pipeline's layout ``[v, S]``
  (stage parameters, their optimizer state; `jaxpipe.layout`) is stored in *logical* stage
  order ``[S * v, ...]``, still sharded over the pipe axis, so a checkpoint written under one
  schedule, ``S`` or mesh restores under another with the same number of logical stages:
  `restore` with the new pipeline places those leaves into its own layout. A checkpoint
  whose number of logical stages differs is refused with one line saying what it holds.
- `restore` checks the checkpoint against ``target`` first and raises ``ValueError`` naming
  the first leaf whose path or shape differs ("checkpoint from a different model").
- In a multi-process run every process calls `save` and `restore` with the same arguments.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

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
    """Writes ``state`` (a pytree of arrays) as step ``step`` under the directory ``path``.

    ``pipeline``: the `jaxpipe.pipeline.Pipeline` whose layout the stage leaves are in;
    they are then stored in logical stage order (see the module docstring). Returns when
    the checkpoint is complete on disk; a checkpoint interrupted half way (a killed process)
    is never seen by `latest_step` or `restore`. Raises ``ValueError`` if ``step`` already
    exists there.
    """
    step = _check_step(step)
    held = {"logical": False}
    if pipeline is not None:
        state = _map_stage_leaves(pipeline.layout, state, pipeline.layout.logical)
        held = _describe(pipeline) | {"logical": True}
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
    """The complete steps saved under ``path`` (sorted; empty if there are none)."""
    if not os.path.isdir(os.fspath(path)):
        return []
    with _manager(path) as manager:
        return sorted(manager.all_steps())


def latest_step(path) -> int | None:
    """The newest complete step under ``path``, or None if there is none."""
    steps = all_steps(path)
    return steps[-1] if steps else None


def info(path, step: int | None = None) -> dict:
    """What a checkpoint holds: ``logical`` (stage leaves in logical order), and when it
    was saved with a pipeline, its ``schedule``, ``num_stages``, ``stages_per_device`` and
    ``num_logical_stages``."""
    path, step = _existing(path, step)
    with _manager(path) as manager:
        items = {INFO: ocp.args.JsonRestore()}
        return dict(manager.restore(step, args=ocp.args.Composite(**items))[INFO])


def abstract(state, mesh: jax.sharding.Mesh | None = None):
    """``state`` as abstract arrays (``jax.ShapeDtypeStruct`` with shardings), for `restore`.

    Leaves keep their own sharding; when ``mesh`` is given, leaves without one (NumPy arrays,
    Python scalars, abstract arrays with ``sharding=None``) or on a single device (an
    optimizer's step count created outside ``jit``) are replicated over ``mesh``.
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
):
    """Reads step ``step`` (default: the latest) from ``path``.

    Args:
      target: the state's structure with the wanted shardings: a pytree of arrays or of
        ``jax.ShapeDtypeStruct`` (for example ``checkpoint.abstract(state)``, or
        ``jax.eval_shape`` output with shardings set). Each array is read directly into its
        target sharding, by the processes that own its shards. The result has ``target``'s
        tree structure (optax state classes included).
      mesh: where target leaves without a sharding, or on a single device, go
        (replicated; default: the pipeline's mesh); with ``target=None``, every array is
        restored replicated over ``mesh``.
      pipeline: the pipeline to restore into: target leaves in its layout ``[v, S, ...]``
        are read from the checkpoint's logical order and placed (the checkpoint must have
        been saved with ``pipeline=``, of any schedule with as many logical stages).

    Raises:
      FileNotFoundError: no checkpoint, or no step ``step``, under ``path``.
      ValueError: the checkpoint's tree or shapes differ from ``target`` (a checkpoint from
        a different model), or its logical stages differ from ``pipeline``'s; the message
        names what the checkpoint holds and what was asked.
    """
    path, step = _existing(path, step)
    held = info(path, step)
    if pipeline is not None:
        _check_pipeline(held, pipeline, path, step)
        mesh = pipeline.mesh if mesh is None else mesh
    with _manager(path) as manager:
        saved = _leaf_shapes(_metadata_tree(manager.item_metadata(step)[STATE]))
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
        if pipeline is None:
            _compare(saved, _leaf_shapes(target), path, step, held)
            return _restore(manager, step, target)
        layout = pipeline.layout
        logical_target = _map_stage_leaves(layout, target, _logical_structs(layout))
        _compare(saved, _leaf_shapes(logical_target), path, step, held)
        state = _restore(manager, step, logical_target)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    targets = treedef.flatten_up_to(target)
    index = [i for i, t in enumerate(targets) if _is_stage_leaf(layout, t)]
    specs = [_inner_spec(targets[i]) for i in index]
    for i, leaf in zip(index, layout.place([leaves[i] for i in index], specs), strict=True):
        leaves[i] = leaf
    return jax.tree_util.tree_unflatten(treedef, leaves)


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


def _holds(held: dict) -> str:
    if not held.get("logical"):
        return "arrays as they were (saved without pipeline=)"
    return (
        f"{held['num_logical_stages']} logical stages (schedule {held['schedule']!r}, "
        f"S={held['num_stages']}, v={held['stages_per_device']})"
    )


def _check_pipeline(held: dict, pipeline, path, step) -> None:
    asked = _describe(pipeline)
    if not held.get("logical"):
        raise ValueError(
            f"checkpoint {path!r} step {step} holds {_holds(held)}, so it cannot be placed "
            f"into the layout of schedule {asked['schedule']!r}; restore it without "
            "pipeline= into the layout it was saved from, and save with pipeline= from now on"
        )
    if held["num_logical_stages"] != asked["num_logical_stages"]:
        raise ValueError(
            f"checkpoint {path!r} step {step} holds {_holds(held)}, but the pipeline asked for "
            f"has {asked['num_logical_stages']} (schedule {asked['schedule']!r}, "
            f"S={asked['num_stages']}, v={asked['stages_per_device']}); use a schedule and S "
            f"with S*v = {held['num_logical_stages']}"
        )


def _is_stage_leaf(layout, leaf) -> bool:
    return tuple(np.shape(leaf)[:2]) == tuple(layout.stage_at.shape)


def _map_stage_leaves(layout, tree, fn):
    """``tree`` with its stage leaves (leading axes the layout's ``[v, S]``) passed through
    ``fn`` (all of them at once, as one pytree)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    index = [i for i, leaf in enumerate(leaves) if _is_stage_leaf(layout, leaf)]
    if not index:
        return tree
    converted = fn([leaves[i] for i in index])
    for i, leaf in zip(index, converted, strict=True):
        leaves[i] = leaf
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _logical_structs(layout):
    """Abstract logical ``[S * v, ...]`` forms of placed abstract leaves."""

    def convert(structs):
        return [
            jax.ShapeDtypeStruct(
                (layout.num_logical_stages, *t.shape[2:]),
                t.dtype,
                sharding=layout.logical_sharding(t),
            )
            for t in structs
        ]

    return convert


def _inner_spec(target) -> P | None:
    """The spec of a placed leaf's dimensions after ``[v, S]``."""
    spec = getattr(getattr(target, "sharding", None), "spec", None)
    return P(*spec[2:]) if spec is not None and len(spec) > 2 else None


def _check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return int(step)


def _metadata_tree(metadata) -> Any:
    return getattr(metadata, "tree", metadata)  # TreeMetadata in orbax >= 0.11.x


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


def _format(path: tuple[str, ...]) -> str:
    return "".join(f"[{p!r}]" if not p.isdigit() else f"[{p}]" for p in path) or "<root>"


def _compare(saved: dict, wanted: dict, where: str, step: int, held: dict) -> None:
    head = f"checkpoint from a different model ({where!r}, step {step}): "
    hint = ""
    if held.get("logical"):
        hint = f" (the checkpoint holds {_holds(held)}: restore it with pipeline=)"
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
        if saved[path] != wanted[path]:
            raise ValueError(
                head + f"leaf {_format(path)} has shape {saved[path]} in the checkpoint but "
                f"{wanted[path]} in the target" + hint
            )
