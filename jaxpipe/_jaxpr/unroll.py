"""A stage whose blocks run in a ``lax.scan`` over stacked weights, run as a Python loop.

Inside a pipeline a stage's forward, B and W run in ticks of their own, and each keeps what
the next needs in buffers per micro-batch. A ``lax.scan`` over the stage's blocks hands
every block's residuals from its forward loop to its backward loop as stacked arrays
``[blocks, ...]`` made whole before the next loop starts (the value ``1 - tanh(h)`` beside
``tanh(h)``, say, which XLA fuses into its reader when nothing stands between them), and
hands B's stash to W the same way, copied once more into its slot: the compilers keep
several such stacks live at once where a Python loop over the same blocks keeps one block's
values at a time, written straight into their slots. `unrolled` writes the stage's scans
out as that loop, equation for equation, so both forms compile to the same program.

Which scans are written out: those the stage runs itself (at its top level, and inside the
calls it makes: ``jit``, ``closed_call``, ``jax.checkpoint``, which are kept as calls or
inlined), of at most `MAX_UNROLLED` iterations, whose written-out form has at most
`MAX_UNROLLED_EQUATIONS` equations (iterations times the equations of the body, nested ones
counted). A scan inside a scan's body (a loop inside a block) stays a loop, and so does a
longer scan (over time steps, say). A stage of several large blocks (three transformer
blocks or more, say) stays a scan too: written out, its forward, B and W programs would each
hold every block's equations, and the compilers' time grows with them. Such a scan, unless
its body holds a ``jax.checkpoint`` of its own (whose policy is kept), runs its body under
``jax.checkpoint`` with `save_all_but_elementwise`: the values it hands from its forward to
its backward are then the results of matrix products, reductions and other operations that
are not elementwise, and the backward recomputes the elementwise ones (casts, the softmax's
exponentials, an activation beside its input) from them, as XLA's fusions do for a loop,
and the products whose results outgrow their operands (attention's scores), as XLA's
scheduler does for a loop by computing them again where the backward needs them. (A policy
around the whole stage, the pipeline's ``remat_policy``, decides first: its
``dots_saveable`` keeps every product's result, the scores among them, in either form.)
Every block's equations, a ``jax.checkpoint`` around a block with its policy among them, are
bound as they were traced: the values are those of the scan.

Forward mode: a written-out scan's stacked inputs are sliced by a ``jax.custom_vjp`` (its
backward writes the slices' cotangents one by one into one buffer), which ``jax.jvp`` cannot
differentiate. Forward-mode derivatives with respect to those inputs (a stage's stacked
weights) raise JAX's "can't apply forward-mode autodiff (jvp) to a custom_vjp function";
with respect to the carry (the stage input) they run. JAX has no public way to give a
linear map both a transpose of one's own and a tangent rule.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.extend as jex
import jax.numpy as jnp

from jaxpipe._jaxpr import equations
from jaxpipe._jaxpr.equations import Literal, bind, is_var

# a scan of more iterations than this is left as a loop (not a loop over a stage's blocks)
MAX_UNROLLED = 64
# a scan whose written-out form would have more equations than this is left as a loop, so
# that the compile time of a stage of many large blocks does not grow with their number
MAX_UNROLLED_EQUATIONS = 256
# checkpoint primitives: rebuilt with `jax.checkpoint` around their unrolled body
_CHECKPOINTS = ("remat2", "checkpoint")
# primitives whose results a kept scan's backward recomputes (`save_all_but_elementwise`):
# elementwise arithmetic and functions, comparisons, casts, and the data movement of
# broadcasts, reshapes, transposes, slices, pads and concatenations (names from jax 0.10 to
# 0.12; one a release does not have never matches)
_RECOMPUTED = frozenset(
    {"abs", "acos", "acosh", "add", "and", "asin", "asinh", "atan", "atan2", "atanh",
     "bitcast_convert_type", "broadcast_in_dim", "cbrt", "ceil", "clamp", "clz", "concatenate",
     "conj", "convert_element_type", "copy", "cos", "cosh", "div", "dynamic_slice", "eq",
     "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt", "imag",
     "integer_pow", "iota", "is_finite", "le", "log", "log1p", "logistic", "lt", "max", "min",
     "mul", "ne", "neg", "nextafter", "not", "one_minus_square", "or", "pad",
     "population_count", "pow", "real", "reduce_precision", "rem", "reshape", "rev", "round",
     "rsqrt", "select_n", "shift_left", "shift_right_arithmetic", "shift_right_logical",
     "sign", "sin", "sinh", "slice", "split", "sqrt", "square", "squeeze", "sub", "tan",
     "tanh", "transpose", "xor"}
)  # fmt: skip


def save_all_but_elementwise(prim, *avals, **params) -> bool:
    """A `jax.checkpoint` policy: save every result except those of the primitives named in
    ``_RECOMPUTED`` (elementwise operations, casts, broadcasts, reshapes, slices and the
    like) and of the matrix products that `_expands`, which are recomputed from the saved
    ones. Any other primitive's results are saved, as JAX's default saves everything:
    matrix products, reductions, gathers, random bits, collectives, and primitives of
    releases it does not know."""
    if prim.name == "dot_general":
        return not _expands(*avals[:2], params["dimension_numbers"])
    return prim.name not in _RECOMPUTED


def _expands(lhs, rhs, dimension_numbers) -> bool:
    """Whether a matrix product with batch dimensions has a result of more elements than
    its operands together: attention's scores, ``s x s`` per head from two ``s x d``
    operands, recomputed in the backward from the (saved) projections they are made of
    rather than kept for every block."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if not lhs_batch:
        return False
    lhs_free = math.prod(n for i, n in enumerate(lhs.shape) if i not in {*lhs_contract, *lhs_batch})
    rhs_free = math.prod(n for i, n in enumerate(rhs.shape) if i not in {*rhs_contract, *rhs_batch})
    batch = math.prod(lhs.shape[i] for i in lhs_batch)
    return batch * lhs_free * rhs_free > math.prod(lhs.shape) + math.prod(rhs.shape)


