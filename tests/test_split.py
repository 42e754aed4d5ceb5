"""B/W split of a stage backward (`jaxpipe._jaxpr.split`).

For each kind of stage, three properties of ``split_backward(back, ...)``:
- numbers: B's ``dx`` and W's ``d_params`` equal the full backward's (f32, rtol 1e-5);
- memory: the stash (kept per micro-batch from B to W) has no parameter-shaped array and at
  most ``weight_ops`` activation-sized arrays per layer (``weight_ops``: the ops that consume
  a weight, one cotangent each; the widest activation bounds each);
- compute: B + W costs at most 1.1 full backwards (XLA ``cost_analysis``, scans unrolled),
  where B + the naive W (the full backward, keeping ``d_params``) costs more than 1.3 for
  stages of several layers.

``back`` is built as the executor builds it (`jaxpipe._jaxpr.residuals`: the residuals
that depend on the stage input are stored, the rest recomputed in the backward), or, where
``all_stored``, from every leaf of the vjp function.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import pytest
from jax.interpreters import mlir
from jax.sharding import PartitionSpec as P

from jaxpipe._jaxpr import equations, residuals
from jaxpipe._jaxpr.split import (
    SplitFallbackWarning,
    flops,
    narrows_stash,
    split_backward,
    stacks_stash,
)

BATCH, WIDTH, HIDDEN, LAYERS, HEADS = 24, 64, 160, 4, 4


class Context(NamedTuple):
    key: jax.Array  # a typed key
    stage: jax.Array  # int32


@dataclasses.dataclass
class Case:
    stage: Callable  # stage(params, x, context) -> y
    params: Callable  # key -> params
    x: Callable  # key -> x
    weight_ops: int  # ops consuming a weight (all layers)
    widest: int  # elements of the widest activation of one layer
    naive_over: float | None = 1.3  # the naive B + W exceeds this many backwards
    all_stored: bool = False  # stored = every vjp leaf (else: as the executor stores)


def normal(key, shape, scale=1.0):
    return scale * jax.random.normal(key, shape, jnp.float32)


def dense_init(key, fan_in, fan_out, layers=None):
    shape = (fan_in, fan_out) if layers is None else (layers, fan_in, fan_out)
    return normal(key, shape, fan_in**-0.5)


def mlp_params(key, layers=None):
    k1, k2, k3 = jax.random.split(key, 3)
    b_shape = (HIDDEN,) if layers is None else (layers, HIDDEN)
    return {
        "w1": dense_init(k1, WIDTH, HIDDEN, layers),
        "b1": normal(k2, b_shape, 0.1),
        "w2": dense_init(k3, HIDDEN, WIDTH, layers),
    }


def block(p, x):
    return x + jax.nn.gelu(x @ p["w1"] + p["b1"]) @ p["w2"]


def x_of(key):
    return normal(key, (BATCH, WIDTH))


# ---------------------------------------------------------------------------- stages
def linear(p, x, context):
    return x @ p["w"] + p["b"]


def mlp(p, x, context):
    return jax.nn.gelu(x @ p["w1"] + p["b1"]) @ p["w2"]


def unrolled_blocks(p, x, context):
    for layer in p:
        x = block(layer, x)
    return x


def scanned_blocks(p, x, context):
    return jax.lax.scan(lambda x, layer: (block(layer, x), None), x, p)[0]


def scanned_checkpointed_blocks(p, x, context):
    remat_block = jax.checkpoint(block, policy=jax.checkpoint_policies.dots_saveable)
    return jax.lax.scan(lambda x, layer: (remat_block(layer, x), None), x, p)[0]


def nested_scans(p, x, context):
    """Groups of layers: a scan over groups of a scan over layers, reversed and unrolled."""

    def group(x, layers):
        return jax.lax.scan(lambda x, layer: (block(layer, x), None), x, layers, unroll=2)[0]

    return jax.lax.scan(lambda x, layers: (group(x, layers), None), x, p, reverse=True)[0]


def shared_and_scanned(p, x, context):
    def body(x, layer):
        mixed = jnp.tanh(x @ p["shared"])  # one weight, used by every layer
        return x + jax.nn.gelu(mixed @ layer["w1"] + layer["b1"]) @ layer["w2"], None

    return jax.lax.scan(body, x, p["layers"])[0]


def rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def attention(p, x, context):
    h = rms_norm(x, p["scale"])
    q, k, v = (jnp.einsum("td,dhe->hte", h, p[name]) for name in ("wq", "wk", "wv"))
    scores = jnp.einsum("hte,hse->hts", q, k) / np.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    out = jnp.einsum("hts,hse->hte", weights, v)
    return x + jnp.einsum("hte,hed->td", out, p["wo"])


def attention_params(key):
    keys = jax.random.split(key, 5)
    head = WIDTH // HEADS
    p = {n: normal(k, (WIDTH, HEADS, head), WIDTH**-0.5) for n, k in zip("qkv", keys, strict=False)}
    return {
        "scale": 1.0 + normal(keys[3], (WIDTH,), 0.1),
        "wq": p["q"],
        "wk": p["k"],
        "wv": p["v"],
        "wo": normal(keys[4], (HEADS, head, WIDTH), WIDTH**-0.5),
    }


def bf16_blocks(p, x, context):
    half = jax.tree_util.tree_map(lambda w: w.astype(jnp.bfloat16), p)
    h = x.astype(jnp.bfloat16)
    for layer in half:
        h = block(layer, h)
    return h.astype(jnp.float32)


def pytree_blocks(p, x, context):
    h = x["h"] + jnp.sin(x["pos"].astype(jnp.float32))[:, None]
    for layer in p:
        h = block(layer, h)
    return {"h": h, "pos": x["pos"]}


def dropout_blocks(p, x, context):
    key = jax.random.fold_in(context.key, context.stage)
    for i, layer in enumerate(p):
        hidden = jax.nn.gelu(x @ layer["w1"] + layer["b1"])
        keep = jax.random.bernoulli(jax.random.fold_in(key, i), 0.9, hidden.shape)
        x = x + jnp.where(keep, hidden / 0.9, 0.0) @ layer["w2"]
    return x


def layer_list(key, layers=LAYERS):
    return [mlp_params(k) for k in jax.random.split(key, layers)]


CASES = {
    "linear": Case(
        linear,
        lambda k: {"w": dense_init(k, WIDTH, HIDDEN), "b": normal(k, (HIDDEN,))},
        x_of,
        weight_ops=1,
        widest=BATCH * HIDDEN,
        naive_over=None,
    ),
    "mlp": Case(mlp, mlp_params, x_of, weight_ops=2, widest=BATCH * HIDDEN, naive_over=1.15),
    "unrolled": Case(
        unrolled_blocks, layer_list, x_of, weight_ops=2 * LAYERS, widest=BATCH * HIDDEN
    ),
    "scan": Case(
        scanned_blocks,
        lambda k: mlp_params(k, LAYERS),
        x_of,
        weight_ops=2 * LAYERS,
        widest=BATCH * HIDDEN,
    ),
    "scan_all_stored": Case(
        scanned_blocks,
        lambda k: mlp_params(k, LAYERS),
        x_of,
        weight_ops=2 * LAYERS,
        widest=BATCH * HIDDEN,
        all_stored=True,
    ),
    "scan_checkpoint": Case(
        jax.checkpoint(scanned_blocks, policy=jax.checkpoint_policies.dots_saveable),
        lambda k: mlp_params(k, LAYERS),
        x_of,
        weight_ops=2 * LAYERS,
        widest=BATCH * HIDDEN,
    ),
    "scan_checkpoint_body": Case(
        scanned_checkpointed_blocks,
        lambda k: mlp_params(k, LAYERS),
        x_of,
        weight_ops=2 * LAYERS,
        widest=BATCH * HIDDEN,
    ),
    "nested_scans": Case(
        nested_scans,
        lambda k: jax.tree_util.tree_map(
            lambda w: w.reshape(2, LAYERS // 2, *w.shape[1:]), mlp_params(k, LAYERS)
        ),
        x_of,
        weight_ops=2 * LAYERS,
        widest=BATCH * HIDDEN,
    ),
    "jit": Case(
        jax.jit(unrolled_blocks), layer_list, x_of, weight_ops=2 * LAYERS, widest=BATCH * HIDDEN
    ),
    "shared_const": Case(
        shared_and_scanned,
        lambda k: {
            "shared": dense_init(jax.random.fold_in(k, 1), WIDTH, WIDTH),
            "layers": mlp_params(k, LAYERS),
        },
        x_of,
        weight_ops=3 * LAYERS,
        widest=BATCH * HIDDEN,
    ),
    "attention": Case(
        attention,
        attention_params,
        x_of,
        weight_ops=5,
        widest=max(BATCH * WIDTH, HEADS * BATCH * BATCH),
        naive_over=1.15,
    ),
    "bf16": Case(bf16_blocks, layer_list, x_of, weight_ops=2 * LAYERS, widest=BATCH * HIDDEN),
    "pytree": Case(
        pytree_blocks,
        layer_list,
        lambda k: {
            "h": x_of(k),
            "pos": jax.random.randint(jax.random.fold_in(k, 1), (BATCH,), 0, 100, jnp.int32),
        },
        weight_ops=2 * LAYERS,
        widest=BATCH * HIDDEN,
    ),
    "dropout": Case(dropout_blocks, layer_list, x_of, weight_ops=2 * LAYERS, widest=BATCH * HIDDEN),
}


# --------------------------------------------------------------------------- harness
def is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def make_backward(case: Case, params, x, context):
    """``(back, stored, ct)`` as the executor has them for one micro-batch: ``ct`` and
    ``dx`` are the float leaves of the stage output and input."""
    y_like = jax.eval_shape(case.stage, params, x, context)
    y_leaves, y_tree = jax.tree_util.tree_flatten(y_like)

    def full_cotangent(ct):
        floats = iter(ct)
        leaves = [
            next(floats) if is_float(leaf) else np.zeros(leaf.shape, jax.dtypes.float0)
            for leaf in y_leaves
        ]
        return jax.tree_util.tree_unflatten(y_tree, leaves)

    def finish(d_params, dx):
        return d_params, [leaf for leaf in jax.tree_util.tree_leaves(dx) if is_float(leaf)]

    if case.all_stored:
        _, vjp_fn = jax.vjp(lambda p, x: case.stage(p, x, context), params, x)
        stored, vjp_tree = jax.tree_util.tree_flatten(vjp_fn)

        def back(stored, params, context, ct):
            vjp_fn = jax.tree_util.tree_unflatten(vjp_tree, stored)
            return finish(*vjp_fn(full_cotangent(ct)))

    else:
        spec = residuals.analyse(case.stage, params, x, context)
        _, stored = residuals.forward(spec, case.stage, params, x, context)

        def back(stored, params, context, ct):
            vjp_fn = residuals.vjp(spec, case.stage, params, x, context, stored)
            return finish(*vjp_fn(full_cotangent(ct)))

    ct_key = jax.random.key(7)
    ct = [
        normal(jax.random.fold_in(ct_key, i), leaf.shape)
        for i, leaf in enumerate(y_leaves)
        if is_float(leaf)
    ]
    return back, stored, ct


def setup(case: str | Case, seed: int = 0):
    case = CASES[case] if isinstance(case, str) else case
    keys = jax.random.split(jax.random.key(seed), 3)
    params = case.params(keys[0])
    x = case.x(keys[1])
    context = Context(key=keys[2], stage=jnp.int32(1))
    back, stored, ct = make_backward(case, params, x, context)
    return case, back, (stored, params, context, ct)


def assert_close(actual, expected, rtol=1e-5):
    actual, expected = jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype
        scale = float(jnp.max(jnp.abs(e)))
        assert scale > 0  # random inputs: no gradient is zero
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=rtol * scale)


# ----------------------------------------------------------------------------- tests
# The fast loop splits the plain cases; scans, remat, attention, dtypes and dropout are slow.
FAST = {"linear", "mlp", "unrolled", "jit", "pytree"}


@pytest.mark.parametrize(
    "name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in CASES]
)
def test_split_is_exact_small_and_cheap(name):
    case, back, args = setup(name)
    stored, params, context, ct = args
    split = split_backward(back, *args)
    assert split.recomputed == ()

    # numbers
    d_params, dx = back(*args)
    b_dx, stash = split.b_fn(*args)
    assert_close(b_dx, dx)
    assert_close(split.w_fn(stored, params, context, stash), d_params)
    assert [(s.shape, s.dtype) for s in stash] == [(s.shape, s.dtype) for s in split.stash_structs]

    # memory: activation-sized, never parameter-shaped
    param_shapes = {leaf.shape for leaf in jax.tree_util.tree_leaves(params)}
    param_shapes |= {shape[1:] for shape in param_shapes}  # one layer of a stack
    for s in split.stash_structs:
        for shape in param_shapes:  # the stash is not a parameter, nor a stack of them
            assert len(shape) < 2 or s.shape[-len(shape) :] != shape, (s, shape)
        assert jnp.issubdtype(s.dtype, jnp.floating), s
    bound = case.weight_ops * case.widest * 4
    assert 0 < split.stash_nbytes <= bound, (split.stash_structs, bound)

    # compute
    full = flops(back, *args)
    b = flops(split.b_fn, *args)
    w = flops(split.w_fn, stored, params, context, stash)
    assert b + w <= 1.1 * full, (b, w, full)
    if case.naive_over is not None:
        naive_w = flops(lambda *a: back(*a)[0], *args)
        assert b + naive_w > case.naive_over * full, (b, naive_w, full)


def test_dropout_mask_is_recomputed_not_stashed():
    _, back, args = setup("dropout")
    split = split_backward(back, *args)
    assert not any(s.dtype == jnp.bool_ for s in split.stash_structs)
    assert len(split.stash_structs) == 2 * LAYERS  # one cotangent per weight-consuming op
    assert "random_bits" in str(jax.make_jaxpr(split.b_fn)(*args))


def test_shared_weight_gradient_is_carried_by_w():
    """The gradient of a weight every scan iteration uses is a carry of the W scan."""
    _, back, args = setup("shared_const")
    split = split_backward(back, *args)
    b_jaxpr = str(jax.make_jaxpr(split.b_fn)(*args))
    stash = split.b_fn(*args)[1]
    w_jaxpr = jax.make_jaxpr(split.w_fn)(*args[:3], stash)
    (scan,) = [e for e in w_jaxpr.eqns if e.primitive.name == "scan"]
    carried = [v.aval.shape for v in scan.outvars[: equations.scan(scan).num_carry]]
    assert carried == [(WIDTH, WIDTH)]
    assert f"f32[{WIDTH},{WIDTH}]" not in b_jaxpr.split("scan[")[1].split("jaxpr=")[0]


def normed_blocks(p, x, context):
    """Pre-norm blocks: ``x + gelu(rms_norm(x, scale) @ w1) @ w2``, a scan over layers."""

    def body(x, layer):
        normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        return x + jax.nn.gelu((normed * layer["scale"]) @ layer["w1"]) @ layer["w2"], None

    return jax.lax.scan(body, x, p)[0]


def test_small_weight_gradients_are_reduced_by_b_not_stashed_as_cotangents():
    """A norm scale's gradient is reduced by B and stashed whole (``[LAYERS, WIDTH]``):
    the stash is that and each matmul's output cotangent, not the norm's activation-sized
    float32 cotangent too."""
    tokens = 16 * BATCH

    def params(key):
        k1, k2, k3 = jax.random.split(key, 3)
        scale = 1.0 + normal(k1, (LAYERS, WIDTH), 0.1)
        return {"scale": scale, "w1": dense_init(k2, WIDTH, HIDDEN, LAYERS),
                "w2": dense_init(k3, HIDDEN, WIDTH, LAYERS)}  # fmt: skip

    case = Case(normed_blocks, params, lambda key: normal(key, (tokens, WIDTH)), 2, 0)
    _, back, args = setup(case)
    split = split_backward(back, *args)
    d_params, dx = back(*args)
    b_dx, stash = split.b_fn(*args)
    assert_close(b_dx, dx)
    assert_close(split.w_fn(*args[:3], stash), d_params)
    shapes = sorted(s.shape for s in split.stash_structs)
    assert shapes == [(LAYERS, WIDTH), (LAYERS, tokens, WIDTH), (LAYERS, tokens, HIDDEN)]


@pytest.mark.parametrize("name", ["unrolled", pytest.param("scan", marks=pytest.mark.slow)])
def test_narrow_stash_keeps_block_output_cotangents_and_recomputes_the_hidden_ones(name):
    """With ``narrow_stash`` W computes each hidden-layer cotangent again from its block's
    output cotangent (one matrix product per block more): the stash holds no hidden-wide
    array, is at most half the default's, and the gradients stay exact."""
    case, back, args = setup(name)
    stored, params, context, ct = args
    wide = split_backward(back, *args)
    narrow = split_backward(back, *args, narrow_stash=True)
    d_params, dx = back(*args)
    b_dx, stash = narrow.b_fn(*args)
    assert_close(b_dx, dx)
    assert_close(narrow.w_fn(stored, params, context, stash), d_params)

    def hidden_wide(split):
        return [s.shape for s in split.stash_structs if {BATCH, HIDDEN} <= set(s.shape)]

    assert hidden_wide(wide) and not hidden_wide(narrow), (wide, narrow)
    assert 2 * narrow.stash_nbytes <= wide.stash_nbytes, (narrow, wide)
    assert "dot_general" in " ".join(narrow.recomputed), narrow.recomputed
    full = flops(back, *args)
    b = flops(narrow.b_fn, *args)
    w = flops(narrow.w_fn, stored, params, context, stash)
    one_product_per_block = 2 * BATCH * WIDTH * HIDDEN * LAYERS
    assert b + w <= 1.1 * (full + one_product_per_block), (b, w, full)
    assert b + w > full + 0.9 * one_product_per_block, (b, w, full)


