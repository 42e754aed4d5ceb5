"""Pipeline x data x FSDP x tensor in one mesh: a Llama-style block split the way Megatron
splits it over ``tensor``, its other weight dimension over ``fsdp``; exact against the plain
model, and the compiled step's collectives, memory and stage applications."""

import functools

import hlo
import jax
import jax.numpy as jnp
import llama
import models
import numpy as np
import optax
import pytest

from jaxpipe import pipeline, reference, schedules

CONFIG = llama.Config(width=16, heads=4, kv_heads=2, hidden=32, seq=4, vocab=16)
MESHES = {
    "pipe2-data2-tensor2": (2, (("data", 2), ("tensor", 2))),
    "pipe2-fsdp2-tensor2": (2, (("fsdp", 2), ("tensor", 2))),
    "pipe4-fsdp2": (4, (("fsdp", 2),)),
}
OPTIONS = {"interleaved_1f1b": {"virtual_stages": 2}}
M = 2


def _pipe(mesh_name, schedule, num_microbatches=M, **kwargs):
    S, extra = MESHES[mesh_name]
    mesh = models.pipe_mesh(S, extra)
    pipe = pipeline.Pipeline(
        llama.make_stage_fn(CONFIG),
        llama.loss_fn,
        mesh=mesh,
        schedule=schedule,
        num_microbatches=num_microbatches,
        schedule_options=OPTIONS.get(schedule),
        **kwargs,
    )
    return pipe


def _specs(pipe):
    tensor = "tensor" if "tensor" in pipe.mesh.shape else None
    fsdp = "fsdp" if "fsdp" in pipe.mesh.shape else None
    return llama.megatron_specs(tensor, fsdp)


def _batch(pipe, rows_per_microbatch=4, seed=2):
    return _draw_batch(rows_per_microbatch * pipe.num_replicas * pipe.num_microbatches, seed)


def _draw_batch(rows, seed):
    tokens, targets, positions = llama.data(jax.random.key(seed), CONFIG, rows)
    return tokens, targets, {"positions": positions}


def _plain_loss(num_microbatches, config=CONFIG):
    """The plain model's ``loss(params, outer, x, targets, side)`` (`jaxpipe.reference`),
    jitted: the loop over stages and micro-batches compiles in seconds and runs eagerly in
    tens of seconds."""

    def loss(params, outer, x, targets, side):
        stage_fn = llama.make_stage_fn(config)
        return reference.loss(
            stage_fn, llama.loss_fn, params, outer, x, targets, num_microbatches, side=side
        )

    return jax.jit(loss)


def _loss(pipe, params, outer, tokens, targets, side):
    return pipe.loss(params, outer, outer["embed"][tokens], targets, side=side)


@functools.cache
def _reference(num_logical_stages, seed=0):
    """Logical stage parameters and the outer (embedding, head) parameters of the plain
    model, per stage count. (One jitted draw with ``rbg`` keys: XLA compiles threefry's
    bits for a dozen shapes in seconds on CPU.)"""

    @jax.jit
    def draw(key):
        k_stages, k_outer = jax.random.split(key)
        stages = llama.init_blocks(k_stages, CONFIG, num_logical_stages, 1)
        return stages, llama.init_outer(k_outer, CONFIG)

    return draw(jax.random.key(seed, impl="rbg"))


@functools.cache
def _plain_value_and_grads(num_logical_stages, num_microbatches, rows, seed=2):
    """Loss and gradients (of the stages, of the outer parameters) of the plain model on
    `_reference`'s parameters and `_batch`'s batch of ``rows`` rows. Cached: the cases of one
    stage count compare against one compile."""
    params, outer = _reference(num_logical_stages)
    tokens, targets, side = _draw_batch(rows, seed)

    def plain(params, outer):
        x = outer["embed"][tokens]
        return _plain_loss(num_microbatches)(params, outer, x, targets, side)

    return jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))(params, outer)


# Slow: each compiles and runs for 10-30 s; the fast loop has the FSDP test. Each schedule
# runs on two of the three meshes, and each mesh under two schedules (CI time).
CASES = [
    pytest.param(mesh, schedule, marks=pytest.mark.slow)
    for mesh, schedules in (
        ("pipe2-data2-tensor2", ("1f1b", "zbv")),
        ("pipe2-fsdp2-tensor2", ("interleaved_1f1b", "zbv")),
        ("pipe4-fsdp2", ("1f1b", "interleaved_1f1b")),
    )
    for schedule in schedules
]


