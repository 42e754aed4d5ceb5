"""`jaxpipe._jaxpr.slots.call_on_slot`: a backward that scans over one slot of stacked
buffers reads each iteration's slice from the buffers, computes what it computes on the
slot read whole, and holds no copy of the slot (the compiled program's temp)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
