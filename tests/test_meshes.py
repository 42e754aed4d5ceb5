"""Pipelines on pipe x data meshes: where the data all-reduce sits in the compiled HLO, remat
memory, bf16 compute and an optax chain with global-norm clipping."""

import re

import jax
import jax.numpy as jnp
import models
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe import pipeline

S, M, BATCH = 2, 4, 16


def _setup(remat=False, stage_fn=models.stage_fn, seed=0):
    mesh = models.pipe_mesh(S, (("data", 2),))
    pipe = pipeline.Pipeline(
        stage_fn, models.loss_fn, mesh=mesh, schedule="1f1b", num_microbatches=M, remat=remat
    )
    k1, k2 = jax.random.split(jax.random.key(seed))
    stage_params, loss_params = models.init(k1, S)
    inputs, targets = jax.device_put(models.data(k2, BATCH), NamedSharding(mesh, P("data")))
    return pipe, pipe.place(stage_params), loss_params, inputs, targets


def _computations(hlo: str) -> dict[str, str]:
    """HLO module text -> {computation name: its text}."""
    parts = re.split(r"\n(?=(?:ENTRY )?%[\w.\-]+ )", hlo)
    out = {}
    for part in parts:
        m = re.match(r"(?:ENTRY )?%([\w.\-]+) ", part)
        if m:
            out[m.group(1)] = part
    return out


def _reachable(comps: dict[str, str], roots) -> set[str]:
    seen, stack = set(), list(roots)
    while stack:
        name = stack.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        body = comps[name].split("\n", 1)[1] if "\n" in comps[name] else ""
        stack += re.findall(r"%([\w.\-]+)", body)
    return seen


def test_data_allreduce_of_stage_gradients_is_outside_the_tick_loop():
    pipe, sp, lp, x, t = _setup()
    grad = jax.jit(jax.grad(pipe.loss, argnums=(0, 1)))
    hlo = grad.lower(sp, lp, x, t).compile().as_text()
    comps = _computations(hlo)
    bodies = re.findall(r"while\([^\n]*body=%([\w.\-]+)", hlo)
    assert bodies, "no while loop (the tick scan) found in the compiled program"
    in_loop = _reachable(comps, bodies)
    inside = [n for n in in_loop if re.search(r"all-reduce(-start)?\(", comps[n])]
    outside = [
        n for n in comps if n not in in_loop and re.search(r"all-reduce(-start)?\(", comps[n])
    ]
    assert not inside, f"all-reduce inside the tick loop: {inside}"
    assert outside, "no all-reduce over data after the loop"


@pytest.mark.slow
def test_remat_lowers_temp_memory_and_keeps_gradients():
    results = {}
    for remat in (False, True):
        pipe, sp, lp, x, t = _setup(remat=remat)
        grad = jax.jit(jax.grad(pipe.loss, argnums=(0, 1)))
        memory = grad.lower(sp, lp, x, t).compile().memory_analysis()
        results[remat] = (memory.temp_size_in_bytes, grad(sp, lp, x, t))
    assert results[True][0] < results[False][0], {k: v[0] for k, v in results.items()}
    assert models.relative_error(results[True][1], results[False][1]) < 1e-6


def _bf16_stage_fn(p, x):
    """float32 params and activations at the boundary, bf16 compute inside."""
    cast = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), p)
    return models.stage_fn(cast, x.astype(jnp.bfloat16)).astype(x.dtype)


@pytest.mark.slow
def test_bf16_compute_stays_close_to_float32():
    pipe, sp, lp, x, t = _setup()
    pipe16 = pipeline.Pipeline(
        _bf16_stage_fn, models.loss_fn, mesh=pipe.mesh, schedule="1f1b", num_microbatches=M
    )
    step = jax.value_and_grad(lambda pipe, *a: pipe.loss(*a), argnums=(1, 2))
    loss32, grads32 = jax.jit(lambda *a: step(pipe, *a))(sp, lp, x, t)
    loss16, grads16 = jax.jit(lambda *a: step(pipe16, *a))(sp, lp, x, t)
    for g in jax.tree_util.tree_leaves(grads16):
        assert g.dtype == jnp.float32  # gradients accumulate in the params' float32
    np.testing.assert_allclose(loss16, loss32, rtol=2e-2)
    assert models.relative_error(grads16, grads32) < 5e-2
    assert not np.allclose(loss16, loss32, rtol=1e-7)  # bf16 did run


@pytest.mark.slow
def test_clip_by_global_norm_chain_matches_the_plain_model():
    pipe, sp, lp, x, t = _setup(seed=1)
    opt = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))

    def update(loss, params):
        grads = jax.grad(loss)(params)
        updates, _ = opt.update(grads, opt.init(params), params)
        return optax.tree.norm(grads), updates

    norm, updates = jax.jit(lambda: update(lambda p: pipe.loss(*p, x, t), (sp, lp)))()
    ref_params = (pipe.logical(sp), lp)
    ref_norm, ref_updates = jax.jit(
        lambda: update(lambda p: models.sequential_loss(p[0], p[1], x, t, M), ref_params)
    )()
    assert norm > 0.05  # clipping is active
    np.testing.assert_allclose(norm, ref_norm, rtol=1e-5)
    updates = (pipe.logical(updates[0]), updates[1])
    assert models.relative_error(updates, ref_updates) < 1e-5
