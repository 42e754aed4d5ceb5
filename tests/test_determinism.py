"""Same seeds and inputs give bitwise identical losses and gradients on CPU, across two
separately compiled programs. (Across processes: see the kill-and-resume test in
test_checkpoint.py, whose fresh process reproduces the parameters bit for bit.)"""

import jax
import models
import numpy as np
import pytest

from jaxpipe import pipeline


def _run():
    """Builds everything from seeds, compiles afresh and returns host loss and gradients."""
    jax.clear_caches()
    mesh = models.pipe_mesh(2)
    pipe = pipeline.Pipeline(
        models.stage_fn,
        models.loss_fn,
        mesh=mesh,
        schedule="interleaved_1f1b",
        num_microbatches=4,
        schedule_options={"virtual_stages": 2},
    )
    k1, k2 = jax.random.split(jax.random.key(1234))
    stage_params, loss_params = models.init(k1, pipe.num_logical_stages)
    inputs, targets = models.data(k2, 16)
    grad = jax.jit(jax.value_and_grad(pipe.loss, argnums=(0, 1, 2)))
    loss, grads = grad(pipe.place(stage_params), loss_params, inputs, targets)
    return jax.tree_util.tree_map(np.asarray, (loss, grads))


@pytest.mark.slow
def test_two_runs_are_bitwise_identical():
    first, second = _run(), _run()
    leaves = jax.tree_util.tree_leaves(first)
    assert len(leaves) == 1 + 4 + 1 + 1  # loss, stage grads, loss-param grad, input grad
    assert all(np.all(np.isfinite(x)) for x in leaves)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_array_equal(a, b, strict=True), first, second
    )
