"""Stages that run their blocks in a ``lax.scan`` over stacked weights (bare, with a
``jax.checkpoint`` body, or through ``nnx.scan``): the pipeline runs the scan as a loop over
the blocks (`jaxpipe._jaxpr.unroll`), and loss and gradients stay those of the plain model
written with the scan."""

import jax
import jax.numpy as jnp
import models
import numpy as np
import pytest
from flax import nnx

from jaxpipe import pipeline, reference
from jaxpipe._jaxpr.unroll import MAX_UNROLLED_EQUATIONS, unrolled

TOL = 1e-5
BLOCKS, WIDTH, HIDDEN = 3, 8, 16


def block(q, x):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    h = (x - mean) * q["scale"]
    return x + jnp.tanh(h @ q["w1"] + q["b1"]) @ q["w2"]


def scanned(p, x):
    return jax.lax.scan(lambda x, q: (block(q, x), None), x, p)[0]


# a block repeated this often has more equations, three times over, than the pipeline
# writes out: a stage of three runs its scan as a scan (`jaxpipe._jaxpr.unroll`)
REPEATS = MAX_UNROLLED_EQUATIONS // BLOCKS // 8 + 1


def kept(p, x):
    def body(x, q):
        for _ in range(REPEATS):
            x = block(q, x)
        return x, None

    return jax.lax.scan(body, x, p)[0]


def checkpointed(p, x):
    body = jax.checkpoint(
        lambda x, q: (block(q, x), None), policy=jax.checkpoint_policies.nothing_saveable
    )
    return jax.lax.scan(body, x, p)[0]