@pytest.mark.parametrize(
    "name,stacked", [("unrolled", False), ("jit", False), ("scan", True), ("nested_scans", True)]
)
def test_a_stash_made_by_a_scan_is_narrowed_with_remat_even_in_one_slot(name, stacked):
    """A scan hands B's stash over stacked over its iterations (`stacks_stash`), so with
    ``remat`` the executor narrows it even where one slot holds it; written value by value
    (the blocks in a loop, a jit), it narrows it only where W's are held back."""
    _, back, args = setup(name)
    assert stacks_stash(back, *args) == stacked
    assert narrows_stash(True, 1, stacked) == stacked
    assert narrows_stash(True, 2, stacked) and not narrows_stash(False, 2, stacked)


def deep_blocks(p, x, context):
    """Blocks of three hidden layers: ``x + gelu(gelu(x @ w1) @ w2) @ w3``."""
    for q in p:
        x = x + jax.nn.gelu(jax.nn.gelu(x @ q["w1"]) @ q["w2"]) @ q["w3"]
    return x


def deep_params(key):
    keys = jax.random.split(key, 3 * 2)
    return [
        {"w1": dense_init(a, WIDTH, HIDDEN), "w2": dense_init(b, HIDDEN, HIDDEN),
         "w3": dense_init(c, HIDDEN, WIDTH)}
        for a, b, c in zip(keys[0::3], keys[1::3], keys[2::3], strict=True)
    ]  # fmt: skip


