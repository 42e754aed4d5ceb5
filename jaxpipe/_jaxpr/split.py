"""A stage's backward split into B (input gradient) and W (weight gradient), on its jaxpr.

Zero-bubble schedules run a stage's backward in two parts: B, the gradient with respect to
the stage input, which the previous stage waits for, and W, the gradient with respect to the
stage's weights, which nobody waits for. Calling the full vjp twice and keeping one output
each time makes W recompute the whole chain of cotangents through every layer.
`split_backward` instead cuts the jaxpr of one backward ``back(stored, params, context,
ct) -> (d_params, dx)`` in two, as zero-bubble implementations do per linear layer (B keeps
the cotangent at the output of each weight-consuming op, W computes ``x^T dy`` from it):

- a variable depends on ``ct`` if any input of the equation that made it does;
- B is every equation the ``dx`` outputs need, and those of every weight gradient at most
  1/`SMALL` the size of the stage output's cotangent (a norm scale, a bias): W would
  reduce such a gradient from a stashed cotangent the size of an activation (in float32,
  for a norm), so B reduces it at once and stashes the small result;
- W is every equation the other ``d_params`` outputs need, except that a ``ct``-dependent
  variable B computes anyway is read from the *stash* (the arrays B hands to W) instead of
  computed again. What does not depend on ``ct`` (a weight cast, a dropout mask, a
  recomputed forward) W computes again from ``stored``, ``params`` and ``context``.

Besides those small gradients, only variables on the chain of cotangents that reaches
``dx`` are stashed, and those are shaped like the forward's activations: no other weight
gradient is stashed.

Structures:

- ``scan`` is split recursively: the transpose of a scan over layers is one scan producing
  both the ``dx`` chain (a carry) and the stacked weight gradients (ys). B becomes a scan
  carrying the ``dx`` chain that also returns each iteration's stash (extra ys, stacked); W
  becomes a scan reading them (extra xs) that returns the weight gradients. A carry that
  only feeds weight gradients (the gradient of a weight shared by all iterations) is carried
  by W. Scans are rebuilt with `jax.lax.scan`, keeping ``length``, ``reverse`` and
  ``unroll``.
- Calls (``jit``/``pjit``, ``closed_call``, ``core_call``, and ``jax.checkpoint``'s
  ``remat2``/``checkpoint``) are inlined: their bodies are split like the top level, so a
  stage under ``jax.jit`` or ``jax.checkpoint`` splits as if it were written out. Their
  shardings, names and ``prevent_cse`` barriers are not kept (B and W run in ticks of their
  own, so XLA cannot merge their recomputation with the forward).
- Anything else with a sub-jaxpr (``while``, ``cond``, custom rules, ``shard_map``, a
  Pallas kernel's ``pallas_call``) is one opaque equation: if B needs one of its outputs
  and W another, W computes the equation again from its (stashed) inputs.
  `SplitBackward.recomputed` names every ``ct``-dependent equation that both run, so this
  fallback is visible (as are the equations W runs again for a narrower stash, below).
- What the split cannot read is opaque too, never an error: a scan or call whose params are
  not in a form `jaxpipe._jaxpr.equations` knows (a JAX release that changed them), or a
  primitive with a sub-jaxpr on the chain of cotangents other than ``while``, ``cond``,
  ``shard_map`` and ``pallas_call`` (a new loop or call primitive). One
  `SplitFallbackWarning` per split names them.

Inside ``shard_map``: B and W may run there though ``back`` was split outside it (where no
value varies over the manual axes); where an equation's inputs then disagree on the axes
they vary over, they are cast with `jax.lax.pcast` as tracing inside would have, and scan
carries vary over every axis the scan's inputs do. ``split_backward`` may also be called
inside, on the values themselves. Equations without outputs (debug callbacks) are dropped.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from jaxpipe._jaxpr import equations
from jaxpipe._jaxpr.equations import Literal, bind, is_var, vary, varying

# primitives with sub-jaxprs that are opaque by design (documented above): no warning. A
# kernel (pallas_call) is one equation whose inputs and outputs are all its operands.
OPAQUE = frozenset({"while", "cond", "shard_map", "pallas_call"})
# B computes a weight gradient this many times smaller than the stage output's cotangent
SMALL = 64
# with narrow_stash, W recomputes a cotangent through at most this many matrix products
MAX_RECOMPUTED_PRODUCTS = 1
# collectives W never runs again for a narrower stash
COLLECTIVES = frozenset(
    {"psum", "pmax", "pmin", "ppermute", "pbroadcast", "all_gather", "all_to_all",
     "reduce_scatter", "psum_scatter", "psum_invariant", "all_gather_invariant"}
)  # fmt: skip


class SplitFallbackWarning(UserWarning):
    """The backward split met an equation it does not understand and recomputes it whole.

    The gradients stay exact; W runs that equation again (as it does ``while`` and
    ``cond``), which costs time. Seen when a JAX release changes a primitive's params or
    adds a loop or call primitive; the warning names it."""


class SplitBackward(NamedTuple):
    """One stage backward, split into B and W.

    ``b_fn(stored, params, context, ct) -> (dx, stash)``: ``dx`` as ``back`` returns it, and
    ``stash``, a list of arrays shaped as ``stash_structs``, kept for W. ``w_fn(stored,
    params, context, stash) -> d_params``: ``d_params`` as ``back`` returns it. Both take
    trees of the structure and shapes ``split_backward`` was given. ``recomputed`` names the
    ``ct``-dependent equations both run (empty when the split is complete and the stash not
    narrowed), as paths such as ``"scan/while"``.
    """

    b_fn: Callable
    w_fn: Callable
    stash_structs: list
    recomputed: tuple[str, ...]

    @property
    def stash_nbytes(self) -> int:
        """Bytes of one micro-batch's stash."""
        return sum(s.size * s.dtype.itemsize for s in self.stash_structs)