def unrolled(fn: Callable) -> Callable:
    """``fn`` with the scans it runs over at most `MAX_UNROLLED` iterations (at its top level
    and inside its calls, not inside a scan's body) written out as Python loops, or, where
    that would exceed `MAX_UNROLLED_EQUATIONS`, run with their body under ``jax.checkpoint``
    (`save_all_but_elementwise`; not where the body holds a checkpoint of its own).

    Args:
        fn: a function of arrays (pytrees of them, keywords too) to arrays.

    Returns:
        A function of the same arguments and results; ``fn`` itself is called where it runs
        no such scan.
    """

    @functools.wraps(fn)
    def run(*args, **kwargs):
        closed, out_shape = jax.make_jaxpr(lambda a, k: fn(*a, **k), return_shape=True)(
            args, kwargs
        )
        if not _has_unrollable_scan(closed.jaxpr):
            return fn(*args, **kwargs)
        flat = jax.tree_util.tree_leaves((args, kwargs))
        outs = _eval(closed.jaxpr, closed.consts, flat)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

    return run


def _unrollable(eqn) -> equations.Scan | None:
    scan = equations.scan(eqn)
    if scan is None or not 0 < scan.length <= MAX_UNROLLED:
        return None
    if scan.length * _size(scan.body) > MAX_UNROLLED_EQUATIONS:
        return None
    return scan


def _inner(eqn):
    """The jaxprs inside ``eqn``'s params (a call's body, a loop's, a branch, a rule's)."""
    for value in eqn.params.values():
        for v in value if isinstance(value, tuple | list) else (value,):
            if isinstance(v, jex.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jex.core.Jaxpr):
                yield v


def _size(jaxpr) -> int:
    """The equations of ``jaxpr``, those of the jaxprs inside its equations counted too."""
    return sum(1 + sum(map(_size, _inner(eqn))) for eqn in jaxpr.eqns)


def _holds_checkpoint(jaxpr) -> bool:
    """Whether ``jaxpr`` runs a ``jax.checkpoint``, at any depth."""
    return any(
        eqn.primitive.name in _CHECKPOINTS or any(map(_holds_checkpoint, _inner(eqn)))
        for eqn in jaxpr.eqns
    )


def _kept(eqn) -> equations.Scan | None:
    """A scan over a stage's blocks too large to write out, with no ``jax.checkpoint`` of
    its own anywhere in its body: it runs its body under `save_all_but_elementwise`."""
    scan = equations.scan(eqn)
    if scan is None or not 0 < scan.length <= MAX_UNROLLED or _unrollable(eqn) is not None:
        return None
    if _holds_checkpoint(scan.body):
        return None
    return scan


