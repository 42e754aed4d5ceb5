"""Real transformers through the pipeline, against the same model without one.

Two models feed the pipeline what a Llama-style training run does: a data loader's dict
batch of packed documents (`llama.packed_batch`: tokens, positions that restart per
document, segment ids, a loss mask); activations that are a dict with an integer leaf,
``{"h": float, "segment": int32, "aux": float32 per row}``; side inputs (positions, the loss
mask) that the stages and ``loss_fn`` read and no stage ships; dropout from ``key=``; a
router whose load-balancing loss each stage adds to the ``aux`` leaf, which ``loss_fn`` adds
(its mean) to the cross-entropy. ``PACKED`` is the real thing (`llama`: RMSNorm, rotary
positions, grouped-query attention within each document, a mixture of SwiGLU experts, two
scanned blocks per stage); ``LIGHT`` has the same features in a few lines and compiles in a
fraction of the time, so it runs under every schedule in the fast subset.

The definition is `jaxpipe.reference.loss`: loss and every gradient (stage parameters,
head, and the embedding, which runs before the pipeline and reaches it through the float
input leaves) agree to 1e-5 relative in float32, fresh random inputs, under ``gpipe``,
``1f1b``, ``interleaved_1f1b``, ``zbv`` and ``dualpipev`` on 2 and 4 devices;
``pipedream_2bw`` (weights updated inside the pipeline) is held to `jaxpipe.replay.replay`
of its own table. Also: stages that differ (keyword ``stage``, a list of per-stage
functions), bf16 parameters with float32 gradient accumulation, and the refusals of
parameters the pipeline cannot train.

Tests on 4 devices, of the packed model, and most schedules are marked slow; the fast subset
keeps, on 2 devices with the light model, loss and gradients under 1f1b (the auxiliary loss
among them), stages that differ by the keyword ``stage``, and the refusals
(tests/test_llama_example.py runs the packed model's features in examples/train_llama.py
against the plain model too).
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import llama
import models
import numpy as np
import optax
import pytest
from against_replay import train_against_replay
from flax import nnx

import jaxpipe
from jaxpipe import reference

TOL = 1e-5
CONFIG = llama.Config(width=16, heads=2, kv_heads=1, hidden=32, seq=8, vocab=16, experts=2)
BLOCKS = 2  # blocks per stage of the packed model, scanned
DROPOUT = 0.1
AUX_WEIGHT = 0.5  # large, so that the auxiliary loss carries a real share of every gradient
OPTIONS = {"interleaved_1f1b": {"virtual_stages": 2}}
SYNCHRONOUS = ["gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev"]


# ----------------------------------------------------------------------------- the two models


def light_stage_fn(p, x, *, side, key=None):
    """A stage with every feature of the packed model's, in a few lines: rotary-like
    positions from ``side``, the integer ``segment`` leaf read (and passed on), a router
    weighting the MLP, dropout from ``key``, the router's load-balancing loss added to
    ``aux``."""
    h = x["h"] + jnp.sin(side["positions"][..., None] * p["freq"])
    sign = (2 * (x["segment"] % 2) - 1)[..., None].astype(h.dtype)
    probs = jax.nn.softmax(h @ p["router"], axis=-1)  # [rows, seq, experts]
    z = jnp.tanh(h @ p["w1"] + sign * p["b1"])
    if key is not None:
        z = jnp.where(jax.random.bernoulli(key, 1 - DROPOUT, z.shape), z / (1 - DROPOUT), 0)
    out = (z @ p["w2"]) * 2 * probs[..., :1]
    top = jax.lax.stop_gradient(jax.nn.one_hot(jnp.argmax(probs, -1), probs.shape[-1]))
    aux = probs.shape[-1] * jnp.sum(jnp.mean(top, (0, 1)) * jnp.mean(probs, (0, 1)))
    return {"h": h + out, "segment": x["segment"], "aux": x["aux"] + AUX_WEIGHT * aux}


def light_init(key, num_stages):
    W, k = CONFIG.width, jax.random.split(key, 5)
    return {
        "freq": jax.random.normal(k[0], (num_stages, W)),
        "router": jax.random.normal(k[1], (num_stages, W, 2)),
        "w1": jax.random.normal(k[2], (num_stages, W, 2 * W)) / jnp.sqrt(W),
        "b1": 0.1 * jax.random.normal(k[3], (num_stages, 2 * W)),
        "w2": jax.random.normal(k[4], (num_stages, 2 * W, W)) / jnp.sqrt(2 * W),
    }


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    stage_fn: Callable
    init_stages: Callable  # (key, num_stages) -> logical stage parameters

    def __str__(self):
        return self.name


LIGHT = Model("light", light_stage_fn, light_init)
PACKED = Model(
    "packed",
    llama.make_packed_stage_fn(CONFIG, dropout=DROPOUT, aux_weight=AUX_WEIGHT),
    lambda key, num_stages: llama.init_blocks(key, CONFIG, num_stages, BLOCKS),
)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def model_data(seed, model, num_stages, rows):
    """Fresh logical stage parameters, head, embedding and one packed batch. (Drawn with
    ``rbg`` keys: XLA compiles threefry's bits for a dozen shapes in seconds on CPU.)"""
    keys = jax.random.split(jax.random.key(seed, impl="rbg"), 3)
    outer = llama.init_outer(keys[1], CONFIG)
    head = {"norm": outer["norm"], "head": outer["head"]}
    batch = llama.packed_batch(keys[2], CONFIG, rows)
    return model.init_stages(keys[0], num_stages), head, outer["embed"], batch


def make_pipeline(model, name, S, *, loss_fn=llama.packed_loss_fn, M=None, **kw):
    return jaxpipe.Pipeline(
        model.stage_fn,
        loss_fn,
        mesh=models.pipe_mesh(S),
        schedule=name,
        num_microbatches=M or 2 * S,
        schedule_options=OPTIONS.get(name),
        **kw,
    )


def cases(names, models=(LIGHT,), fast=None):
    """(model, schedule, S) for S in 2 and 4: the light model on 2 devices under the
    schedules ``fast`` (default: all of ``names``) in the fast subset, the rest slow."""
    fast = names if fast is None else fast
    out = []
    for model in models:
        for S in (2, 4):
            for name in names:
                quick = (model, S) == (LIGHT, 2) and name in fast
                marks = () if quick else pytest.mark.slow
                out.append(pytest.param(model, name, S, id=f"{model}-{name}-S{S}", marks=marks))
    return out


def slow_cases(pairs, model=LIGHT):
    """(model, schedule, S) for the given (schedule, S) pairs, all slow: a test that checks
    one mechanism under several schedules takes each schedule at one size."""
    return [
        pytest.param(model, name, S, id=f"{model}-{name}-S{S}", marks=pytest.mark.slow)
        for name, S in pairs
    ]


def relative_errors(got, want):
    errors = jax.tree_util.tree_map(
        lambda a, b: float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30)), got, want
    )
    return jax.tree_util.tree_leaves_with_path(errors)


