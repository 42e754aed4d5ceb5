"""A stage that gathers its FSDP-split weights one block at a time (``fsdp_gather=
"per_block"``).

The user's stage function takes whole weights. `per_block` returns a stage function that
takes this device's shards instead: it traces the user's function on the whole shapes and
runs its jaxpr on the shards, carrying "the shard of a weight split along these dimensions"
through the equations that only index the weight's other dimensions (slicing a block out
of a stack, squeezing, casting, a ``scan`` slicing its xs into its body, calls and remats
run inline), and all-gathers a shard just before each equation that needs it whole (a
weight two equations use is gathered twice). A stage that scans or loops over stacked
blocks so gathers each block right before the block runs. Each gather and the equation
that needs it run under a ``jax.checkpoint`` that
saves nothing: a gathered weight is never a residual; the backward gathers it again where
its transpose runs, and the transpose of the gather (a reduce-scatter of the block's weight
gradient) follows there. Gradients come out as the shards' own.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax import lax

from jaxpipe._executor.sharding import _gather, _on_local_shards, _scatter
from jaxpipe._jaxpr import equations, unroll
from jaxpipe._jaxpr.equations import bind, is_var


class Shard(NamedTuple):
    """This device's shard ``value`` of a weight split, per dimension, over the batch axes
    ``split`` (``()`` where whole); ``spec`` is the dimension's entry of the weight's
    placement spec, ``kept`` the expert axes it stays split over anyway. ``taken``: in a
    probe (`takes_blocks`), a list that records each time a weight is taken apart along a
    dimension it is not split over, and ``value`` is the whole weight, never gathered."""

    value: Any
    split: tuple
    spec: tuple
    kept: frozenset
    taken: list | None = None

    def whole(self):
        """The weight, all-gathered over its batch axes (tiled)."""
        if self.taken is not None:
            return self.value
        return _on_local_shards(self.value, self.split, self.spec, 0, _gather_block, self.kept)

    def drop(self, dims) -> Shard:
        """The metadata of this shard with ``dims`` removed (its value given later)."""
        keep = [d for d in range(len(self.split)) if d not in set(dims)]
        return self._replace(
            split=tuple(self.split[d] for d in keep), spec=tuple(self.spec[d] for d in keep)
        )

    def took(self, pieces: int) -> None:
        """Records (in a probe) that the weight is used ``pieces`` pieces at a time."""
        if self.taken is not None and pieces > 1:
            self.taken.append(pieces)

    def split_dims(self) -> list[int]:
        return [d for d, axes in enumerate(self.split) if axes]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_block(x, axes, dim):
    """`_gather`, whose transpose is a tiled reduce-scatter along ``dim`` (`_scatter`).
    JAX's own transpose of `_gather`'s untiled all-gather is an untiled reduce-scatter,
    which the TPU compiler runs as an all-reduce of the whole gradient: twice the bytes."""
    return _gather(x, axes, dim)


def _gather_block_forward(x, axes, dim):
    return _gather(x, axes, dim), None


def _gather_block_backward(axes, dim, _, gradient):
    return (_scatter(gradient, axes, dim),)


_gather_block.defvjp(_gather_block_forward, _gather_block_backward)


def per_block(stage_fn: Callable, weights, sizes: dict[str, int]) -> Callable:
    """``stage_fn(params, x, context)`` of whole weights, as a function of this device's
    shards of them (leaves split as ``weights.split`` says, over axes of ``sizes``) that
    gathers each where an equation needs it whole (module docstring)."""

    def stage(params, x, context):
        return _run_stage(stage_fn, weights, sizes, params, x, context, taken=None)

    return stage


def takes_blocks(stage_fn: Callable, weights, params, x, context) -> bool:
    """Whether ``stage_fn(params, x, context)`` (whole weights, shapes and dtypes will
    do) takes a weight that ``weights`` splits over a batch axis apart along a dimension
    it is not split over: a ``scan`` or a loop over stacked blocks (a block sliced or
    indexed out of the stack), or a slice of a weight. There `per_block` gathers a piece
    of the weight at a time, not the whole of it. Traces ``stage_fn``; runs nothing."""
    taken = []
    sizes = dict.fromkeys(weights.axes(), 1)  # the probe's shards are the whole weights
    jax.eval_shape(
        lambda p, x, c: _run_stage(stage_fn, weights, sizes, p, x, c, taken), params, x, context
    )
    return bool(taken)


def _run_stage(stage_fn, weights, sizes, params, x, context, taken):
    """`per_block`'s stage on ``params`` (shards; with ``taken``, the probe of
    `takes_blocks`: whole weights, recorded where taken apart and never gathered)."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    inner = weights.inner or (None,) * len(leaves)
    shards, wholes = [], []
    for i, leaf in enumerate(leaves):
        split = tuple(weights.split[i]) + ((),) * (leaf.ndim - len(weights.split[i]))
        if not any(split):
            shards.append(leaf)
            wholes.append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
            continue
        spec = tuple(inner[i] or ()) + (None,) * (leaf.ndim - len(tuple(inner[i] or ())))
        shards.append(Shard(leaf, split, spec, frozenset(weights.kept_axes(i)), taken))
        shape = [
            n * math.prod(sizes[a] for a in axes) for n, axes in zip(leaf.shape, split, strict=True)
        ]
        wholes.append(jax.ShapeDtypeStruct(tuple(shape), leaf.dtype))
    ctx_leaves, ctx_tree = jax.tree_util.tree_flatten(context)
    traced = [i for i, a in enumerate(ctx_leaves) if hasattr(a, "shape")]

    def whole_stage(whole_leaves, x, dynamic):
        ctx = list(ctx_leaves)
        for i, a in zip(traced, dynamic, strict=True):
            ctx[i] = a
        ctx = jax.tree_util.tree_unflatten(ctx_tree, ctx)
        return stage_fn(treedef.unflatten(whole_leaves), x, ctx)

    dynamic = [ctx_leaves[i] for i in traced]
    closed, out_shape = jax.make_jaxpr(whole_stage, return_shape=True)(wholes, x, dynamic)
    args = [*shards, *jax.tree_util.tree_leaves(x), *dynamic]
    out = run(closed.jaxpr, closed.consts, args, in_loop=False)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), out)


