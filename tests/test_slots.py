"""`jaxpipe._jaxpr.slots.call_on_slot`: a backward that scans over one slot of stacked
buffers reads each iteration's slice from the buffers, computes what it computes on the
slot read whole, and holds no copy of the slot (the compiled program's temp)."""

import jax
import jax.numpy as jnp
import models
import numpy as np
import pytest

import jaxpipe
from jaxpipe._jaxpr.slots import call_on_slot, read_slot, scanned_leaves

SLOTS, BLOCKS, N = 4, 3, 64
LAZY = (True, False)  # the block inputs stay unread; the scale is read whole


def _backward(stored, w, ct):
    """The backward of ``x -> tanh(x @ w_i)`` over the blocks, with the forward's inputs
    (``stored[0]``, ``[BLOCKS, N, N]``) as residuals and a plain residual beside them."""
    xs, scale = stored

    def step(ct, inputs):
        x, w_i = inputs
        y = x @ w_i
        d = ct * (1 - jnp.tanh(y) ** 2)
        return d @ w_i.T, x.T @ d

    dx, dw = jax.lax.scan(step, ct * scale, (xs, w), reverse=True)
    return dx, dw


def _draw(key):
    k = jax.random.split(key, 4)
    buffers = [
        jax.random.normal(k[0], (SLOTS, BLOCKS, N, N)),
        jax.random.normal(k[1], (SLOTS,)),
    ]
    w = jax.random.normal(k[2], (BLOCKS, N, N)) / np.sqrt(N)
    ct = jax.random.normal(k[3], (N, N))
    return buffers, w, ct


@pytest.mark.parametrize("slot", [0, 2])
def test_a_scan_over_a_slot_computes_what_it_computes_on_the_slot_read_whole(slot):
    buffers, w, ct = _draw(jax.random.key(slot))

    @jax.jit
    def lazily(buffers, slot, w, ct):
        return call_on_slot(_backward, read_slot(buffers, slot, LAZY), w, ct)

    expected = _backward([b[slot] for b in buffers], w, ct)
    got = lazily(buffers, jnp.int32(slot), w, ct)
    for e, g in zip(expected, got, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


def test_the_leaves_a_scan_runs_over_are_found():
    buffers, w, ct = _draw(jax.random.key(3))
    stored = [jax.ShapeDtypeStruct(b.shape[1:], b.dtype) for b in buffers]
    assert scanned_leaves(_backward, stored, w, ct) == LAZY
    assert scanned_leaves(jax.jit(_backward), stored, w, ct) == LAZY  # inside a call too


def test_a_plain_list_is_passed_through():
    buffers, w, ct = _draw(jax.random.key(7))
    stored = read_slot(buffers, 1)  # nothing unread: a plain list
    assert isinstance(stored, list)
    for e, g in zip(_backward(stored, w, ct), call_on_slot(_backward, stored, w, ct), strict=True):
        np.testing.assert_array_equal(g, e)


def test_no_copy_of_the_slot_is_made_for_the_scan():
    """Compiled for CPU: the plain read holds the slot (``BLOCKS * N * N`` floats) as a
    loop operand of its own; reading inside the scan holds less by that much (within a
    KiB of small buffers)."""
    buffers, w, ct = _draw(jax.random.key(1))
    slot_bytes = BLOCKS * N * N * 4

    def temp(fn):
        compiled = jax.jit(fn).lower(buffers, jnp.int32(1), w, ct).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    whole = temp(lambda b, s, w, ct: _backward([x[s] for x in b], w, ct))
    sliced = temp(lambda b, s, w, ct: call_on_slot(_backward, read_slot(b, s, LAZY), w, ct))
    assert whole - sliced >= slot_bytes - 1024, (sliced, whole, slot_bytes)


def test_a_scan_of_no_iterations_reads_no_slice():
    """A stage whose blocks may be none (an optional group of blocks, empty at some model
    size): its scan over stored ``[0, ...]`` residuals reads nothing from the slot, and the
    pipeline's loss and gradients are the plain model's. Slicing one iteration out of the
    empty axis failed to trace."""
    empty = [jnp.zeros((SLOTS, 0, N, N)), jnp.ones((SLOTS,))]
    stored = [jax.ShapeDtypeStruct(b.shape[1:], b.dtype) for b in empty]
    w = jnp.zeros((0, N, N))
    assert scanned_leaves(_backward, stored, w, jnp.ones((N, N))) == (False, False)

    def stage_fn(p, x):
        group = jax.tree_util.tree_map(lambda a: a[:0], p)  # no blocks of this kind
        x = jax.lax.scan(lambda h, q: (jnp.tanh(h @ q), None), x, group)[0]
        return x + jnp.tanh(x @ p[0])

    def loss_fn(head, y, target):
        return jnp.mean((y @ head - target) ** 2)

    rng = np.random.default_rng(0)
    weights = jnp.asarray(rng.normal(size=(2, 3, 8, 8)) / 3, jnp.float32)
    head = jnp.asarray(rng.normal(size=(8, 2)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)
    target = jnp.asarray(rng.normal(size=(16, 2)), jnp.float32)

    def plain(weights, head):
        h = x
        for p in weights:
            h = stage_fn(p, h)
        return loss_fn(head, h, target)

    mesh = models.pipe_mesh(2)
    for schedule in ("1f1b", "zbv"):
        pipe = jaxpipe.Pipeline(stage_fn, loss_fn, mesh=mesh, schedule=schedule,
                                num_microbatches=4, remat_policy=None)  # fmt: skip
        stages = weights if schedule == "1f1b" else jnp.concatenate([weights, weights[::-1]])
        got, grads = jax.value_and_grad(pipe.loss, argnums=(0, 1))(
            pipe.place(stages), head, x, target
        )
        want, want_grads = jax.value_and_grad(plain, argnums=(0, 1))(stages, head)
        np.testing.assert_allclose(got, want, rtol=1e-6)
        for g, w in ((pipe.logical(grads[0]), want_grads[0]), (grads[1], want_grads[1])):
            scale = float(np.abs(w).max())
            assert scale > 0  # a zero gradient proves nothing
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * scale)
