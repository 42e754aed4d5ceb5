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

Interleaved and V placements give leaves of the same shape ``[2, S, ...]`` in different
orders, so placed parameters carry their layout: `place` and `init` return a `Placed`, a
pytree node holding the ``[v, S, ...]`` tree and, as static data, the layout's `Order`
(which logical stage each chunk of each device holds) and the specs its leaves were placed
with (how their dimensions after ``[v, S]`` are split, e.g. over ``tensor`` or ``fsdp``).
Both survive ``jax.tree.map``, ``jax.jit``, ``jax.grad`` and ``optax`` (gradients and
optimizer moments of placed parameters are `Placed` in the same order, with the same
specs), so a pipeline compiles a step for the sharding of the parameters it is given, and
refuses a `Placed` of another order, before tracing.

Flax NNX modules keep values, not a `Placed`: `place` and `init` therefore also record the
layout in the metadata of every ``nnx.Variable`` they return (key ``"jaxpipe_layout"``: the
`Order` and the leaf's spec), ``nnx.update`` copies it into the module, and a pipeline reads
it from ``nnx.state(module, nnx.Param)`` as from a `Placed`: a module placed for another
layout is refused, and a `Placed` wrapped around its state by hand cannot claim another.
`block_mask` builds optax masks from each stage leaf's per-block shape.

Bare ``[v, S, ...]`` arrays (a hand reshape) say nothing about their order: they are taken
only where one order is possible, one stage per device in stage order (``1f1b``, ``gpipe``,
``zb_h1``, ...); elsewhere they are refused. Their specs are read from their shardings
where those show (`Layout.carried_specs`).
`place` also converts a tree holding `Placed` nodes or recording NNX variables of any order
(parameters, optimizer state) into its own layout, and `recut` regroups stacked blocks into
another number of stages.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.schedules import Schedule

tree_map = jax.tree_util.tree_map

__all__ = ["Layout", "Order", "Placed", "block_mask", "recut"]


@dataclasses.dataclass(frozen=True)
class Order:
    """The identity of a device layout: ``stage_at[c][d]`` is the logical stage at chunk ``c``
    of device ``d``. Static data of `Placed`; its text says how to convert."""

    stage_at: tuple[tuple[int, ...], ...]

    def __repr__(self) -> str:
        return (
            f"jaxpipe layout {self.stage_at} (logical stage at [chunk][device]; "
            "move a tree into a pipeline's layout with pipe.place(tree))"
        )

    @property
    def shape(self) -> tuple[int, int]:
        """``(v, S)``."""
        return len(self.stage_at), len(self.stage_at[0])


class Placed:
    """Stage parameters, their gradients or optimizer state in one device layout.

    A pytree node with one child, ``tree`` (leaves ``[v, S, ...]``), and as static data the
    layout's `Order` and ``specs``: per leaf of ``tree`` (in leaf order) the
    ``PartitionSpec`` of its dimensions after ``[v, S]`` that it was placed with, or None
    when no leaf is split beyond the pipe axis. ``jax.tree.map``, ``jit``, ``grad`` and
    ``optax`` keep both, and combining trees of two orders fails with both orders named.
    Reads pass through to ``tree``: ``placed["w"]``, ``placed.items()``.

    Args:
      tree: the ``[v, S, ...]`` leaves.
      order: the layout they are in.
      specs: one inner ``PartitionSpec`` (or None) per leaf of ``tree``, or None.
    """

    def __init__(self, tree, order: Order, specs: tuple | None = None):
        self.tree = tree
        self.order = order
        self.specs = specs

    def __getitem__(self, key):
        return self.tree[key]

    def __getattr__(self, name):
        if name.startswith("_") or name in ("tree", "order", "specs"):
            raise AttributeError(name)
        return getattr(self.tree, name)

    def __repr__(self) -> str:
        specs = "" if self.specs is None else f", specs={self.specs!r}"
        return f"Placed({self.tree!r}, {self.order!r}{specs})"


def _unflatten(static, children) -> Placed:
    placed = Placed(children[0], *static)
    _check_split(placed)
    return placed


def _check_split(placed: Placed) -> None:
    """Refuses concrete ``[v, S, ...]`` leaves that are not split over the ``S`` devices
    (each device would hold every stage's values): what ``jax.jit`` returns for values
    that read no parameter, such as ``jax.jit(optimizer.init)(params)``'s moments."""
    v, S = placed.order.shape
    if S == 1:
        return
    for path, leaf in jax.tree_util.tree_leaves_with_path(placed.tree):
        if isinstance(leaf, jax.core.Tracer) or not isinstance(leaf, jax.Array):
            continue
        if leaf.shape[:2] != (v, S) or leaf.sharding.shard_shape(leaf.shape)[1] == 1:
            continue
        raise ValueError(
            f"placed leaf {jax.tree_util.keystr(path) or '<root>'} of shape {leaf.shape} "
            f"has sharding {leaf.sharding}: its stage axis (of {S}) is not split over the "
            f"{S} pipe devices, so one device holds every stage's values. jax.jit returns "
            "this for values that read no parameter, such as jax.jit(optimizer.init)(params) "
            "(XLA puts them on one device, or under jax.set_mesh on every device). Create "
            "optimizer state outside jit, where it keeps each parameter's sharding: "
            "opt_state = optimizer.init(params), or pipe.init_optimizer(optimizer, params) "
            "for pipe.train"
        )


jax.tree_util.register_pytree_with_keys(
    Placed,
    lambda p: (((jax.tree_util.GetAttrKey("tree"), p.tree),), (p.order, p.specs)),
    _unflatten,
    lambda p: ((p.tree,), (p.order, p.specs)),
)


def is_placed(x) -> bool:
    """Whether ``x`` is a `Placed`: the ``is_leaf`` of tree functions that stop there.

    Args:
      x: anything.

    Returns:
      True for a `Placed`.
    """
    return isinstance(x, Placed)


NNX_METADATA = "jaxpipe_layout"
"""The ``nnx.Variable`` metadata key under which `place` and `init` record a leaf's layout:
the pair ``(Order, inner PartitionSpec or None)``."""


def _is_variable(x) -> bool:
    """Whether ``x`` is an ``nnx.Variable`` (none exists unless Flax NNX is loaded)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Variable)


def _recorded(x):
    """The ``(order, spec)`` an ``nnx.Variable`` records, or None."""
    return x.get_metadata().get(NNX_METADATA) if _is_variable(x) else None


def _is_recorded(x) -> bool:
    return _recorded(x) is not None


def _record(tree, order: Order | None, specs=None):
    """``tree`` with every ``nnx.Variable`` recording ``order`` and its leaf's spec (None:
    recording no layout, the key removed); ``specs`` has one entry per array leaf of
    ``tree``, or is None."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_variable)
    if not any(map(_is_variable, leaves)):
        return tree
    specs = iter(specs if specs is not None else [None] * treedef.num_leaves)
    out = []
    for leaf in leaves:
        leaf_specs = [next(specs, None) for _ in jax.tree_util.tree_leaves(leaf)]
        if _is_variable(leaf) and order is not None:
            spec = leaf_specs[0] if len(leaf_specs) == 1 else None
            leaf = leaf.replace(**{NNX_METADATA: (order, spec)})
        elif _is_variable(leaf) and NNX_METADATA in leaf.get_metadata():
            metadata = leaf.get_metadata()
            del metadata[NNX_METADATA]
            leaf = leaf.replace()
            leaf.set_metadata(metadata)
        out.append(leaf)
    return treedef.unflatten(out)


