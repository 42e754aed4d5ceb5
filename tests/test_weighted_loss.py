"""A loss that is not a mean over rows: token-weighted cross-entropy with padding.

The pipeline averages ``loss_fn`` over micro-batches by default. A way to get the
whole-batch value ``sum(nll * mask) / sum(mask)`` without ``loss_reduction``
(tests/test_loss_options.py holds that option): count the tokens of the whole batch before
the call and pass
``M / count`` as a per-row target leaf; ``loss_fn`` returns its micro-batch's token sum
times it. Held to the plain whole-batch model, uneven token counts per micro-batch, loss and
every gradient, float32, under gpipe, 1f1b and zbv (split backward).
"""

import jax
import jax.numpy as jnp
import models
import numpy as np
import optax
import pytest

from jaxpipe import pipeline, schedules

WIDTH, VOCAB, ROWS, SEQ, M = 8, 5, 16, 6, 4


def stage_fn(w, h):
    return h + jnp.tanh(h @ w)


def loss_fn(head, y, target):
    """The micro-batch's summed token cross-entropy times ``M / tokens of the batch``."""
    nll = optax.softmax_cross_entropy_with_integer_labels(y @ head, target["labels"])
    return jnp.sum(nll * target["mask"]) * target["scale"][0]


def weighted_targets(labels, mask, num_microbatches):
    """Targets with the per-row leaf ``scale = M / tokens in the whole batch``."""
    scale = num_microbatches / jnp.sum(mask)
    return {"labels": labels, "mask": mask, "scale": jnp.full(labels.shape[0], scale)}


def plain_loss(weights, head, inputs, labels, mask):
    h = inputs
    for w in weights:
        h = stage_fn(w, h)
    nll = optax.softmax_cross_entropy_with_integer_labels(h @ head, labels)
    return jnp.sum(nll * mask) / jnp.sum(mask)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("gpipe", marks=pytest.mark.slow),
        pytest.param("1f1b", marks=pytest.mark.slow),
        "zbv",
    ],
)
def test_token_weighted_loss_equals_the_whole_batch(name):
    rng = np.random.default_rng(1)
    schedule = schedules.get(name, 4, M)
    stages = schedule.num_logical_stages
    weights = jnp.asarray(rng.normal(size=(stages, WIDTH, WIDTH)) / 3, jnp.float32)
    head = jnp.asarray(rng.normal(size=(WIDTH, VOCAB)), jnp.float32)
    inputs = jnp.asarray(rng.normal(size=(ROWS, SEQ, WIDTH)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, VOCAB, size=(ROWS, SEQ)), jnp.int32)
    lengths = rng.integers(1, SEQ + 1, size=ROWS)  # real tokens per row, the rest padding
    mask = jnp.asarray(np.arange(SEQ) < lengths[:, None], jnp.float32)
    per_microbatch = [float(mb.sum()) for mb in pipeline.split_microbatches(mask, M)]
    assert len(set(per_microbatch)) > 1, per_microbatch  # uneven, or the test proves nothing

    pipe = pipeline.Pipeline(stage_fn, loss_fn, mesh=models.pipe_mesh(4), schedule=schedule)
    targets = weighted_targets(labels, mask, M)
    loss, (grads, head_grads) = pipe.loss_and_grads(pipe.place(weights), head, inputs, targets)
    want, (want_grads, want_head) = jax.value_and_grad(plain_loss, argnums=(0, 1))(
        weights, head, inputs, labels, mask
    )
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    np.testing.assert_allclose(head_grads, want_head, atol=1e-5 * np.abs(want_head).max())
    np.testing.assert_allclose(
        pipe.logical(grads), want_grads, atol=1e-5 * np.abs(want_grads).max()
    )
    parts = [pipeline.split_microbatches(a, M) for a in (inputs, labels, mask)]
    rows_mean = jnp.mean(
        jnp.stack([plain_loss(weights, head, *mb) for mb in zip(*parts, strict=True)])
    )
    assert abs(rows_mean - want) > 1e-4 * want  # the naive mean of means differs
