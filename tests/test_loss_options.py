"""Losses as users write them: ``loss_has_aux`` and ``loss_reduction``.

A token-weighted cross-entropy (``loss_reduction`` a weight function: the micro-batch's
count of scored tokens) with its accuracy as ``aux``, under zbv with a data axis, equals the
plain whole-batch model: loss, accuracy, and the gradients of the stage parameters, the
head, the inputs and the float mask (through the weights too). A loss that sums over rows
(``loss_reduction="sum"``) with an integer count as ``aux`` equals the whole-batch sum, and
`Pipeline.train` returns the aux beside the losses; by default loss and aux are the means
over micro-batches. Micro-batches hold uneven token counts, so the mean of micro-batch means
differs from the whole-batch value. What cannot work is refused before tracing.
"""

import jax
import jax.numpy as jnp
import models
import numpy as np
import optax
import pytest

import jaxpipe
from jaxpipe import pipeline

WIDTH, VOCAB, ROWS, SEQ, M, S = 8, 5, 16, 6, 4, 2
RTOL = 1e-5


def stage_fn(w, h):
    return h + jnp.tanh(h @ w)


def token_nll(head, y, target):
    logits = y @ head
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, target["labels"])
    correct = (jnp.argmax(logits, -1) == target["labels"]).astype(jnp.float32)
    return nll, correct, target["mask"]


def mean_loss_fn(head, y, target):
    """The micro-batch's token mean, and its token accuracy."""
    nll, correct, mask = token_nll(head, y, target)
    tokens = jnp.sum(mask)
    return jnp.sum(nll * mask) / tokens, {"accuracy": jnp.sum(correct * mask) / tokens}


def sum_loss_fn(head, y, target):
    """The micro-batch's token sum, and its count of correct tokens (an integer)."""
    nll, correct, mask = token_nll(head, y, target)
    return jnp.sum(nll * mask), jnp.sum(correct * mask).astype(jnp.int32)


def tokens(target):
    return jnp.sum(target["mask"])


def plain(weights, head, inputs, targets):
    """The whole batch at once: token sums of the loss and of correct tokens, token count."""
    h = inputs
    for w in weights:
        h = stage_fn(w, h)
    nll, correct, mask = token_nll(head, h, targets)
    return jnp.sum(nll * mask), (jnp.sum(correct * mask), jnp.sum(mask))


def problem(seed, num_stages):
    rng = np.random.default_rng(seed)
    weights = jnp.asarray(rng.normal(size=(num_stages, WIDTH, WIDTH)) / 3, jnp.float32)
    head = jnp.asarray(rng.normal(size=(WIDTH, VOCAB)), jnp.float32)
    inputs = jnp.asarray(rng.normal(size=(ROWS, SEQ, WIDTH)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, VOCAB, size=(ROWS, SEQ)), jnp.int32)
    lengths = rng.integers(1, SEQ + 1, size=ROWS)  # real tokens per row, the rest padding
    mask = jnp.asarray(np.arange(SEQ) < lengths[:, None], jnp.float32)
    counts = [float(mb.sum()) for mb in pipeline.split_microbatches(mask, M * 2)]
    assert len(set(counts)) > 1, counts  # uneven, or the test proves nothing
    return weights, head, inputs, {"labels": labels, "mask": mask}


def assert_close(got, want):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        scale = float(np.abs(w).max())
        assert scale > 0  # a zero gradient proves nothing
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=RTOL * scale)


@pytest.mark.parametrize(
    "num_stages, split_loss_grads", [(S, False), (S, True), (1, True)], ids=str
)
def test_token_weighted_loss_and_aux_equal_the_whole_batch(num_stages, split_loss_grads):
    """(``split_loss_grads``: the head's gradient accumulated split over data, as the tick
    loop and, on one device, plain accumulation keep it; the weights scale each replica's
    share before its reduce-scatter.)"""
    mesh = models.pipe_mesh(num_stages, [("data", 2)])
    pipe = jaxpipe.Pipeline(
        stage_fn,
        mean_loss_fn,
        mesh=mesh,
        schedule="zbv",
        num_microbatches=M,
        loss_has_aux=True,
        loss_reduction=tokens,
        split_loss_grads=split_loss_grads,
    )
    weights, head, inputs, targets = problem(0, pipe.num_logical_stages)

    def piped(params, head, inputs, mask):
        return pipe.loss(params, head, inputs, dict(targets, mask=mask))

    def whole(weights, head, inputs, mask):
        total, (correct, count) = plain(weights, head, inputs, dict(targets, mask=mask))
        return total / count, {"accuracy": correct / count}

    argnums = (0, 1, 2, 3)
    (loss, aux), grads = jax.jit(jax.value_and_grad(piped, argnums, has_aux=True))(
        pipe.place(weights), head, inputs, targets["mask"]
    )
    (want, want_aux), want_grads = jax.jit(jax.value_and_grad(whole, argnums, has_aux=True))(
        weights, head, inputs, targets["mask"]
    )
    np.testing.assert_allclose(loss, want, rtol=RTOL)
    np.testing.assert_allclose(aux["accuracy"], want_aux["accuracy"], rtol=RTOL)
    assert_close((pipe.logical(grads[0]), *grads[1:]), want_grads)