def nnx_layout(tree, what: str = "stage_params"):
    """The layout the NNX variables of ``tree`` record (`NNX_METADATA`).

    Args:
      tree: a pytree, possibly holding NNX variables.
      what: how error messages name ``tree``.

    Returns:
      None when no variable records a layout; else ``(order, specs)`` with one inner spec
      (or None) per array leaf of ``tree``.

    Raises:
      ValueError: variables that record two layouts, or some that record one and some none.
    """
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=_is_variable)
    orders, specs, without = {}, [], []
    for path, leaf in leaves:
        count = len(jax.tree_util.tree_leaves(leaf))
        recorded = _recorded(leaf)
        if recorded is None:
            specs += [None] * count
            if _is_variable(leaf):
                without.append(jax.tree_util.keystr(path) or "<root>")
            continue
        orders.setdefault(recorded[0], jax.tree_util.keystr(path) or "<root>")
        specs += [recorded[1]] * count
    if not orders:
        return None
    if len(orders) > 1:
        (a, at_a), (b, at_b) = list(orders.items())[:2]
        raise ValueError(
            f"{what} mixes NNX variables placed for two layouts: {at_a} holds logical stages "
            f"{_columns(a.stage_at)} and {at_b} {_columns(b.stage_at)} (device d: its "
            "stages). Move the whole tree into one pipeline's layout once, before the "
            f"training loop: {what} = pipe.place({what})"
        )
    if without:
        listed = ", ".join(without[:3]) + (", ..." if len(without) > 3 else "")
        raise ValueError(
            f"{what} holds NNX variables placed by a pipeline and variables that record no "
            f"layout ({listed}): the pipeline cannot tell in which order those hold their "
            "stages. Place all stage parameters together, from logical stage order: "
            "nnx.update(module, pipe.place(nnx.state(module, nnx.Param)))"
        )
    return next(iter(orders)), specs


