"""What a stage's forward keeps for its backward, and how the backward gets its vjp back.

A stage's backward needs the residuals of ``jax.vjp(stage, params, x)``: the leaves of the
returned vjp function (a pytree). Some depend on the stage input ``x`` (the activations the
backward reads); the others are functions of the parameters, side inputs and key alone (the
weights themselves, a weight cast to bfloat16, a dropout mask). Only the first kind is
stored, per micro-batch, in the residual buffers; the second is recomputed in the backward
from what it depends on, so no weight-sized array is ever kept per micro-batch.

Which leaves depend on ``x`` is read off the jaxpr of the vjp's residuals
(``jax.make_jaxpr``): a variable depends on ``x`` if any input of the equation that made it
does. Equations are taken whole (a nested jit, scan or custom rule counts as depending on
every input), so the analysis may store more than needed, never less. In the backward,
``jax.vjp`` is traced again on a zero ``x``: its ``x``-independent leaves are the recomputed
residuals, the rest is replaced by the stored arrays, and XLA removes the dead forward.

`split_pullback` and `join_pullback` cut a vjp function another way: into the leaves that
are the call's own arguments (read again by the backward) and the rest (kept by the
forward), as `jaxpipe.costs` compiles a stage's forward and backward apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxpipe._jaxpr.equations import is_var


@dataclasses.dataclass(frozen=True)
class Residuals:
    """Which leaves of a stage's vjp function are stored (per leaf), and their shapes."""

    stored: tuple[bool, ...]
    structs: tuple[jax.ShapeDtypeStruct, ...]  # of the stored leaves, in leaf order
    remat: bool = False  # store the stage input only and recompute the forward

    @property
    def nbytes(self) -> int:
        """Bytes of one micro-batch's stored residuals."""
        return sum(s.size * s.dtype.itemsize for s in self.structs)


def analyse(stage: Callable, params, x, context, remat: bool = False) -> Residuals:
    """The residual split for ``stage(params, x, context)``; ``context`` (side inputs, key,
    stage index) is treated like the parameters: what depends on it alone is recomputed."""
    if remat:
        structs = tuple(_struct(a) for a in jax.tree_util.tree_leaves(x))
        return Residuals(stored=(), structs=structs, remat=True)

    jaxpr = leaves_jaxpr(stage, params, x, context)
    depends = set(jaxpr.invars[: len(jax.tree_util.tree_leaves(x))])
    for eqn in jaxpr.eqns:
        if any(is_var(v) and v in depends for v in eqn.invars):
            depends.update(eqn.outvars)
    stored = tuple(is_var(v) and v in depends for v in jaxpr.outvars)
    structs = tuple(
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
        for v, keep in zip(jaxpr.outvars, stored, strict=True)
        if keep
    )
    return Residuals(stored=stored, structs=structs)


def leaves_jaxpr(stage: Callable, params, x, context):
    """The open jaxpr that maps the leaves of ``(x, params, context)``, in that order, to the
    leaves of the vjp function of ``stage(params, x, context)`` (its residuals)."""

    def vjp_leaves(x, params, context):
        _, vjp_fn = jax.vjp(lambda p, x: stage(p, x, context), params, x)
        return jax.tree_util.tree_leaves(vjp_fn)

    return jax.make_jaxpr(vjp_leaves)(x, params, context).jaxpr


def forward(spec: Residuals, stage: Callable, params, x, context):
    """``(y, stored)``: the stage output and the residual leaves to keep."""
    if spec.remat:
        return stage(params, x, context), jax.tree_util.tree_leaves(x)
    y, vjp_fn = jax.vjp(lambda p, x: stage(p, x, context), params, x)
    leaves = jax.tree_util.tree_leaves(vjp_fn)
    _check_count(spec, leaves)
    return y, [leaf for leaf, keep in zip(leaves, spec.stored, strict=True) if keep]


def vjp(spec: Residuals, stage: Callable, params, x_like, context, stored: list):
    """The stage's vjp function (of ``params`` and ``x``) at the micro-batch whose residuals
    are ``stored``; ``x_like`` is any tree of the stage input's structure and dtypes."""

    def stage_at(p, x):
        return stage(p, x, context)

    if spec.remat:
        x = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(x_like), stored)
        return jax.vjp(stage_at, params, x)[1]
    zero_x = jax.tree_util.tree_map(jnp.zeros_like, x_like)
    fresh, treedef = jax.tree_util.tree_flatten(jax.vjp(stage_at, params, zero_x)[1])
    _check_count(spec, fresh)
    kept = iter(stored)
    leaves = [next(kept) if keep else leaf for leaf, keep in zip(fresh, spec.stored, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _check_count(spec: Residuals, leaves: list) -> None:
    if len(leaves) != len(spec.stored):
        raise RuntimeError(
            f"the stage's vjp has {len(leaves)} residual leaves where the analysis found "
            f"{len(spec.stored)}; stage_fn must trace to the same computation every time"
        )


def _struct(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jnp.shape(x), x.dtype)


class PullbackLayout(NamedTuple):
    """Where each leaf of a vjp function comes from (`split_pullback`): ``(True, i)`` for the
    ``i``-th leaf of the call's arguments, read again; ``(False, i)`` for the ``i``-th kept
    residual."""

    treedef: Any
    sources: tuple[tuple[bool, int], ...]


def split_pullback(pullback, args) -> tuple[list, PullbackLayout]:
    """What a forward keeps for its backward beyond its own arguments.

    Args:
        pullback: the vjp function of a call on ``args`` (as ``jax.vjp`` returns it).
        args: the call's arguments (a pytree), whose leaves the pullback may hold.

    Returns:
        ``(kept, layout)``: the pullback's leaves that are not leaves of ``args`` (compared
        by identity), and the `PullbackLayout` that `join_pullback` rebuilds it from.
    """
    inputs = {id(leaf): i for i, leaf in enumerate(jax.tree_util.tree_leaves(args))}
    leaves, treedef = jax.tree_util.tree_flatten(pullback)
    sources, kept = [], []
    for leaf in leaves:
        if id(leaf) in inputs:
            sources.append((True, inputs[id(leaf)]))
        else:
            sources.append((False, len(kept)))
            kept.append(leaf)
    return kept, PullbackLayout(treedef, tuple(sources))


def join_pullback(layout: PullbackLayout, args, kept: list) -> Callable:
    """The vjp function `split_pullback` took apart, from the call's arguments and the kept
    residuals.

    Args:
        layout: the `PullbackLayout` of `split_pullback`.
        args: arguments of the structure the pullback was split against.
        kept: the kept residuals.

    Returns:
        The pullback, a function of the output's cotangent.
    """
    inputs = jax.tree_util.tree_leaves(args)
    leaves = [inputs[i] if is_input else kept[i] for is_input, i in layout.sources]
    return jax.tree_util.tree_unflatten(layout.treedef, leaves)