def test_narrow_stash_recomputes_through_one_matrix_product_at_most():
    """A block whose hidden cotangents chain through two matrix products: W recomputes the
    last hidden layer's cotangent only (one product per block), and stashes the others."""
    case = Case(deep_blocks, deep_params, x_of, weight_ops=6, widest=BATCH * HIDDEN)
    _, back, args = setup(case)
    stored, params, context, ct = args
    narrow = split_backward(back, *args, narrow_stash=True)
    d_params, dx = back(*args)
    b_dx, stash = narrow.b_fn(*args)
    assert_close(b_dx, dx)
    assert_close(narrow.w_fn(stored, params, context, stash), d_params)
    full = flops(back, *args)
    w = flops(narrow.w_fn, stored, params, context, stash)
    b = flops(narrow.b_fn, *args)
    assert b + w <= 1.05 * full + 2 * (2 * BATCH * WIDTH * HIDDEN), (b, w, full)
    assert narrow.stash_nbytes < split_backward(back, *args).stash_nbytes


def test_narrow_stash_leaves_keys_and_empty_gradients_alone():
    """A cotangent-dependent PRNG key (no size in bytes) splits without error and exactly;
    an empty weight gradient from a loop is not "narrower" than itself (W would run the
    loop again)."""
    k = jax.random.split(jax.random.key(1), 4)
    x, ct, A = normal(k[1], (6, 4)), normal(k[2], (6, 4)), normal(k[3], (4, 4), 0.5)
    params = {"w": normal(k[3], (4, 12)), "empty": jnp.zeros((0,))}
    context = Context(key=k[0], stage=jnp.int32(1))

    def back(stored, params, context, ct):
        key = jax.random.fold_in(context.key, jax.lax.bitcast_convert_type(ct[0, 0], jnp.uint32))
        wide = jnp.tile(ct, (1, 3)) + 1e-3 * jax.random.uniform(key, (6, 12))

        def body(i, c):
            return jnp.tanh(c[0] @ A), c[1] + 0 * c[0].sum()

        g, d_empty = jax.lax.fori_loop(0, 3 + context.stage, body, (ct, jnp.zeros((0,))))
        return {"w": stored.T @ wide, "empty": d_empty}, g @ params["w"][:, :4].T

    args = (x, params, context, ct)
    split = split_backward(back, *args, narrow_stash=True)
    d_params, dx = back(*args)
    b_dx, stash = split.b_fn(*args)
    assert_close(b_dx, dx)
    w_params = split.w_fn(x, params, context, stash)
    assert_close(w_params["w"], d_params["w"])
    assert w_params["empty"].shape == (0,)
    assert "while" not in split.recomputed, split.recomputed


