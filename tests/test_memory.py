"""Memory and program size from XLA's own analyses (`memory_analysis`, the compiled HLO)."""

import jax
import models
import pytest

from jaxpipe import pipeline

WIDTH = 64
ROWS = 16  # rows per micro-batch: activations large enough that buffers, not weights, dominate


def _compiled(name, S, M, opts=None, remat=False):
    pipe = pipeline.Pipeline(
        models.stage_fn,
        models.loss_fn,
        mesh=models.pipe_mesh(S),
        schedule=name,
        num_microbatches=M,
        schedule_options=opts,
        remat=remat,
    )
    sp, lp = models.init(jax.random.key(0), pipe.num_logical_stages, width=WIDTH)
    x, t = models.data(jax.random.key(1), ROWS * M, width=WIDTH)
    step = jax.jit(jax.grad(pipe.loss, argnums=(0, 1)))
    return step.lower(sp, lp, x, t).compile()


def _temp(*args, **kwargs):
    return _compiled(*args, **kwargs).memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize(
    "name,opts,small,large",
    [
        ("1f1b", None, 8, 64),
        ("interleaved_1f1b", {"virtual_stages": 2}, 8, 64),
        ("zb_h2", None, 16, 64),
        ("zbv", None, 16, 64),
    ],
)
def test_activation_memory_is_bounded_in_microbatches(name, opts, small, large):
    temp_small, temp_large = _temp(name, 4, small, opts), _temp(name, 4, large, opts)
    assert temp_large <= 1.10 * temp_small, (temp_small, temp_large)


def test_gpipe_memory_grows_with_microbatches():
    """The contrast that makes the test above meaningful: GPipe keeps every micro-batch."""
    assert _temp("gpipe", 4, 32) > 2.5 * _temp("gpipe", 4, 8)


def test_1f1b_uses_at_most_a_third_of_gpipe():
    assert 3 * _temp("1f1b", 4, 32) <= _temp("gpipe", 4, 32)


def test_zb_h1_within_15_percent_of_1f1b():
    one_f_one_b, zb_h1 = _temp("1f1b", 4, 16), _temp("zb_h1", 4, 16)
    assert abs(zb_h1 - one_f_one_b) <= 0.15 * one_f_one_b, (one_f_one_b, zb_h1)


def test_remat_lowers_gpipe_memory():
    assert _temp("gpipe", 4, 32, remat=True) < 0.5 * _temp("gpipe", 4, 32)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zbv"])
def test_program_size_does_not_grow_with_microbatches(name):
    """One scan over ticks: the same HLO instructions at M = 8 and M = 128."""

    def instructions(M):
        text = _compiled(name, 4, M).as_text()
        return sum(1 for line in text.splitlines() if " = " in line)

    assert instructions(8) == instructions(128)


def test_remat_policy_saves_memory_between_none_and_full_remat():
    """A jax.checkpoint policy per stage: gradients unchanged, memory between the extremes."""
    import jax.numpy as jnp
    import numpy as np

    def temp_and_grads(**kwargs):
        pipe = pipeline.Pipeline(
            models.stage_fn,
            models.loss_fn,
            mesh=models.pipe_mesh(4),
            schedule="gpipe",
            num_microbatches=16,
            **kwargs,
        )
        sp, lp = models.init(jax.random.key(0), 4, width=WIDTH)
        x, t = models.data(jax.random.key(1), ROWS * 16, width=WIDTH)
        step = jax.jit(jax.grad(pipe.loss, argnums=(0, 1)))
        temp = step.lower(sp, lp, x, t).compile().memory_analysis().temp_size_in_bytes
        return temp, step(sp, lp, x, t)

    full, grads_full = temp_and_grads()
    policy, grads_policy = temp_and_grads(
        remat_policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    )
    inputs_only, _ = temp_and_grads(remat=True)
    assert inputs_only < policy < full, (inputs_only, policy, full)
    for a, b in zip(
        jax.tree_util.tree_leaves(grads_policy), jax.tree_util.tree_leaves(grads_full), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7 * float(jnp.abs(b).max()))
