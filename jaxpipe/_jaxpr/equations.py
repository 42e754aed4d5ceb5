"""What jaxpipe reads of JAX's jaxprs: the one place that knows how JAX spells an equation.

The backward split (`jaxpipe._jaxpr.split`), the residual analysis
(`jaxpipe._jaxpr.residuals`) and the memory prediction (`jaxpipe.memory`) walk jaxprs
equation by equation. The params of JAX's primitives differ between releases (a scan's
consts and carries are counted by ``num_consts``/``num_carry`` in some, by the flat trees
``ft_in``/``ft_out`` in others; ``ClosedJaxpr`` is its own type in some, ``Jaxpr`` in
others), so every read of a primitive's params is here, one function per primitive. Each
returns ``None`` for params it does not recognise; callers then treat the equation as
opaque (bound as it is, or its outputs taken whole) instead of failing.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import jax
import jax.extend as jex

Var = jex.core.Var
Literal = jex.core.Literal
DropVar = jex.core.DropVar

# call primitives whose body is one jaxpr, run once with the equation's inputs: name -> param
CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr"}
CALLS |= {"closed_call": "call_jaxpr", "core_call": "call_jaxpr"}


class Scan(NamedTuple):
    """A ``scan`` equation's params: its body (an open jaxpr and its consts), the number of
    const and carry inputs (the rest are xs), and the loop's own settings."""

    body: Any
    body_consts: list
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: Any

    @property
    def carries(self) -> slice:
        """Where the carries sit among the equation's inputs (after the consts, before the
        xs) and among its body's inputs."""
        return slice(self.num_consts, self.num_consts + self.num_carry)


def is_var(v) -> bool:
    """Whether ``v`` is a variable of a jaxpr (not a literal, not a dropped output)."""
    return isinstance(v, Var) and not isinstance(v, DropVar)


def open_jaxpr(jaxpr) -> tuple[Any, list]:
    """``(jaxpr, consts)`` of a closed jaxpr, a jaxpr carrying its consts (where
    ``ClosedJaxpr`` is ``Jaxpr``), or an open jaxpr (no consts)."""
    if isinstance(jaxpr, jex.core.ClosedJaxpr):
        return jaxpr.jaxpr, list(jaxpr.consts)
    return jaxpr, []


def scan(eqn) -> Scan | None:
    """The params of a ``scan`` equation, or None where they are not in a known form (or
    ``eqn`` is not a scan)."""
    if eqn.primitive.name != "scan":
        return None
    p = eqn.params
    try:
        if "num_consts" in p:  # counts of consts and carries
            num_consts, num_carry = p["num_consts"], p["num_carry"]
        else:  # flat trees of (consts, carry, xs)
            consts, carry, _ = p["ft_in"].unpack()
            num_consts, num_carry = len(consts), len(carry)
        body, body_consts = open_jaxpr(p["jaxpr"])
        parts = Scan(
            body, body_consts, num_consts, num_carry, p["length"], p["reverse"], p["unroll"]
        )
        fits = len(body.invars) == len(eqn.invars) and len(body.outvars) == len(eqn.outvars)
    except (KeyError, AttributeError, TypeError, ValueError):
        return None
    if not fits or num_consts + num_carry > len(eqn.invars) or num_carry > len(eqn.outvars):
        return None
    return parts


def call(eqn) -> tuple[Any, list] | None:
    """``(body, consts)`` of a call equation (`CALLS`): a jaxpr that maps the equation's
    inputs to its outputs. None for other primitives or params not in a known form."""
    param = CALLS.get(eqn.primitive.name)
    body = eqn.params.get(param) if param else None
    if body is None:
        return None
    try:
        body, consts = open_jaxpr(body)
        fits = len(body.invars) == len(eqn.invars) and len(body.outvars) == len(eqn.outvars)
    except (AttributeError, TypeError):
        return None
    return (body, consts) if fits else None


def has_subjaxpr(eqn) -> bool:
    """Whether any param of ``eqn`` is a jaxpr (a loop, a branch, a call, a custom rule)."""
    kinds = (jex.core.ClosedJaxpr, jex.core.Jaxpr)
    for value in eqn.params.values():
        values = value if isinstance(value, tuple | list) else (value,)
        if any(isinstance(v, kinds) for v in values):
            return True
    return False


# params that hold the one jaxpr an equation runs on its own inputs: a call's body, a custom
# derivative rule's primal function, a shard_map's, a remat's or a scan's body
_BODY_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def body(eqn):
    """The open jaxpr ``eqn`` runs as its body (a call, a custom derivative rule, a
    ``shard_map``, a remat, a scan), or None where it has none. Unlike `call`, the body's
    inputs need not be the equation's: callers check the counts."""
    for name in _BODY_PARAMS:
        inner = eqn.params.get(name)
        if inner is not None:
            return open_jaxpr(inner)[0]
    return None


