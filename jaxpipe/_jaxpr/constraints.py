"""Sharding constraints written inside a stage, fitted to the pipeline's mesh.

Layers often constrain the sharding of their activations or weights
(``jax.lax.with_sharding_constraint``, Flax's ``nn.with_logical_constraint`` under logical
axis rules, NNX variables with sharding names). Inside the pipeline the pipe axis and the
data axes are manual: each device runs its own part of the schedule on its own rows, so a
constraint over them cannot hold there (JAX refuses it), and the pipeline already splits
over them. The other mesh axes (``tensor``) stay automatic, and constraints over them still
guide XLA. `fit` makes a function's constraints fit:

- Flax's logical axis rules are narrowed while the function runs (``nn.logical_axis_rules``)
  to the automatic axes of the mesh, so logical constraints name no manual axis;
- a constraint with a ``NamedSharding`` (of the pipeline's mesh, or of another mesh the
  module was built on) keeps, in its spec, the automatic axes of the pipeline's mesh only,
  and is placed on the pipeline's mesh. This is done on the function's jaxpr, traced where
  the function runs: the equations are bound again with the narrowed constraints;
- a constraint with a bare ``PartitionSpec`` (code written for ``jax.set_mesh``) is read on
  the pipeline's mesh and fitted as a ``NamedSharding`` of it is. JAX refuses one that
  names a manual axis while tracing (and one with no mesh in context), so a function whose
  trace fails is traced again with every axis of the mesh automatic, and all its
  constraints are placed on the pipeline's mesh.

Constraints inside a custom derivative rule's own functions are not rewritten.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax
import jax.extend as jex
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe._jaxpr import equations

CONSTRAINT = "sharding_constraint"


def fit(fn: Callable, mesh: jax.sharding.Mesh, manual_axes) -> Callable:
    """``fn`` with its sharding constraints fitted to ``mesh`` with ``manual_axes`` manual.

    Args:
      fn: a function of pytrees of arrays, returning a pytree of arrays.
      mesh: the pipeline's mesh.
      manual_axes: the axes that are manual where ``fn`` runs (pipe and data axes).

    Returns:
      A function computing what ``fn`` computes, whose constraints name only automatic axes
      of ``mesh`` (see the module docstring).
    """
    manual = frozenset(manual_axes)
    kept = frozenset(a for a in mesh.axis_names if a not in manual)
    automatic = mesh.abstract_mesh.update_axis_types(
        {a: jax.sharding.AxisType.Auto for a in mesh.axis_names}
    )
    unchanged = set()  # argument shapes whose jaxpr needs no rewrite

    def fitted(*args, **keywords):
        with _narrowed_rules(kept):
            leaves, treedef = jax.tree_util.tree_flatten((args, keywords))
            structs = [_struct(a) for a in leaves]
            signature = (treedef, tuple((s.shape, s.dtype, s.weak_type) for s in structs))
            if signature in unchanged:
                return fn(*args, **keywords)

            def flat(*leaves):
                args, keywords = treedef.unflatten(leaves)
                return fn(*args, **keywords)

            try:
                closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*structs)
                moved = False
            except (ValueError, RuntimeError):
                # a bare PartitionSpec over a manual axis (or with no mesh in context):
                # traced again with every axis of the mesh automatic, then fitted
                try:
                    with jax.sharding.use_abstract_mesh(automatic):
                        closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*structs)
                except (ValueError, RuntimeError) as again:
                    if isinstance(again, ValueError):
                        _explain(again, mesh)
                    raise again from None
                moved = True
            jaxpr, changed = _rewrite(closed.jaxpr, mesh, kept, moved)
            if not changed:
                unchanged.add(signature)
                return fn(*args, **keywords)
            out = _evaluate(jaxpr, closed.consts, leaves)
            return jax.tree_util.tree_structure(out_shape).unflatten(out)

    return fitted


def _struct(x) -> jax.ShapeDtypeStruct:
    """The shape and dtype ``x`` is traced with, weakly typed where ``x`` is (a Python
    number): ``bf16 * 2.0`` stays bfloat16 in the traced function as in ``fn``."""
    dtype = x.dtype if hasattr(x, "dtype") else jax.numpy.result_type(x)
    weak = bool(getattr(jax.typeof(x), "weak_type", False))
    return jax.ShapeDtypeStruct(jax.numpy.shape(x), dtype, weak_type=weak)


def _narrowed_rules(kept: frozenset):
    """Flax's logical axis rules with every mesh axis not in ``kept`` removed, while the
    function runs (none set: nothing changes)."""
    try:
        from flax.core import spmd
    except ImportError:  # pragma: no cover - flax is a dependency
        return contextlib.nullcontext()
    rules = spmd.get_logical_axis_rules()
    if not rules:
        return contextlib.nullcontext()
    narrowed = []
    for logical, axes in rules:
        if isinstance(axes, list | tuple):
            axes = tuple(a for a in axes if a in kept) or None
        elif isinstance(axes, str) and axes not in kept:
            axes = None
        narrowed.append((logical, axes))
    return spmd.logical_axis_rules(tuple(narrowed))


def _fitted_spec(spec, kept: frozenset) -> P:
    entries = []
    for entry in spec:
        if entry is None or entry is P.UNCONSTRAINED:
            entries.append(entry)
            continue
        names = tuple(n for n in (entry if isinstance(entry, tuple) else (entry,)) if n in kept)
        entries.append(names[0] if len(names) == 1 else (names or None))
    return P(*entries)


def _fitted_sharding(sharding, mesh, kept: frozenset, moved: bool = False):
    """The constraint's sharding on ``mesh`` over the axes in ``kept``; None if it needs no
    change (or is not a ``NamedSharding``). ``moved``: traced on a mesh of automatic axes,
    so every constraint is placed on ``mesh`` again."""
    if not isinstance(sharding, NamedSharding):
        return None
    spec = _fitted_spec(sharding.spec, kept)
    own = tuple(sharding.mesh.shape.items()) == tuple(mesh.shape.items()) and not moved
    if own and tuple(spec) == tuple(sharding.spec):
        return None
    return NamedSharding(mesh, spec, memory_kind=sharding.memory_kind)


def _rewrite(jaxpr, mesh, kept: frozenset, moved: bool = False):
    """``(jaxpr, changed)``: ``jaxpr`` with every constraint (in nested jaxprs too) fitted
    (``moved``: as `_fitted_sharding` says)."""
    eqns, changed = [], moved
    for eqn in jaxpr.eqns:
        params, this = dict(eqn.params), False
        if eqn.primitive.name == CONSTRAINT:
            sharding = _fitted_sharding(params.get("sharding"), mesh, kept, moved)
            if sharding is not None:
                params["sharding"], this = sharding, True
        for name, value in eqn.params.items():
            new, inner_changed = _rewrite_param(value, mesh, kept, moved)
            if inner_changed:
                params[name], this = new, True
        eqns.append(eqn.replace(params=params) if this else eqn)
        changed = changed or this
    return (jaxpr.replace(eqns=eqns) if changed else jaxpr), changed


def _rewrite_param(value, mesh, kept, moved=False):
    if isinstance(value, jex.core.ClosedJaxpr):
        inner, changed = _rewrite(value.jaxpr, mesh, kept, moved)
        return (jex.core.ClosedJaxpr(inner, value.consts) if changed else value), changed
    if isinstance(value, jex.core.Jaxpr):
        return _rewrite(value, mesh, kept, moved)
    if isinstance(value, tuple | list) and any(
        isinstance(v, jex.core.ClosedJaxpr | jex.core.Jaxpr) for v in value
    ):
        pairs = [_rewrite_param(v, mesh, kept, moved) for v in value]
        if any(c for _, c in pairs):
            return type(value)(v for v, _ in pairs), True
    return value, False


def _evaluate(jaxpr, consts, args) -> list:
    """The outputs of ``jaxpr`` on ``args``, its equations bound where this runs."""
    env = {}

    def read(v):
        return v.val if isinstance(v, jex.core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        outs = equations.bind(eqn, [read(v) for v in eqn.invars])
        for v, out in zip(eqn.outvars, outs, strict=True):
            if equations.is_var(v):
                env[v] = out
    return [read(v) for v in jaxpr.outvars]


def _explain(error: ValueError, mesh) -> None:
    """Raises a ValueError that says how to fix a switch, inside the function, to a mesh of
    another size than the pipeline's."""
    text = str(error)
    if "cannot change the size of the mesh" in text:
        raise ValueError(
            "the stage (or loss_fn) switches to a mesh of another size than the pipeline's "
            f"({mesh.size} devices, axes {dict(mesh.shape)}), probably the mesh its module "
            "was built on (jax.set_mesh or jax.sharding.use_abstract_mesh inside the "
            "module). Inside the pipeline a module runs on the pipeline's mesh: build the "
            "module with the pipeline's mesh (pipe.mesh) instead of the whole one, or take "
            "the mesh switch out of the module. Constraints with a NamedSharding of another "
            "mesh need no change: jaxpipe moves them onto the pipeline's mesh. "
            f"JAX said: {text.splitlines()[0]}"
        ) from error
