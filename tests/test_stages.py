"""Flax stages: a tiny GPT (NNX and Linen stages) trains through the pipeline on DP x PP (x TP)
meshes with the same losses as the plain model; `jaxpipe.stages` helpers and their errors."""

import functools
import inspect
import os

import gpt
import jax
import jax.numpy as jnp
import models
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe import pipeline

STEPS = 10
BATCH = 8
MICROBATCHES = 4
# (flavour, mesh extra axes, S, schedule, options): every mesh and schedule once per flavour
# with JAXPIPE_FULL=1; by default the three that cover both meshes, both schedules and Linen
# within the suite's time budget (the two NNX cases share one reference run).
CASES = [
    ("nnx", (("data", 2),), 4, "1f1b", {}),
    ("nnx", (("data", 2), ("tensor", 2)), 2, "interleaved_1f1b", {"virtual_stages": 2}),
    ("linen", (("data", 2), ("tensor", 2)), 2, "1f1b", {}),
]
if os.environ.get("JAXPIPE_FULL"):
    CASES += [
        ("nnx", (("data", 2),), 4, "interleaved_1f1b", {"virtual_stages": 2}),
        ("nnx", (("data", 2), ("tensor", 2)), 2, "1f1b", {}),
        ("linen", (("data", 2),), 4, "interleaved_1f1b", {"virtual_stages": 2}),
    ]
# hidden dim of the MLP over "tensor": (substrings of the leaf path, spec of the dimensions
# after the stage axis)
TENSOR_RULES = {
    "nnx": [
        (("mlp_in", "kernel"), P(None, "tensor")),
        (("mlp_out", "kernel"), P("tensor", None)),
    ],
    "linen": [
        (("Dense_2", "kernel"), P(None, "tensor")),
        (("Dense_3", "kernel"), P("tensor", None)),
    ],
}


def _case_id(case):
    flavour, extra, S, name, opts = case
    axes = "x".join(f"{a}{n}" for a, n in (("pipe", S), *extra))
    return f"{flavour}-{axes}-{name}{''.join(str(v) for v in opts.values())}"


def _place(pipe, stage_params, rules):
    """The pipeline's layout; leaves matching a rule get the rule's spec after the stage
    axes."""

    def spec(path, leaf):
        name = jax.tree_util.keystr(path)
        return next((s for keys, s in rules if all(k in name for k in keys)), None)

    return pipe.place(stage_params, jax.tree_util.tree_map_with_path(spec, stage_params))


def _train(loss, params, tokens, targets, mesh=None):
    """Losses of STEPS jitted adam steps of ``loss(params, tokens, targets)``; with a
    ``mesh``, parameters and optimizer state start on it (the step compiles once)."""
    opt = optax.adam(1e-2)

    @jax.jit
    def step(params, opt_state):
        value, grads = jax.value_and_grad(loss)(params, tokens, targets)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state = opt.init(params)
    if mesh is not None:
        params, opt_state = models.on_mesh((params, opt_state), mesh)
    losses = []
    for _ in range(STEPS):
        params, opt_state, value = step(params, opt_state)
        losses.append(float(value))
    return np.array(losses), params


@functools.cache
def _model(flavour, num_stages):
    """``(stage_fn, stage_params, loss_params, tokens, targets)`` of the GPT with
    ``num_stages`` one-block stages, built once per process."""
    config = gpt.Config(num_layers=num_stages)
    init = gpt.init if flavour == "nnx" else gpt.init_linen
    stage_fn, stage_params, loss_params = init(jax.random.key(num_stages), config, num_stages)
    return stage_fn, stage_params, loss_params, *gpt.data(jax.random.key(1), config, BATCH)


@functools.cache
def _reference_losses(flavour, num_stages):
    """Losses of the plain model (no mesh, no pipeline) with the test's parameters and data."""
    stage_fn, stage_params, loss_params, tokens, targets = _model(flavour, num_stages)
    params = {"stages": stage_params, "outer": loss_params}
    return _train(lambda p, x, t: gpt.reference_loss(stage_fn, p, x, t), params, tokens, targets)[0]