def _sharing_the_plain_model(mesh_name, schedule, gather, split_loss_grads=False):
    """A case of `test_exact_on_every_mesh`, slow, in the ``xdist_group`` of its logical
    stage count: the cases of one group compare against one plain model
    (`_plain_value_and_grads`), which one worker then compiles once."""
    S, _ = MESHES[mesh_name]
    stages = schedules.get(schedule, S, M, **OPTIONS.get(schedule, {})).num_logical_stages
    group = pytest.mark.xdist_group(f"parallelism-plain-{stages}-stages")
    marks = [pytest.mark.slow, group]
    return pytest.param(mesh_name, schedule, gather, split_loss_grads, marks=marks)


@pytest.mark.parametrize(
    ("mesh_name", "schedule", "gather", "split_loss_grads"),
    [_sharing_the_plain_model(*case.values, "per_use") for case in CASES]
    + [_sharing_the_plain_model("pipe2-fsdp2-tensor2", "1f1b", "once")]
    + [  # gathered ahead, two chunks per device (a forward's and a backward's)
        _sharing_the_plain_model("pipe4-fsdp2", "zbv", "ahead"),
    ]
    + [  # the outer parameters' gradient accumulated split over the batch axes
        _sharing_the_plain_model("pipe4-fsdp2", "1f1b", "per_use", split_loss_grads=True),
        _sharing_the_plain_model("pipe2-data2-tensor2", "zbv", "per_use", split_loss_grads=True),
    ],
)
def test_exact_on_every_mesh(mesh_name, schedule, gather, split_loss_grads):
    pipe = _pipe(mesh_name, schedule, fsdp_gather=gather, split_loss_grads=split_loss_grads)
    params, outer = _reference(pipe.num_logical_stages)
    placed = pipe.place(params, _specs(pipe))
    tokens, targets, side = _batch(pipe)
    step = jax.jit(jax.value_and_grad(functools.partial(_loss, pipe), argnums=(0, 1)))
    loss, (grads, outer_grads) = step(placed, outer, tokens, targets, side)

    want, (want_grads, want_outer) = _plain_value_and_grads(
        pipe.num_logical_stages, pipe.num_microbatches, tokens.shape[0]
    )
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    assert models.relative_error(pipe.logical(grads), want_grads) < 1e-5
    assert models.relative_error(outer_grads, want_outer) < 1e-5
    for name, leaf in grads.items():  # gradients come back split like the parameters
        assert leaf.sharding.is_equivalent_to(placed[name].sharding, leaf.ndim), name


@pytest.mark.parametrize("gather", ["per_use", "once"])
def test_fsdp_stores_one_share_and_gathers_only_its_own_stages(gather):
    """pipe 4 x fsdp 2: parameters, gradients and Adam's moments per device within 10% of
    total / (S * F); the compiled step's all-gathers and reduce-scatters run over fsdp only
    and each moves at most one chunk's weights; over pipe, only collective-permutes (and the
    sums of the losses and of the loss parameters' gradient)."""
    pipe = _pipe("pipe4-fsdp2", "1f1b", fsdp_gather=gather)
    params, outer = _reference(pipe.num_logical_stages)
    placed = pipe.place(params, _specs(pipe))
    tokens, targets, side = _batch(pipe)
    opt = optax.adam(1e-3)
    opt_state = opt.init(placed)

    @jax.jit
    def train_step(params, opt_state, tokens, targets, side):
        loss, grads = jax.value_and_grad(_loss, argnums=1)(
            pipe, params, outer, tokens, targets, side
        )
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    new_params, new_state, _, grads = train_step(placed, opt_state, tokens, targets, side)
    S, F = 4, 2
    device = pipe.mesh.devices.flat[0]
    for tree in (new_params, grads, new_state[0].mu, new_state[0].nu):
        total = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree))
        mine = sum(
            shard.data.nbytes
            for leaf in jax.tree_util.tree_leaves(tree)
            for shard in leaf.addressable_shards
            if shard.device == device
        )
        norms = sum(tree[k].nbytes for k in ("attn_norm", "mlp_norm"))  # not split over fsdp
        assert mine <= 1.10 * (total - norms) / (S * F) + norms / S, (mine, total)

    text = train_step.lower(placed, opt_state, tokens, targets, side).compile().as_text()
    chunk_bytes = max(leaf.nbytes for leaf in jax.tree_util.tree_leaves(params)) // 4
    found = hlo.collectives(text, pipe.mesh)
    assert any(c.kind == "all-gather" for c in found) and any(
        c.kind in ("reduce-scatter", "all-reduce") and c.axes == {"fsdp"} for c in found
    )
    loss_sized = 4 * M + sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(outer))
    for c in found:
        if "pipe" in c.axes:
            assert c.kind == "collective-permute" or c.nbytes <= loss_sized, c.line
        if c.kind in ("all-gather", "reduce-scatter"):
            assert c.axes == {"fsdp"}, c.line
            assert c.nbytes <= 2 * chunk_bytes, c.line