@pytest.mark.slow
def test_summed_loss_and_integer_aux_equal_the_whole_batch():
    pipe = jaxpipe.Pipeline(
        stage_fn,
        sum_loss_fn,
        mesh=models.pipe_mesh(S),
        schedule="1f1b",
        num_microbatches=M,
        loss_has_aux=True,
        loss_reduction="sum",
    )
    weights, head, inputs, targets = problem(1, pipe.num_logical_stages)
    params = pipe.place(weights)
    (loss, correct), (grads, head_grads) = pipe.loss_and_grads(params, head, inputs, targets)
    (want, (want_correct, _)), want_grads = jax.jit(
        jax.value_and_grad(plain, argnums=(0, 1), has_aux=True)
    )(weights, head, inputs, targets)
    np.testing.assert_allclose(loss, want, rtol=RTOL)
    assert correct == want_correct and correct.dtype == jnp.float32
    assert_close((pipe.logical(grads), head_grads), want_grads)

    optimizer = optax.sgd(0.1)
    _, _, (losses, train_correct) = pipe.train(
        optimizer, params, pipe.init_optimizer(optimizer, params), head, inputs, targets
    )
    np.testing.assert_allclose(jnp.sum(losses), want, rtol=RTOL)
    assert train_correct == want_correct


# ------------------------------------------------------------------------- refusals
def make(loss_fn, schedule="1f1b", **options):
    return jaxpipe.Pipeline(
        stage_fn, loss_fn, mesh=models.pipe_mesh(S), schedule=schedule, num_microbatches=M,
        **options,
    )  # fmt: skip


def shapes_of_loss(pipe):
    weights, head, inputs, targets = problem(2, pipe.num_logical_stages)
    return jax.eval_shape(pipe.loss, pipe.place(weights), head, inputs, targets)


def test_loss_has_aux_without_a_pair_is_refused():
    """(The other refusals are rows of docs/errors.md, tested in tests/test_errors.py.)"""
    loss_fn = lambda h, y, t: mean_loss_fn(h, y, t)[0]  # noqa: E731
    with pytest.raises(ValueError, match="loss_has_aux=True, so loss_fn must return a pair"):
        shapes_of_loss(make(loss_fn, loss_has_aux=True))


def test_aux_is_averaged_by_default_and_has_no_gradient():
    """With the default reduction, loss and aux are the means over micro-batches of the
    plain model's (a forward-only run); a gradient flowing into aux is refused."""
    pipe = make(mean_loss_fn, loss_has_aux=True)
    weights, head, inputs, targets = problem(3, pipe.num_logical_stages)
    params = pipe.place(weights)
    loss, aux = jax.jit(pipe.loss)(params, head, inputs, targets)

    def one_microbatch(m):
        part = jax.tree_util.tree_map(lambda a: pipeline.split_microbatches(a, M)[m], targets)
        h = pipeline.split_microbatches(inputs, M)[m]
        for w in weights:
            h = stage_fn(w, h)
        return mean_loss_fn(head, h, part)

    want = [one_microbatch(m) for m in range(M)]
    np.testing.assert_allclose(loss, np.mean([w[0] for w in want]), rtol=RTOL)
    want_accuracy = np.mean([w[1]["accuracy"] for w in want])
    np.testing.assert_allclose(aux["accuracy"], want_accuracy, rtol=RTOL)

    def uses_aux(head):
        loss, aux = pipe.loss(params, head, inputs, targets)
        return loss + aux["accuracy"]

    with pytest.raises(TypeError, match="gradient flows into the aux"):
        jax.eval_shape(jax.grad(uses_aux), head)