# The NNX cases (and the tensor-sharded one) share one model and one reference run on one
# worker; each case alone compiles its pipeline's step.
SHARED_NNX = pytest.mark.xdist_group("gpt-nnx-4-stages")


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=SHARED_NNX if c[0] == "nnx" else ()) for c in CASES],
    ids=_case_id,
)
def test_gpt_trains_like_the_plain_model(case, tensor_sharded=False):
    """On the tensor mesh the batch is sharded over data; stage params are replicated over
    tensor (see `test_gpt_with_tensor_sharded_stage_weights`)."""
    flavour, extra, S, name, opts = case
    mesh = models.pipe_mesh(S, extra)
    N = S * opts.get("virtual_stages", 1)
    stage_fn, stage_params, loss_params, tokens, targets = _model(flavour, N)
    pipe = pipeline.Pipeline(
        stage_fn,
        gpt.loss_fn,
        mesh=mesh,
        schedule=name,
        num_microbatches=MICROBATCHES,
        schedule_options=opts,
    )
    ref_losses = _reference_losses(flavour, N)

    rules = TENSOR_RULES[flavour] if tensor_sharded else []
    sharded = {"stages": _place(pipe, stage_params, rules), "outer": loss_params}
    batch_sharding = NamedSharding(mesh, P("data"))
    tokens, targets = jax.device_put((tokens, targets), batch_sharding)
    losses, trained = _train(
        lambda p, x, t: gpt.pipeline_loss(pipe, p, x, t), sharded, tokens, targets, mesh
    )

    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    assert losses[-1] < losses[0] - 0.1  # it learns
    for leaf in jax.tree_util.tree_leaves(trained["stages"]):
        assert leaf.sharding.spec[:2] == (None, "pipe")  # stage params stay on their stages
    if rules:
        kernels = [
            leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(trained["stages"])
            if all(k in jax.tree_util.keystr(path) for k in rules[0][0])
        ]
        assert kernels and all(k.sharding.spec == P(None, "pipe", *rules[0][1]) for k in kernels)


@pytest.mark.slow
@SHARED_NNX
def test_gpt_with_tensor_sharded_stage_weights():
    """Stage weights sharded over tensor: XLA places tensor collectives inside the stage,
    inside the action's branch, which every device of one pipe position takes together."""
    test_gpt_trains_like_the_plain_model(CASES[1], tensor_sharded=True)


def test_stages_differ_and_bad_modules_are_refused():
    from flax import linen as nn
    from flax import nnx

    from jaxpipe import stages

    _, params = stages.nnx_stage(lambda rngs: nnx.Linear(3, 3, rngs=rngs), jax.random.key(0), 3)
    kernel = np.asarray(params["kernel"][...])
    assert kernel.shape == (3, 3, 3) and not np.allclose(kernel[0], kernel[1])
    x = jax.random.normal(jax.random.key(1), (2, 3))
    stage_fn, lparams = stages.linen_stage(nn.Dense(3), jax.random.key(0), x, 2)
    assert lparams["kernel"].shape == (2, 3, 3)
    assert not np.allclose(lparams["kernel"][0], lparams["kernel"][1])
    np.testing.assert_allclose(
        stage_fn(stages.stage_slice(lparams, 1), x),
        x @ lparams["kernel"][1] + lparams["bias"][1],
        rtol=1e-6,
    )
    with pytest.raises(ValueError, match="besides 'params'"):
        stages.linen_stage(nn.BatchNorm(use_running_average=False), jax.random.key(0), x, 2)
    with pytest.raises(ValueError, match="other than nnx.Param"):
        stages.nnx_stage(lambda rngs: nnx.BatchNorm(3, rngs=rngs), jax.random.key(0), 2)
    with pytest.raises(ValueError, match="num_stages must be a positive int"):
        stages.nnx_stage(lambda rngs: nnx.Linear(3, 3, rngs=rngs), jax.random.key(0), 0)
    mesh = models.pipe_mesh(2)
    placed = stages.shard_stage_params(lparams, mesh)
    assert placed["kernel"].sharding.spec == P("pipe")
    with pytest.raises(ValueError, match="multiple of the 'pipe' axis size 2"):
        stages.shard_stage_params({"w": jnp.ones((3, 2))}, mesh)


def test_shard_stage_params_then_place_with_specs_splits_over_tensor():
    """As shard_stage_params' docstring says: the tensor split comes from place's specs."""
    from jaxpipe import stages

    mesh = models.pipe_mesh(2, (("tensor", 2),))
    pipe = pipeline.Pipeline(
        lambda p, x: x @ p["w"],
        lambda lp, y, t: jnp.mean((y - t) ** 2),
        mesh=mesh,
        num_microbatches=2,
    )
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((2, 4, 4)) / 2, jnp.float32)
    x = jnp.asarray(rng.standard_normal((4, 4)), jnp.float32)
    placed = pipe.place(stages.shard_stage_params({"w": w}, mesh), {"w": P(None, "tensor")})
    assert placed["w"].sharding.spec == P(None, "pipe", None, "tensor")
    np.testing.assert_array_equal(pipe.logical(placed)["w"], w)
    want = jnp.mean((x @ w[0] @ w[1] - x) ** 2)
    np.testing.assert_allclose(jax.jit(pipe.loss)(placed, None, x, x), want, rtol=1e-5)


