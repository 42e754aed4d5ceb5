"""Dropout masks that do not depend on how the blocks are cut into stages.

The documented way (docs/transformers.md, "Dropout that does not depend on the cut"): one key
per row as a side input (``jax.random.split(key, rows)`` as raw key data), and each block
folds its global index, ``stage * blocks_per_stage + i`` from the keyword ``stage``, into
its rows' keys. Eight blocks cut 4 x 2 (gpipe, 1f1b on 4 devices) or 8 x 1
(interleaved_1f1b, zbv, dualpipev on 4 devices) give the plain model's loss and gradients,
float32, 1e-5 (relative to the largest gradient); other keys give another loss.
"""

import jax
import jax.numpy as jnp
import models
import numpy as np
import pytest

from jaxpipe import pipeline, schedules

BLOCKS, WIDTH, ROWS, M, RATE = 8, 16, 16, 8, 0.5


def dropout(h, row_keys, block):
    """Drops each row's units with its own key folded with the global block index."""

    def one_row(row_key, row):
        key = jax.random.fold_in(jax.random.wrap_key_data(row_key), block)
        keep = jax.random.bernoulli(key, 1 - RATE, row.shape)
        return jnp.where(keep, row / (1 - RATE), 0.0)

    return jax.vmap(one_row)(row_keys, h)


def block(w, h, row_keys, index):
    return h + dropout(jnp.tanh(h @ w), row_keys, index)


def make_stage_fn(blocks_per_stage):
    def stage_fn(p, h, *, side, stage):
        for i in range(blocks_per_stage):
            h = block(p[i], h, side, stage * blocks_per_stage + i)
        return h

    return stage_fn


def loss_fn(head, y, target):
    return jnp.mean((y @ head - target) ** 2)


def plain_loss(weights, head, inputs, targets, row_keys):
    """The whole batch through the eight blocks, no pipeline."""
    h = inputs
    for index in range(BLOCKS):
        h = block(weights[index], h, row_keys, index)
    return loss_fn(head, h, targets)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("gpipe", marks=pytest.mark.slow),
        pytest.param("1f1b", marks=pytest.mark.slow),
        pytest.param("zb_h1", marks=pytest.mark.slow),
        pytest.param("interleaved_1f1b", marks=pytest.mark.slow),
        "zbv",
        pytest.param("dualpipev", marks=pytest.mark.slow),
    ],
)
def test_dropout_masks_do_not_depend_on_the_cut(name):
    rng = np.random.default_rng(0)
    weights = jnp.asarray(rng.normal(size=(BLOCKS, WIDTH, WIDTH)) / 4, jnp.float32)
    head = jnp.asarray(rng.normal(size=(WIDTH, 2)), jnp.float32)
    inputs = jnp.asarray(rng.normal(size=(ROWS, WIDTH)), jnp.float32)
    targets = jnp.asarray(rng.normal(size=(ROWS, 2)), jnp.float32)
    row_keys = jax.random.key_data(jax.random.split(jax.random.key(7), ROWS))

    schedule = schedules.get(name, 4, M)
    per_stage = BLOCKS // schedule.num_logical_stages  # 2 (4 x 2) or 1 (8 x 1)
    pipe = pipeline.Pipeline(
        make_stage_fn(per_stage), loss_fn, mesh=models.pipe_mesh(4), schedule=schedule
    )
    stages = weights.reshape(pipe.num_logical_stages, per_stage, WIDTH, WIDTH)
    loss, (grads, head_grads) = pipe.loss_and_grads(
        pipe.place(stages), head, inputs, targets, side=row_keys
    )
    want, (want_grads, want_head) = jax.value_and_grad(plain_loss, argnums=(0, 1))(
        weights, head, inputs, targets, row_keys
    )
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    np.testing.assert_allclose(head_grads, want_head, atol=1e-5 * np.abs(want_head).max())
    logical = pipe.logical(grads).reshape(BLOCKS, WIDTH, WIDTH)
    np.testing.assert_allclose(logical, want_grads, atol=1e-5 * np.abs(want_grads).max())
    other_keys = jax.random.key_data(jax.random.split(jax.random.key(8), ROWS))
    assert abs(plain_loss(weights, head, inputs, targets, other_keys) - want) > 1e-3 * want
