"""Save and restore pipeline training state with orbax, shard by shard.

```python
from jaxpipe import checkpoint
checkpoint.save("/ckpt", step, {"params": params, "opt": opt_state})
state = checkpoint.restore("/ckpt", target=abstract_state)   # latest step
```

- ``state`` is any pytree of arrays (parameters, optax state, step counters). Stage-sharded
  arrays are written as they are: every process writes the shards of its own devices; nothing
  is gathered to one host.
- Stage parameters have a leading axis of length ``S * v`` in *logical* stage order whatever
  the schedule (see `jaxpipe.pipeline`), so a checkpoint saved with one layout (``S = 4``,
  ``1f1b``) restores into another (``S = 2`` with ``virtual_stages = 2``, another mesh):
  pass a ``target`` whose leaves carry the new shardings.
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

__all__ = ["save", "restore", "latest_step", "all_steps", "abstract"]


def _manager(path) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        os.path.abspath(os.fspath(path)), item_handlers=ocp.StandardCheckpointHandler()
    )


def save(path, step: int, state) -> None:
    """Writes ``state`` (a pytree of arrays) as step ``step`` under the directory ``path``.

    Returns when the checkpoint is complete on disk; a checkpoint interrupted half way (a
    killed process) is never seen by `latest_step` or `restore`. Raises ``ValueError`` if
    ``step`` already exists there.
    """
    step = _check_step(step)
    with _manager(path) as manager:
        if step in manager.all_steps():
            raise ValueError(
                f"step {step} already exists in checkpoint directory {os.fspath(path)!r}; "
                "save under a new step or delete the old one"
            )
        manager.save(step, args=ocp.args.StandardSave(state))
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


def abstract(state, mesh: jax.sharding.Mesh | None = None):
    """``state`` as abstract arrays (``jax.ShapeDtypeStruct`` with shardings), for `restore`.

    Leaves keep their own sharding; leaves without one (NumPy arrays, Python scalars, abstract
    arrays with ``sharding=None``) are replicated over ``mesh`` when one is given.
    """

    def convert(x):
        sharding = getattr(x, "sharding", None)
        if sharding is None and mesh is not None:
            sharding = NamedSharding(mesh, P())
        dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
        return jax.ShapeDtypeStruct(np.shape(x), dtype, sharding=sharding)

    return jax.tree_util.tree_map(convert, state)


def restore(
    path, step: int | None = None, target: Any = None, mesh: jax.sharding.Mesh | None = None
):
    """Reads step ``step`` (default: the latest) from ``path``.

    Args:
      target: the state's structure with the wanted shardings: a pytree of arrays or of
        ``jax.ShapeDtypeStruct`` (for example ``checkpoint.abstract(state)``, or
        ``jax.eval_shape`` output with shardings set). Each array is read directly into its
        target sharding, by the processes that own its shards, so a checkpoint restores into
        a different mesh or pipeline layout. The result has ``target``'s tree structure
        (optax state classes included).
      mesh: where target leaves without a sharding go (replicated); with ``target=None``,
        every array is restored replicated over ``mesh``.

    Raises:
      FileNotFoundError: no checkpoint, or no step ``step``, under ``path``.
      ValueError: the checkpoint's tree or shapes differ from ``target`` (a checkpoint from
        a different model); the message names the first differing leaf and both shapes.
    """
    steps = all_steps(path)
    if not steps:
        raise FileNotFoundError(f"no checkpoint under {os.fspath(path)!r}")
    if step is None:
        step = steps[-1]
    elif _check_step(step) not in steps:
        raise FileNotFoundError(
            f"no step {step} in checkpoint directory {os.fspath(path)!r}; saved steps: {steps}"
        )
    with _manager(path) as manager:
        saved = _leaf_shapes(_metadata_tree(manager.item_metadata(step)))
        if target is None:
            if mesh is None:
                return manager.restore(step, args=ocp.args.StandardRestore())
            target = _metadata_tree(manager.item_metadata(step))
            target = jax.tree_util.tree_map(
                lambda m: jax.ShapeDtypeStruct(
                    tuple(m.shape), m.dtype, sharding=NamedSharding(mesh, P())
                ),
                target,
                is_leaf=_is_metadata,
            )
        else:
            target = abstract(target, mesh)
            _compare(saved, _leaf_shapes(target), os.fspath(path), step)
        return manager.restore(step, args=ocp.args.StandardRestore(target))


# ------------------------------------------------------------------------------ internals
def _check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return int(step)


def _metadata_tree(metadata) -> Any:
    return getattr(metadata, "tree", metadata)  # TreeMetadata in orbax >= 0.11.x


def _is_metadata(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


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


def _compare(saved: dict, wanted: dict, where: str, step: int) -> None:
    head = f"checkpoint from a different model ({where!r}, step {step}): "
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
                f"{wanted[path]} in the target"
            )
