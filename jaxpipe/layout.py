"""Where stage parameters live: the device layout ``[v, S, ...]`` and logical stage order.

A model cut into ``N = S * v`` stages has, in *logical* order, leaves ``[N, ...]``: stage
``s`` is ``leaf[s]``. The pipeline keeps them in the *device layout* ``[v, S, ...]`` instead,
with the ``S`` axis sharded over the pipe mesh axis: ``leaf[c, d]`` is the ``c``-th stage held
by device ``d`` (its chunk ``c``), so every device stores exactly its own stages. Parameters,
gradients and optimizer state keep this layout for the whole of training; converting to and
from logical order (`Layout.place`, `Layout.logical`) happens at the edges only (init,
import, export), never inside a step, because a reorder of the sharded axis inside a step is
a whole-model all-gather in disguise.

For placements where stage ``s`` lives on device ``s % S`` (one stage per device,
interleaved, circular) ``leaf[c, d]`` is logical stage ``c * S + d``: the layout is a
reshape of logical order. A V placement (``zbv``, ``dualpipev``) holds stage ``d`` and stage
``2S - 1 - d`` on device ``d``: its second row is reversed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.schedules import Schedule

tree_map = jax.tree_util.tree_map

__all__ = ["Layout"]


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """The device layout of one schedule's placement on one mesh.

    Attributes:
      stage_at: ``[v, S]`` int array: the logical stage at chunk ``c`` of device ``d``.
      mesh: the mesh whose ``axis`` holds the ``S`` devices.
      axis: the pipe axis name.
    """

    stage_at: np.ndarray
    mesh: jax.sharding.Mesh
    axis: str

    @classmethod
    def of(cls, schedule: Schedule, mesh: jax.sharding.Mesh, axis: str = "pipe") -> Layout:
        """The layout of ``schedule``'s placement: chunk ``c`` of device ``d`` is the ``c``-th
        smallest logical stage that device holds."""
        stage_at = np.array(
            [schedule.device_stages(d) for d in range(schedule.num_stages)], dtype=np.int32
        ).T
        return cls(stage_at=stage_at, mesh=mesh, axis=axis)

    @property
    def num_stages(self) -> int:
        """``S``: devices on the pipe axis."""
        return self.stage_at.shape[1]

    @property
    def stages_per_device(self) -> int:
        """``v``: chunks per device."""
        return self.stage_at.shape[0]

    @property
    def num_logical_stages(self) -> int:
        """``N = S * v``."""
        return self.stage_at.size

    def spec(self, inner: P | None = None) -> P:
        """The ``PartitionSpec`` of a placed leaf whose dimensions after the stage axes are
        split by ``inner`` (default: not split)."""
        return P(None, self.axis, *(inner or ()))

    def sharding(self, inner: P | None = None) -> NamedSharding:
        """The ``NamedSharding`` of a placed leaf (see `spec`)."""
        return NamedSharding(self.mesh, self.spec(inner))

    def shardings(self, tree, specs=None):
        """Per leaf of ``tree`` its placed sharding; ``specs`` as in `place`."""
        treedef = jax.tree_util.tree_structure(tree)
        return treedef.unflatten([self.sharding(s) for s in flat_specs(tree, specs)])

    def place(self, logical_params, specs=None):
        """``[N, ...]`` leaves in logical stage order -> ``[v, S, ...]`` leaves, sharded.

        ``specs``: optionally, per leaf (a pytree matching ``logical_params``, or one spec
        for all), a ``PartitionSpec`` of the dimensions after the stage axis, e.g.
        ``P("fsdp", "tensor")``; the placed leaf is sharded ``P(None, pipe, *spec)``.
        NumPy leaves are sliced on the host, so each device receives only its own stages
        (in a multi-process run every process passes the same host values); JAX arrays are
        reordered by one jitted gather into the sharded layout.
        """
        self._check_logical(logical_params)
        shardings = self.shardings(logical_params, specs)
        order = self.stage_at.reshape(-1)
        v, S = self.stage_at.shape

        def reorder(x):
            x = x[order]
            return x.reshape(v, S, *x.shape[1:])

        leaves, treedef = jax.tree_util.tree_flatten(logical_params)
        flat_shardings = treedef.flatten_up_to(shardings)
        if all(isinstance(x, np.ndarray) for x in leaves):  # each device copies its stages
            placed = [
                _from_host(reorder(x), s) for x, s in zip(leaves, flat_shardings, strict=True)
            ]
        else:
            placed = self._jit(lambda xs: [reorder(x) for x in xs], flat_shardings)(leaves)
        return jax.tree_util.tree_unflatten(treedef, placed)

    def logical(self, params):
        """``[v, S, ...]`` leaves (the device layout) -> ``[N, ...]`` in logical stage order.

        For export, checkpoints and inspection: the result of one jitted gather, sharded
        over the pipe axis along the stage axis, not for use inside a training step.
        """
        self.check_placed(params, "params", allow_empty=True)
        inverse = np.argsort(self.stage_at.reshape(-1))

        def unplace(x):
            return x.reshape(self.num_logical_stages, *x.shape[2:])[inverse]

        shardings = tree_map(self.logical_sharding, params)
        return self._jit(lambda p: tree_map(unplace, p), shardings)(params)

    def logical_sharding(self, placed) -> NamedSharding:
        """The sharding of a placed leaf's logical form: the stage axis over the pipe axis
        (each device holds ``v`` consecutive logical stages), other axes as placed."""
        spec = getattr(getattr(placed, "sharding", None), "spec", None)
        inner = tuple(spec[2:]) if spec is not None and len(spec) > 2 else ()
        return NamedSharding(self.mesh, P(self.axis, *inner))

    def init(self, init_stage: Callable[[jax.Array], Any], key, specs=None):
        """Parameters of every stage created directly in the device layout.

        ``init_stage(key) -> one stage's parameters``. Logical stage ``s`` is initialised
        with ``jax.random.split(key, N)[s]``, so ``logical(init(f, key))`` equals
        ``jax.vmap(f)(jax.random.split(key, N))`` for threefry keys (not for ``rbg`` keys,
        whose bits under ``vmap`` depend on the batch); each device computes only its own
        stages.
        """
        keys = jax.random.split(key, self.num_logical_stages)[self.stage_at.reshape(-1)]
        keys = keys.reshape(*self.stage_at.shape, *keys.shape[1:])
        v, S = self.stage_at.shape
        abstract = jax.eval_shape(init_stage, keys[0, 0])
        placed = tree_map(lambda a: jax.ShapeDtypeStruct((v, S, *a.shape), a.dtype), abstract)
        shardings = self.shardings(placed, specs)
        key_sharding = NamedSharding(self.mesh, P(None, self.axis))
        keys = jax.device_put(keys, key_sharding)
        return self._jit(jax.vmap(jax.vmap(init_stage)), shardings)(keys)

    def _jit(self, fn, out_shardings):
        """``jax.jit(fn)`` producing ``out_shardings``; on a mesh with explicit axes ``fn``
        runs under that mesh with its axes automatic (``jax.sharding.auto_axes``), since
        reordering a sharded axis has no explicit-sharding rule."""
        if not any(t == jax.sharding.AxisType.Explicit for t in self.mesh.axis_types):
            return jax.jit(fn, out_shardings=out_shardings)
        jitted = jax.jit(jax.sharding.auto_axes(fn, out_sharding=out_shardings))

        def call(*args):
            with jax.set_mesh(self.mesh):
                return jitted(*args)

        return call

    # ------------------------------------------------------------------ checks
    def check_placed(self, params, what: str = "stage_params", allow_empty=False) -> None:
        """Raises ``ValueError`` unless every leaf has the leading axes ``(v, S)``."""
        v, S = self.stage_at.shape
        leaves = jax.tree_util.tree_leaves_with_path(params)
        if not leaves and not allow_empty:
            raise ValueError(f"{what} has no arrays")
        for path, leaf in leaves:
            shape = jnp.shape(leaf)
            if shape[:2] != (v, S):
                hint = (
                    "; it looks like logical stage order [N, ...]: call pipe.place(params) "
                    "once, before the training loop"
                    if shape[:1] == (v * S,)
                    else ""
                )
                raise ValueError(
                    f"{_name(what, path)} has shape {shape}; the pipeline keeps stage "
                    f"parameters in its device layout, leaves [v, S, ...] = [{v}, {S}, ...]"
                    f"{hint}"
                )

    def _check_logical(self, params) -> None:
        N = self.num_logical_stages
        leaves = jax.tree_util.tree_leaves_with_path(params)
        if not leaves:
            raise ValueError("logical_params has no arrays")
        for path, leaf in leaves:
            shape = jnp.shape(leaf)
            if not shape or shape[0] != N:
                raise ValueError(
                    f"{_name('logical_params', path)} has shape {shape}; "
                    f"place() takes leaves with a leading stage axis of length "
                    f"S*v = {self.num_stages}*{self.stages_per_device} = {N} in logical "
                    "stage order"
                )


def _name(what: str, path) -> str:
    key = jax.tree_util.keystr(path)
    return f"{what} leaf {key}" if key else what


def _from_host(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def flat_specs(tree, specs) -> list:
    """One ``PartitionSpec`` (or None) per leaf of ``tree``, in leaf order."""
    treedef = jax.tree_util.tree_structure(tree)
    if specs is None or isinstance(specs, P):
        return [specs] * treedef.num_leaves
    try:
        return treedef.flatten_up_to(specs)
    except (ValueError, TypeError) as error:
        raise ValueError(
            "specs must be one PartitionSpec, or a pytree of PartitionSpecs (or None) with "
            f"the structure of the parameters; {error}"
        ) from None