def split_backward(
    back: Callable, stored, params, context, ct, narrow_stash: bool = False
) -> SplitBackward:
    """Split ``back(stored, params, context, ct) -> (d_params, dx)`` into B and W.

    The arguments are example trees (arrays or `jax.ShapeDtypeStruct`): ``stored`` the
    residuals kept from the forward, ``params`` one stage's parameters, ``context`` side
    inputs, keys and integers, ``ct`` the cotangent of the stage output. ``back`` is traced
    once (`jax.make_jaxpr`). B's ``dx`` and W's ``d_params`` are computed by the same
    equations as ``back``'s, so they agree with it to rounding; together B and W compute
    what ``back`` does, plus whatever W needs again that does not depend on ``ct``.

    With ``narrow_stash``, W also computes again each cotangent it needs that follows,
    through at most one matrix product and no collective, from cotangents of at most half
    its bytes (`_Plan.propagate_frontier`), and the stash holds those instead: for an MLP
    block, its output's cotangent instead of its hidden layer's too, for one more matrix
    product in W. Less memory per held-back W, for more work in W; gradients as exact
    (`SplitBackward.recomputed` names the equations both run).
    """
    args = (stored, params, context, ct)
    leaves, in_tree = jax.tree_util.tree_flatten(args)
    w_tree = jax.tree_util.tree_structure(args[:3])
    num_ct = len(jax.tree_util.tree_leaves(ct))
    closed, out_shape = jax.make_jaxpr(back, return_shape=True)(*args)
    if not (isinstance(out_shape, tuple | list) and len(out_shape) == 2):
        raise TypeError(
            "split_backward: back must return a pair (d_params, dx); it returned "
            f"{jax.tree_util.tree_structure(out_shape)}"
        )
    params_tree = jax.tree_util.tree_structure(out_shape[0])
    dx_tree = jax.tree_util.tree_structure(out_shape[1])
    num_w = params_tree.num_leaves
    num_in = len(leaves)
    is_ct = [False] * (num_in - num_ct) + [True] * num_ct
    num_out = len(closed.jaxpr.outvars)

    plan = _Plan(closed.jaxpr, closed.consts, "")
    plan.propagate_ct(is_ct)
    in_b = _small(jax.tree_util.tree_leaves(out_shape[0]), jax.tree_util.tree_leaves(ct))
    plan.propagate_b(in_b + [True] * (num_out - num_w))
    if narrow_stash:
        plan.propagate_frontier([None] * num_in)
    plan.propagate_w([True] * num_w + [False] * (num_out - num_w), is_ct)

    def flat_args(fn_name, expected, *trees):
        flat, tree = jax.tree_util.tree_flatten(trees)
        if tree != expected:
            raise TypeError(
                f"{fn_name}: arguments of structure {tree} where split_backward was given "
                f"{expected}; call it with trees of the structure it was split for"
            )
        return flat

    def b_fn(stored, params, context, ct):
        flat = flat_args("b_fn", in_tree, stored, params, context, ct)
        outs, stash = plan.eval_b(flat)
        return jax.tree_util.tree_unflatten(dx_tree, outs[num_w:]), stash

    def w_fn(stored, params, context, stash):
        flat = flat_args("w_fn", w_tree, stored, params, context)
        stash = list(stash)
        if len(stash) != plan.num_stash:
            raise ValueError(f"w_fn: {len(stash)} stash arrays where b_fn makes {plan.num_stash}")
        outs = plan.eval_w(flat + [None] * num_ct, stash)
        return jax.tree_util.tree_unflatten(params_tree, outs[:num_w])

    stash_structs = list(jax.eval_shape(b_fn, *args)[1])
    fallbacks = plan.fallbacks()
    if fallbacks:
        warnings.warn(
            "split_backward: not understood, so run whole by both B and W (gradients stay "
            f"exact, W recomputes them): {', '.join(fallbacks)}. jaxpipe reads the params of "
            "scan and call primitives in jaxpipe/_jaxpr/equations.py; a JAX release that "
            "changed them needs an edit there. To avoid the recomputation meanwhile, pass "
            "schedule_options={'split_backward': False} to the Pipeline (1f1b, interleaved_1f1b)",
            SplitFallbackWarning,
            stacklevel=2,
        )
    return SplitBackward(b_fn, w_fn, stash_structs, tuple(plan.recomputed()))