class _DropoutBlock:
    """An NNX block whose dropout takes the pipeline's key (built lazily: flax imports)."""

    @staticmethod
    def make(width):
        from flax import nnx

        class DropoutBlock(nnx.Module):
            def __init__(self, rngs):
                self.linear = nnx.Linear(width, width, rngs=rngs)
                self.dropout = nnx.Dropout(0.5)

            def __call__(self, x, key=None):
                y = self.dropout(jnp.tanh(self.linear(x)), rngs=key, deterministic=key is None)
                return x + y

        return DropoutBlock


def _mse(_, y, target):
    return jnp.mean((y - target) ** 2)


@pytest.mark.parametrize(
    "schedule, num_logical",
    [
        pytest.param("1f1b", 2, marks=pytest.mark.slow),
        pytest.param("zbv", 4, marks=pytest.mark.slow),
    ],
)
def test_nnx_stage_passes_the_pipelines_key_to_the_module(schedule, num_logical):
    """A module whose ``__call__`` takes ``key`` gets stage s, micro-batch m's own key: the
    pipeline's loss and gradients equal a plain loop over the same blocks, micro-batches
    and folded keys (``jaxpipe.reference``), and another key gives another loss."""
    from jaxpipe import reference, stages

    width, M = 8, 4
    stage_fn, logical = stages.nnx_stage(_DropoutBlock.make(width), jax.random.key(0), num_logical)
    assert list(inspect.signature(stage_fn).parameters) == ["params", "x", "key"]
    pipe = pipeline.Pipeline(
        stage_fn, _mse, mesh=models.pipe_mesh(2), schedule=schedule, num_microbatches=M
    )
    assert pipe.num_logical_stages == num_logical
    x = jax.random.normal(jax.random.key(1), (4 * M, width))
    target = jax.random.normal(jax.random.key(2), (4 * M, width))
    key = jax.random.key(3)

    def plain(p):
        return reference.loss(stage_fn, _mse, p, None, x, target, M, key=key)

    want, want_grads = jax.value_and_grad(plain)(logical)
    got, (grads, _) = pipe.loss_and_grads(pipe.place(logical), None, x, target, key=key)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(pipe.logical(grads)), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    no_dropout = reference.loss(stage_fn, _mse, logical, None, x, target, M)
    other = pipe.loss(pipe.place(logical), None, x, target, key=jax.random.key(4))
    assert len({float(got), float(other), float(no_dropout)}) == 3


def test_stage_keywords_follow_the_modules_call():
    """A module that takes no ``key`` gets none: ``key=`` is refused at the call with the fix,
    and a Linen module's ``__call__`` keywords are passed on the same way."""
    from flax import linen as nn
    from flax import nnx

    from jaxpipe import stages

    stage_fn, params = stages.nnx_stage(
        lambda rngs: nnx.Linear(4, 4, rngs=rngs), jax.random.key(0), 2
    )
    pipe = pipeline.Pipeline(
        stage_fn, _mse, mesh=models.pipe_mesh(2), schedule="1f1b", num_microbatches=2
    )
    x = jnp.ones((4, 4))
    with pytest.raises(ValueError, match=r"key= was given but neither stage_fn nor loss_fn"):
        pipe.loss(pipe.place(params), None, x, x, key=jax.random.key(0))

    class Scaled(nn.Module):
        @nn.compact
        def __call__(self, x, stage=0):
            return nn.Dense(4)(x) * (1.0 + stage)

    stage_fn, lparams = stages.linen_stage(Scaled(), jax.random.key(0), x, 2)
    one = stages.stage_slice(lparams, 1)
    want = (x @ one["Dense_0"]["kernel"] + one["Dense_0"]["bias"]) * 3.0
    np.testing.assert_allclose(stage_fn(one, x, stage=2), want, rtol=1e-6)


def test_place_and_init_refuse_state_a_step_would_never_update():
    """BatchNorm statistics and random state are refused when parameters first reach the
    pipeline (``place``/``init``), before any step is traced."""
    from flax import nnx

    pipe = pipeline.Pipeline(
        lambda p, x: x, _mse, mesh=models.pipe_mesh(2), schedule="1f1b", num_microbatches=2
    )
    whole = nnx.vmap(lambda k: nnx.state(nnx.BatchNorm(4, rngs=nnx.Rngs(k))))(
        jax.random.split(jax.random.key(0), 2)
    )
    with pytest.raises(ValueError, match=r"nnx\.BatchStat.*(RMSNorm|LayerNorm)"):
        pipe.place(whole)
    with pytest.raises(ValueError, match=r"nnx\.BatchStat.*(RMSNorm|LayerNorm)"):
        pipe.init(lambda k: nnx.state(nnx.BatchNorm(4, rngs=nnx.Rngs(k))), jax.random.key(0))
    with pytest.raises(ValueError, match=r"PRNG key at \['rng'\]"):
        pipe.init(lambda k: {"w": jnp.ones(4), "rng": k}, jax.random.key(0))