def bodies(eqn) -> list:
    """The open jaxprs ``eqn`` runs inside it: its `body`, a ``while`` loop's body, or
    each branch of a ``cond``; empty for an equation that runs none."""
    inner = body(eqn)
    if inner is not None:
        return [inner]
    name = eqn.primitive.name
    if name == "while" and eqn.params.get("body_jaxpr") is not None:
        return [open_jaxpr(eqn.params["body_jaxpr"])[0]]
    if name == "cond" and eqn.params.get("branches") is not None:
        return [open_jaxpr(b)[0] for b in eqn.params["branches"]]
    return []


def dot_dimensions(eqn) -> tuple[tuple[Any, Any], tuple[Any, Any]] | None:
    """``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))`` of a
    ``dot_general`` equation, or None."""
    if eqn.primitive.name != "dot_general":
        return None
    try:
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    except (KeyError, TypeError, ValueError):
        return None
    return (tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))


def _tuple_param(eqn, primitives: tuple[str, ...], name: str) -> tuple[int, ...] | None:
    if eqn.primitive.name not in primitives:
        return None
    value = eqn.params.get(name)
    try:
        return None if value is None else tuple(int(v) for v in value)
    except (TypeError, ValueError):
        return None


def permutation(eqn) -> tuple[int, ...] | None:
    """The permutation of a ``transpose`` equation (output dimension i is input dimension
    ``permutation[i]``), or None."""
    return _tuple_param(eqn, ("transpose",), "permutation")


def broadcast_dimensions(eqn) -> tuple[int, ...] | None:
    """The output dimension of each input dimension of a ``broadcast_in_dim`` equation, or
    None."""
    return _tuple_param(eqn, ("broadcast_in_dim",), "broadcast_dimensions")


REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin")


def reduced_axes(eqn) -> tuple[int, ...] | None:
    """The input dimensions a reduction (`REDUCTIONS`) removes, or None."""
    return _tuple_param(eqn, REDUCTIONS, "axes")


def squeezed_dimensions(eqn) -> tuple[int, ...] | None:
    """The input dimensions a ``squeeze`` equation removes, or None."""
    return _tuple_param(eqn, ("squeeze",), "dimensions")


def bind(eqn, ins: list) -> list:
    """Runs one equation on ``ins``, as ``jax.core.eval_jaxpr`` does; inputs that disagree
    on the manual axes they vary over are cast to agree (see `vary`)."""
    if any(x is None for x in ins):
        raise AssertionError(f"equation {eqn.primitive.name} is missing an input")
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns = ()
    if isinstance(params, tuple):  # (subfuns, params) in the older spelling
        subfuns, params = params
    if len(ins) > 1:
        ins = vary(ins, frozenset().union(*map(varying, ins)))
    with _source(eqn), _context(eqn):
        out = eqn.primitive.bind(*subfuns, *ins, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def varying(x) -> frozenset:
    """The manual mesh axes (of an enclosing ``shard_map``) along which ``x`` varies."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))  # the older spelling of the same set


def vary(values: list, axes: frozenset) -> list:
    """``values``, each cast to vary along ``axes``.

    Inside ``shard_map``, equations traced outside it do not say which inputs vary along
    the manual axes; `jax.lax.pcast` makes inputs agree where they are mixed, as tracing
    inside ``shard_map`` would have (a type change, not a change of value)."""
    if not axes:
        return values
    out = []
    for x in values:
        missing = axes - varying(x)
        out.append(jax.lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x)
    return out


def _context(eqn):
    """The equation's own context (compute type, XLA metadata, PRNG flags), but the mesh of
    where it runs now: an equation traced outside a ``shard_map`` and run inside must see the
    manual axes (an equation's context may record the abstract mesh it was traced under)."""
    manager = getattr(getattr(eqn, "ctx", None), "manager", None)
    if manager is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    mesh = jax.sharding.get_abstract_mesh()
    stack.enter_context(manager)
    stack.enter_context(jax.sharding.use_abstract_mesh(mesh))
    return stack


def _source(eqn):
    """The equation's source location and name stack, for profiles and errors."""
    info = getattr(eqn, "source_info", None)
    if info is None:
        return contextlib.nullcontext()
    util = jex.source_info_util
    return util.user_context(info.traceback, name_stack=util.current_name_stack() + info.name_stack)
