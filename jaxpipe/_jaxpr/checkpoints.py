"""A stage's own checkpoints run under another policy.

A stage often checkpoints its blocks itself: ``jax.checkpoint`` around a block in a
``lax.scan``, Flax's ``nnx.remat`` or ``nn.remat`` (``nn.scan`` over ``nn.remat``), each
with its own policy. The pipeline's ``remat_policy`` wraps the whole stage, and cannot
change what those inner checkpoints save: an inner policy that saves nothing recomputes
every block whatever the outer one keeps. `with_policy` traces the stage and runs its
jaxpr again with every checkpoint inside (in scans, calls and branches, at any depth) under
one given policy; everything else runs as traced.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import lax

from jaxpipe._jaxpr import equations
from jaxpipe._jaxpr.equations import bind, is_var

CHECKPOINTS = ("checkpoint", "remat2")


def with_policy(fn: Callable, policy: Callable) -> Callable:
    """``fn`` with each ``jax.checkpoint`` inside it under ``policy``.

    Args:
        fn: any function of pytrees of arrays (a stage); leaves that are not arrays are
            held fixed, as under ``jax.jit``'s static arguments.
        policy: a ``jax.checkpoint`` policy (``jax.checkpoint_policies.dots_saveable``).

    Returns:
        A function of the same arguments and results. Where ``fn`` holds no checkpoint it
        computes what ``fn`` does, equation for equation.
    """

    def wrapped(*args, **kwargs):
        leaves, tree = jax.tree.flatten((args, kwargs))
        dynamic = [i for i, a in enumerate(leaves) if _is_array(a)]

        def flat(*values):
            full = list(leaves)
            for i, v in zip(dynamic, values, strict=True):
                full[i] = v
            a, k = jax.tree.unflatten(tree, full)
            return fn(*a, **k)

        values = [leaves[i] for i in dynamic]
        closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*values)
        out = run(closed.jaxpr, closed.consts, values, policy)
        return jax.tree.unflatten(jax.tree.structure(out_shape), out)

    return wrapped


def has_checkpoint(jaxpr) -> bool:
    """Whether ``jaxpr`` (open) runs a ``jax.checkpoint`` anywhere inside it."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in CHECKPOINTS:
            return True
        if any(has_checkpoint(b) for b in equations.bodies(eqn)):
            return True
    return False


def run(jaxpr, consts, args, policy) -> list:
    """Evaluates ``jaxpr`` on ``args``, each checkpoint in it under ``policy``."""
    env = {}

    def read(v):
        return v.val if isinstance(v, equations.Literal) else env[v]

    for v, value in zip(jaxpr.constvars, consts, strict=True):
        env[v] = value
    for v, value in zip(jaxpr.invars, args, strict=True):
        env[v] = value
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs = _equation(eqn, ins, policy)
        for v, value in zip(eqn.outvars, outs, strict=True):
            if is_var(v):
                env[v] = value
    return [read(v) for v in jaxpr.outvars]


def _equation(eqn, ins: list, policy) -> list:
    """One equation: a checkpoint under ``policy``; a call, scan or branch that holds a
    checkpoint run through; any other as traced."""
    name = eqn.primitive.name
    if name not in CHECKPOINTS and not any(has_checkpoint(b) for b in equations.bodies(eqn)):
        return bind(eqn, ins)
    if name in CHECKPOINTS:
        inner = equations.call(eqn)
        if inner is not None:
            body, consts = inner
            prevent_cse = eqn.params.get("prevent_cse", True)
            return _arrays_through(
                lambda values: run(body, consts, values, policy),
                ins,
                lambda f: jax.checkpoint(f, policy=policy, prevent_cse=prevent_cse),
            )
    if name in equations.CALLS:
        inner = equations.call(eqn)
        if inner is not None:
            return run(*inner, ins, policy)
    if name == "scan":
        parts = equations.scan(eqn)
        if parts is not None:
            return _scan(parts, ins, policy)
    if name == "cond" and eqn.params.get("branches") is not None:
        branches = [equations.open_jaxpr(b) for b in eqn.params["branches"]]
        index, operands = ins[0], ins[1:]
        return _arrays_through(
            lambda values: list(lax.switch(
                values[0],
                [lambda *o, b=b: run(*b, list(o), policy) for b in branches],
                *values[1:],
            )),
            [index, *operands],
            lambda f: f,
        )  # fmt: skip
    return bind(eqn, ins)  # a custom rule or a while loop: its checkpoints as they are


def _scan(parts: equations.Scan, ins: list, policy) -> list:
    consts = ins[: parts.num_consts]
    carry = ins[parts.carries]
    xs = ins[parts.num_consts + parts.num_carry :]

    def body(carry, x):
        outs = run(parts.body, parts.body_consts, [*consts, *carry, *x], policy)
        return outs[: parts.num_carry], outs[parts.num_carry :]

    carry, ys = lax.scan(
        body, list(carry), list(xs), length=parts.length, reverse=parts.reverse,
        unroll=parts.unroll,
    )  # fmt: skip
    return [*carry, *ys]


def _arrays_through(fn, ins: list, wrap) -> list:
    """``fn(ins)`` under ``wrap`` (a transformation of a function of arrays), the arrays
    among ``ins`` passed through it and the rest (literals) closed over."""
    passed = [i for i, a in enumerate(ins) if _is_array(a)]

    def inner(*values):
        full = list(ins)
        for i, value in zip(passed, values, strict=True):
            full[i] = value
        return fn(full)

    return list(wrap(inner)(*[ins[i] for i in passed]))


def _is_array(a) -> bool:
    return hasattr(a, "shape") and hasattr(a, "dtype")
