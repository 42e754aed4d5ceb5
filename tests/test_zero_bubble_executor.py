"""Zero-bubble schedules executed: B and W as separate actions, DualPipeV's fused pairs."""

import jax
import models
import numpy as np
import pytest

from jaxpipe import pipeline
from jaxpipe._executor import local

# (schedule, S, M): M from the smallest the schedule allows up to 4S; each schedule's smallest
# case and one or two larger ones, S = 8 among them (CI time).
CASES = [
    ("zb_h1", 2, 1),
    ("zb_h1", 8, 9),
    ("zb_h2", 2, 1),
    ("zb_h2", 3, 5),
    ("zbv", 2, 1),
    ("zbv", 4, 16),
    ("dualpipev", 2, 4),
    ("dualpipev", 3, 7),
    ("dualpipev", 8, 16),
]
# The fast loop runs the smallest case of each schedule.
FAST = {("zb_h1", 2, 1), ("zb_h2", 2, 1), ("zbv", 2, 1), ("dualpipev", 2, 4)}
PARAMS = [
    pytest.param(
        *case, id="{}-S{}-M{}".format(*case), marks=() if case in FAST else pytest.mark.slow
    )
    for case in CASES
]
TOL = 1e-5


@pytest.mark.parametrize("name,S,M", PARAMS)
def test_split_backward_matches_sequential_reference(name, S, M):
    check_against_sequential_reference(name, S, M)


@pytest.mark.parametrize(
    "name,S,M",
    [("1f1b", 2, 3), ("zb_h1", 3, 4), pytest.param("dualpipev", 2, 4, marks=pytest.mark.slow)],
)
def test_the_tpu_compilers_hand_over_is_exact_too(name, S, M, monkeypatch):
    """The tick hands buffers to the backward's switch one way for the TPU compiler (the
    residuals read outside the switch, the stash passed through it and written by B) and
    another for the others (`jaxpipe._executor.local.updates_in_place`); the TPU's way, run
    here on CPU host devices, gives the sequential model's gradients too: one stash slot
    (1f1b), several (zb_h1), fused forward-backward cells (dualpipev)."""
    monkeypatch.setattr(local, "updates_in_place", lambda mesh: True)
    check_against_sequential_reference(name, S, M)


def check_against_sequential_reference(name, S, M):
    pipe = pipeline.Pipeline(
        models.stage_fn, models.loss_fn, mesh=models.pipe_mesh(S), schedule=name, num_microbatches=M
    )
    assert pipe.schedule.splits_backward
    k1, k2 = jax.random.split(jax.random.key(1000 * S + M))
    sp, lp = models.init(k1, pipe.num_logical_stages)
    x, t = models.data(k2, 2 * M)
    step = jax.jit(jax.value_and_grad(pipe.loss, argnums=(0, 1, 2)))
    loss, grads = step(pipe.place(sp), lp, x, t)
    grads = (pipe.logical(grads[0]), *grads[1:])
    ref_loss, ref = jax.value_and_grad(models.sequential_loss, argnums=(0, 1, 2))(sp, lp, x, t, M)
    np.testing.assert_allclose(loss, ref_loss, rtol=TOL)
    for got, want in zip(grads, ref, strict=True):
        assert models.relative_error(got, want) < TOL


@pytest.mark.slow
def test_dualpipev_runs_fused_pairs():
    """The table has forward+backward cells, and the compiled program executes both."""
    pipe = pipeline.Pipeline(
        models.stage_fn,
        models.loss_fn,
        mesh=models.pipe_mesh(4),
        schedule="dualpipev",
        num_microbatches=8,
        schedule_options={"overlap": True},
    )
    sp, lp = models.init(jax.random.key(0), pipe.num_logical_stages)
    x, t = models.data(jax.random.key(1), 16)
    trace = pipe.trace(pipe.place(sp), lp, x, t)
    both = (trace[:, :, 0] != 0) & (trace[:, :, 3] != 0)
    pairs = sum(1 for row in pipe.schedule.ticks for cell in row if len(cell) == 2)
    assert pairs > 0 and int(both.sum()) == pairs