def block_mask(predicate: Callable[[jax.ShapeDtypeStruct], bool], *, block_axes: int = 0):
    """An optax mask (weight decay, freezing) decided per leaf from the shape one block has.

    Stage leaves are stacked ``[v, S, ...]`` (and, for stages of several stacked blocks,
    ``[v, S, B, ...]``), so the usual ``x.ndim > 1`` would decay every stage leaf, norm
    scales and biases included. The mask built here gives ``predicate`` each stage leaf
    without its stacking axes: the leaves of a `Placed`, and the NNX variables that
    record a layout (`NNX_METADATA`), lose ``[v, S]`` and ``block_axes`` more leading axes;
    other leaves (an embedding, a head, a final norm) are given whole. Bare ``[v, S, ...]``
    arrays are not recognised as stage leaves: place them (`Layout.place`).

    Args:
      predicate: ``predicate(leaf) -> bool`` on a ``jax.ShapeDtypeStruct`` of one block's
        leaf, e.g. ``lambda x: x.ndim > 1`` (decay matrices, not biases nor norm scales).
      block_axes: how many axes after ``[v, S]`` stack blocks within a stage.

    Returns:
      ``mask(params)``: a pytree of bools of ``params``' structure (`Placed` nodes and
      NNX variables kept), as ``optax.adamw(..., mask=...)`` and ``optax.masked`` take it.
    """

    def decide(x, stacking: int):
        shape = jnp.shape(x)
        if len(shape) < stacking:
            raise ValueError(
                f"block_mask: a stage leaf of shape {shape} has fewer than the {stacking} "
                f"stacking axes [v, S] + block_axes={block_axes}"
            )
        return bool(predicate(jax.ShapeDtypeStruct(shape[stacking:], jnp.result_type(x))))

    def node(x):
        if is_placed(x) or _is_recorded(x):
            return tree_map(lambda leaf: decide(leaf, 2 + block_axes), x)
        return decide(x, 0)

    def mask(params):
        return tree_map(node, params, is_leaf=lambda x: is_placed(x) or _is_recorded(x))

    return mask