def narrows_stash(remat: bool, num_stash_slots: int, stacked: bool = False) -> bool:
    """Whether the executor splits with ``narrow_stash``: with ``remat`` (memory before
    compute), where the plan holds more than one micro-batch's stash at once (W held back,
    as zero-bubble schedules do), or where the stash comes out of a scan (``stacked``, see
    `stacks_stash`). With one slot of a stash written value by value, W runs soon after its
    B and the narrower stash would save one slot's bytes for the recomputation in every W.
    A scan hands its stash over stacked over its iterations, whole until its loop ends and
    copied into the slot, several times a slot's bytes at once: for three Llama-3-8B blocks
    per stage in a scan, 1f1b on the TPU compiler held 20.1 GiB of temp with the wide
    stash and 13.3 with the narrow one (the same blocks in a loop: 15.8)."""
    return remat and (num_stash_slots > 1 or stacked)


def stacks_stash(back: Callable, *args) -> bool:
    """Whether ``back`` (`split_backward`'s) runs a ``scan``, at its top level or inside
    its calls: B's stash would then come out of it stacked over its iterations."""

    def runs_scan(jaxpr) -> bool:
        for eqn in jaxpr.eqns:
            body = equations.call(eqn)
            if eqn.primitive.name == "scan" or (body and runs_scan(body[0])):
                return True
        return False

    return runs_scan(jax.make_jaxpr(back)(*args).jaxpr)