def cond_stage(p, x, context):
    return jax.lax.cond(
        context.stage > 0,
        lambda x: unrolled_blocks(p, x, context),
        lambda x: -unrolled_blocks(p, x, context),
        x,
    )


COND = Case(cond_stage, layer_list, x_of, weight_ops=1, widest=BATCH * WIDTH)


def test_cond_falls_back_to_recompute_in_w():
    """A ``cond`` is not split: W runs it again, from a stash that is still activations."""
    _, back, args = setup(COND)
    stored, params, context, ct = args
    split = split_backward(back, *args)
    assert split.recomputed == ("cond",)
    d_params, dx = back(*args)
    b_dx, stash = split.b_fn(*args)
    assert_close(b_dx, dx)
    assert_close(split.w_fn(stored, params, context, stash), d_params)
    assert [s.shape for s in split.stash_structs] == [(BATCH, WIDTH)]  # ct itself


def test_a_scan_it_cannot_read_is_recomputed_with_one_warning(monkeypatch):
    """A JAX whose scan params `equations` does not know (simulated): the scan is one
    opaque equation, one warning names it, and B and W stay exact."""
    monkeypatch.setattr(equations, "scan", lambda eqn: None)
    _, back, args = setup("scan")
    stored, params, context, ct = args
    with pytest.warns(SplitFallbackWarning) as caught:
        split = split_backward(back, *args)
    assert len(caught) == 1 and "scan (its params are not in a form" in str(caught[0].message)
    assert split.recomputed == ("scan",)
    d_params, dx = back(*args)
    b_dx, stash = split.b_fn(*args)
    assert_close(b_dx, dx)
    assert_close(split.w_fn(stored, params, context, stash), d_params)