def recut(logical_params, num_stages: int):
    """Stacked blocks regrouped into ``num_stages`` stages, block order kept.

    For `Placed` trees, convert with ``pipe.logical`` first and `Pipeline.place` the
    result.

    Args:
      logical_params: leaves ``[N, B, ...]``: ``N`` stages in logical order, each a stack of
        ``B`` identical blocks along axis 1 (the same ``N`` and ``B`` for every leaf), so
        block ``i`` of the model is ``leaf[i // B, i % B]``.
      num_stages: the number of stages to regroup into.

    Returns:
      Leaves ``[num_stages, N * B // num_stages, ...]`` holding the same blocks in the same
      order (a reshape).

    Raises:
      ValueError: a leaf without a block axis, leaves that disagree on ``N`` or ``B``, or
        ``N * B`` not divisible by ``num_stages``.
    """
    leaves = jax.tree_util.tree_leaves_with_path(logical_params)
    if not leaves:
        raise ValueError("recut: logical_params has no arrays")
    if any(is_node(x) for x in jax.tree_util.tree_leaves(logical_params, is_leaf=is_node)):
        raise ValueError(
            "recut takes logical stage order [N, B, ...]; it was given placed parameters: "
            "recut(pipe.logical(params), num_stages), then new_pipe.place(...)"
        )
    shapes = [(jax.tree_util.keystr(path) or "<root>", jnp.shape(x)) for path, x in leaves]
    first_name, first = shapes[0]
    for name, shape in shapes:
        if len(shape) < 2 or shape[:2] != first[:2]:
            raise ValueError(
                f"recut: leaf {name} has shape {shape} where leaf {first_name} has {first}; "
                "recut needs every leaf [N, B, ...] with the same N stages and B blocks per "
                "stage (a stack of identical blocks along axis 1). Stack a stage's blocks "
                "on axis 1 (jax.vmap of the block's init, nnx.vmap), and keep per-stage "
                "values without a block axis (an optimizer's per-stage step count) out"
            )
    N, B = first[:2]
    blocks = N * B
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"recut: num_stages must be a positive int, got {num_stages!r}")
    if blocks % num_stages:
        raise ValueError(
            f"recut: {N} stages of {B} blocks = {blocks} blocks do not split into "
            f"{num_stages} stages of equal size; use a number of stages that divides {blocks}"
        )
    per_stage = blocks // num_stages
    return tree_map(lambda x: x.reshape(num_stages, per_stage, *x.shape[2:]), logical_params)


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
        """The layout of ``schedule``'s placement.

        Args:
          schedule: the schedule; chunk ``c`` of device ``d`` is the ``c``-th smallest
            logical stage that device holds.
          mesh: the mesh.
          axis: its pipe axis.

        Returns:
          The `Layout`.
        """
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
        """The ``PartitionSpec`` of a placed leaf.

        Args:
          inner: how its dimensions after ``[v, S]`` are split (default: not split).

        Returns:
          ``P(None, axis, *inner)``.
        """
        return P(None, self.axis, *(inner or ()))

    def sharding(self, inner: P | None = None) -> NamedSharding:
        """The ``NamedSharding`` of a placed leaf.

        Args:
          inner: as in `spec`.

        Returns:
          A ``NamedSharding`` on this layout's mesh.
        """
        return NamedSharding(self.mesh, self.spec(inner))

    def shardings(self, tree, specs=None):
        """Per leaf of ``tree`` its placed sharding.

        Args:
          tree: placed leaves (or their shapes), a bare tree or a `Placed`.
          specs: as in `place`; None: for a `Placed`, the specs it was placed with.

        Returns:
          A tree of ``NamedSharding`` of ``tree``'s structure (a `Placed` if it is one).
        """
        treedef = jax.tree_util.tree_structure(tree)
        return treedef.unflatten([self.sharding(s) for s in flat_specs(tree, specs)])

    @property
    def order(self) -> Order:
        """This layout's identity, as `Placed` carries it."""
        return Order(tuple(tuple(int(s) for s in row) for row in self.stage_at))

    @property
    def takes_bare(self) -> bool:
        """Whether bare ``[v, S, ...]`` arrays are read in this layout: only with one stage
        per device in stage order, the one layout of shape ``[1, S]`` built-in schedules
        make."""
        return self.stages_per_device == 1 and bool(
            np.array_equal(self.stage_at.reshape(-1), np.arange(self.num_logical_stages))
        )

    def place(self, logical_params, specs=None):
        """Logical stage order -> this device layout, sharded.

        NumPy leaves are sliced on the host, so each device receives only its own stages
        (in a multi-process run every process passes the same host values); JAX arrays are
        reordered by one jitted gather into the sharded layout. Arrays on another mesh
        (placed or logical) are first copied onto this layout's mesh, so a tree placed in
        this order elsewhere is moved here, not returned as it was.

        Args:
          logical_params: ``[N, ...]`` leaves in logical stage order; or a tree holding
            `Placed` nodes or NNX variables that record a layout (parameters or
            optimizer state of any layout), each of which is moved into this layout with
            the specs given for it, or else those it was placed with; other leaves kept.
          specs: optionally, per leaf (a pytree matching ``logical_params``, or one spec
            for all), a ``PartitionSpec`` of the dimensions after the stage axis, e.g.
            ``P("fsdp", "tensor")``; the placed leaf is sharded ``P(None, pipe, *spec)``.
            For a tree holding placed nodes: one spec for all their leaves, or a pytree of
            its structure up to the nodes, holding per node one spec, a pytree of them of
            the node's structure, or None (the specs it was placed with), and None for
            every leaf that is not placed.

        Returns:
          A `Placed` of ``[v, S, ...]`` leaves carrying ``specs``, its NNX variables
          recording this layout (or the tree with its placed nodes moved).

        Raises:
          ValueError: leaves without the leading ``[N]`` axis, ``specs`` this mesh cannot
            apply (see `check_specs`), or, for a tree holding placed nodes, specs of
            another structure or a spec for a leaf that is not placed.
        """
        logical_params = self._onto_mesh(logical_params)
        if any(map(_is_node, jax.tree_util.tree_leaves(logical_params, _is_node))):
            return self._replace(logical_params, specs)
        if not jax.tree_util.tree_leaves(logical_params) and logical_params is not None:
            return Placed(logical_params, self.order)  # an optimizer state of no arrays
        self._check_logical(logical_params)
        placed = self._place_leaves(logical_params, specs)
        placed_specs = recorded_specs(flat_specs(logical_params, specs))
        return Placed(_record(placed, self.order, placed_specs), self.order, placed_specs)

    def _onto_mesh(self, tree):
        """``tree`` with its arrays committed to other devices than the mesh's (placed by a
        pipeline on another mesh) copied onto the mesh: split over the axes the two meshes
        share (same name and size) as they were, replicated over the others."""
        devices = set(self.mesh.devices.flat)

        def move(x):
            if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
                return x
            if not x.committed or x.sharding.device_set == devices:
                return x
            theirs = getattr(x.sharding, "mesh", None)
            spec = []
            for entry in tuple(getattr(x.sharding, "spec", ())):
                names = entry if isinstance(entry, tuple) else (entry,)
                kept = tuple(
                    n for n in names if n is not None and self.mesh.shape.get(n) == theirs.shape[n]
                )
                spec.append(kept or None)
            return jax.device_put(x, NamedSharding(self.mesh, P(*spec)))

        return tree_map(move, tree)

    def _place_leaves(self, logical_params, specs):
        self.check_specs(logical_params, flat_specs(logical_params, specs), 1, "logical_params")
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

    def _replace(self, tree, specs):
        """Every `Placed` node and recording ``nnx.Variable`` of ``tree`` in this layout,
        with ``specs`` (as in `place`) or the specs it was placed with."""
        nodes, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_node)
        if specs is None or isinstance(specs, P):
            node_specs = [specs] * len(nodes)
        else:
            try:
                node_specs = treedef.flatten_up_to(specs)
            except (ValueError, TypeError) as error:
                raise ValueError(
                    "specs for a tree holding placed nodes must be one PartitionSpec, or a "
                    "pytree of the tree's structure up to its placed nodes, each holding one "
                    "PartitionSpec or a pytree of them of its own structure (None: the specs "
                    f"it was placed with); {error}"
                ) from None
        out = []
        for path, node, spec in zip(_node_paths(tree), nodes, node_specs, strict=True):
            if not _is_node(node):
                if spec is not None and not isinstance(specs, P):
                    raise ValueError(
                        f"specs give leaf {jax.tree_util.keystr(path)} spec {spec}, but it "
                        "is not placed (neither in a jaxpipe.Placed nor an NNX variable that "
                        "records a layout), and place keeps such leaves as they are: give it "
                        "None, and place it by itself if it is a stage leaf"
                    )
                out.append(node)
                continue
            variable = not is_placed(node)
            placed = as_placed(node)  # on this mesh: `place` moved it
            if placed.order == self.order and spec is None:
                out.append(placed.tree if variable else placed)
                continue
            flat = flat_specs(placed, spec)  # spec None: the specs it was placed with
            logical = self.like(placed.order).logical(placed)
            moved = self.place(logical, jax.tree_util.tree_structure(logical).unflatten(flat))
            out.append(moved.tree if variable else moved)
        return treedef.unflatten(out)

    def like(self, order: Order) -> Layout:
        """The layout of ``order`` on this layout's mesh and axis.

        Args:
          order: a layout's identity, as a `Placed` carries it.

        Returns:
          The `Layout`.
        """
        return Layout(stage_at=np.array(order.stage_at, np.int32), mesh=self.mesh, axis=self.axis)

    def logical(self, params):
        """The device layout -> logical stage order, for export, checkpoints and
        inspection (one jitted gather; not for use inside a training step).

        Args:
          params: a `Placed`, read in its own order (or bare ``[v, S, ...]`` leaves where
            `takes_bare`); or a tree holding `Placed` nodes or NNX variables that
            record a layout (optimizer state, an NNX module's state), each of which is
            converted, other leaves kept.

        Returns:
          ``[N, ...]`` leaves in logical stage order, sharded over the pipe axis along the
          stage axis; NNX variables among them record no layout.
        """
        params = self._onto_mesh(params)
        if is_placed(params) and params.order != self.order:
            return self.like(params.order).logical(params)
        if not is_placed(params) and any(
            map(_is_node, jax.tree_util.tree_leaves(params, _is_node))
        ):
            return tree_map(
                lambda x: self.logical(as_placed(x)) if _is_node(x) else x,
                params,
                is_leaf=_is_node,
            )
        params = self.check_placed(params, "params", allow_empty=True)
        inverse = np.argsort(self.stage_at.reshape(-1))

        def unplace(x):
            return x.reshape(self.num_logical_stages, *x.shape[2:])[inverse]

        shardings = tree_map(self.logical_sharding, params)
        return _record(self._jit(lambda p: tree_map(unplace, p), shardings)(params), None)

    def logical_sharding(self, placed) -> NamedSharding:
        """The sharding of a placed leaf's logical form.

        Args:
          placed: a placed leaf (or its shape with a sharding).

        Returns:
          The stage axis over the pipe axis (each device holds ``v`` consecutive logical
          stages), other axes as placed.
        """
        inner = inner_spec(getattr(placed, "sharding", None)) or ()
        return NamedSharding(self.mesh, P(self.axis, *inner))

    def init(self, init_stage: Callable[[jax.Array], Any], key, specs=None):
        """Parameters of every stage created directly in the device layout; each device
        computes only its own stages.

        Args:
          init_stage: ``init_stage(key) -> one stage's parameters``. Logical stage ``s`` is
            initialised with ``jax.random.split(key, N)[s]``, so ``logical(init(f, key))``
            equals ``jax.vmap(f)(jax.random.split(key, N))`` for threefry keys (not for
            ``rbg`` keys, whose bits under ``vmap`` depend on the batch).
          key: a PRNG key.
          specs: as in `place`.

        Returns:
          A `Placed` carrying ``specs``.

        Raises:
          ValueError: ``specs`` this mesh cannot apply (see `check_specs`).
        """
        keys = jax.random.split(key, self.num_logical_stages)[self.stage_at.reshape(-1)]
        keys = keys.reshape(*self.stage_at.shape, *keys.shape[1:])
        v, S = self.stage_at.shape
        abstract = jax.eval_shape(init_stage, keys[0, 0])
        placed = tree_map(lambda a: jax.ShapeDtypeStruct((v, S, *a.shape), a.dtype), abstract)
        self.check_specs(placed, flat_specs(placed, specs), 2, "init_stage's parameters")
        shardings = self.shardings(placed, specs)
        key_sharding = NamedSharding(self.mesh, P(None, self.axis))
        keys = jax.device_put(keys, key_sharding)
        tree = self._jit(jax.vmap(jax.vmap(init_stage)), shardings)(keys)
        placed_specs = recorded_specs(flat_specs(placed, specs))
        return Placed(_record(tree, self.order, placed_specs), self.order, placed_specs)

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
    def check_specs(self, tree, specs, leading: int, what: str) -> None:
        """Refuses placement specs this mesh cannot apply to the leaves of ``tree``.

        Args:
          tree: the leaves (or their shapes) the specs are for.
          specs: one inner ``PartitionSpec`` (or None) per leaf, in leaf order.
          leading: the stage axes before the dimensions the specs describe (1 for logical
            ``[N, ...]`` leaves, 2 for placed ``[v, S, ...]`` ones).
          what: how error messages name ``tree``.

        Raises:
          ValueError: a spec that names an axis the mesh does not have (or the pipe axis),
            more dimensions than the leaf has after its stage axes, or a dimension whose
            size the devices of the axes splitting it do not divide; the message names the
            leaf, the spec, the leaf's shape and the mesh's axes.
        """
        sizes = dict(self.mesh.shape)
        leaves = jax.tree_util.tree_leaves_with_path(tree)
        for (path, leaf), spec in zip(leaves, specs, strict=True):
            shape = tuple(jnp.shape(leaf))
            problem = _spec_problem(tuple(spec or ()), shape[leading:], sizes, self.axis)
            if problem is not None:
                axes = ", ".join(f"{n!r}: {size}" for n, size in sizes.items())
                raise ValueError(
                    f"{_name(what, path)} of shape {shape} is given placement spec {spec}, "
                    f"for its dimensions after the stage axis {shape[leading:]}, on a mesh "
                    f"of axes {{{axes}}} (pipe axis {self.axis!r}): {problem}"
                )

    def carried_specs(self, tree, what: str = "stage_params") -> list | None:
        """Per leaf of bare ``[v, S, ...]`` leaves, the split of its dimensions after
        ``[v, S]`` that its own sharding shows, so that hand-placed leaves run as placed.

        A leaf shows its sharding when it is a concrete array or a ``jax.ShapeDtypeStruct``
        with a ``NamedSharding``, or a traced array on a mesh of explicit axes (its type
        names them). A traced array on a mesh of automatic axes (inside ``jax.jit``) shows
        none.

        Args:
          tree: the bare leaves.
          what: how error messages name ``tree``.

        Returns:
          One inner ``PartitionSpec`` (or None) per leaf, in leaf order; None where a leaf
          is traced on a mesh with automatic axes besides the pipe axis.

        Raises:
          ValueError: a leaf whose sharding is not ``P(None, pipe, *inner)`` (or ``[v, S]``
            whole) with ``inner`` as `check_specs` takes it, or that names an axis of
            another size than this mesh's; the message names the leaf, its sharding and
            the fix, ``pipe.place``.
        """
        automatic = any(
            t != jax.sharding.AxisType.Explicit and name != self.axis and size > 1
            for (name, size), t in zip(self.mesh.shape.items(), self.mesh.axis_types, strict=True)
        )
        sizes = dict(self.mesh.shape)
        specs = []
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            if isinstance(leaf, jax.core.Tracer):
                if automatic:
                    return None
                sharding = getattr(jax.typeof(leaf), "sharding", None)
            else:
                sharding = getattr(leaf, "sharding", None)
            if not isinstance(sharding, NamedSharding):
                specs.append(None)
                continue
            shape = tuple(jnp.shape(leaf))
            spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
            stage = [_axis_names(entry) for entry in spec[:2]]
            theirs = dict(sharding.mesh.shape)
            if stage[0] or stage[1] not in ((), (self.axis,)):
                problem = (
                    f"its stage axes [v, S] are split {P(*spec[:2])}, where the pipeline "
                    f"keeps them P(None, {self.axis!r})"
                )
            else:
                problem = _spec_problem(spec[2:], shape[2:], sizes, self.axis)
            if problem is None and any(theirs[n] != sizes[n] for e in spec for n in _axis_names(e)):
                problem = (
                    f"its mesh {theirs} splits it over axes of other sizes than the "
                    f"pipeline's mesh {sizes}"
                )
            if problem is not None:
                raise ValueError(
                    f"{_name(what, path)} of shape {shape} is a bare array sharded "
                    f"{P(*spec)}, which the pipeline cannot run as it is: {problem}. Place "
                    "stage parameters with the pipeline, naming how the dimensions after the "
                    f"stage axis are split: {what} = pipe.place(logical_params, specs), "
                    "specs e.g. P(None, 'tensor') (logical_params: leaves [S*v, ...] in "
                    "logical stage order)"
                )
            specs.append(P(*spec[2:]))
        return list(recorded_specs(specs) or [None] * len(specs))

    def check_placed(self, params, what: str = "stage_params", allow_empty=False):
        """The ``[v, S, ...]`` tree of ``params``, checked.

        Args:
          params: a `Placed` of this layout's order, a tree whose NNX variables
            record this layout (`NNX_METADATA`), or bare arrays where `takes_bare`.
          what: how error messages name ``params``.
          allow_empty: accept a tree without arrays (an optimizer state).

        Returns:
          The tree of ``[v, S, ...]`` leaves.

        Raises:
          ValueError: ``params`` are of another layout, bare where the layout is not
            `takes_bare`, or not ``[v, S, ...]``; NNX variables that record another layout
            than the `Placed` around them, or none inside a hand-made `Placed` where the
            layout is not `takes_bare`. The message says how to convert.
        """
        params = self._read_nnx_layout(params, what)
        if is_placed(params):
            if params.order != self.order:
                same = " of the same shapes" if params.order.shape == self.order.shape else ""
                fix = f"{what} = pipe.place({what})"
                if what != "opt_state":
                    fix += " (and the same for optimizer state: opt_state = pipe.place(opt_state))"
                if _holds_variables(params.tree):
                    fix = (
                        "nnx.update(module, pipe.place(nnx.state(module, nnx.Param))) for the "
                        "module holding them (and the same for its optimizer state)"
                    )
                raise ValueError(
                    f"{what} were placed for another layout{same}: device d "
                    f"holds logical stages {_columns(params.order.stage_at)} there, but "
                    f"{_columns(self.order.stage_at)} in this pipeline's, so every stage "
                    "would run with another stage's weights. Convert once, before the "
                    f"training loop: {fix}"
                )
            tree = params.tree
        else:
            tree = params
        self._check_shapes(tree, what, allow_empty)
        if not is_placed(params) and not self.takes_bare and jax.tree_util.tree_leaves(tree):
            raise ValueError(
                f"{what} are bare arrays [v, S, ...] = [{self.stages_per_device}, "
                f"{self.num_stages}, ...]: they do not say which layout they are in (interleaved "
                "and V placements keep the same shapes in different orders), and only one "
                "stage per device in stage order is read from bare arrays; this pipeline's "
                f"layout has device d hold logical stages {_columns(self.order.stage_at)}. "
                "Make them with pipe.init, or "
                "pipe.place(logical_params) from logical stage order [S*v, ...] (not a "
                "reshape); a tree placed by another pipeline converts with pipe.place(tree)"
            )
        return tree

    def _read_nnx_layout(self, params, what):
        """``params`` as a `Placed` of the layout its NNX variables record, if they
        record one (a `Placed` around them must name the same); else ``params``."""
        tree = params.tree if is_placed(params) else params
        recorded = nnx_layout(tree, what)
        if recorded is None:
            if is_placed(params) and not self.takes_bare and _holds_variables(tree):
                raise ValueError(
                    f"{what} is a jaxpipe.Placed around NNX variables that record no layout: "
                    "a Placed made by hand cannot tell where the values were placed, and "
                    "interleaved and V layouts keep the same shapes in different orders. "
                    "pipe.place and pipe.init record the layout in each variable, and "
                    "nnx.update keeps it: place the module once, from logical stage order, "
                    "with nnx.update(module, pipe.place(nnx.state(module, nnx.Param))), and "
                    "pass nnx.state(module, nnx.Param) as it is"
                )
            return params
        order, specs = recorded
        if is_placed(params) and params.order != order:
            raise ValueError(
                f"{what} is a jaxpipe.Placed that names the layout with device d holding "
                f"logical stages {_columns(params.order.stage_at)}, around NNX variables "
                f"that pipe.place put in another: {_columns(order.stage_at)}. Running them "
                "as the Placed says would give every stage another stage's weights. The "
                "variables carry their layout: pass nnx.state(module, nnx.Param) without "
                "jaxpipe.Placed, and convert a module placed by another pipeline once, "
                "before the training loop: nnx.update(module, pipe.place(nnx.state(module, "
                "nnx.Param)))"
            )
        return params if is_placed(params) else Placed(params, order, recorded_specs(specs))

    def _check_shapes(self, tree, what, allow_empty) -> None:
        """Raises ``ValueError`` unless every leaf has the leading axes ``(v, S)``."""
        v, S = self.stage_at.shape
        leaves = jax.tree_util.tree_leaves_with_path(tree)
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