def run(jaxpr, consts, args, in_loop: bool) -> list:
    """Evaluates ``jaxpr`` on ``args``, some of them `Shard`\\ s; its outputs whole."""
    env = {}

    def read(v):
        return v.val if isinstance(v, equations.Literal) else env[v]

    for v, value in zip(jaxpr.constvars, consts, strict=True):
        env[v] = value
    for v, value in zip(jaxpr.invars, args, strict=True):
        env[v] = value
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        if any(isinstance(a, Shard) for a in ins):
            outs = _on_shards(eqn, ins, in_loop)
        else:
            outs = bind(eqn, ins)
        for v, value in zip(eqn.outvars, outs, strict=True):
            if is_var(v):
                env[v] = value
    return [_whole(read(v)) for v in jaxpr.outvars]


def _whole(value):
    return value.whole() if isinstance(value, Shard) else value


def _on_shards(eqn, ins: list, in_loop: bool) -> list:
    """One equation some of whose inputs are `Shard`\\ s: run on the shards where it only
    indexes their unsplit dimensions, else on the gathered weights (`_gathered`)."""
    name = eqn.primitive.name
    operand = ins[0]
    if isinstance(operand, Shard) and not any(isinstance(a, Shard) for a in ins[1:]):
        dims = operand.split_dims()
        if name == "convert_element_type" and eqn.params.get("sharding") is None:
            return [operand._replace(value=bind(eqn, [operand.value])[0])]
        if name == "squeeze":
            squeezed = equations.squeezed_dimensions(eqn)
            if squeezed is not None and not set(squeezed) & set(dims):
                value = lax.squeeze(operand.value, squeezed)
                return [operand.drop(squeezed)._replace(value=value)]
        if name == "slice" and eqn.params.get("strides") in (None, (1,) * len(operand.split)):
            start, limit = eqn.params["start_indices"], list(eqn.params["limit_indices"])
            whole_shape = eqn.invars[0].aval.shape
            if all(start[d] == 0 and limit[d] == whole_shape[d] for d in dims):
                operand.took(math.prod(whole_shape) // max(1, math.prod(eqn.outvars[0].aval.shape)))
                for d in dims:
                    limit[d] = operand.value.shape[d]
                return [operand._replace(value=lax.slice(operand.value, start, limit))]
        if name == "dynamic_slice":
            sizes = list(eqn.params["slice_sizes"])
            whole_shape = eqn.invars[0].aval.shape
            if all(sizes[d] == whole_shape[d] for d in dims):
                operand.took(math.prod(whole_shape) // max(1, math.prod(sizes)))
                starts = list(ins[1:])
                for d in dims:
                    sizes[d] = operand.value.shape[d]
                    starts[d] = 0
                value = lax.dynamic_slice(operand.value, starts, sizes)
                return [operand._replace(value=value)]
    if name in equations.CALLS and name not in ("remat2", "checkpoint"):
        inner = equations.call(eqn)
        if inner is not None:
            return run(*inner, ins, in_loop)
    if name in ("remat2", "checkpoint"):
        inner = equations.call(eqn)
        if inner is not None:
            body, consts = inner
            policy = eqn.params.get("policy")
            prevent_cse = eqn.params.get("prevent_cse", True)
            return _with_shards(
                lambda values: run(body, consts, values, in_loop),
                ins,
                lambda f: jax.checkpoint(f, policy=policy, prevent_cse=prevent_cse),
            )
    if name == "scan":
        outs = _scan(eqn, ins)
        if outs is not None:
            return outs
    if name == "cond" and not isinstance(ins[0], Shard):
        return _cond(eqn, ins, in_loop)
    if _unstacks(eqn, ins):  # a scan written out as a loop slices its xs so
        operand.took(len(eqn.outvars))
        return [operand.drop([0])._replace(value=v) for v in unroll.unstack(operand.value)]
    return _gathered(eqn, ins, in_loop)


def _cond(eqn, ins: list, in_loop: bool) -> list:
    """A ``cond`` (``lax.cond``, ``lax.switch``) with `Shard` operands, as a
    ``lax.switch`` whose branches run on the shards: each gathers what it needs whole."""
    branches = [equations.open_jaxpr(b) for b in eqn.params["branches"]]
    index, operands = ins[0], ins[1:]
    passed = [i for i, a in enumerate(operands) if isinstance(a, Shard | jax.Array)]

    def branch(body, consts):
        def run_branch(*values):
            full = list(operands)
            for i, value in zip(passed, values, strict=True):
                a = operands[i]
                full[i] = a._replace(value=value) if isinstance(a, Shard) else value
            return run(body, consts, full, in_loop)

        return run_branch

    values = [operands[i].value if isinstance(operands[i], Shard) else operands[i] for i in passed]
    return list(lax.switch(index, [branch(*b) for b in branches], *values))


def _unstacks(eqn, ins) -> bool:
    """Whether ``eqn`` is a custom-derivative function that only takes its one input apart
    along the leading axis, slice by slice (`jaxpipe._jaxpr.unroll.unstack`), a `Shard`
    whose leading axis is not split."""
    inner = equations.body(eqn)
    if not eqn.primitive.name.startswith("custom_vjp") or inner is None or len(ins) != 1:
        return False
    (x,), shape = ins, eqn.invars[0].aval.shape
    return (
        isinstance(x, Shard)
        and not x.split[0]
        and len(eqn.outvars) == shape[0]
        and all(v.aval.shape == shape[1:] for v in eqn.outvars)
        and all(e.primitive.name in ("slice", "squeeze") for e in inner.eqns)
    )


def _with_shards(fn, ins, wrap):
    """``fn(ins)`` under ``wrap`` (a transformation of a function of arrays), the `Shard`\\
    s among ``ins`` passed as their values and rebuilt inside; values that are not arrays
    (literals) closed over."""
    passed = [i for i, a in enumerate(ins) if isinstance(a, Shard | jax.Array)]

    def inner(*values):
        full = list(ins)
        for i, value in zip(passed, values, strict=True):
            full[i] = ins[i]._replace(value=value) if isinstance(ins[i], Shard) else value
        return fn(full)

    return wrap(inner)(*[ins[i].value if isinstance(ins[i], Shard) else ins[i] for i in passed])


def _gathered(eqn, ins: list, in_loop: bool) -> list:
    """``eqn`` on its inputs with every `Shard` gathered first, the gathers and the
    equation under a ``jax.checkpoint`` that saves nothing: no gathered weight is kept
    for the backward, which gathers again. Outside a loop CSE is prevented, so that a
    compiler does not merge the backward's gather with the forward's."""
    return _with_shards(
        lambda values: bind(eqn, [_whole(a) for a in values]),
        ins,
        lambda f: jax.checkpoint(
            f, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=not in_loop
        ),
    )


def _scan(eqn, ins: list) -> list | None:
    """A ``scan`` whose xs or consts include `Shard`\\ s, as a ``lax.scan`` whose body
    runs on the shards: a shard of stacked xs split on other than its leading dimension
    enters the body as the shard of one slice; other shards are gathered first."""
    parts = equations.scan(eqn)
    if parts is None:
        return None
    consts = ins[: parts.num_consts]
    carry = [_whole(a) for a in ins[parts.carries]]
    xs = ins[parts.num_consts + parts.num_carry :]
    slices = []
    for i, a in enumerate(xs):
        if isinstance(a, Shard) and a.split[0]:
            xs[i] = a = a.whole()
        if isinstance(a, Shard):
            a.took(parts.length)
        slices.append(a.drop([0]) if isinstance(a, Shard) else None)
    values = [a.value if isinstance(a, Shard) else a for a in xs]

    def body(carry, x):
        x = [s._replace(value=v) if s is not None else v for s, v in zip(slices, x, strict=True)]
        outs = run(parts.body, parts.body_consts, [*consts, *carry, *x], in_loop=True)
        return outs[: parts.num_carry], outs[parts.num_carry :]

    carry, ys = lax.scan(
        body, carry, values, length=parts.length, reverse=parts.reverse, unroll=parts.unroll
    )
    return [*carry, *ys]