def test_python_scalars_from_loss_fn_are_taken_as_jit_takes_them():
    """A loss_fn returning a Python or NumPy scalar (a loss that does not read the output),
    and Python numbers in its aux, crashed in the executor ('float' object has no attribute
    'astype')."""
    weights, head, inputs, targets = problem(4, S)
    for constant in (0.5, np.float64(0.5)):
        pipe = make(lambda h, y, t, c=constant: c)
        params = pipe.place(weights)
        loss, grads = pipe.loss_and_grads(params, head, inputs, targets, input_grads=True)
        assert loss.dtype == jnp.float32 and loss == 0.5
        assert not any(np.any(g) for g in jax.tree_util.tree_leaves(grads))
        assert pipe.loss(params, head, inputs, targets) == 0.5

    def with_numbers(h, y, t):
        loss, aux = mean_loss_fn(h, y, t)
        return loss, {**aux, "one": 1.0, "half": np.float64(0.5)}

    loss, aux = make(with_numbers, loss_has_aux=True).loss(params, head, inputs, targets)
    want, want_aux = make(mean_loss_fn, loss_has_aux=True).loss(params, head, inputs, targets)
    np.testing.assert_allclose(loss, want, rtol=RTOL)
    np.testing.assert_allclose(aux["accuracy"], want_aux["accuracy"], rtol=RTOL)
    assert (aux["one"], aux["half"]) == (1.0, 0.5)


@pytest.mark.parametrize("num_stages", [2, 1])
def test_a_summed_loss_without_targets_is_the_sum(num_stages):
    """A loss that needs no targets (``targets=None``) under ``loss_reduction="sum"`` is the
    whole-batch sum, as with targets: the step gave the mean over micro-batches, loss and
    gradients M times too small, on one stage and on several."""
    weights, head, inputs, _ = problem(5, num_stages)

    def square_sum(head, y, target):
        return jnp.sum((y @ head) ** 2)

    def whole(weights, head):
        h = inputs
        for w in weights:
            h = stage_fn(w, h)
        return square_sum(head, h, None)

    mesh = models.pipe_mesh(num_stages)
    pipe = jaxpipe.Pipeline(
        stage_fn, square_sum, mesh=mesh, num_microbatches=M, loss_reduction="sum"
    )
    params = pipe.place(weights)
    loss, (grads, head_grads) = jax.value_and_grad(pipe.loss, argnums=(0, 1))(
        params, head, inputs, None
    )
    want, want_grads = jax.value_and_grad(whole, argnums=(0, 1))(weights, head)
    np.testing.assert_allclose(loss, want, rtol=RTOL)
    assert_close((pipe.logical(grads), head_grads), want_grads)


def test_integer_loss_parameters_take_no_gradient_on_any_number_of_stages():
    """An integer leaf of ``loss_params`` (a count, a scale) under ``jax.grad(...,
    allow_int=True)``: float0, as JAX gives it, and the other gradients those of the plain
    model. On several stages the idle forward's zero and the last stage's float0 made the
    actions' switch refuse the program."""
    weights, head, inputs, targets = problem(6, S)

    def scaled(loss_params, y, target):
        loss, _ = mean_loss_fn(loss_params["head"], y, target)
        return loss * loss_params["scale"]

    def whole(weights, loss_params):
        total = 0.0
        for m in range(M):
            h = pipeline.split_microbatches(inputs, M)[m]
            part = jax.tree.map(lambda a, m=m: pipeline.split_microbatches(a, M)[m], targets)
            for w in weights:
                h = stage_fn(w, h)
            total += scaled(loss_params, h, part)
        return total / M

    loss_params = {"head": head, "scale": jnp.int32(3)}
    pipe = make(scaled)
    grad = jax.value_and_grad(pipe.loss, argnums=(0, 1), allow_int=True)
    loss, (grads, loss_grads) = grad(pipe.place(weights), loss_params, inputs, targets)
    want_grad = jax.value_and_grad(whole, argnums=(0, 1), allow_int=True)
    want, (want_grads, want_loss_grads) = want_grad(weights, loss_params)
    np.testing.assert_allclose(loss, want, rtol=RTOL)
    assert_close((pipe.logical(grads), loss_grads["head"]), (want_grads, want_loss_grads["head"]))
    assert loss_grads["scale"].dtype == jax.dtypes.float0


