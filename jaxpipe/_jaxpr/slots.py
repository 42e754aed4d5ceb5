"""Reading one slot of stacked buffers where a scan uses it, one iteration at a time.

A stage whose blocks run in a ``lax.scan`` keeps its residuals stacked over the blocks, and
the stage's backward is a scan over them. The executor keeps each micro-batch's residuals
in a slot of a buffer (``[slots, blocks, ...]``). Read whole (``buffer[slot]``) and handed
to the backward's loop, a slot is copied out of the buffer first: a loop's operand is a
buffer of its own. `call_on_slot` runs the backward so that each scan reads its iteration's
slice from the buffer itself (``buffer[slot, i]``) and no slot is copied.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxpipe._jaxpr import equations
from jaxpipe._jaxpr.equations import Literal, bind, is_var

# calls run inline where they take an unread leaf (a checkpoint too: in a backward, its body
# is the forward recomputed from the residuals, and runs once either way)
_INLINED = ("pjit", "jit", "closed_call", "core_call", "remat2", "checkpoint")


@jax.tree_util.register_pytree_node_class
class SlotRead:
    """Slot ``slot`` of stacked buffers, some of its leaves not read yet: ``leaves[i]`` is
    ``buffer[slot]`` where ``lazy[i]`` is False, the whole ``buffer`` where it is True."""

    def __init__(self, leaves: list, slot, lazy: tuple[bool, ...]):
        self.leaves, self.slot, self.lazy = list(leaves), slot, tuple(lazy)

    def tree_flatten(self):
        return (self.leaves, self.slot), self.lazy

    @classmethod
    def tree_unflatten(cls, lazy, children):
        return cls(*children, lazy)


def read_slot(buffers: list, slot, lazy: tuple[bool, ...] = ()):
    """Slot ``slot`` of ``buffers``: a list ``[b[slot] for b in buffers]``, or where
    ``lazy`` marks leaves (`scanned_leaves`), a `SlotRead` that leaves those unread."""
    if not any(lazy):
        return [b[slot] for b in buffers]
    leaves = [b if unread else b[slot] for b, unread in zip(buffers, lazy, strict=True)]
    return SlotRead(leaves, slot, lazy)


def scanned_leaves(fn, stored: list, *args) -> tuple[bool, ...]:
    """Per leaf of ``stored`` (shapes), whether a scan of ``fn(stored, *args)`` (at its top
    level or inside calls) takes it as a scanned-over input, so that `call_on_slot` can
    read it one iteration's slice at a time."""
    closed = jax.make_jaxpr(fn)(stored, *args)
    jaxpr, _ = equations.open_jaxpr(closed)
    found: set = set()
    _find_scanned(jaxpr, {v: i for i, v in enumerate(jaxpr.invars[: len(stored)])}, found)
    return tuple(i in found for i in range(len(stored)))


def _find_scanned(jaxpr, leaf_of: dict, found: set) -> None:
    for eqn in jaxpr.eqns:
        scan, body = equations.scan(eqn), equations.call(eqn)
        if scan is not None and scan.length > 0:  # a scan of no iterations reads nothing
            xs = eqn.invars[scan.num_consts + scan.num_carry :]
            found.update(leaf_of[v] for v in xs if is_var(v) and v in leaf_of)
        elif body is not None and eqn.primitive.name in _INLINED:
            inner = {b: leaf_of[v] for v, b in zip(eqn.invars, body[0].invars, strict=True)
                     if is_var(v) and v in leaf_of}  # fmt: skip
            _find_scanned(body[0], inner, found)


def call_on_slot(fn, stored, *args):
    """``fn(stored, *args)``, where ``stored`` is a list of arrays or a `SlotRead`. The
    unread leaves of a `SlotRead` that a scan of ``fn`` takes as scanned-over inputs are
    read by the scan's body, one iteration's slice of the slot at a time; elsewhere they
    are read whole, once."""
    if not isinstance(stored, SlotRead):
        return fn(stored, *args)
    structs = [
        jax.ShapeDtypeStruct(x.shape[1:] if unread else x.shape, x.dtype)
        for x, unread in zip(stored.leaves, stored.lazy, strict=True)
    ]
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(structs, *args)
    jaxpr, consts = equations.open_jaxpr(closed)
    leaves = [
        _Leaf(x, stored.slot) if unread else x
        for x, unread in zip(stored.leaves, stored.lazy, strict=True)
    ]
    outs = _eval(jaxpr, consts, leaves + jax.tree_util.tree_leaves(args))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)


class _Leaf(NamedTuple):
    """``buffer[slot]``, not read yet."""

    buffer: Any
    slot: Any

    def whole(self):
        return self.buffer[self.slot]

    def at(self, i):
        """``buffer[slot, i]``."""
        start = (self.slot, i) + (0,) * (self.buffer.ndim - 2)
        size = (1, 1, *self.buffer.shape[2:])
        return lax.dynamic_slice(self.buffer, start, size).reshape(self.buffer.shape[2:])


def _eval(jaxpr, consts, args: list) -> list:
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    whole: dict[int, Any] = {}

    def read(v, keep_lazy=False):
        x = v.val if isinstance(v, Literal) else env[v]
        if isinstance(x, _Leaf) and not keep_lazy:
            if id(x) not in whole:
                whole[id(x)] = x.whole()
            return whole[id(x)]
        return x

    for eqn in jaxpr.eqns:
        ins = [read(v, keep_lazy=True) for v in eqn.invars]
        outs = None
        if any(isinstance(x, _Leaf) for x in ins):
            scan, body = equations.scan(eqn), equations.call(eqn)
            if scan is not None:
                heads = eqn.invars[: scan.num_consts + scan.num_carry]
                outs = _scan(scan, ins, [read(v) for v in heads])
            elif body is not None and eqn.primitive.name in _INLINED:
                outs = _eval(*body, ins)
        if outs is None:
            outs = bind(eqn, [read(v) for v in eqn.invars])
        for v, x in zip(eqn.outvars, outs, strict=True):
            if is_var(v):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _scan(scan: equations.Scan, ins: list, heads: list) -> list:
    """A scan whose scanned-over inputs ``ins[c + k:]`` may be `_Leaf` s: their slices are
    read in the body; ``heads``: its consts and carries, read."""
    c, k = scan.num_consts, scan.num_carry
    xs = ins[c + k :]
    plain = [x for x in xs if not isinstance(x, _Leaf)]
    consts, carry = heads[:c], heads[c:]
    axes = frozenset().union(*map(equations.varying, [*heads, *plain]))
    axes |= frozenset().union(*(equations.varying(x.buffer) for x in xs if isinstance(x, _Leaf)))
    carry = equations.vary(carry, axes)

    def step(carry, inputs):
        i, values = inputs
        it = iter(values)
        sliced = [x.at(i) if isinstance(x, _Leaf) else next(it) for x in xs]
        outs = _eval(scan.body, scan.body_consts, [*consts, *carry, *sliced])
        return equations.vary(outs[:k], axes), outs[k:]

    index = jnp.arange(scan.length, dtype=jnp.int32)
    final, ys = lax.scan(
        step, carry, (index, plain), length=scan.length, reverse=scan.reverse, unroll=scan.unroll
    )
    return list(final) + list(ys)