def is_node(x) -> bool:
    """Whether ``x`` is a placed node: a `Placed`, or an ``nnx.Variable`` that records a
    layout (`NNX_METADATA`); the ``is_leaf`` of tree functions that stop at either.

    Args:
      x: anything.

    Returns:
      True for a placed node.
    """
    return is_placed(x) or _is_recorded(x)


_is_node = is_node


def as_placed(node) -> Placed:
    """A placed node as a `Placed`: an ``nnx.Variable`` that records a layout becomes a
    `Placed` of that layout around it; a `Placed` is returned as it is.

    Args:
      node: a `Placed` or a recording ``nnx.Variable``.

    Returns:
      A `Placed`.
    """
    if is_placed(node):
        return node
    order, spec = _recorded(node)
    return Placed(node, order, recorded_specs([spec]))


def without_record(tree):
    """``tree`` with no ``nnx.Variable`` recording a layout (a logical form of it).

    Args:
      tree: a pytree.

    Returns:
      ``tree``, its NNX variables without the `NNX_METADATA` key.
    """
    return _record(tree, None)


def _node_paths(tree) -> list:
    """The paths of ``tree``'s leaves up to placed nodes, in leaf order."""
    return [path for path, _ in jax.tree_util.tree_leaves_with_path(tree, is_leaf=_is_node)]


