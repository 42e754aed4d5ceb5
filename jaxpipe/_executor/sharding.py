"""Stage weights split over the batch axes (FSDP, ZeRO-3): which dimensions, and the
gathers and reduce-scatters that bring them together for a stage and split their gradients.

Inside the pipeline the batch axes (``data``, ``fsdp``) are manual, like the pipe axis: each
replica runs the schedule on its own rows. A stage weight whose placement spec names a batch
axis on some dimension (`Pipeline.place`'s ``specs``, e.g. ``P("fsdp", "tensor")``) arrives
as this device's shard of that dimension and is all-gathered over those axes, tiled, when a
stage needs it: once per step for all of the device's chunks (``gather="once"``: fewest
collectives, the full chunks live for the step) or inside every action, for the one chunk
it uses (``gather="per_use"``: least memory), or by the tick, one tick before the action
that uses it, outside the actions' switch, so that the gather runs while the previous
action computes (``gather="ahead"``). Weight gradients are reduce-scattered back over the
same axes (once after the schedule, inside every backward, or with ``"ahead"`` by the tick
during the next tick's forward), so parameters,
gradients and optimizer state stay split ``S * F`` ways. Axes a spec names that are not
batch axes (``tensor``) stay with XLA's automatic sharding inside the stage; around the
gathers and reduce-scatters they are made manual too (a ``shard_map`` over them), so each
device gathers and scatters its own ``tensor`` share, and the largest weight it holds is one
chunk's share. (Left automatic there, XLA would gather the operand over ``tensor`` first.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

tree_map = jax.tree_util.tree_map
GATHER_MODES = ("per_use", "once", "ahead", "per_block")


@dataclasses.dataclass(frozen=True)
class WeightSharding:
    """Per parameter leaf (flat, in leaf order), the batch axes each inner dimension is
    split over; ``gather`` is one of `GATHER_MODES`. ``seen``: the specs are the
    parameters' own (False for bare arrays traced on a mesh of automatic axes, whose
    split over those axes the trace does not show)."""

    treedef: Any = None
    split: tuple[tuple[tuple[str, ...], ...], ...] = ()  # leaf -> dim -> batch axes
    gather: str = "per_use"
    inner: tuple = ()  # leaf -> its placement spec (or None), every axis it names
    kept: tuple[tuple[tuple[str, ...], ...], ...] = ()  # leaf -> dim -> expert axes
    seen: bool = True

    @classmethod
    def of(
        cls, treedef, specs, batch_axes: tuple[str, ...], gather: str, expert_axes=(), seen=True
    ) -> WeightSharding:
        """From the placement ``specs`` (one inner ``PartitionSpec`` or None per leaf).

        ``expert_axes``: batch axes over which a weight dimension stays split inside the
        stage (a device holds its own experts): never gathered; the stage exchanges
        tokens over them instead."""
        if gather not in GATHER_MODES:
            raise ValueError(f"fsdp_gather must be one of {GATHER_MODES}, got {gather!r}")
        split, kept = [], []
        for spec in specs:
            dims, own = [], []
            for entry in tuple(spec or ()):
                names = entry if isinstance(entry, tuple) else (entry,)
                dims.append(tuple(n for n in names if n in batch_axes and n not in expert_axes))
                own.append(tuple(n for n in names if n in expert_axes))
            split.append(tuple(dims))
            kept.append(tuple(own))
        kept = tuple(kept) if any(a for dims in kept for a in dims) else ()
        return cls(
            treedef=treedef,
            split=tuple(split),
            gather=gather,
            inner=tuple(specs),
            kept=kept,
            seen=seen,
        )

    @property
    def per_action(self) -> bool:
        """True if each action's chunk is gathered whole for it (``"per_use"`` or
        ``"ahead"``), not every chunk once for the step nor each block inside the stage."""
        return self.gather in ("per_use", "ahead")

    @property
    def per_block(self) -> bool:
        """True if the stage gathers each block's weights where it runs
        (``"per_block"``, `jaxpipe._jaxpr.blockwise`): the stage takes the shards."""
        return self.active and self.gather == "per_block"

    @property
    def active(self) -> bool:
        """True if some weight is split over a batch axis."""
        return any(axes for dims in self.split for axes in dims)

    def axes(self) -> set[str]:
        return {a for dims in self.split for axes in dims for a in axes}

    def spec(self, leaf_index: int, pipe_axis: str) -> P:
        """The ``shard_map`` spec of placed leaf ``leaf_index`` (``[v, S, ...]``): the pipe
        axis, the batch axes and the expert axes; the rest is automatic."""
        dims = self.split[leaf_index] if self.split else ()
        if self.kept:
            dims = [
                tuple(n for n in _names(entry) if n in axes + own)
                for entry, axes, own in zip(
                    tuple(self.inner[leaf_index] or ()), dims, self.kept[leaf_index], strict=True
                )
            ]
        return P(None, pipe_axis, *[axes or None for axes in dims])

    def kept_axes(self, leaf_index: int) -> tuple[str, ...]:
        """The expert axes leaf ``leaf_index`` stays split over inside the stage."""
        if not self.kept:
            return ()
        return tuple(a for axes in self.kept[leaf_index] for a in axes)

    def specs(self, params, pipe_axis: str):
        """Per leaf of ``params`` its ``shard_map`` spec (see `spec`)."""
        leaves, treedef = jax.tree_util.tree_flatten(params)
        if not self.split:
            return treedef.unflatten([P(None, pipe_axis)] * len(leaves))
        return treedef.unflatten([self.spec(i, pipe_axis) for i in range(len(leaves))])

    def placed_specs(self, params, pipe_axis: str):
        """Per leaf of ``params`` the spec it was placed with, ``P(None, pipe, *inner)``:
        what its gradient is constrained to, so gradients keep the parameters' sharding.
        Unless `seen`: ``P(None, pipe)`` and the other dimensions unconstrained, so that the
        compiler keeps them split as the parameters it propagates from."""
        leaves, treedef = jax.tree_util.tree_flatten(params)
        if not self.seen:
            free = [P(None, pipe_axis, *[P.UNCONSTRAINED] * (jnp.ndim(x) - 2)) for x in leaves]
            return treedef.unflatten(free)
        inner = self.inner or (None,) * len(leaves)
        return treedef.unflatten([P(None, pipe_axis, *(spec or ())) for spec in inner])

    def gather_tree(self, tree, offset: int):
        """All-gather every split dimension of ``tree``'s leaves (tiled); ``offset`` is how
        many leading axes the leaves have before the inner dimensions (1 for ``[v, ...]``,
        0 for one chunk)."""
        return self._map(tree, offset, _gather)

    def scatter_tree(self, tree, offset: int, one_by_one: bool = True):
        """Sum every split dimension of gradient leaves over its axes and keep this
        device's shard (a tiled reduce-scatter). ``one_by_one``: leaf by leaf, each after
        the one before (an optimization barrier orders them): no compiler combines them
        into one collective over the whole gradient (the TPU compiler turns such a
        combination into an all-reduce of the full-size gradients and holds more). Last
        leaf first: the order in which the TPU compiler holds least
        (tests/test_fsdp_tensor.py). Otherwise unordered, so that all of them can run
        at once behind a computation."""
        return self._map(tree, offset, _scatter, chained=one_by_one)

    def _map(self, tree, offset, fn, chained=False):
        """``fn`` on every split leaf of ``tree``; ``chained``: last leaf first, each
        ordered after the previous one."""
        if not self.active:
            return tree
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        inner = self.inner or (None,) * len(leaves)
        out, previous = list(leaves), None
        order = reversed(range(len(leaves))) if chained else range(len(leaves))
        for i in order:
            if not any(self.split[i]):
                continue
            leaf = leaves[i]
            if chained and previous is not None:
                leaf, out[previous] = lax.optimization_barrier((leaf, out[previous]))
            out[i] = _on_local_shards(
                leaf, self.split[i], inner[i], offset, fn, set(self.kept_axes(i))
            )
            previous = i
        return treedef.unflatten(out)

    def scattered_axes(self, leaf_index: int) -> tuple[str, ...]:
        """The batch axes leaf ``leaf_index``'s gradient was reduce-scattered over."""
        if not self.split:
            return ()
        return tuple(a for axes in self.split[leaf_index] for a in axes)


