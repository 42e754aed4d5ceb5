"""What jaxpipe reads of JAX's jaxprs: the one place that knows how each JAX version spells it.

The backward split (`jaxpipe._jaxpr.split`) and the flop counter walk jaxprs equation by
equation. JAX changes the params of its primitives between releases (jax 0.12 replaced a
scan's ``num_consts``/``num_carry`` by flat trees ``ft_in``/``ft_out`` and merged
``ClosedJaxpr`` into ``Jaxpr``), so every read of a primitive's params is here, one
function per primitive. Each returns ``None`` for params it does not recognise; callers
then treat the equation as opaque (bound as it is) instead of failing. Tested on jax 0.10.2
and 0.12.
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


def is_var(v) -> bool:
    """Whether ``v`` is a variable of a jaxpr (not a literal, not a dropped output)."""
    return isinstance(v, Var) and not isinstance(v, DropVar)


def open_jaxpr(jaxpr) -> tuple[Any, list]:
    """``(jaxpr, consts)`` of a closed jaxpr (jax < 0.12), a jaxpr carrying its consts
    (jax 0.12, where ``ClosedJaxpr`` is ``Jaxpr``), or an open jaxpr (no consts)."""
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
        if "num_consts" in p:  # jax < 0.11
            num_consts, num_carry = p["num_consts"], p["num_carry"]
        else:  # jax 0.11 and 0.12: flat trees of (consts, carry, xs)
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


def bind(eqn, ins: list) -> list:
    """Runs one equation on ``ins``, as ``jax.core.eval_jaxpr`` does; inputs that disagree
    on the manual axes they vary over are cast to agree (see `vary`)."""
    if any(x is None for x in ins):
        raise AssertionError(f"equation {eqn.primitive.name} is missing an input")
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns = ()
    if isinstance(params, tuple):  # jax before 0.7 returned (subfuns, params)
        subfuns, params = params
    if len(ins) > 1:
        ins = vary(ins, frozenset().union(*map(varying, ins)))
    with _source(eqn), _context(eqn):
        out = eqn.primitive.bind(*subfuns, *ins, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def varying(x) -> frozenset:
    """The manual mesh axes (of an enclosing ``shard_map``) along which ``x`` varies."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.10 to 0.12
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))  # jax 0.6 to 0.9


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
    manual axes (jax 0.12 records the abstract mesh in the equation's context)."""
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