def _small(d_params: list, ct: list) -> list[bool]:
    """Which weight gradients B computes: those at most 1/`SMALL` the bytes of the stage
    output's cotangent (norm scales, biases). Left to W, each would be reduced from a
    stashed activation-sized cotangent; B reduces it at once and stashes the result."""
    ct_bytes = sum(_nbytes(c) for c in ct)
    return [SMALL * _nbytes(g) <= ct_bytes for g in d_params]


def _nbytes(x) -> int:
    return math.prod(x.shape) * jax.numpy.dtype(x.dtype).itemsize


def _bytes_of(variables) -> float:
    """Bytes of jaxpr variables; infinite for a dtype without a size (a typed PRNG key),
    which is never recomputed for a narrower stash."""
    total = 0
    for v in variables:
        dtype = v.aval.dtype
        if not jax.numpy.issubdtype(dtype, jax.numpy.number):
            return math.inf
        total += _nbytes(v.aval)
    return total


def _own(v) -> tuple[set, set]:
    """The frontier of a variable W does not recompute: itself, no matrix products."""
    return {v}, set()


def flops(fn: Callable, *args, unroll: bool = True) -> float:
    """Floating-point operations of ``jax.jit(fn)(*args)`` by XLA's ``cost_analysis``.

    XLA counts a while loop's body once, whatever its trip count, so with ``unroll`` (the
    default) every ``lax.scan`` in ``fn`` (nested, inside calls too) is unrolled fully
    before compiling; ``while`` and ``cond`` are still counted once.
    """
    if unroll:
        inner = fn

        def fn(*args):
            flat, tree = jax.tree_util.tree_flatten(args)
            closed, out_shape = jax.make_jaxpr(inner, return_shape=True)(*args)
            outs = _eval_unrolled(closed.jaxpr, closed.consts, flat)
            return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    if isinstance(cost, Sequence):
        return float(sum(c.get("flops", 0.0) for c in cost))
    return float(cost.get("flops", 0.0))