def test_a_weight_function_without_targets_is_refused():
    """A weight function weighs each micro-batch by its targets; a step without targets
    ran as the mean, silently."""
    weights, head, inputs, _ = problem(7, S)
    pipe = make(lambda h, y, t: jnp.sum(y @ h), loss_reduction=lambda t: 1.0)
    with pytest.raises(ValueError, match=r"weight_fn\(target\), but this step has no targets"):
        pipe.loss(pipe.place(weights), head, inputs, None)


def _dropout_stage(w, h, *, key):
    return h * w * jax.random.bernoulli(key, 0.5, h.shape)


def _dropout_loss(head, y, target, *, key):
    return jnp.mean(y * head * (1 - jax.random.bernoulli(key, 0.5, y.shape)))


@pytest.mark.parametrize("devices, schedule", [(2, "1f1b"), (1, "zbv")])
def test_the_loss_draws_its_own_random_numbers(devices, schedule):
    """The loss keeps where its mask is 0, the last stage where its mask is 1: with its own
    key the loss sees about a quarter of the units (with the last stage's key none), and the
    pipeline equals `jaxpipe.reference` (the one-device zbv runs plain accumulation)."""
    pipe = pipeline.Pipeline(
        _dropout_stage,
        _dropout_loss,
        mesh=models.pipe_mesh(devices),
        schedule=schedule,
        num_microbatches=2,
    )
    N = pipe.num_logical_stages
    rng = np.random.default_rng(0)
    w = jnp.asarray(1 + rng.random((N, 1, 64)), jnp.float32)
    x = jnp.asarray(1 + rng.random((4, 64)), jnp.float32)
    key = jax.random.key(0)
    loss, grads = jax.jit(jax.value_and_grad(pipe.loss, argnums=(0, 1)))(
        pipe.place(w), jnp.float32(1.0), x, x, key=key
    )
    want, want_grads = jax.value_and_grad(jaxpipe.reference.loss, argnums=(2, 3))(
        _dropout_stage, _dropout_loss, w, jnp.float32(1.0), x, x, 2, key=key
    )
    assert loss > 0
    np.testing.assert_allclose(loss, want, rtol=RTOL)
    np.testing.assert_allclose(pipe.logical(grads[0]), want_grads[0], rtol=RTOL)
    np.testing.assert_allclose(grads[1], want_grads[1], rtol=RTOL)
    # the documented keys: stage s fold_in(fold_in(key, m), s), the loss fold_in(..., N)
    total = 0.0
    for m in range(2):
        mb_key, y = jax.random.fold_in(key, m), x[2 * m : 2 * m + 2]
        for s in range(N):
            y = _dropout_stage(w[s], y, key=jax.random.fold_in(mb_key, s))
        total += _dropout_loss(1.0, y, None, key=jax.random.fold_in(mb_key, N))
    np.testing.assert_allclose(total / 2, want, rtol=RTOL)


def test_weights_summing_to_zero_are_refused():
    """A batch with no scored token under a token-weighted loss: the weighted mean divides
    by zero (the step's loss was NaN)."""
    weights, head, inputs, targets = problem(8, S)
    pipe = make(lambda h, y, t: jnp.sum(y @ h), loss_reduction=tokens)
    targets = dict(targets, mask=jnp.zeros_like(targets["mask"]))
    with pytest.raises(ValueError, match=r"weight_fn\(target\) of each of the step's 4 micro"):
        pipe.loss(pipe.place(weights), head, inputs, targets)


def test_weights_of_concrete_targets_closed_over_in_a_jitted_step_are_read():
    """Concrete targets closed over by a jitted loss: their weights are read at trace time
    (the check converted a staged value and raised TracerArrayConversionError); a zero sum
    is still refused, a nonzero one runs and equals the loss outside jit."""
    weights, head, inputs, targets = problem(8, S)
    pipe = make(lambda h, y, t: jnp.sum(y @ h), loss_reduction=tokens)
    placed = pipe.place(weights)
    eager = pipe.loss(placed, head, inputs, targets)
    jitted = jax.jit(lambda h: pipe.loss(placed, h, inputs, targets))(head)
    np.testing.assert_allclose(jitted, eager, rtol=1e-6)
    zero = dict(targets, mask=jnp.zeros_like(targets["mask"]))
    with pytest.raises(ValueError, match=r"weight_fn\(target\) of each of the step's 4 micro"):
        jax.jit(lambda h: pipe.loss(placed, h, inputs, zero))(head)
