"""Stage parameters placed by hand: bare ``[1, S, ...]`` arrays (or their shapes) carrying
a ``NamedSharding`` that splits their inner dimensions over ``tensor`` and ``fsdp``, not
made by `Pipeline.place`. The pipeline runs them as they are split (as it runs the
`jaxpipe.Placed` of the same specs): exact against the plain model, gradients split like
the parameters, no weight gathered over ``tensor``; a sharding that is no layout of the
pipeline is refused with the fix."""

import jax
import models
import numpy as np
import pytest
from hlo import collectives
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe import pipeline

S, M, BATCH, WIDTH = 2, 4, 16, 64  # a weight (64 x 128 floats) >> an activation (4 x 64)
MEGATRON = {"scale": None, "w1": P(None, "tensor"), "b1": P("tensor"), "w2": P("tensor", None)}
FSDP = {"scale": None, "w1": P("fsdp", "tensor"), "b1": P("tensor"), "w2": P("tensor", "fsdp")}


def _setup():
    mesh = models.pipe_mesh(S, (("fsdp", 2), ("tensor", 2)))
    pipe = pipeline.Pipeline(
        models.stage_fn, models.loss_fn, mesh=mesh, schedule="1f1b", num_microbatches=M
    )
    k1, k2 = jax.random.split(jax.random.key(0))
    logical, loss_params = models.init(k1, S, WIDTH)
    inputs, targets = models.data(k2, BATCH, WIDTH)
    return mesh, pipe, logical, pipe.replicate(loss_params), pipe.place_batch((inputs, targets))


def _by_hand(mesh, logical, specs):
    """``logical`` reshaped to ``[1, S, ...]`` and put on ``mesh`` split as ``specs`` say."""
    return {
        k: jax.device_put(
            x.reshape(1, *x.shape), NamedSharding(mesh, P(None, "pipe", *(specs[k] or ())))
        )
        for k, x in logical.items()
    }


def _reference(logical, loss_params, inputs, targets):
    grad = jax.value_and_grad(models.sequential_loss, argnums=(0, 1))
    loss, (grads, loss_grads) = grad(logical, loss_params, inputs, targets, M)
    return loss, jax.tree.map(lambda g: g[None], grads), loss_grads


@pytest.mark.parametrize("specs", [MEGATRON, FSDP], ids=["tensor", "fsdp-tensor"])
def test_hand_placed_params_run_split_as_given_and_exact(specs):
    """Eager ``loss_and_grads`` of concrete hand-placed arrays: loss and gradients equal the
    plain model's, and each gradient comes back split as its parameter is."""
    mesh, pipe, logical, loss_params, (inputs, targets) = _setup()
    params = _by_hand(mesh, logical, specs)
    loss, (grads, loss_grads) = pipe.loss_and_grads(params, loss_params, inputs, targets)
    want_loss, want_grads, want_loss_grads = _reference(logical, loss_params, inputs, targets)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    assert models.relative_error((grads, loss_grads), (want_grads, want_loss_grads)) < 1e-5
    for k, g in grads.items():
        assert g.sharding.is_equivalent_to(params[k].sharding, g.ndim), (k, g.sharding)


def test_hand_placed_params_under_jit_are_exact_and_an_unseen_split_is_warned_about():
    """``jax.jit(jax.value_and_grad(pipe.loss))`` and eager ``jax.value_and_grad`` of
    hand-placed arrays (traced: their shardings do not show to the pipeline) equal the plain
    model; the pipeline warns once that a split over a data axis is not seen there."""
    mesh, pipe, logical, loss_params, (inputs, targets) = _setup()
    params = _by_hand(mesh, logical, FSDP)
    want = _reference(logical, loss_params, inputs, targets)
    grad = jax.value_and_grad(pipe.loss, argnums=(0, 1))
    unseen = r"bare arrays traced .*\('fsdp': 2\).*pipe\.place\(logical_params, specs\)"
    with pytest.warns(UserWarning, match=unseen):
        jitted = jax.jit(grad)(params, loss_params, inputs, targets)
    eager = grad(params, loss_params, inputs, targets)
    for loss, (grads, loss_grads) in (jitted, eager):
        np.testing.assert_allclose(loss, want[0], rtol=1e-6)
        assert models.relative_error((grads, loss_grads), want[1:]) < 1e-5


@pytest.mark.filterwarnings("ignore:stage_params are bare arrays traced")
def test_hand_placed_shapes_compile_without_gathering_a_weight_over_tensor():
    """The issue's case: a step compiled from ``ShapeDtypeStruct``s split the Megatron way
    (not made by `Pipeline.place`): no all-gather over ``tensor`` larger than a
    micro-batch's activation (the pipeline once replicated every weight's gradient over
    ``tensor``), and the gradients come out split as the parameters."""
    mesh, pipe, logical, loss_params, (inputs, targets) = _setup()

    def struct(x, spec):
        sharding = NamedSharding(mesh, P(None, "pipe", *(spec or ())))
        return jax.ShapeDtypeStruct((1, *x.shape), x.dtype, sharding=sharding)

    params = {k: struct(x, MEGATRON[k]) for k, x in logical.items()}
    grad = jax.jit(jax.value_and_grad(pipe.loss))
    compiled = grad.lower(params, loss_params, inputs, targets).compile()
    activation = BATCH // M * WIDTH * 4
    gathered = [
        c.line
        for c in collectives(compiled.as_text(), mesh)
        if c.kind == "all-gather" and "tensor" in c.axes and c.nbytes > activation
    ]
    assert not gathered, gathered
    _, grads = compiled.output_shardings
    for k, g in grads.items():
        assert g.is_equivalent_to(params[k].sharding, params[k].ndim), (k, g)


def test_hand_placed_params_of_no_pipeline_layout_are_refused():
    """Arrays whose stage axis is split over ``tensor`` instead of ``pipe``: refused before
    tracing, naming the leaf and ``pipe.place`` (they were once re-split without a word)."""
    mesh, pipe, logical, loss_params, (inputs, targets) = _setup()
    params = {
        k: jax.device_put(x.reshape(1, *x.shape), NamedSharding(mesh, P(None, "tensor")))
        for k, x in logical.items()
    }
    with pytest.raises(ValueError, match=r"stage_params leaf \['b1'\].*pipe\.place\("):
        pipe.loss(params, loss_params, inputs, targets)