@dataclasses.dataclass(frozen=True)
class LossGradSplit:
    """How the loss parameters' gradient is kept inside the step with
    ``Pipeline(split_loss_grads=True)``: split over the batch axes.

    Each replica (device of the batch axes) computes its own rows' share of a micro-batch's
    loss-parameter gradient, whole; summed over the replicas only after the schedule (the
    default, where a step's program holds no `LossGradSplit`), every device holds a whole
    float32 accumulator (for a language model's head, vocabulary x width) for the step.
    Split, each micro-batch's gradient is reduce-scattered over the batch axes along one
    dimension of its leaf as soon as the loss computes it, and only this device's share is
    accumulated: ``1 / replicas`` of the whole, for a reduce-scatter per micro-batch in
    place of one all-reduce per step. The step's gradient leaves the ``shard_map`` split
    that way (`specs`) and is laid out as the caller's parameters are by the compiler
    outside.

    ``dims``: per leaf of the loss parameters (flat, in leaf order), the dimension its
    gradient is split along, or None where it stays whole (summed over the replicas after
    the schedule): a leaf that is not float, or that no dimension of divides into
    ``replicas`` equal shares. The dimension is the leaf's largest such one (the first of
    equals): a language model's head and embedding are split by vocabulary, as FSDP
    splits them outside."""

    axes: tuple[str, ...] = ()
    dims: tuple = ()
    replicas: int = 1

    @classmethod
    def of(cls, loss_params, mesh, batch_axes: tuple[str, ...]) -> LossGradSplit:
        """The split of ``loss_params``' gradient over ``batch_axes`` of ``mesh``."""
        replicas = int(np.prod([mesh.shape[a] for a in batch_axes]))
        dims = []
        for leaf in jax.tree_util.tree_leaves(loss_params):
            shape, dtype = jnp.shape(leaf), jnp.result_type(leaf)
            fits = [d for d, n in enumerate(shape) if n % replicas == 0]
            if replicas == 1 or not jnp.issubdtype(dtype, jnp.inexact) or not fits:
                dims.append(None)
            else:
                dims.append(max(fits, key=lambda d: (shape[d], -d)))
        return cls(axes=tuple(batch_axes), dims=tuple(dims), replicas=replicas)

    def _map(self, fn, tree):
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        return treedef.unflatten([fn(x, d) for x, d in zip(leaves, self.dims, strict=True)])

    def scatter(self, grads):
        """One micro-batch's gradient (whole, this replica's rows' share) summed over the
        replicas, this device's share of each split leaf kept (a tiled reduce-scatter)."""
        return self._map(lambda g, d: g if d is None else _scatter(g, self.axes, d), grads)

    def zeros(self, loss_params, dtype=None):
        """Zeros of the shape of this device's share of each leaf's gradient (``dtype``, or
        the leaf's own)."""

        def zeros(p, d):
            shape = list(jnp.shape(p))
            if d is not None:
                shape[d] //= self.replicas
            return jnp.zeros(shape, dtype or jnp.result_type(p))

        return self._map(zeros, loss_params)

    def mean(self, grads):
        """The accumulated gradient averaged over the replicas: split leaves hold the sum
        over them already; the others are averaged here (an all-reduce)."""

        def mean(g, d):
            if d is not None:
                return g / self.replicas
            return lax.pmean(g, self.axes) if self.axes else g

        return self._map(mean, grads)

    def specs(self, loss_params):
        """The ``shard_map`` out-spec of each leaf's gradient: split over the batch axes
        along its dimension, or whole."""
        return self._map(lambda p, d: P() if d is None else P(*[None] * d, self.axes), loss_params)


