"""A table with one device (S = 1) runs as plain gradient accumulation over the
micro-batches: the plain model's loss and gradients, keys folded as the tick loop folds
them, no tick loop in the program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpipe

WIDTH, BLOCKS, ROWS, M = 16, 2, 4, 4
KEEP = 0.75


def block(w, h, key, side):
    h = jnp.tanh(h @ w + side)
    mask = jax.random.bernoulli(key, KEEP, h.shape)
    return jnp.where(mask, h / KEEP, 0.0)


def stage_fn(params, x, *, key, side):
    h, keys = x["h"], jax.random.split(key, BLOCKS)
    for i in range(BLOCKS):
        h = block(params[i], h, keys[i], side)
    return {"h": h, "ids": x["ids"]}


def loss_fn(head, y, target):
    err = (y["h"] @ head - target) ** 2
    return jnp.mean(err), {"size": jnp.mean(jnp.abs(y["h"]))}


def weight_fn(target):
    return jnp.sum(target**2) + 1.0


def plain_loss(stages, head, x, target, side, key, reduction, replicas):
    """The step's loss without the pipeline: replica ``r`` holds a contiguous block of
    rows, micro-batch ``m`` a contiguous block of its rows."""
    losses, weights, sizes = [], [], []
    n = x["h"].shape[0] // (replicas * M)
    for r in range(replicas):
        rkey = jax.random.fold_in(key, r) if replicas > 1 else key
        for m in range(M):
            rows = slice((r * M + m) * n, (r * M + m + 1) * n)
            h = {"h": x["h"][rows], "ids": x["ids"][rows]}
            for s in range(stages.shape[0]):
                skey = jax.random.fold_in(jax.random.fold_in(rkey, m), s)
                h = stage_fn(stages[s], h, key=skey, side=side[rows])
            loss, aux = loss_fn(head, h, target[rows])
            losses.append(loss)
            sizes.append(aux["size"])
            weights.append(weight_fn(target[rows]))
    losses, sizes, weights = jnp.stack(losses), jnp.stack(sizes), jnp.stack(weights)
    if reduction == "mean":
        w = jnp.full_like(losses, 1.0 / losses.size)
    elif reduction == "sum":
        w = jnp.ones_like(losses)
    else:
        w = weights / jnp.sum(weights)
    return jnp.sum(w * losses), {"size": jnp.sum(w * sizes)}


def data(replicas, num_stages):
    keys = jax.random.split(jax.random.key(0), 6)
    B = ROWS * M * replicas
    stages = jax.random.normal(keys[0], (num_stages, BLOCKS, WIDTH, WIDTH)) / WIDTH**0.5
    head = jax.random.normal(keys[1], (WIDTH, 3))
    x = {
        "h": jax.random.normal(keys[2], (B, WIDTH)),
        "ids": jnp.arange(B, dtype=jnp.int32),
    }
    target = jax.random.normal(keys[3], (B, 3))
    side = 0.1 * jax.random.normal(keys[4], (B, WIDTH))
    return stages, head, x, target, side, keys[5]


def mesh_of(replicas):
    return jax.make_mesh(
        (1, replicas),
        ("pipe", "data"),
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
        devices=jax.devices()[:replicas],
    )


def scan_lengths_and_primitives(fn, *args) -> tuple[list[int], set[str]]:
    """The lengths of every ``scan`` in ``fn``'s jaxpr and the names of its primitives,
    nested jaxprs included."""
    lengths, names = [], set()

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            names.add(eqn.primitive.name)
            if eqn.primitive.name == "scan":
                lengths.append(eqn.params["length"])
            for value in eqn.params.values():
                for sub in value if isinstance(value, list | tuple) else [value]:
                    if hasattr(sub, "eqns"):
                        visit(sub)
                    elif hasattr(getattr(sub, "jaxpr", None), "eqns"):
                        visit(sub.jaxpr)

    visit(jax.make_jaxpr(fn)(*args).jaxpr)
    return lengths, names


@pytest.mark.filterwarnings("ignore:the pipeline step called")  # traced twice on purpose
@pytest.mark.parametrize(
    "reduction, replicas, remat, schedule",
    [("mean", 2, False, "1f1b"), ("sum", 1, True, "zbv"), (weight_fn, 2, False, "1f1b")],
    ids=["mean-data2", "sum-remat-zbv", "weighted-data2"],
)
def test_one_stage_gives_the_plain_loss_and_every_gradient(reduction, replicas, remat, schedule):
    """Loss, aux and the gradients of the stages, the loss parameters, the inputs, the
    targets and the side inputs, with dropout keys; zbv puts two stages on the device."""
    pipe = jaxpipe.Pipeline(
        stage_fn,
        loss_fn,
        mesh=mesh_of(replicas),
        schedule=schedule,
        num_microbatches=M,
        loss_has_aux=True,
        loss_reduction=reduction,
        remat=remat,
    )
    stages, head, x, target, side, key = data(replicas, pipe.num_logical_stages)

    def step(params, head, xh, target, side):
        xs = {"h": xh, "ids": x["ids"]}
        return pipe.loss(params, head, xs, target, side=side, key=key)

    grad = jax.value_and_grad(step, argnums=(0, 1, 2, 3, 4), has_aux=True)
    (loss, aux), grads = jax.jit(grad)(pipe.place(stages), head, x["h"], target, side)

    def plain(stages, head, xh, target, side):
        xs = {"h": xh, "ids": x["ids"]}
        return plain_loss(stages, head, xs, target, side, key, reduction, replicas)

    want_grad = jax.value_and_grad(plain, argnums=(0, 1, 2, 3, 4), has_aux=True)
    (want, want_aux), want_grads = jax.jit(want_grad)(stages, head, x["h"], target, side)
    close = dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, want, **close)
    np.testing.assert_allclose(aux["size"], want_aux["size"], **close)
    d_stages, d_head, d_x, d_target, d_side = grads
    np.testing.assert_allclose(pipe.logical(d_stages), want_grads[0], **close)
    np.testing.assert_allclose(d_head, want_grads[1], **close)
    np.testing.assert_allclose(d_x, want_grads[2], **close)
    np.testing.assert_allclose(d_target, want_grads[3], **close)
    np.testing.assert_allclose(d_side, want_grads[4], **close)

    # The step is one scan of M micro-batches: no tick loop, nothing sent.
    args = (pipe.place(stages), head, x["h"], target, side)
    lengths, names = scan_lengths_and_primitives(jax.grad(lambda *a: step(*a)[0]), *args)
    assert pipe.schedule.num_ticks != M and "ppermute" not in names
    assert M in lengths and pipe.schedule.num_ticks not in lengths, lengths


def test_two_stages_keep_the_tick_loop():
    stages, head, x, target, side, key = data(1, 2)
    mesh = jax.make_mesh((2,), ("pipe",), axis_types=(jax.sharding.AxisType.Auto,))
    pipe = jaxpipe.Pipeline(stage_fn, loss_fn, mesh=mesh, num_microbatches=M, loss_has_aux=True)

    def loss(params):
        return pipe.loss(params, head, x, target, side=side, key=key)[0]

    placed = pipe.place(stages)
    lengths, names = scan_lengths_and_primitives(jax.grad(loss), placed)
    assert pipe.schedule.num_ticks in lengths and "ppermute" in names