def assert_close(got, want, tol=TOL):
    bad = [(jax.tree_util.keystr(p), e) for p, e in relative_errors(got, want) if not e < tol]
    assert not bad, f"relative errors above {tol}: {bad}"


def plain_loss(model, loss_fn, M):
    """`jaxpipe.reference.loss` with the pipeline's signature."""

    def loss(stages, head, inputs, targets, *, side, key=None):
        return reference.loss(
            model.stage_fn, loss_fn, stages, head, inputs, targets, M, side=side, key=key
        )

    return loss


@functools.cache
def plain_value_and_grads(model, M):
    """The plain model's jitted ``(stages, head, embed, batch, key) -> (loss, gradients of
    stages, head and embedding)``, one per model and M: cases with the same shapes share
    its compilation."""

    def loss(stages, head, embed, batch, key):
        inputs, targets, side = llama.packed_inputs(embed, batch)
        run = plain_loss(model, llama.packed_loss_fn, M)
        return run(stages, head, inputs, targets, side=side, key=key)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


# ----------------------------------------------------------------------------- the plain model


# The light model under every schedule on 2 devices and, where a device holds several
# stages or the backward is split, on 4 (gpipe and 1f1b on 4 devices run the code paths of 2:
# tests/test_executor.py takes them up to 8 on a plain model); the packed one on 2 devices
# under the V schedules (two stages per device, split backward), on one worker: their plain
# model has the same shapes, and compiles once.
LOSS_CASES = [
    c if c.values[0] is LIGHT else pytest.param(*c.values, id=c.id, marks=[
        *c.marks, pytest.mark.xdist_group("packed-v-schedules")])
    for c in cases(SYNCHRONOUS, models=(LIGHT, PACKED), fast=["1f1b"])
    if (c.values[0] is LIGHT and not (c.values[2] == 4 and c.values[1] in ("gpipe", "1f1b")))
    or (c.values[2] == 2 and c.values[1] in ("zbv", "dualpipev"))
]  # fmt: skip