def new_call(fn, *args):
    """``fn(*args)`` as one equation of a call primitive JAX does not have."""
    return _NEW_CALL.bind(*args, jaxpr=jax.make_jaxpr(fn)(*args))


def _run_body(*args, jaxpr):
    return jex.core.jaxpr_as_fun(jaxpr)(*args)


_NEW_CALL = jex.core.Primitive("new_call")
_NEW_CALL.multiple_results = True
_NEW_CALL.def_impl(_run_body)
_NEW_CALL.def_abstract_eval(lambda *avals, jaxpr: [v.aval for v in jaxpr.jaxpr.outvars])
mlir.register_lowering(_NEW_CALL, mlir.lower_fun(_run_body, multiple_results=True))


def test_a_new_call_primitive_is_recomputed_with_one_warning():
    """An unknown primitive with a sub-jaxpr on the chain of cotangents, one output for B
    and one for W: W runs it again from the stash, one warning names it, both exact."""
    keys = jax.random.split(jax.random.key(5), 3)
    x, w = normal(keys[0], (BATCH, WIDTH)), normal(keys[1], (WIDTH, HIDDEN))
    ct = normal(keys[2], (BATCH, HIDDEN))

    def back(stored, params, context, ct):
        dx, dy = new_call(lambda c, w: (c @ w.T, jnp.tanh(c)), ct, params["w"])
        return {"w": stored.T @ dy}, dx

    args = (x, {"w": w}, Context(key=keys[0], stage=jnp.int32(0)), ct)
    with pytest.warns(SplitFallbackWarning) as caught:
        split = split_backward(back, *args)
    assert len(caught) == 1 and "new_call (a primitive with a sub-jaxpr" in str(caught[0].message)
    assert split.recomputed == ("new_call",)
    d_params, dx = back(*args)
    b_dx, stash = split.b_fn(*args)
    assert_close(b_dx, dx)
    assert_close(split.w_fn(x, {"w": w}, args[2], stash), d_params)
    assert [s.shape for s in split.stash_structs] == [(BATCH, HIDDEN)]  # ct itself