def _names(entry) -> tuple:
    """The axis names of one entry of a ``PartitionSpec``."""
    return tuple(n for n in (entry if isinstance(entry, tuple) else (entry,)) if n is not None)


def _on_local_shards(leaf, dims, spec, offset, fn, manual_already=frozenset()):
    """``fn(x, axes, dim)`` for every split dimension of ``leaf``, applied to this device's
    shard of the axes the placement spec names besides the batch axes (``tensor``): a
    ``shard_map`` over those axes around the collectives, so that they move only the
    device's own share and XLA never gathers the operand over ``tensor`` around them.
    ``manual_already``: axes the spec names that are manual here already (expert axes)."""

    def local(x):
        for dim, axes in enumerate(dims):
            if axes:
                x = fn(x, axes, dim + offset)
        return x

    batch = {a for axes in dims for a in axes} | set(manual_already)
    other = []
    for entry in tuple(spec or ()):
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(n for n in names if n is not None and n not in batch)
        other.append(kept[0] if len(kept) == 1 else (kept or None))
    manual = {a for e in other if e for a in (e if isinstance(e, tuple) else (e,))}
    mixed = any(axes and kept for axes, kept in zip(dims, other, strict=False))
    if not manual or mixed:
        return local(leaf)
    inner = P(*([None] * offset), *other)
    return jax.shard_map(
        local,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=inner,
        out_specs=inner,
        axis_names=manual,
        check_vma=False,
    )(leaf)


def _gather(x, axes, dim):
    """The tiled all-gather of ``x`` over ``axes`` along ``dim``, gathered as a new leading
    axis and moved into place: the collective's operand keeps its layout, so compilers that
    gather only along the major dimension (the GPU and TPU compilers) need no relaid-out copy
    of the stored shards, which they would hoist out of the tick loop and hold for the step.
    Where ``dim`` is not the leaf's first dimension the move is a transposed copy of the
    gathered leaf, made per use and freed with it."""
    gathered = lax.all_gather(x, axes, axis=0, tiled=False)  # [size, *x.shape]
    shape = list(x.shape)
    shape[dim] *= gathered.shape[0]
    return jnp.moveaxis(gathered, 0, dim).reshape(shape)


def _scatter(x, axes, dim):
    return lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True)


def constrain(tree, mesh, spec):
    """``tree`` constrained to ``spec`` (one spec for all leaves, or a tree of them) on its
    leading dimensions, the others unsharded: ``jax.reshard`` on a mesh with explicit axes,
    a sharding constraint otherwise."""
    explicit = any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)

    def one(x, spec):
        full = P(*spec, *([None] * (x.ndim - len(spec))))
        sharding = jax.sharding.NamedSharding(mesh, full)
        if explicit:  # jax.reshard takes no unconstrained dimension: whole there
            free = [None if e is P.UNCONSTRAINED else e for e in full]
            return jax.reshard(x, jax.sharding.NamedSharding(mesh, P(*free)))
        return lax.with_sharding_constraint(x, sharding)

    if isinstance(spec, P):
        return jax.tree_util.tree_map(lambda x: one(x, spec), tree)
    return jax.tree_util.tree_map(one, tree, spec)