def _holds_variables(tree) -> bool:
    return any(map(_is_variable, jax.tree_util.tree_leaves(tree, is_leaf=_is_variable)))


def _name(what: str, path) -> str:
    key = jax.tree_util.keystr(path)
    return f"{what} leaf {key}" if key else what


def _spec_problem(entries: tuple, inner: tuple, sizes: dict, pipe: str) -> str | None:
    """What is wrong with a spec's ``entries`` for dimensions ``inner`` on a mesh of axis
    ``sizes`` with pipe axis ``pipe``, said with the fix; None if nothing."""
    if len(entries) > len(inner):
        return (
            f"it has {len(entries)} entries for {len(inner)} dimensions; give one entry (or "
            "None) per dimension after the stage axis"
        )
    used = set()
    for dim, entry in enumerate(entries):
        names = [n for n in (entry if isinstance(entry, tuple) else (entry,)) if isinstance(n, str)]
        for name in names:
            if name == pipe:
                return (
                    f"it names the pipe axis {pipe!r}, which splits the stage axis already; "
                    "name only the mesh's other axes"
                )
            if name not in sizes:
                return (
                    f"it names axis {name!r}, which the mesh does not have; name only the "
                    "mesh's axes, or build the mesh with that axis"
                )
            if name in used:
                return f"it names axis {name!r} twice; an axis can split one dimension only"
            used.add(name)
        devices = int(np.prod([sizes[n] for n in names]))
        if inner[dim] % devices:
            return (
                f"dimension {dim} (of size {inner[dim]}) does not split over {devices} devices "
                f"({' x '.join(map(repr, names))}); split a dimension their number divides, "
                "or leave this one whole (None)"
            )
    return None