def test_a_pallas_kernel_is_one_opaque_equation_without_a_warning():
    """A Pallas kernel (``pallas_call``, here in interpret mode) on the chain of cotangents,
    as a fused attention kernel's backward is: one equation, no warning, B and W exact, and
    W reads the kernel's output from the stash instead of running the kernel again."""
    from jax.experimental import pallas as pl

    def double(ref, out):
        out[...] = 2.0 * jnp.tanh(ref[...])

    keys = jax.random.split(jax.random.key(6), 3)
    x, w = normal(keys[0], (BATCH, WIDTH)), normal(keys[1], (WIDTH, HIDDEN))
    ct = normal(keys[2], (BATCH, HIDDEN))

    def back(stored, params, context, ct):
        dy = pl.pallas_call(double, out_shape=ct, interpret=True)(ct)
        return {"w": stored.T @ dy}, dy @ params["w"].T

    args = (x, {"w": w}, Context(key=keys[0], stage=jnp.int32(0)), ct)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SplitFallbackWarning)
        split = split_backward(back, *args)
    assert split.recomputed == ()
    d_params, dx = back(*args)
    b_dx, stash = split.b_fn(*args)
    assert_close(b_dx, dx)
    assert_close(split.w_fn(x, {"w": w}, args[2], stash), d_params)
    assert [s.shape for s in split.stash_structs] == [(BATCH, HIDDEN)]  # the kernel's output


