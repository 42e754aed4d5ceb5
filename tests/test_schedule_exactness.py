"""The new default tables executed: loss and every gradient equal to a plain sequential model.

One small case per (schedule, device count) on 2, 4 and 8 devices: the split-backward
defaults of `1f1b` and `interleaved_1f1b` (also with M not a multiple of S, which it now
takes), `interleaved_zb`, the unfolded `dualpipev`, and the asynchronous `pipedream` and
`pipedream_2bw` (whose updates are ``U`` actions in the table), those against the
sequential replay of the same table. fp32, relative tolerance 1e-5, fresh random inputs.
Written against the public `Pipeline` API only.
"""

import jax
import models
import numpy as np
import optax
import pytest
from against_replay import train_against_replay

from jaxpipe import pipeline

TOL = 1e-5
V2 = {"virtual_stages": 2}
# (schedule, options, S, M); M not a multiple of S wherever the schedule allows it.
CASES = [
    pytest.param("1f1b", {}, 2, 3, marks=pytest.mark.slow),
    pytest.param("1f1b", {}, 4, 6, marks=pytest.mark.slow),
    pytest.param("1f1b", {}, 8, 9, marks=pytest.mark.slow),
    pytest.param("interleaved_1f1b", V2, 2, 3, marks=pytest.mark.slow),
    pytest.param("interleaved_1f1b", V2, 4, 6, marks=pytest.mark.slow),
    pytest.param("interleaved_1f1b", {"virtual_stages": 3}, 4, 5, marks=pytest.mark.slow),
    pytest.param("interleaved_1f1b", V2, 4, 3, marks=pytest.mark.slow),  # M < S
    pytest.param("interleaved_1f1b", V2, 8, 10, marks=pytest.mark.slow),
    ("interleaved_zb", V2, 2, 3),
    pytest.param("interleaved_zb", V2, 4, 6, marks=pytest.mark.slow),
    pytest.param("interleaved_zb", V2, 8, 8, marks=pytest.mark.slow),
    pytest.param("dualpipev", {}, 2, 5, marks=pytest.mark.slow),
    pytest.param("dualpipev", {}, 4, 8, marks=pytest.mark.slow),
    pytest.param("dualpipev", {}, 8, 16, marks=pytest.mark.slow),
]


def _id(case):
    name, options, S, M = case.values if hasattr(case, "values") else case
    return f"{name}-{'-'.join(f'{k}{v}' for k, v in options.items())}-S{S}-M{M}"


@pytest.mark.parametrize("name,options,S,M", CASES, ids=[_id(c) for c in CASES])
def test_loss_and_gradients_equal_the_sequential_model(name, options, S, M):
    pipe = pipeline.Pipeline(
        models.stage_fn,
        models.loss_fn,
        mesh=models.pipe_mesh(S),
        schedule=name,
        num_microbatches=M,
        schedule_options=options,
    )
    assert pipe.schedule.splits_backward and pipe.schedule.max_actions_per_tick == 1
    k1, k2 = jax.random.split(jax.random.key(97 * S + M + len(name)))
    sp, lp = models.init(k1, pipe.num_logical_stages)
    x, t = models.data(k2, 2 * M)
    step = jax.jit(jax.value_and_grad(pipe.loss, argnums=(0, 1, 2)))
    loss, grads = step(pipe.place(sp), lp, x, t)
    grads = (pipe.logical(grads[0]), *grads[1:])
    ref_loss, ref = jax.value_and_grad(models.sequential_loss, argnums=(0, 1, 2))(sp, lp, x, t, M)
    np.testing.assert_allclose(loss, ref_loss, rtol=TOL)
    for got, want in zip(grads, ref, strict=True):
        assert models.relative_error(got, want) < TOL


ASYNC = [
    pytest.param("pipedream", 2, 5, marks=pytest.mark.slow),
    pytest.param("pipedream_2bw", 4, 9, marks=pytest.mark.slow),
    pytest.param("pipedream", 8, 17, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name,S,M", ASYNC, ids=lambda x: str(x))
def test_asynchronous_updates_equal_the_replay(name, S, M):
    """Split backward, with the updates read from the table's U actions: two steps of
    Pipeline.train against the sequential replay of the same table."""
    pipe = pipeline.Pipeline(
        models.stage_fn,
        models.loss_fn,
        mesh=models.pipe_mesh(S),
        schedule=name,
        num_microbatches=M,
    )
    assert pipe.schedule.has_updates and pipe.schedule.splits_backward
    params, loss_params = models.init(jax.random.key(S + M), S)
    batches = [models.batch(jax.random.key(50 + k), 2 * M) for k in range(2)]
    train_against_replay(
        pipe, optax.adam(1e-2), models.stage_fn, models.loss_fn, params, loss_params, batches,
        tol=TOL,
    )  # fmt: skip