@pytest.fixture(scope="module")
def packed_plain_model():
    """Compiles the packed model's plain loss and gradients once for the V-schedule cases
    (S = 2: four logical stages, M = 4, 8 rows): each case then compiles its pipeline only."""
    stages, head, embed, batch = model_data(0, PACKED, 4, 8)
    want = functools.partial(plain_value_and_grads(PACKED, 4), batch=batch)  # as the test calls
    jax.block_until_ready(want(stages, head, embed, key=jax.random.key(0)))


@pytest.fixture
def plain_model_compiled(request):
    """The packed model's `packed_plain_model` for the cases that run it; nothing else."""
    if request.node.callspec.params["model"] is PACKED:
        request.getfixturevalue("packed_plain_model")


@pytest.mark.parametrize("model,name,S", LOSS_CASES)
def test_loss_and_gradients_equal_the_plain_model(model, name, S, plain_model_compiled):
    """Dict activations with an integer leaf, a dict batch, side inputs read by the stages
    and the loss, dropout with a key, an auxiliary loss: loss and the gradients of stage
    parameters, head and embedding (through the float input leaves)."""
    pipe = make_pipeline(model, name, S)
    M = pipe.num_microbatches
    stages, head, embed, batch = model_data(31 * S + len(name), model, pipe.num_logical_stages,
                                            2 * M)  # fmt: skip

    def loss(stages, head, embed, key):
        inputs, targets, side = llama.packed_inputs(embed, batch)
        return pipe.loss(stages, head, inputs, targets, side=side, key=key)

    piped = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    want = functools.partial(plain_value_and_grads(model, M), batch=batch)
    key = jax.random.key(5)
    value, (g_stages, g_head, g_embed) = piped(pipe.place(stages), head, embed, key)
    want_value, want_grads = want(stages, head, embed, key=key)

    np.testing.assert_allclose(value, want_value, rtol=TOL)
    assert_close((pipe.logical(g_stages), g_head, g_embed), want_grads)
    # The auxiliary loss takes part: the routers get gradients.
    assert float(jnp.abs(want_grads[0]["router"]).max()) > 1e-4
    # Another key, other dropout masks, another loss (the same compiled step).
    other = piped(pipe.place(stages), head, embed, jax.random.key(6))[0]
    np.testing.assert_allclose(other, want(stages, head, embed, key=jax.random.key(6))[0],
                               rtol=TOL)  # fmt: skip
    assert abs(float(other) - float(value)) > 1e-3