def test_arguments_of_another_structure_are_refused():
    _, back, args = setup("mlp")
    stored, params, context, ct = args
    split = split_backward(back, *args)
    with pytest.raises(TypeError, match="structure"):
        split.b_fn(stored, params, context, ct + ct)


def test_flops_counts_every_scan_iteration():
    w = jnp.ones((LAYERS, WIDTH, WIDTH))
    x = jnp.ones((BATCH, WIDTH))

    def stack(w, x):
        return jax.lax.scan(lambda x, w: (x @ w, None), x, w)[0]

    assert flops(stack, w, x) == pytest.approx(LAYERS * 2 * BATCH * WIDTH * WIDTH, rel=0.01)
    assert flops(stack, w, x, unroll=False) < flops(stack, w, x)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["shared_const", "scan_checkpoint", "cond"])
def test_split_runs_inside_shard_map(name):
    """B and W run in a ``shard_map`` over ``pipe`` (as in the executor), split either
    outside it (from arrays that do not vary over ``pipe``) or inside it (from what the
    executor has there: inputs and cotangents varying over ``pipe``, weights not)."""
    mesh = jax.make_mesh(
        (2,), ("pipe",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2]
    )
    cases = [COND if name == "cond" else CASES[name]]
    keys = jax.random.split(jax.random.key(3), 3)
    context = Context(key=keys[2], stage=jnp.int32(1))
    params = [case.params(keys[0]) for case in cases]
    xs = [jnp.stack([case.x(jax.random.fold_in(keys[1], d)) for d in range(2)]) for case in cases]

    outside, stored, cts, expected = [], [], [], []
    for case, x, p in zip(cases, xs, params, strict=True):
        per_device = [make_backward(case, p, x[d], context) for d in range(2)]
        back, _, _ = per_device[0]
        outside.append(split_backward(back, per_device[0][1], p, context, per_device[0][2]))
        stored.append(jax.tree_util.tree_map(lambda *a: jnp.stack(a), *[b[1] for b in per_device]))
        cts.append(jax.tree_util.tree_map(lambda *a: jnp.stack(a), *[b[2] for b in per_device]))
        expected.append([b[0](b[1], p, context, b[2]) for b in per_device])

    def on_device(xs, stored, cts, params, context):
        results = []
        for case, x, s, ct, p, split in zip(cases, xs, stored, cts, params, outside, strict=True):
            s, ct = [a[0] for a in s], [a[0] for a in ct]
            dx, stash = split.b_fn(s, p, context, ct)  # split outside
            outside_result = (dx, split.w_fn(s, p, context, stash))
            back, s, ct = make_backward(case, p, x[0], context)  # split inside
            ct = [jax.lax.pcast(c, ("pipe",), to="varying") for c in ct]
            split = split_backward(back, s, p, context, ct)
            dx, stash = split.b_fn(s, p, context, ct)
            inside_result = (dx, split.w_fn(s, p, context, stash))
            d_params, dx = back(s, p, context, ct)
            results.append((outside_result, inside_result, (dx, d_params)))
        return jax.tree_util.tree_map(lambda a: a[None], results)

    run = jax.jit(
        jax.shard_map(
            on_device, mesh=mesh, in_specs=(P("pipe"),) * 3 + (P(), P()), out_specs=P("pipe")
        )
    )
    results = run(xs, stored, cts, params, context)
    for result, per_device in zip(results, expected, strict=True):
        (dx, d_params), inside, inside_expected = result
        for d, (ref_params, ref_dx) in enumerate(per_device):
            assert_close([a[d] for a in dx], ref_dx)
            assert_close(jax.tree_util.tree_map(lambda a, d=d: a[d], d_params), ref_params)
        assert_close(inside, inside_expected)