class Block(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(WIDTH, HIDDEN, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, WIDTH, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


def nnx_blocks(rngs):
    @nnx.split_rngs(splits=BLOCKS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return Block(rngs)

    return make(rngs)


def nnx_stage(graphdef):
    def stage_fn(p, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, one):
            return one(x)

        return run(x, nnx.merge(graphdef, p))

    return stage_fn


def stage_and_params(form, num_stages, key):
    """``(stage_fn, logical stage parameters [num_stages, BLOCKS, ...])`` of a form."""
    if form == "nnx":
        keys = jax.random.split(key, num_stages)
        states = [nnx.split(nnx_blocks(nnx.Rngs(k))) for k in keys]
        params = jax.tree.map(lambda *a: jnp.stack(a), *[s for _, s in states])
        return nnx_stage(states[0][0]), params
    normal = models.numpy_rng(key).standard_normal
    lead = (num_stages, BLOCKS)
    params = models.float32({
        "scale": 1.0 + 0.1 * normal((*lead, WIDTH)),
        "w1": normal((*lead, WIDTH, HIDDEN)) / np.sqrt(WIDTH),
        "b1": 0.1 * normal((*lead, HIDDEN)),
        "w2": normal((*lead, HIDDEN, WIDTH)) / np.sqrt(HIDDEN),
    })  # fmt: skip
    return {"scan": scanned, "checkpointed": checkpointed, "kept": kept}[form], params


def scan_lengths(closed) -> list:
    return [e.params["length"] for e in closed.jaxpr.eqns if e.primitive.name == "scan"]


def test_unrolled_scans_compute_what_the_scans_do():
    """Consts, two carries, xs, ys, a reverse scan, a scan inside a scan's body (kept, once per
    iteration) and one inside a ``jax.checkpoint`` (written out): the same values and
    gradients, to rounding, and no scan over ``w`` left."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((4, 5, 5)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((5,)), jnp.float32)

    def fn(w, x, c):
        def body(carry, q):
            h, total = carry
            inner = jax.lax.scan(lambda a, _: (jnp.sin(a) + c, a.sum()), h @ q, None, length=2)
            h = jnp.tanh(inner[0])
            return (h, total + h.sum()), (h.mean(), inner[1])

        (h, total), ys = jax.lax.scan(body, (x, 0.0), w)
        back = jax.checkpoint(lambda h: jax.lax.scan(lambda a, q: (a @ q.T, a), h, w, reverse=True))
        h, stacked = back(h)
        return h, total, ys, stacked

    want = fn(w, x, c)
    got = unrolled(fn)(w, x, c)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert scan_lengths(jax.make_jaxpr(fn)(w, x, c)) == [4]
    assert scan_lengths(jax.make_jaxpr(unrolled(fn))(w, x, c)) == [2] * 4
    grads = jax.grad(lambda w: unrolled(fn)(w, x, c)[1])(w)
    np.testing.assert_allclose(grads, jax.grad(lambda w: fn(w, x, c)[1])(w), rtol=1e-5)


def test_written_out_loop_barriers_its_results_not_their_cotangents():
    """The written-out loop's results pass one optimization barrier; their cotangents pass
    none (the TPU compiler keeps the recomputed blocks' values around a barrier on B's
    incoming cotangent), and forward mode runs through it with respect to the carry, with
    the scan's tangents (a scan over stacked inputs takes none: `unroll`'s docstring)."""
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((3, 4, 4)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 4)), jnp.float32)

    def fn(w, x):
        return jax.lax.scan(lambda h, q: (jnp.tanh(h @ q), None), x, w)[0]

    def barriers(f, *args):
        return str(jax.make_jaxpr(f)(*args)).count("optimization_barrier")

    assert barriers(unrolled(fn), w, x) == 1
    assert barriers(jax.grad(lambda x: unrolled(fn)(w, x).sum()), x) == 1
    grads = jax.grad(lambda w, x: unrolled(fn)(w, x).sum(), argnums=(0, 1))(w, x)
    want = jax.grad(lambda w, x: fn(w, x).sum(), argnums=(0, 1))(w, x)
    for a, b in zip(grads, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    tangent = jnp.ones_like(x)
    got = jax.jvp(
        lambda x: unrolled(
            lambda x: jax.lax.scan(lambda h, _: (jnp.tanh(h @ w[0]), None), x, None, length=3)[0]
        )(x),
        (x,),
        (tangent,),
    )
    want = jax.jvp(
        lambda x: jax.lax.scan(lambda h, _: (jnp.tanh(h @ w[0]), None), x, None, length=3)[0],
        (x,),
        (tangent,),
    )
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


CASES = [  # each form once, each remat, the split-backward schedules (CI time)
    pytest.param("zbv", "scan", False, marks=pytest.mark.slow),
    pytest.param("1f1b", "checkpointed", True, marks=pytest.mark.slow),
    pytest.param("dualpipev", "nnx", True, marks=pytest.mark.slow),
    pytest.param("zb_h1", "nnx", False, marks=pytest.mark.slow),
    pytest.param("zbv", "kept", True, marks=pytest.mark.slow),
    # one stash slot, narrowed: the stash comes out of a scan
    pytest.param("1f1b", "kept", True, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("schedule,form,remat", CASES)
def test_scanned_stage_loss_and_gradients_equal_the_plain_model(schedule, form, remat):
    """4 devices, 8 micro-batches, three blocks per stage scanned: loss and every gradient
    equal the plain model's (the same stage function, stage after stage, under
    ``jax.value_and_grad``) to 1e-5 relative."""
    S, M = 4, 8
    mesh = models.pipe_mesh(S)
    probe = pipeline.Pipeline(
        scanned, models.loss_fn, mesh=mesh, schedule=schedule, num_microbatches=M
    )
    k1, k2, k3 = jax.random.split(jax.random.key(len(schedule) + 7 * remat), 3)
    stage_fn, sp = stage_and_params(form, probe.num_logical_stages, k1)
    pipe = pipeline.Pipeline(
        stage_fn, models.loss_fn, mesh=mesh, schedule=schedule, num_microbatches=M, remat=remat
    )
    lp = {"head": models.init(k2, 1)[1]["head"]}
    x, t = models.data(k3, 2 * M)
    loss, grads = jax.jit(jax.value_and_grad(pipe.loss, argnums=(0, 1, 2)))(
        pipe.place(sp), lp, x, t
    )
    grads = (pipe.logical(grads[0]), *grads[1:])

    def plain(sp, lp, x):
        return reference.loss(stage_fn, models.loss_fn, sp, lp, x, t, M)

    ref_loss, ref = jax.jit(jax.value_and_grad(plain, argnums=(0, 1, 2)))(sp, lp, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=TOL)
    for got, want in zip(grads, ref, strict=True):
        assert models.relative_error(got, want) < TOL


def residual_bytes(fn, *args) -> int:
    """Bytes of what ``jax.vjp(fn, *args)`` keeps for the backward (its inputs among them)."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(jax.vjp(fn, *args)[1]))


def test_a_scan_beyond_the_equation_bound_stays_a_scan_keeping_no_elementwise_values():
    """A scan whose written-out form would exceed ``MAX_UNROLLED_EQUATIONS`` (many large
    blocks) is left a scan, with the scan's values and gradients. What it keeps for its
    backward is each block's input and its matrix products' results: the elementwise values
    (GELU's) are recomputed, where a bare scan keeps 4x as much or more. A body with a
    ``jax.checkpoint`` of its own keeps what its policy says."""
    rng = np.random.default_rng(1)
    blocks, matmuls = 8, MAX_UNROLLED_EQUATIONS // 8 // 4 + 1  # > bound / 8 equations
    w = jnp.asarray(rng.standard_normal((blocks, 5, 5)) / 3, jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)

    def large_block(h, q):
        for _ in range(matmuls):
            h = jax.nn.gelu(h @ q)
        return h, None

    def fn(w, x):
        return jax.lax.scan(large_block, x, w)[0]

    def own_checkpoint(w, x):
        body = jax.checkpoint(large_block, policy=jax.checkpoint_policies.nothing_saveable)
        return jax.lax.scan(body, x, w)[0]

    assert scan_lengths(jax.make_jaxpr(unrolled(fn))(w, x)) == [blocks]
    assert scan_lengths(jax.make_jaxpr(unrolled(fn))(w[:1], x)) == []  # one block: written out
    np.testing.assert_allclose(unrolled(fn)(w, x), fn(w, x), rtol=1e-6)
    loss = lambda f: lambda w, x: jnp.sum(jnp.sin(f(w, x)))  # noqa: E731
    for got, want in zip(
        jax.grad(loss(unrolled(fn)), (0, 1))(w, x), jax.grad(loss(fn), (0, 1))(w, x), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    products_and_inputs = w.nbytes + blocks * (matmuls + 1) * x.nbytes
    assert residual_bytes(unrolled(fn), w, x) == products_and_inputs
    assert residual_bytes(fn, w, x) > 3 * products_and_inputs
    assert residual_bytes(unrolled(own_checkpoint), w, x) == residual_bytes(own_checkpoint, w, x)
    assert residual_bytes(own_checkpoint, w, x) == w.nbytes + blocks * x.nbytes


def test_a_kept_scan_recomputes_attention_scores_and_keeps_the_other_products():
    """In a kept scan, a matrix product whose result outgrows its operands (attention's
    scores, ``s x s`` per head from ``s x d`` ones) is recomputed in the backward, so what
    the scan keeps holds no array of the scores' size; a batched product that does not
    outgrow them (an expert's ``[e, c, d] x [e, d, f]``) is kept like any other. Values and
    gradients are the scan's."""
    rng = np.random.default_rng(3)
    blocks, heads, seq, dim, experts = 4, 2, 16, 4, 2
    width = heads * dim
    w = jnp.asarray(rng.standard_normal((blocks, 3, width, width)) / 3, jnp.float32)
    e = jnp.asarray(rng.standard_normal((blocks, experts, width, width)) / 3, jnp.float32)
    x = jnp.asarray(rng.standard_normal((seq, width)), jnp.float32)
    repeats = MAX_UNROLLED_EQUATIONS // blocks // 20 + 1

    def attention_and_experts(h, q):
        qkv, expert = q
        for _ in range(repeats):
            a, b, c = (jnp.reshape(h @ m, (seq, heads, dim)) for m in qkv)
            scores = jnp.einsum("shd,thd->hst", a, b)  # batched over heads, s x s
            h = h + jnp.einsum("hst,thd->shd", jax.nn.softmax(scores), c).reshape(seq, width)
            routed = jnp.einsum("ecd,edf->ecf", jnp.reshape(h, (experts, -1, width)), expert)
            h = jnp.tanh(jnp.reshape(routed, (seq, width)))
        return h, None

    def fn(w, e, x):
        return jax.lax.scan(attention_and_experts, x, (w, e))[0]

    assert scan_lengths(jax.make_jaxpr(unrolled(fn))(w, e, x)) == [blocks]
    np.testing.assert_allclose(unrolled(fn)(w, e, x), fn(w, e, x), rtol=1e-6)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    got = jax.grad(loss(unrolled(fn)), (0, 1, 2))(w, e, x)
    want = jax.grad(loss(fn), (0, 1, 2))(w, e, x)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    kept_shapes = [a.shape[1:] for a in jax.tree.leaves(jax.vjp(unrolled(fn), w, e, x)[1])]
    bare_shapes = [a.shape[1:] for a in jax.tree.leaves(jax.vjp(fn, w, e, x)[1])]
    scores, routed = (heads, seq, seq), (experts, seq // experts, width)
    assert scores in bare_shapes and scores not in kept_shapes
    assert routed in kept_shapes


def test_a_kept_scan_computes_what_the_scan_does():
    """A scan the pipeline keeps (too large to write out) with consts, a float and an int
    carry, two xs, ys, ``reverse`` and ``unroll``: its values and gradients are the scan's,
    to rounding. A ``jax.checkpoint`` nested in the body (inside a ``jit``) keeps its
    policy: the rewritten scan keeps for the backward what the scan does."""
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((6, 5, 5)) / 3, jnp.float32)
    b = jnp.asarray(rng.standard_normal((6, 5)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((5,)), jnp.float32)
    matmuls = MAX_UNROLLED_EQUATIONS // 6 // 4 + 1

    def large_block(carry, q):
        h, count = carry
        for _ in range(matmuls):
            h = jax.nn.gelu(h @ q[0] + q[1]) + c
        return (h, count + 1), (jnp.sum(h * h), count)

    def fn(w, b, x, c):
        (h, count), (sq, counts) = jax.lax.scan(
            large_block, (x, jnp.int32(0)), (w, b), reverse=True, unroll=2
        )
        return jnp.sum(jnp.sin(h)) + jnp.sum(sq * jnp.cos(counts.astype(jnp.float32))), count

    def nested(w, b, x, c):
        inner = jax.jit(
            jax.checkpoint(large_block, policy=jax.checkpoint_policies.nothing_saveable)
        )
        return jax.lax.scan(inner, (x, jnp.int32(0)), (w, b))[0][0]

    assert scan_lengths(jax.make_jaxpr(unrolled(fn))(w, b, x, c)) == [6]
    got, want = unrolled(fn)(w, b, x, c), fn(w, b, x, c)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert got[1] == want[1] == 6
    grad = jax.grad(lambda *a: unrolled(fn)(*a)[0], argnums=(0, 1, 2, 3))(w, b, x, c)
    ref = jax.grad(lambda *a: fn(*a)[0], argnums=(0, 1, 2, 3))(w, b, x, c)
    for g, r in zip(grad, ref, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    assert residual_bytes(unrolled(nested), w, b, x, c) == residual_bytes(nested, w, b, x, c)


# ----------------------------------------------------------------------------- inner policies
def looped_checkpoints(p, x):
    """Each block under its own checkpoint that saves nothing, in a Python loop."""
    one = jax.checkpoint(block, policy=jax.checkpoint_policies.nothing_saveable)
    for i in range(BLOCKS):
        x = one(jax.tree.map(lambda a, i=i: a[i], p), x)
    return x


def nnx_remat_stage(graphdef):
    """``nnx.scan`` over blocks each under ``nnx.remat`` (it saves nothing)."""

    def stage_fn(p, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def run(x, one):
            return one(x)

        return run(x, nnx.merge(graphdef, p))

    return stage_fn


def inner_form(form, key):
    """``(stage_fn, params of one stage)`` of a stage whose blocks checkpoint themselves."""
    if form == "nnx_remat":
        graphdef, params = nnx.split(nnx_blocks(nnx.Rngs(key)))
        return nnx_remat_stage(graphdef), params
    fn, params = stage_and_params("checkpointed", 1, key)
    params = jax.tree.map(lambda a: a[0], params)
    return {"checkpointed": checkpointed, "looped": looped_checkpoints}[form], params


@pytest.mark.parametrize("form", ["checkpointed", "looped", "nnx_remat"])
def test_an_inner_policy_runs_every_checkpoint_inside_the_stage_under_it(form):
    """`checkpoints.with_policy` keeps the stage's values and gradients (to rounding) and
    makes each block keep what the given policy saves: everything or the matrix products
    (more than the stage's own policy, which saves nothing), nothing (as the stage's own)."""
    from jaxpipe._jaxpr import checkpoints

    fn, p = inner_form(form, jax.random.key(3))
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 5, WIDTH)), jnp.float32)
    policies = jax.checkpoint_policies
    sizes = {}
    for name in ("everything_saveable", "dots_saveable", "nothing_saveable"):
        moved = checkpoints.with_policy(fn, getattr(policies, name))
        np.testing.assert_allclose(moved(p, x), fn(p, x), rtol=1e-6, atol=1e-6)
        got = jax.grad(lambda p, x, f=moved: f(p, x).sum(), argnums=(0, 1))(p, x)
        want = jax.grad(lambda p, x: fn(p, x).sum(), argnums=(0, 1))(p, x)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        sizes[name] = residual_bytes(moved, p, x)
    own = residual_bytes(fn, p, x)
    assert sizes["everything_saveable"] >= sizes["dots_saveable"] > own
    assert sizes["nothing_saveable"] == own


def test_an_inner_policy_leaves_a_stage_without_checkpoints_as_traced():
    """A stage that checkpoints nothing runs equation for equation as traced."""
    from jaxpipe._jaxpr import checkpoints

    fn, p = stage_and_params("scan", 1, jax.random.key(5))
    p = jax.tree.map(lambda a: a[0], p)
    x = jnp.ones((2, 5, WIDTH), jnp.float32)
    moved = checkpoints.with_policy(fn, jax.checkpoint_policies.everything_saveable)
    assert str(jax.make_jaxpr(moved)(p, x)) == str(jax.make_jaxpr(fn)(p, x))


@pytest.mark.parametrize("schedule,form,policy", [
    pytest.param("zbv", "checkpointed", "dots_saveable", marks=pytest.mark.slow),
    pytest.param("1f1b", "nnx_remat", "everything_saveable", marks=pytest.mark.slow),
])  # fmt: skip
def test_a_pipeline_with_an_inner_policy_equals_the_plain_model(schedule, form, policy):
    """4 devices, 8 micro-batches, the stage's own checkpoints under ``inner_remat_policy``:
    loss and every gradient equal the plain model's (its own policies) to 1e-5 relative."""
    S, M = 4, 8
    mesh = models.pipe_mesh(S)
    probe = pipeline.Pipeline(scanned, models.loss_fn, mesh=mesh, schedule=schedule,
                              num_microbatches=M)  # fmt: skip
    k1, k2, k3 = jax.random.split(jax.random.key(11), 3)
    if form == "nnx_remat":
        keys = jax.random.split(k1, probe.num_logical_stages)
        states = [nnx.split(nnx_blocks(nnx.Rngs(k))) for k in keys]
        sp = jax.tree.map(lambda *a: jnp.stack(a), *[s for _, s in states])
        stage_fn = nnx_remat_stage(states[0][0])
    else:
        stage_fn, sp = stage_and_params(form, probe.num_logical_stages, k1)
    inner = getattr(jax.checkpoint_policies, policy)
    pipe = pipeline.Pipeline(stage_fn, models.loss_fn, mesh=mesh, schedule=schedule,
                             num_microbatches=M, remat_policy=None,
                             inner_remat_policy=inner)  # fmt: skip
    lp = {"head": models.init(k2, 1)[1]["head"]}
    x, t = models.data(k3, 2 * M)
    loss, grads = jax.jit(jax.value_and_grad(pipe.loss, argnums=(0, 1, 2)))(
        pipe.place(sp), lp, x, t
    )
    grads = (pipe.logical(grads[0]), *grads[1:])

    def plain(sp, lp, x):
        return reference.loss(stage_fn, models.loss_fn, sp, lp, x, t, M)

    ref_loss, ref = jax.jit(jax.value_and_grad(plain, argnums=(0, 1, 2)))(sp, lp, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=TOL)
    for got, want in zip(grads, ref, strict=True):
        assert models.relative_error(got, want) < TOL


def test_a_pipeline_with_an_inner_policy_that_saves_recomputes_no_block():
    """In the compiled step, a stage whose blocks checkpoint themselves saving nothing runs
    each block's tanh again in its backward; under ``inner_remat_policy=everything_saveable``
    (and no policy of the pipeline's around the stage) the backward reads them and the
    program holds fewer tanh."""
    S, M = 2, 4
    mesh = models.pipe_mesh(S)
    stage_fn, sp = stage_and_params("checkpointed", S, jax.random.key(2))
    lp = {"head": models.init(jax.random.key(3), 1)[1]["head"]}
    x, t = models.data(jax.random.key(4), 2 * M)

    def tanh_count(**options):
        pipe = pipeline.Pipeline(stage_fn, models.loss_fn, mesh=mesh, schedule="1f1b",
                                 num_microbatches=M, remat_policy=None, **options)  # fmt: skip
        step = jax.jit(jax.grad(pipe.loss, argnums=(0, 1)))
        return step.lower(pipe.place(sp), lp, x, t).compile().as_text().count(" tanh(")

    own = tanh_count()
    kept = tanh_count(inner_remat_policy=jax.checkpoint_policies.everything_saveable)
    assert 0 < kept < own


def test_an_inner_policy_that_is_not_a_policy_is_refused():
    with pytest.raises(ValueError, match="inner_remat_policy must be a jax.checkpoint policy"):
        pipeline.Pipeline(scanned, models.loss_fn, mesh=models.pipe_mesh(2),
                          num_microbatches=4, inner_remat_policy="dots")  # fmt: skip