def _axis_names(entry) -> tuple:
    """The mesh axes one entry of a ``PartitionSpec`` names."""
    names = entry if isinstance(entry, tuple) else (entry,)
    return tuple(n for n in names if isinstance(n, str))


def is_bare(tree) -> bool:
    """Whether ``tree`` says nothing of its layout: not a `Placed`, and no NNX variable in
    it records one.

    Args:
      tree: stage parameters.

    Returns:
      True for bare arrays.
    """
    return not is_placed(tree) and nnx_layout(tree) is None


def _columns(stage_at) -> str:
    """``stage_at`` read per device: ``d0: 0, 7; d1: 1, 6; ...``."""
    return "; ".join(
        f"d{d}: " + ", ".join(str(row[d]) for row in stage_at) for d in range(len(stage_at[0]))
    )


def inner_spec(sharding) -> P | None:
    """The spec of a placed leaf's dimensions after ``[v, S]``, read from its sharding.

    Args:
      sharding: the leaf's sharding, or None.

    Returns:
      A ``PartitionSpec``, or None where the sharding names no such dimension.
    """
    spec = getattr(sharding, "spec", None)
    return P(*spec[2:]) if spec is not None and len(spec) > 2 else None


def _from_host(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def flat_specs(tree, specs) -> list:
    """One ``PartitionSpec`` (or None) per leaf of ``tree``, in leaf order.

    Args:
      tree: a pytree of arrays, or a `Placed` (whose specs have the structure of its
        ``tree``).
      specs: one ``PartitionSpec`` for all leaves, a pytree of them (or None) with the
        structure of ``tree``, or None: no split for a bare tree, and for a `Placed` the
        specs it was placed with.

    Raises:
      ValueError: ``specs`` has another structure than ``tree``.
    """
    if isinstance(tree, Placed) and not isinstance(specs, Placed):
        if specs is None:
            return specs_of(tree)
        tree = tree.tree
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


def recorded_specs(specs) -> tuple | None:
    """The static form of per-leaf inner specs that `Placed` carries, so that equal
    placements compare equal however their specs were spelled.

    Args:
      specs: one ``PartitionSpec`` (or None) per leaf.

    Returns:
      A tuple, each spec without trailing unsplit dimensions (None where nothing is
      split); or None when no leaf is split.
    """

    def canonical(spec):
        entries = list(spec or ())
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries) if entries else None

    specs = tuple(canonical(s) for s in specs)
    return specs if any(s is not None for s in specs) else None