# ------------------------------------------------------------------------------- plans
class _Plan:
    """The split of one jaxpr: which variables depend on ``ct`` (``ct``), which B needs
    (``b_need``) and has (``b_have``), which equations B and W run, and what W reads from
    the stash. The three ``propagate_*`` passes run in order, each from scratch, and set
    the state the ``eval_*`` passes read; scans and calls have child plans, set by the same
    passes."""

    def __init__(self, jaxpr, consts, path: str):
        self.jaxpr = jaxpr
        self.consts = list(consts)
        self.path = path
        self.children: dict[int, _Scan | _Call] = {}
        self.unread: dict[int, str] = {}  # equations split_backward would split but cannot
        self.recompute_in_w: set = set()  # ct-dependent variables W computes from narrower ones
        for i, eqn in enumerate(jaxpr.eqns):
            name = eqn.primitive.name
            if name == "scan":
                parts = equations.scan(eqn)
                if parts:
                    self.children[i] = _Scan(parts, len(eqn.invars), f"{path}scan/")
            elif name in equations.CALLS:
                body = equations.call(eqn)
                if body:
                    self.children[i] = _Call(*body, f"{path}{name}/")
            if i not in self.children and (name == "scan" or name in equations.CALLS):
                self.unread[i] = "its params are not in a form jaxpipe reads"

    # ------------------------------------------------------------------ analysis
    def propagate_ct(self, ct_in: list[bool]) -> list[bool]:
        """Marks what depends on ``ct``, given which inputs do; returns it per output."""
        ct = {v for v, c in zip(self.jaxpr.invars, ct_in, strict=True) if c}
        for i, eqn in enumerate(self.jaxpr.eqns):
            ins = [is_var(v) and v in ct for v in eqn.invars]
            child = self.children.get(i)
            outs = child.propagate_ct(ins) if child else [any(ins)] * len(eqn.outvars)
            ct.update(v for v, c in zip(eqn.outvars, outs, strict=True) if c)
        self.ct = ct
        return [is_var(v) and v in ct for v in self.jaxpr.outvars]

    def propagate_b(self, need_out: list[bool]) -> list[bool]:
        """Marks what B computes for the outputs ``need_out``; returns the inputs it reads."""
        need = {v for v, n in zip(self.jaxpr.outvars, need_out, strict=True) if n and is_var(v)}
        have = set()
        self.b_run = {}
        for i in reversed(range(len(self.jaxpr.eqns))):
            eqn = self.jaxpr.eqns[i]
            outs = [is_var(v) and v in need for v in eqn.outvars]
            child = self.children.get(i)
            if child:
                ins, have_outs = child.propagate_b(outs)
            else:
                ins, have_outs = [any(outs)] * len(eqn.invars), outs
            self.b_run[i] = any(outs)
            need.update(v for v, n in zip(eqn.invars, ins, strict=True) if n and is_var(v))
            have.update(v for v, h in zip(eqn.outvars, have_outs, strict=True) if h)
        self.b_need = need
        self.b_have = have | need
        return [v in need for v in self.jaxpr.invars]

    def propagate_w(self, need_out: list[bool], stash_ok: list[bool]) -> list[bool]:
        """Marks what W computes for the outputs ``need_out`` and what it reads from the
        stash: a ``ct``-dependent variable B has, or an input where ``stash_ok``. Returns
        the inputs W reads (not from the stash)."""
        jaxpr = self.jaxpr
        want = {v for v, n in zip(jaxpr.outvars, need_out, strict=True) if n and is_var(v)}
        stash: list = []
        self.w_run = {}
        for i in reversed(range(len(jaxpr.eqns))):
            eqn = jaxpr.eqns[i]
            child = self.children.get(i)
            compute = []
            for v in eqn.outvars:
                wanted = is_var(v) and v in want
                if wanted and v in self.b_have and v in self.ct and v not in self.recompute_in_w:
                    stash.append(v)
                    wanted = False
                compute.append(wanted)
            ins = child.propagate_w(compute) if child else [any(compute)] * len(eqn.invars)
            self.w_run[i] = any(compute)
            want.update(v for v, n in zip(eqn.invars, ins, strict=True) if n and is_var(v))
        w_in = []
        for v, ok in zip(jaxpr.invars, stash_ok, strict=True):
            if v in want and ok:
                stash.append(v)
            w_in.append(v in want and not ok)
        stash.reverse()  # in the order of the equations, inputs first
        self.stash = list(dict.fromkeys(stash))
        self.w_in = w_in
        return w_in

    def propagate_frontier(self, seed: list) -> list:
        """Marks the ``ct``-dependent variables W computes again (``recompute_in_w``)
        rather than reads from the stash. W recomputes a variable from its *frontier*: a
        set of other cotangents it follows from through equations W can run again (none
        with a sub-jaxpr but calls, whose bodies are followed inside; no collective) with
        at most `MAX_RECOMPUTED_PRODUCTS` matrix product among them; taken where the set
        has at most half the variable's bytes. Frontiers are chosen greedily, equation by
        equation: the union of the inputs' frontiers where that has fewer bytes than the
        variable, else the variable itself. ``seed`` gives the inputs' frontiers as
        ``(variables, products)`` (None: their own); returns the outputs'."""
        frontier = {}
        for v, f in zip(self.jaxpr.invars, seed, strict=True):
            if v in self.ct:
                frontier[v] = f or _own(v)
        for i, eqn in enumerate(self.jaxpr.eqns):
            child = self.children.get(i)
            if isinstance(child, _Scan):
                child.body.propagate_frontier([None] * len(child.body.jaxpr.invars))
            outs = [v for v in eqn.outvars if is_var(v) and v in self.ct]
            if not outs:
                continue
            ins = [frontier[u] for u in eqn.invars if is_var(u) and u in frontier]
            variables = set().union(*(f[0] for f in ins))
            products = set().union(*(f[1] for f in ins))
            if isinstance(child, _Call):
                found = child.body.propagate_frontier(
                    [frontier.get(u) if is_var(u) else None for u in eqn.invars]
                )
                for v, f in zip(eqn.outvars, found, strict=True):
                    # a frontier inside the body would name variables that another call
                    # of the same body shares: there the output is its own frontier
                    if v in outs:
                        frontier[v] = f if f is not None and f[0] <= variables else _own(v)
            elif child or equations.has_subjaxpr(eqn) or eqn.primitive.name in COLLECTIVES:
                frontier.update((v, _own(v)) for v in outs)
            else:
                if eqn.primitive.name == "dot_general":
                    products = products | {(id(self), i)}
                for v in outs:
                    cheaper = _bytes_of(variables) < _bytes_of([v])
                    few = len(products) <= MAX_RECOMPUTED_PRODUCTS
                    frontier[v] = (variables, products) if cheaper and few else _own(v)
            for v in outs:
                f = frontier[v][0]
                if v not in f and 2 * _bytes_of(f) <= _bytes_of([v]):
                    self.recompute_in_w.add(v)
        return [frontier.get(v) if is_var(v) else None for v in self.jaxpr.outvars]

    @property
    def num_stash(self) -> int:
        return len(self.stash) + sum(c.num_stash for c in self.children.values())

    def fallbacks(self) -> list[str]:
        """Equations not understood and run whole: a scan or call whose params are not in a
        known form, and (on the chain of cotangents) any other primitive with a sub-jaxpr
        but those in `OPAQUE`; each as ``"path (why)"``."""
        found = []
        for i, eqn in enumerate(self.jaxpr.eqns):
            child = self.children.get(i)
            name = self.path + eqn.primitive.name
            if child:
                found += child.fallbacks()
            elif i in self.unread:
                found.append(f"{name} ({self.unread[i]})")
            elif (
                eqn.primitive.name not in OPAQUE
                and equations.has_subjaxpr(eqn)
                and any(is_var(v) and v in self.ct for v in eqn.invars)
            ):
                found.append(f"{name} (a primitive with a sub-jaxpr that jaxpipe does not split)")
        return found

    def recomputed(self) -> list[str]:
        """Paths of ``ct``-dependent equations (not split further) that B and W both run."""
        found = []
        for i, eqn in enumerate(self.jaxpr.eqns):
            child = self.children.get(i)
            if child:
                found += child.recomputed()
            elif (
                self.b_run[i]
                and self.w_run[i]
                and any(is_var(v) and v in self.ct for v in eqn.invars)
            ):
                found.append(self.path + eqn.primitive.name)
        return found

    # ---------------------------------------------------------------- evaluation
    def _env(self, invals):
        env = dict(zip(self.jaxpr.constvars, self.consts, strict=True))
        for v, x in zip(self.jaxpr.invars, invals, strict=True):
            if x is not None:
                env[v] = x
        return env

    def eval_b(self, invals: list) -> tuple[list, list]:
        """B: the outputs B has (None for the others) and the stash, from the inputs B
        reads (None for the others)."""
        env = self._env(invals)
        child_stash = []
        for i, eqn in enumerate(self.jaxpr.eqns):
            if not self.b_run[i]:
                continue
            ins = [_read(env, v) for v in eqn.invars]
            child = self.children.get(i)
            if child:
                outs, stash = child.eval_b(ins)
                child_stash += stash
            else:
                outs = bind(eqn, ins)
            _write(env, eqn.outvars, outs)
        outs = [_read(env, v) for v in self.jaxpr.outvars]
        return outs, [env[v] for v in self.stash] + child_stash

    def eval_w(self, invals: list, stash: list) -> list:
        """W: the outputs W computes (None for the others), from the inputs W reads and
        the stash."""
        env = self._env(invals)
        env.update(zip(self.stash, stash[: len(self.stash)], strict=True))
        at = len(self.stash)
        for i, eqn in enumerate(self.jaxpr.eqns):
            child = self.children.get(i)
            if child:
                own, at = stash[at : at + child.num_stash], at + child.num_stash
            if not self.w_run[i]:
                continue
            ins = [_read(env, v) for v in eqn.invars]
            outs = child.eval_w(ins, own) if child else bind(eqn, ins)
            _write(env, eqn.outvars, outs)
        return [_read(env, v) for v in self.jaxpr.outvars]