@pytest.mark.parametrize("model,name,S", slow_cases([("1f1b", 2), ("zbv", 4)]))
def test_integer_leaves_get_no_input_gradient(model, name, S):
    """``loss_and_grads(input_grads=True)``: None for the int32 ``segment`` leaf, the exact
    gradient for the float leaves ``h`` and ``aux``."""
    pipe = make_pipeline(model, name, S)
    M = pipe.num_microbatches
    stages, head, embed, batch = model_data(7 + S, model, pipe.num_logical_stages, 2 * M)
    inputs, targets, side = llama.packed_inputs(embed, batch)
    key = jax.random.key(1)

    _, (_, _, input_grads) = pipe.loss_and_grads(
        pipe.place(stages), head, inputs, targets, input_grads=True, side=side, key=key
    )

    def plain(h, aux):
        x = dict(inputs, h=h, aux=aux)
        return plain_loss(model, llama.packed_loss_fn, M)(
            stages, head, x, targets, side=side, key=key
        )

    want_h, want_aux = jax.grad(plain, argnums=(0, 1))(inputs["h"], inputs["aux"])
    assert input_grads["segment"] is None
    assert_close((input_grads["h"], input_grads["aux"]), (want_h, want_aux))
    # loss_fn adds the mean of aux over a micro-batch's rows, and the loss is the mean over
    # micro-batches: d loss / d aux is 1 / rows for every row.
    np.testing.assert_allclose(input_grads["aux"], 1.0 / inputs["aux"].shape[0], rtol=1e-6)


def only_aux_loss(lp, y, target, *, side=None):
    """The auxiliary loss alone: every gradient reaches the stages through the aux leaf."""
    return jnp.mean(y["aux"])


@pytest.mark.parametrize(
    "model,name,S",
    # All slow: test_loss_and_gradients_equal_the_plain_model has the auxiliary loss in its
    # loss under every schedule, 1f1b in the fast subset; this test isolates it, under a
    # schedule with several stages per device and one with a split backward as well.
    slow_cases([("interleaved_1f1b", 2), ("dualpipev", 4)]),
)
def test_auxiliary_loss_gradient_is_exact(model, name, S):
    """A per-row float leaf that each stage adds its load-balancing loss to, and ``loss_fn``
    its mean: the gradient of the auxiliary loss alone (into the routers of every stage, and
    through the activations into everything before them, the embedding included) equals the
    plain model's."""
    pipe = make_pipeline(model, name, S, loss_fn=only_aux_loss)
    M = pipe.num_microbatches
    stages, head, embed, batch = model_data(11 * S + len(name), model, pipe.num_logical_stages,
                                            2 * M)  # fmt: skip

    def loss(run, stages, embed):
        inputs, targets, side = llama.packed_inputs(embed, batch)
        return run(stages, head, inputs, targets, side=side, key=jax.random.key(3))

    piped = jax.jit(jax.value_and_grad(functools.partial(loss, pipe.loss), argnums=(0, 1)))
    plain = functools.partial(loss, plain_loss(model, only_aux_loss, M))
    value, (g_stages, g_embed) = piped(pipe.place(stages), embed)
    want_value, want = jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))(stages, embed)
    np.testing.assert_allclose(value, want_value, rtol=TOL)
    assert_close((pipe.logical(g_stages), g_embed), want)
    assert float(jnp.abs(want[1]).max()) > 1e-5  # the embedding reaches the aux loss


@pytest.mark.slow
def test_dropout_gives_one_loss_under_every_schedule(model=LIGHT):
    """One model of four logical stages and M = 4 (one stage per device on 4 devices, two
    per device on 2): the same key gives the same loss under every schedule (stage ``s`` on
    micro-batch ``m`` gets ``fold_in(fold_in(key, m), s)``, wherever and whenever it runs);
    another key, or none, gives another. (The packed model's dropout is held to the plain
    model's under every schedule by the loss and gradient test.)"""
    losses = {}
    stages, head, embed, batch = model_data(2, model, 4, 8)
    inputs, targets, side = llama.packed_inputs(embed, batch)
    for name in SYNCHRONOUS:
        S = 4 if name in ("gpipe", "1f1b") else 2
        pipe = make_pipeline(model, name, S, M=4)
        assert pipe.num_logical_stages == 4
        run = jax.jit(functools.partial(pipe.loss, side=side))
        params = pipe.place(stages)
        losses[name] = [
            float(run(params, head, inputs, targets, key=jax.random.key(k))) for k in (0, 1)
        ]
        losses[name].append(float(run(params, head, inputs, targets)))
    first = losses[SYNCHRONOUS[0]]
    for name, values in losses.items():
        np.testing.assert_allclose(values, first, rtol=TOL, err_msg=name)
    assert len({round(v, 4) for v in first}) == 3, first