def specs_of(tree) -> list:
    """Per leaf of ``tree`` (in leaf order) the inner spec it was placed with.

    Args:
      tree: a `Placed`, or a bare tree of ``[v, S, ...]`` leaves (which records no specs
        unless its NNX variables record a layout).

    Returns:
      A list with one ``PartitionSpec`` or None per leaf. For a `Placed` whose leaves no
      longer match its specs one to one (a tree function that dropped leaves, such as a
      masked optimizer's state), the specs are read from the leaves' shardings.
    """
    if not is_placed(tree):
        recorded = nnx_layout(tree)
        return recorded[1] if recorded else [None] * len(jax.tree_util.tree_leaves(tree))
    leaves = jax.tree_util.tree_leaves(tree.tree)
    if tree.specs is None:
        return [None] * len(leaves)
    if len(tree.specs) == len(leaves):
        return list(tree.specs)
    return [inner_spec(getattr(x, "sharding", None)) for x in leaves]


def placed_like(tree, given):
    """``tree`` placed as ``given`` is.

    Args:
      tree: ``[v, S, ...]`` leaves of the structure of ``given``'s tree.
      given: a `Placed`, or a bare tree.

    Returns:
      A `Placed` of ``given``'s order and specs if ``given`` is one, else ``tree``.
    """
    return Placed(tree, given.order, given.specs) if is_placed(given) else tree
