"""Flax stages: a tiny GPT (NNX and Linen stages) trains through the pipeline on DP x PP (x TP)
meshes with the same losses as the plain model; `jaxpipe.stages` helpers and their errors."""

import functools
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


def _train(loss, params, tokens, targets):
    """Losses of STEPS jitted adam steps of ``loss(params, tokens, targets)``."""
    opt = optax.adam(1e-2)

    @jax.jit
    def step(params, opt_state):
        value, grads = jax.value_and_grad(loss)(params, tokens, targets)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state = opt.init(params)
    losses = []
    for _ in range(STEPS):
        params, opt_state, value = step(params, opt_state)
        losses.append(float(value))
    return np.array(losses), params


@functools.cache
def _reference_losses(flavour, num_stages):
    """Losses of the plain model (no mesh, no pipeline) with the test's parameters and data."""
    config = gpt.Config(num_layers=num_stages)
    init = gpt.init if flavour == "nnx" else gpt.init_linen
    stage_fn, stage_params, loss_params = init(jax.random.key(num_stages), config, num_stages)
    tokens, targets = gpt.data(jax.random.key(1), config, BATCH)
    params = {"stages": stage_params, "outer": loss_params}
    return _train(lambda p, x, t: gpt.reference_loss(stage_fn, p, x, t), params, tokens, targets)[0]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gpt_trains_like_the_plain_model(case, tensor_sharded=False):
    """On the tensor mesh the batch is sharded over data; stage params are replicated over
    tensor (see `test_gpt_with_tensor_sharded_stage_weights`)."""
    flavour, extra, S, name, opts = case
    mesh = models.pipe_mesh(S, extra)
    N = S * opts.get("virtual_stages", 1)
    config = gpt.Config(num_layers=N)
    init = gpt.init if flavour == "nnx" else gpt.init_linen
    stage_fn, stage_params, loss_params = init(jax.random.key(N), config, N)
    pipe = pipeline.Pipeline(
        stage_fn,
        gpt.loss_fn,
        mesh=mesh,
        schedule=name,
        num_microbatches=MICROBATCHES,
        schedule_options=opts,
    )
    tokens, targets = gpt.data(jax.random.key(1), config, BATCH)

    ref_losses = _reference_losses(flavour, N)

    rules = TENSOR_RULES[flavour] if tensor_sharded else []
    sharded = {"stages": _place(pipe, stage_params, rules), "outer": loss_params}
    batch_sharding = NamedSharding(mesh, P("data"))
    tokens, targets = jax.device_put((tokens, targets), batch_sharding)
    losses, trained = _train(
        lambda p, x, t: gpt.pipeline_loss(pipe, p, x, t), sharded, tokens, targets
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