@pytest.mark.slow
def test_tensor_parallel_stages_run_each_action_once():
    """S = 4, M = 16, tensor 2, the default schedule: in the compiled step every matmul of
    the schedule's loop sits inside a branch of a ``conditional`` (a device computes only the
    branch it takes), the branch each device takes in each tick is its row of the table (read
    back from the compiled program), so stage applications / asked = 1.0 (at most 1.15
    asked); the step finishes and the loss is the plain model's."""
    mesh = models.pipe_mesh(4, (("tensor", 2),))
    pipe = pipeline.Pipeline(
        llama.make_stage_fn(CONFIG), llama.loss_fn, mesh=mesh, num_microbatches=16
    )
    params, outer = _reference(4)
    placed = pipe.place(params, llama.megatron_specs())
    tokens, targets, side = _batch(pipe, rows_per_microbatch=1)
    x = outer["embed"][tokens]
    step = jax.jit(jax.value_and_grad(pipe.loss)).lower(placed, outer, x, targets, side=side)
    step = step.compile()
    text = step.as_text()
    assert "conditional(" in text
    assert hlo.loop_dots_outside_branches(text) == []
    trace, expected = pipe.trace(placed, outer, x, targets, side=side), pipe.expected_trace()
    np.testing.assert_array_equal(trace, expected)
    for d in range(pipe.num_stages):
        executed = int((trace[:, d, 0] != 0).sum() + (trace[:, d, 3] != 0).sum())
        asked = sum(len(row[d]) for row in pipe.schedule.ticks)
        assert executed <= 1.15 * asked, (d, executed, asked)
    loss, _ = step(placed, outer, x, targets, side=side)
    want = _plain_loss(16)(params, outer, x, targets, side)
    np.testing.assert_allclose(loss, want, rtol=1e-5)


@pytest.mark.slow
def test_uneven_tensor_split_is_refused_before_it_hangs():
    """One key/value head over tensor 2: XLA exchanges halves of the head between the
    tensor devices with collective-permutes inside the stage, which on CPU host devices
    hang inside the per-device branch; the pipeline refuses it, naming the fix, and the fix
    (key/value projections replicated) runs exactly."""
    config = llama.Config(width=16, heads=4, kv_heads=1, hidden=32, seq=4, vocab=16)
    mesh = models.pipe_mesh(2, (("data", 2), ("tensor", 2)))
    pipe = pipeline.Pipeline(llama.make_stage_fn(config), llama.loss_fn, mesh=mesh,
                             num_microbatches=M)  # fmt: skip
    params = llama.init_blocks(jax.random.key(0), config, 2, 1)
    outer = llama.init_outer(jax.random.key(1), config)
    tokens, targets, positions = llama.data(jax.random.key(2), config, 8)
    x, side = outer["embed"][tokens], {"positions": positions}
    placed = pipe.place(params, llama.megatron_specs())
    with pytest.raises(ValueError, match="collective-permutes inside the stage.*spec None"):
        jax.jit(pipe.loss)(placed, outer, x, targets, side=side)
    placed = pipe.place(params, dict(llama.megatron_specs(), attn_k=None, attn_v=None))
    loss = jax.jit(pipe.loss)(placed, outer, x, targets, side=side)
    want = _plain_loss(M, config)(params, outer, x, targets, side)
    np.testing.assert_allclose(loss, want, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.xdist_group("parallelism-plain-2-stages")  # `_plain_value_and_grads`
def test_embedding_and_head_split_over_tensor():
    """The loss parameters (embedding, head) split by vocabulary over tensor: the step
    runs, and their gradients come back split the same way."""
    pipe = _pipe("pipe2-data2-tensor2", "1f1b")
    params, outer = _reference(pipe.num_logical_stages)
    mesh = pipe.mesh
    split = {
        "embed": jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tensor", None)),
        "head": jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "tensor")),
        "norm": jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
    }
    outer_split = {k: jax.device_put(v, split[k]) for k, v in outer.items()}
    placed = pipe.place(params, _specs(pipe))
    tokens, targets, side = _batch(pipe)
    step = jax.jit(
        jax.grad(functools.partial(_loss, pipe), argnums=1),
        out_shardings={k: split[k] for k in outer},
    )
    grads = step(placed, outer_split, tokens, targets, side)
    _, (_, want) = _plain_value_and_grads(pipe.num_logical_stages, M, tokens.shape[0])
    assert models.relative_error(grads, want) < 1e-5
    assert grads["embed"].sharding.spec == jax.sharding.PartitionSpec("tensor", None)
    assert jnp.all(jnp.isfinite(grads["head"]))