class _Call:
    """A call (``jit``, ``closed_call``, ``remat2``): its body is split in place."""

    def __init__(self, body, consts, path: str):
        self.body = _Plan(body, consts, path)

    def propagate_ct(self, ins):
        return self.body.propagate_ct(ins)

    def propagate_b(self, outs):
        ins = self.body.propagate_b(outs)
        have = [is_var(v) and v in self.body.b_have for v in self.body.jaxpr.outvars]
        return ins, have

    def propagate_w(self, outs):
        return self.body.propagate_w(outs, [False] * len(self.body.jaxpr.invars))

    @property
    def num_stash(self):
        return self.body.num_stash

    def recomputed(self):
        return self.body.recomputed()

    def fallbacks(self):
        return self.body.fallbacks()

    def eval_b(self, ins):
        return self.body.eval_b(ins)

    def eval_w(self, ins, stash):
        return self.body.eval_w(ins, stash)


class _Scan:
    """A scan, split into a B scan (its carries that B needs, its stash as extra ys) and a
    W scan (its carries that W needs, the stash as extra xs)."""

    def __init__(self, parts: equations.Scan, num_in: int, path: str):
        self.num_consts, self.num_carry = parts.num_consts, parts.num_carry
        self.length, self.reverse, self.unroll = parts.length, parts.reverse, parts.unroll
        self.body = _Plan(parts.body, parts.body_consts, path)
        self.num_in = num_in

    def _parts(self, flags):
        c, k = self.num_consts, self.num_carry
        return list(flags[:c]), list(flags[c : c + k]), list(flags[c + k :])

    def propagate_ct(self, ins):
        consts, carry, xs = self._parts(ins)
        while True:
            outs = self.body.propagate_ct(consts + carry + xs)
            new = [a or b for a, b in zip(carry, outs[: self.num_carry], strict=True)]
            if new == carry:
                break
            carry = new
        self.carry_ct = carry
        return carry + outs[self.num_carry :]

    def propagate_b(self, outs):
        carry, ys = list(outs[: self.num_carry]), list(outs[self.num_carry :])
        while True:
            ins = self.body.propagate_b(carry + ys)
            new = [a or b for a, b in zip(carry, self._parts(ins)[1], strict=True)]
            if new == carry:
                break
            carry = new
        self.b_carry, self.b_ys = carry, ys
        consts, _, xs = self._parts(ins)
        self.b_consts, self.b_xs = consts, xs
        return consts + carry + xs, carry + ys

    def propagate_w(self, outs):
        carry, ys = list(outs[: self.num_carry]), list(outs[self.num_carry :])
        c = self.num_consts
        stash_ok = [False] * self.num_in
        for j, (b, ct) in enumerate(zip(self.b_carry, self.carry_ct, strict=True)):
            stash_ok[c + j] = b and ct  # B carries it: W reads it per iteration
        while True:
            ins = self.body.propagate_w(carry + ys, stash_ok)
            new = [a or b for a, b in zip(carry, self._parts(ins)[1], strict=True)]
            if new == carry:
                break
            carry = new
        self.w_carry, self.w_ys = carry, ys
        consts, _, xs = self._parts(ins)
        self.w_consts, self.w_xs = consts, xs
        return consts + carry + xs

    @property
    def num_stash(self):
        return self.body.num_stash

    def recomputed(self):
        return self.body.recomputed()

    def fallbacks(self):
        return self.body.fallbacks()

    def _scan(self, step, ins, carry_mask, xs_mask, consts_mask, extra_xs):
        consts, init, xs = self._parts(ins)
        consts = [x if m else None for x, m in zip(consts, consts_mask, strict=True)]
        init = [x for x, m in zip(init, carry_mask, strict=True) if m]
        xs = [x for x, m in zip(xs, xs_mask, strict=True) if m]
        # the carries vary along every manual axis any input does (see `_vary`)
        axes = frozenset().union(
            *map(varying, [x for x in consts if x is not None] + init + xs + list(extra_xs))
        )
        init = vary(init, axes)

        def body(carry, slices):
            xs_i, extra_i = slices
            carry_in = iter(carry)
            carry_full = [next(carry_in) if m else None for m in carry_mask]
            xs_in = iter(xs_i)
            xs_full = [next(xs_in) if m else None for m in xs_mask]
            carry_out, ys = step(consts + carry_full + xs_full, extra_i)
            return vary(carry_out, axes), ys

        return jax.lax.scan(
            body,
            init,
            (xs, extra_xs),
            length=self.length,
            reverse=self.reverse,
            unroll=self.unroll,
        )

    def eval_b(self, ins):
        k = self.num_carry

        def step(body_in, _):
            outs, stash = self.body.eval_b(body_in)
            carry = [x for x, m in zip(outs[:k], self.b_carry, strict=True) if m]
            ys = [x for x, m in zip(outs[k:], self.b_ys, strict=True) if m]
            return carry, (ys, stash)

        final, (ys, stash) = self._scan(step, ins, self.b_carry, self.b_xs, self.b_consts, [])
        return _fill(self.b_carry, final) + _fill(self.b_ys, ys), stash

    def eval_w(self, ins, stash):
        k = self.num_carry

        def step(body_in, stash_i):
            outs = self.body.eval_w(body_in, stash_i)
            carry = [x for x, m in zip(outs[:k], self.w_carry, strict=True) if m]
            ys = [x for x, m in zip(outs[k:], self.w_ys, strict=True) if m]
            return carry, ys

        final, ys = self._scan(step, ins, self.w_carry, self.w_xs, self.w_consts, list(stash))
        return _fill(self.w_carry, final) + _fill(self.w_ys, ys)


