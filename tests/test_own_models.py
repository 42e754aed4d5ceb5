"""Layers written for other libraries as stages: sharding constraints inside a stage (Flax
logical-axis rules as MaxText writes its layers, plain ``with_sharding_constraint``),
modules built on another mesh, per-block kinds, adapters for modules with several inputs
and existing weights, and steps that compile once."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import models
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpipe

WIDTH, HIDDEN, SEQ = 16, 24, 4  # HIDDEN / 2 = 12 marks the tensor-split activations
# Logical-axis rules as MaxText writes them: activations' batch over the pipeline's manual
# axes, the MLP's hidden dimension over tensor.
RULES = (
    ("activation_batch", ("pipe", "data")),
    ("activation_length", None),
    ("activation_mlp", "tensor"),
    ("activation_embed", None),
)


class LogicalMlp(nn.Module):
    """A residual MLP block that constrains its activations by logical axis names."""

    @nn.compact
    def __call__(self, x):
        w_in = self.param("w_in", nn.initializers.normal(0.3), (WIDTH, HIDDEN))
        w_out = self.param("w_out", nn.initializers.normal(0.3), (HIDDEN, WIDTH))
        x = nn.with_logical_constraint(
            x, ("activation_batch", "activation_length", "activation_embed")
        )
        h = nn.with_logical_constraint(
            jnp.tanh(x @ w_in), ("activation_batch", "activation_length", "activation_mlp")
        )
        return x + h @ w_out


def named_mlp(mesh):
    """The same block with plain ``with_sharding_constraint``s on ``mesh``'s shardings."""

    def block(p, x):
        h = jnp.tanh(x @ p["w_in"])
        h = jax.lax.with_sharding_constraint(
            h, NamedSharding(mesh, P(("pipe", "data"), None, "tensor"))
        )
        return x + h @ p["w_out"]

    return block


def loss_fn(lp, y, target):
    return jnp.mean((y @ lp["head"] - target) ** 2)


def mesh_of(shape, names):
    count = int(np.prod(shape))
    return jax.make_mesh(
        shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
        devices=jax.devices()[:count],
    )  # fmt: skip


def plain_loss(blocks, stage_params, loss_params, x, t):
    """The model without the pipeline: every block in order, the loss over all rows."""
    for s, block in enumerate(blocks):
        x = block(jax.tree_util.tree_map(lambda a, s=s: a[s], stage_params), x)
    return loss_fn(loss_params, x, t)


def batch(key, rows):
    normal = models.numpy_rng(key).standard_normal
    x, t = normal((rows, SEQ, WIDTH)), normal((rows, SEQ, WIDTH))
    head = normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)
    return models.float32((x, t, {"head": head}))


@pytest.mark.filterwarnings("ignore:mesh axis 'tensor'")  # only the constraints name it
def test_constraints_inside_stages_keep_automatic_axes():
    """Logical constraints (rules naming pipe, data and tensor) in the first two stages and a
    plain NamedSharding constraint in the others run in a pipe 2 x data 2 x tensor 2
    pipeline: the manual axes are dropped, the tensor constraints hold in the compiled step,
    and loss and gradients equal the plain model's."""
    mesh = mesh_of((2, 2, 2), ("pipe", "data", "tensor"))
    module = LogicalMlp()
    linen_fn, linen_params = jaxpipe.stages.linen_stage(
        module, jax.random.key(0), jnp.zeros((2, SEQ, WIDTH)), 2
    )
    named_fn = named_mlp(mesh)
    _, more = jaxpipe.stages.linen_stage(module, jax.random.key(1), jnp.zeros((2, SEQ, WIDTH)), 2)
    stage_params = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b]), linen_params, more)

    def stage_fn(p, x, *, stage):
        return jax.lax.cond(stage < 2, linen_fn, named_fn, p, x)

    pipe = jaxpipe.Pipeline(
        stage_fn, loss_fn, mesh=mesh, schedule="interleaved_1f1b", num_microbatches=2,
        schedule_options={"virtual_stages": 2},
    )  # fmt: skip
    x, t, loss_params = batch(jax.random.key(2), 8)
    params = pipe.place(stage_params)  # whole weights: only the constraints split over tensor
    step = jax.jit(jax.value_and_grad(pipe.loss, argnums=(0, 1)))
    with nn.logical_axis_rules(RULES):
        lowered = step.lower(params, loss_params, x, t)
        loss, (grads, loss_grads) = lowered.compile()(params, loss_params, x, t)
    # the stages' constraints on activations reach the program over tensor only
    on_activations = [
        line
        for line in lowered.as_text().splitlines()
        if "sharding_constraint" in line and f"x{SEQ}x{HIDDEN}xf32>" in line
    ]
    assert any('[{}, {}, {"tensor"}]' in line for line in on_activations)
    assert not any('"pipe"' in line or '"data"' in line for line in on_activations)
    # the hidden activations of a micro-batch's rows (2 per replica) are split over tensor
    assert f"f32[2,{SEQ},{HIDDEN // 2}]" in lowered.compile().as_text()

    def plain(sp, lp):
        return plain_loss([linen_fn, linen_fn, named_fn, named_fn], sp, lp, x, t)

    want, (want_grads, want_loss_grads) = jax.jit(jax.value_and_grad(plain, (0, 1)))(
        stage_params, loss_params
    )
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    assert models.relative_error(pipe.logical(grads), want_grads) < 1e-5
    assert models.relative_error(loss_grads, want_loss_grads) < 1e-5