def row_mean_loss(lp, y, target, *, side):
    """A mean over rows, as data parallelism assumes: the cross-entropy of every token (and
    not the auxiliary loss, a statistic of the whole micro-batch)."""
    logits = llama.rms_norm(y["h"], lp["norm"]) @ lp["head"]
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, target["labels"])
    return jnp.mean(nll)


def replica_rows(tree, r, R):
    """Replica ``r``'s rows of a batch split over ``R`` data-parallel replicas: the ``r``-th
    contiguous block (micro-batch ``m`` of the pipeline is the ``m``-th contiguous block of
    every replica's rows, `jaxpipe.pipeline.split_microbatches`)."""
    return jax.tree.map(lambda a: a[r * (a.shape[0] // R) : (r + 1) * (a.shape[0] // R)], tree)


@pytest.mark.slow
def test_dropout_with_a_data_axis_folds_in_the_replica():
    """pipe 2 x data 2: without a key the loss and gradients are the plain model's; with one,
    replica ``r`` runs the plain model on its rows with the key ``fold_in(key, r)`` (so the
    replicas draw different masks for their different rows), and the pipeline's loss and
    gradients are the mean over replicas of that."""
    R, M = 2, 2
    mesh = models.pipe_mesh(2, extra=(("data", R),))
    pipe = jaxpipe.Pipeline(
        LIGHT.stage_fn, row_mean_loss, mesh=mesh, schedule="1f1b", num_microbatches=M
    )
    stages, head, embed, batch = model_data(1, LIGHT, 2, 8)
    inputs, targets, side = llama.packed_inputs(embed, batch)
    plain = plain_loss(LIGHT, row_mean_loss, M)

    def replicas_loss(stages, head, key):
        if key is None:
            return plain(stages, head, inputs, targets, side=side)
        losses = [
            plain(stages, head, *replica_rows((inputs, targets), r, R),
                  side=replica_rows(side, r, R), key=jax.random.fold_in(key, r))
            for r in range(R)
        ]  # fmt: skip
        return sum(losses) / R

    def piped_loss(params, head, key):
        return pipe.loss(params, head, inputs, targets, side=side, key=key)

    params = pipe.place(stages)
    piped = jax.jit(jax.value_and_grad(piped_loss, argnums=(0, 1)))
    replicas = jax.jit(jax.value_and_grad(replicas_loss, argnums=(0, 1)))
    values = []
    for key in (None, jax.random.key(0)):
        value, grads = piped(params, head, key)
        want_value, want = replicas(stages, head, key)
        np.testing.assert_allclose(value, want_value, rtol=TOL)
        assert_close((pipe.logical(grads[0]), grads[1]), want)
        values.append(float(value))
    assert abs(values[1] - values[0]) > 1e-4  # dropout took part

    def uniform(p, x, *, key):  # what a stage draws, returned for inspection
        return jax.random.uniform(key, x.shape)

    probe = jaxpipe.Pipeline(uniform, mesh=mesh, schedule="1f1b", num_microbatches=1)
    drawn = probe.forward(probe.place({"w": jnp.zeros((2, 1))}), jnp.zeros((4, 3)),
                          key=jax.random.key(0))  # fmt: skip
    assert not np.allclose(drawn[:2], drawn[2:])  # replica 0's rows, replica 1's rows


# ----------------------------------------------------------------------------- pipedream_2bw


@pytest.mark.parametrize(
    "model,S",
    [
        pytest.param(LIGHT, 4, id="light-S4", marks=pytest.mark.slow),
    ],
)
def test_pipedream_2bw_trains_like_the_replay(model, S):
    """Weights updated inside the pipeline, with every feature (pytree activations with an
    integer leaf, side inputs, dropout keys): two steps of `Pipeline.train` against
    `jaxpipe.replay.replay` of the same table."""
    pipe = make_pipeline(model, "pipedream_2bw", S)
    M = pipe.num_microbatches
    stages, head, embed, _ = model_data(3 + S, model, pipe.num_logical_stages, 2 * M)
    batches = []
    for k in range(2):
        batch = llama.packed_batch(jax.random.key(40 + k), CONFIG, 2 * M)
        inputs, targets, side = llama.packed_inputs(embed, batch)
        batches.append(
            {"inputs": inputs, "targets": targets, "side": side, "key": jax.random.key(70 + k)}
        )
    train_against_replay(
        pipe, optax.adam(1e-2), model.stage_fn, llama.packed_loss_fn, stages, head, batches,
        tol=TOL,
    )  # fmt: skip


def test_init_optimizer_keeps_the_layout():
    """The moments are sharded like their parameters (an inner ``P("data")`` split too), the
    per-stage step counters over the pipe axis: no device holds another's state, and a
    jitted `Pipeline.train` compiles once (its output state is laid out as its input)."""
    mesh = models.pipe_mesh(2, extra=(("data", 2),))
    pipe = jaxpipe.Pipeline(light_stage_fn, llama.packed_loss_fn, mesh=mesh, schedule="1f1b",
                            num_microbatches=2)  # fmt: skip
    stages, head, embed, batch = model_data(0, LIGHT, 2, 8)
    specs = jax.tree.map(lambda _: None, stages)
    specs["w1"] = jax.sharding.PartitionSpec(None, "data")  # [stage, width, 2 * width]
    params = pipe.place(stages, specs)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    state = pipe.init_optimizer(opt, params)  # a Placed: the per-stage states in the layout
    assert state.order == params.order
    adam = state.tree[1][0]
    same = jax.tree.map(lambda m, p: m.sharding == p.sharding, (adam.mu, adam.nu),
                        (params.tree,) * 2)  # fmt: skip
    assert all(jax.tree.leaves(same))
    assert adam.count.shape == (1, 2) and adam.count.sharding == pipe.layout.sharding()

    inputs, targets, side = llama.packed_inputs(embed, batch)
    step = jax.jit(lambda p, o: pipe.train(opt, p, o, head, inputs, targets, side=side))
    _, after, _ = step(params, state)
    same = jax.tree.map(lambda a, b: a.sharding == b.sharding, after, state)
    assert all(jax.tree.leaves(same))


# ----------------------------------------------------------------------------- stages that differ


def embed_stage(p, x):
    return x + jnp.tanh(x @ p["w"])


def mlp_stage(p, x, *, key):
    keep = jax.random.bernoulli(key, 0.8, x.shape)
    return x + jnp.where(keep, jax.nn.gelu(x @ p["w"] + p["b"]), 0.0) / 0.8


def gated_stage(p, x, *, side):
    return x + jax.nn.sigmoid(side["gate"]) * (x @ p["w"])


def head_stage(p, x):
    """Shape-preserving 'head' work that must run on the last stage only."""
    return jax.nn.softmax(x @ p["w"] + p["b"], axis=-1)


DIFFERENT = [embed_stage, mlp_stage, gated_stage, head_stage]
SWITCH_CASES = [  # (form, schedule, S): the keyword in the fast subset, each form and
    # each schedule once in the full suite
    pytest.param(form, name, 2, id=f"{form}-{name}-S2", marks=marks)
    for form, name, marks in [
        ("list", "interleaved_1f1b", pytest.mark.slow),
        ("stage_keyword", "zbv", ()),
        ("list", "zbv", pytest.mark.slow),
        ("stage_keyword", "interleaved_1f1b", pytest.mark.slow),
    ]
]


def small_params(seed, num_stages, width=8):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    stages = {
        "w": jax.random.normal(k1, (num_stages, width, width)) / jnp.sqrt(width),
        "b": 0.1 * jax.random.normal(k2, (num_stages, width)),
    }
    x = jax.random.normal(k3, (8, width))
    side = {"gate": jax.random.normal(jax.random.fold_in(k3, 1), (8, width))}
    targets = jax.random.normal(jax.random.fold_in(k3, 2), (8, width))
    return stages, x, side, targets


def mse(_, y, target):
    return jnp.mean((y - target) ** 2)


def by_hand(stages, x, targets, side, key, M):
    """Function ``s`` on stage ``s``, written out: the definition of a list of stages."""
    total = 0.0
    for m in range(M):
        h = reference.microbatch(x, m, M)
        for s, fn in enumerate(DIFFERENT):
            p = jax.tree.map(lambda a, s=s: a[s], stages)
            kw = {
                "key": jax.random.fold_in(jax.random.fold_in(key, m), s),
                "side": reference.microbatch(side, m, M),
            }
            h = fn(p, h, **{k: v for k, v in kw.items() if k in reference.keywords_of(fn)})
        total = total + mse(None, h, reference.microbatch(targets, m, M))
    return total / M


@pytest.mark.parametrize("form,name,S", SWITCH_CASES)
def test_stages_that_differ(form, name, S):
    """Four different stage functions (one runs only on the last stage, one takes a key, one
    a side input) on two devices, as a list or as one function branching on the keyword
    ``stage`` with ``lax.switch``: loss and gradients equal the stages written out by hand."""
    if form == "list":
        stage_fn = DIFFERENT
    else:

        def stage_fn(p, x, *, stage, key, side):
            branches = [functools.partial(_call_with, f, key=key, side=side) for f in DIFFERENT]
            return jax.lax.switch(stage, branches, p, x)

    M = 2 * S
    pipe = jaxpipe.Pipeline(
        stage_fn,
        mse,
        mesh=models.pipe_mesh(S),
        schedule=name,
        num_microbatches=M,
        schedule_options=OPTIONS.get(name),
    )
    assert pipe.num_logical_stages == len(DIFFERENT)
    stages, x, side, targets = small_params(S + len(form), len(DIFFERENT))
    key = jax.random.key(9)
    value, grads = jax.jit(
        jax.value_and_grad(
            lambda p, x: pipe.loss(p, None, x, targets, side=side, key=key), argnums=(0, 1)
        )
    )(pipe.place(stages), x)
    want_value, want = jax.value_and_grad(by_hand, argnums=(0, 1))(stages, x, targets, side, key, M)
    np.testing.assert_allclose(value, want_value, rtol=TOL)
    assert_close((pipe.logical(grads[0]), grads[1]), want)


def _call_with(f, p, x, **keywords):
    accepted = reference.keywords_of(f)
    return f(p, x, **{k: v for k, v in keywords.items() if k in accepted})


# ----------------------------------------------------------------------------- bf16 parameters


@functools.cache
def _bf16_model(M, width, rows):
    """The bf16 parameters, the float32 batch, and the plain model's gradients of them
    (`jaxpipe.reference`, ``M`` micro-batches): in float32 math on the bf16-valued parameters
    (``exact``) and in bf16 (``plain_bf16``)."""
    bf16 = functools.partial(jax.tree.map, lambda a: a.astype(jnp.bfloat16))
    f32 = functools.partial(jax.tree.map, lambda a: a.astype(jnp.float32))
    stages, head = bf16(models.init(jax.random.key(0), 2, width))
    x, t = models.data(jax.random.key(1), rows, width)

    def plain(stages, head):
        return reference.loss(models.stage_fn, models.loss_fn, stages, head, x, t, M)

    exact = jax.jit(jax.grad(plain, argnums=(0, 1)))(f32(stages), f32(head))
    plain_bf16 = jax.jit(jax.grad(plain, argnums=(0, 1)))(stages, head)
    return stages, head, x, t, exact, plain_bf16


def bf16_errors(M, grad_dtype, width=32, rows=64):
    """Relative gradient error of the pipeline (``1f1b`` on 2 devices) and of the plain model
    (`jaxpipe.reference`), both with bf16 parameters and float32 activations, against float32
    math on the same (bf16-valued) parameters, on one fixed batch: the largest over the
    gradient leaves. The plain model's gradients depend on ``M`` only: computed once for
    both ``grad_dtype``."""
    pipe = jaxpipe.Pipeline(
        models.stage_fn,
        models.loss_fn,
        mesh=models.pipe_mesh(2),
        schedule="1f1b",
        num_microbatches=M,
        grad_dtype=grad_dtype,
    )
    stages, head, x, t, exact, plain_bf16 = _bf16_model(M, width, rows)
    piped = jax.jit(jax.grad(pipe.loss, argnums=(0, 1)))(pipe.place(stages), head, x, t)
    assert jax.tree.leaves(piped[0])[0].dtype == jnp.bfloat16  # in the parameters' dtype
    piped = (pipe.logical(piped[0]), piped[1])

    def error(grads):
        grads = jax.tree.map(lambda a: a.astype(jnp.float32), grads)
        return max(e for _, e in relative_errors(grads, exact))

    return error(piped), error(plain_bf16)


@pytest.mark.slow
def test_bf16_gradient_error_does_not_grow_with_microbatches():
    """bf16 parameters: gradients accumulate over micro-batches in float32, so their error
    against float32 math stays that of one bf16 micro-batch as M goes 4 -> 16, and within the
    plain bf16 model's (whose autodiff sums the micro-batches in bf16). The contrast:
    ``grad_dtype=None`` accumulates in the parameters' bf16, and its error grows with M.
    (One test: each error compiles and runs its own pipeline.)"""
    pipe_4, plain_4 = bf16_errors(4, jnp.float32)
    pipe_16, plain_16 = bf16_errors(16, jnp.float32)
    print(f"bf16 gradient error: pipeline M=4 {pipe_4:.3g}, M=16 {pipe_16:.3g}; "
          f"plain bf16 model M=4 {plain_4:.3g}, M=16 {plain_16:.3g}")  # fmt: skip
    assert pipe_16 < 1.5 * pipe_4
    assert pipe_4 <= 1.2 * plain_4 and pipe_16 <= 1.2 * plain_16
    bf16_4, _ = bf16_errors(4, None)
    bf16_16, _ = bf16_errors(16, None)
    print(f"grad_dtype=None: M=4 {bf16_4:.3g}, M=16 {bf16_16:.3g}; float32 M=16 {pipe_16:.3g}")
    assert bf16_16 > 1.5 * pipe_16


# ----------------------------------------------------------------------------- refusals


def refusal_pipeline():
    def stage_fn(p, x):
        return x

    return jaxpipe.Pipeline(
        stage_fn, mse, mesh=models.pipe_mesh(2), schedule="1f1b", num_microbatches=2
    )


def test_batchnorm_statistics_are_refused():
    """A whole NNX state (Param and BatchStat) is refused, naming RMSNorm/LayerNorm and
    ``nnx.split(module, nnx.Param, ...)``."""
    pipe = refusal_pipeline()
    state = nnx.vmap(lambda k: nnx.state(nnx.BatchNorm(4, rngs=nnx.Rngs(k))))(
        jax.random.split(jax.random.key(0), 2)
    )
    assert any(isinstance(v, nnx.BatchStat) for v in jax.tree.leaves(
        state, is_leaf=lambda v: isinstance(v, nnx.Variable)))  # fmt: skip
    params = jax.tree.map(lambda a: a.reshape(1, *a.shape), state)
    x = jnp.ones((4, 4))
    with pytest.raises(ValueError, match=r"nnx\.BatchStat.*(RMSNorm|LayerNorm).*nnx\.Param"):
        pipe.loss(params, None, x, x)


def test_typed_key_in_parameters_is_refused():
    pipe = refusal_pipeline()
    params = {"w": jnp.ones((1, 2, 4)), "rng": jax.random.split(jax.random.key(0), 2)[None]}
    x = jnp.ones((4, 4))
    with pytest.raises(ValueError, match=r"PRNG key at \['rng'\].*key= to pipe\.loss"):
        pipe.loss(params, None, x, x)


def test_raw_uint32_key_in_parameters_is_refused():
    pipe = refusal_pipeline()
    params = {"w": jnp.ones((1, 2, 4)), "rng": jax.random.split(jax.random.PRNGKey(0), 2)[None]}
    assert params["rng"].dtype == jnp.uint32
    x = jnp.ones((4, 4))
    with pytest.raises(ValueError, match=r"\['rng'\] is uint32.*same random numbers"):
        pipe.loss(params, None, x, x)