# -------------------------------------------------------------------------- evaluation
def _fill(mask, values) -> list:
    it = iter(values)
    return [next(it) if m else None for m in mask]


def _read(env, v):
    if isinstance(v, Literal):
        return v.val
    return env.get(v)


def _write(env, outvars, values) -> None:
    for v, x in zip(outvars, values, strict=True):
        if x is not None and is_var(v) and v not in env:
            env[v] = x


def _eval_unrolled(jaxpr, consts, args: list) -> list:
    """``jaxpr`` evaluated with every scan (nested, and inside calls) fully unrolled; a scan
    or call whose params are not in a known form is run as it is."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        ins = [_read(env, v) for v in eqn.invars]
        scan, body = equations.scan(eqn), equations.call(eqn)
        if scan:
            outs = _scan_unrolled(scan, ins)
        elif body:
            outs = _eval_unrolled(*body, ins)
        else:
            outs = bind(eqn, ins)
        _write(env, eqn.outvars, outs)
    return [_read(env, v) for v in jaxpr.outvars]


def _scan_unrolled(scan: equations.Scan, ins: list) -> list:
    c, k = scan.num_consts, scan.num_carry

    def step(carry, xs):
        outs = _eval_unrolled(scan.body, scan.body_consts, ins[:c] + list(carry) + list(xs))
        return outs[:k], outs[k:]

    final, ys = jax.lax.scan(
        step, ins[c : c + k], ins[c + k :], length=scan.length, reverse=scan.reverse, unroll=True
    )
    return list(final) + list(ys)