def _has_unrollable_scan(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if _unrollable(eqn) is not None or _kept(eqn) is not None:
            return True
        body = equations.call(eqn)
        if body is not None and _has_unrollable_scan(body[0]):
            return True
    return False


def _read(env, v):
    return v.val if isinstance(v, Literal) else env[v]


def _eval(jaxpr, consts, args: list) -> list:
    """``jaxpr`` evaluated with its unrollable scans (and those of its calls) as loops."""
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        ins = [_read(env, v) for v in eqn.invars]
        scan, kept, body = _unrollable(eqn), _kept(eqn), equations.call(eqn)
        if scan is not None:
            outs = _loop(scan, ins)
        elif kept is not None:
            outs = _checkpointed_scan(kept, ins)
        elif body is not None and _has_unrollable_scan(body[0]):
            outs = _call(eqn, body, ins)
        else:
            outs = bind(eqn, ins)
        for v, x in zip(eqn.outvars, outs, strict=True):
            if is_var(v):
                env[v] = x
    return [_read(env, v) for v in jaxpr.outvars]


def _call(eqn, body, ins: list) -> list:
    """A call whose body holds an unrollable scan: a checkpoint is rebuilt around the
    unrolled body with its policy; any other call is inlined."""
    inner, consts = body
    if eqn.primitive.name in _CHECKPOINTS:
        params = eqn.params
        wrapped = jax.checkpoint(
            lambda *a: _eval(inner, consts, list(a)),
            policy=params.get("policy"),
            prevent_cse=params.get("prevent_cse", True),
        )
        return list(wrapped(*ins))
    return _eval(inner, consts, ins)


def _loop(scan: equations.Scan, ins: list) -> list:
    """A scan run as a Python loop: the body bound as traced, on each iteration's slices."""
    c, k = scan.num_consts, scan.num_carry
    consts, carry, xs = ins[:c], ins[c : c + k], ins[c + k :]
    steps = range(scan.length - 1, -1, -1) if scan.reverse else range(scan.length)
    slices = [unstack(x) if jnp.issubdtype(x.dtype, jnp.inexact) else list(x) for x in xs]
    ys = {}
    for i in steps:
        outs = _bind_body(scan, consts + carry + [s[i] for s in slices])
        carry, ys[i] = outs[:k], outs[k:]
    stacked = [jnp.stack([ys[i][j] for i in range(scan.length)]) for j in range(len(ys[0]))]
    # the loop's results leave through a barrier, as a scan's leave its loop: a constraint
    # ending the last block is then no branch's result inside the pipeline's `lax.switch`
    # (XLA requires every branch's result to carry one sharding; an idle branch's zeros
    # carry none)
    carry = _barrier(list(carry))
    return list(carry) + stacked


def _checkpointed_scan(scan: equations.Scan, ins: list) -> list:
    """The scan again, its body under ``jax.checkpoint`` with `save_all_but_elementwise`."""
    c, k = scan.num_consts, scan.num_carry
    consts, carry, xs = ins[:c], ins[c : c + k], ins[c + k :]

    @functools.partial(jax.checkpoint, policy=save_all_but_elementwise)
    def body(consts, carry, x):
        outs = _bind_body(scan, list(consts) + list(carry) + list(x))
        return outs[:k], outs[k:]

    carry, ys = jax.lax.scan(
        lambda carry, x: body(consts, carry, x),
        carry,
        xs,
        length=scan.length,
        reverse=scan.reverse,
        unroll=scan.unroll,
    )
    return list(carry) + list(ys)


@jax.custom_jvp
def _barrier(values):
    """``values`` through an optimization barrier, their tangents (and so their cotangents)
    straight through: the backward starts from the incoming cotangent as a loop's does (a
    barrier on the cotangent, the barrier's own transpose, makes the TPU compiler keep the
    recomputed blocks' values around it)."""
    return jax.lax.optimization_barrier(values)


@_barrier.defjvp
def _barrier_jvp(primals, tangents):
    return _barrier(*primals), tangents[0]


@jax.custom_vjp
def unstack(x):
    """``x``'s slices along its leading axis (a scan's per-iteration inputs)."""
    return tuple(x[i] for i in range(x.shape[0]))


def _unstack_fwd(x):
    return unstack(x), None


def _unstack_bwd(_, cotangents):
    """The slices' cotangents written one by one into one buffer, as a scan's backward
    writes them: each is freed once written, so a stage's whole weight gradient and all of
    its blocks' gradients are never held at once (a sum of padded slices would be)."""
    out = jnp.zeros((len(cotangents), *cotangents[0].shape), cotangents[0].dtype)
    for i in reversed(range(len(cotangents))):
        out = jax.lax.dynamic_update_index_in_dim(out, cotangents[i], i, 0)
    return (out,)


unstack.defvjp(_unstack_fwd, _unstack_bwd)


def _bind_body(scan: equations.Scan, args: list) -> list:
    """One iteration of the scan's body: its equations bound as they are (a scan inside
    stays a scan)."""
    body = scan.body
    env = dict(zip(body.constvars, scan.body_consts, strict=True))
    env.update(zip(body.invars, args, strict=True))
    for eqn in body.eqns:
        outs = bind(eqn, [_read(env, v) for v in eqn.invars])
        for v, x in zip(eqn.outvars, outs, strict=True):
            if is_var(v):
                env[v] = x
    return [_read(env, v) for v in body.outvars]
