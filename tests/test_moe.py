"""Mixture of experts: the `jaxpipe.moe.MoE` layer against a token-by-token reference, and
the layer split over an expert axis inside the pipeline (all-to-alls over the axis, the
batch split over it) against the plain model with every expert on one device: loss, every
gradient, the auxiliary losses and the very tokens dropped for capacity; in the compiled
step (on the CPU, and compiled ahead of time for TPU v5p and H100), all-to-alls over the
expert axis only, expert weights never moved over it or over the pipe axis (gathered over
``fsdp`` only where they are split over it), and only activations crossing the pipe axis."""

import functools
import importlib.util
import math
import re

import hlo
import jax
import jax.numpy as jnp
import models
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpipe
from jaxpipe import moe
from jaxpipe._executor import local as executor_local
from jaxpipe.analysis import hlo as hlo_reader

WIDTH, HIDDEN, EXPERTS, SEQ = 8, 16, 4, 8
M = 4
ROWS = 2  # rows per replica per micro-batch
LOAD_BALANCE, Z_LOSS = 0.5, 0.1  # large, so the router's gradient leans on them


# ------------------------------------------------------------------ the layer alone
def _numpy_moe(layer, x, group_size):
    """``(y, load_balance, router_z, dropped)`` of ``layer`` on ``x``, token by token: each
    group's choices are placed rank by rank, token by token, while their expert has room."""
    params = {k: np.asarray(v, np.float64) for k, v in nnx.to_pure_dict(nnx.state(layer)).items()}
    tokens = np.asarray(x, np.float64).reshape(-1, WIDTH)
    k, E = layer.top_k, layer.num_experts
    capacity = group_size
    if layer.capacity_factor is not None:
        capacity = min(group_size, max(1, math.ceil(layer.capacity_factor * k * group_size / E)))

    def swiglu(t, gate, up, down):
        a = t @ gate
        return (a / (1 + np.exp(-a)) * (t @ up)) @ down

    y = np.zeros_like(tokens)
    dropped = np.zeros(len(tokens), np.int32)
    balance, z = [], []
    for start in range(0, len(tokens), group_size):
        ids = np.arange(start, start + group_size)
        logits = tokens[ids] @ params["router"]
        z.extend(np.log(np.sum(np.exp(logits), -1)) ** 2)
        probs = np.exp(logits) / np.sum(np.exp(logits), -1, keepdims=True)
        choices = np.argsort(-probs, -1)[:, :k]
        weights = np.take_along_axis(probs, choices, -1)
        if layer.normalize_weights:
            weights = weights / weights.sum(-1, keepdims=True)
        load = np.zeros(E, int)
        for rank in range(k):
            for t, i in enumerate(ids):
                e = choices[t, rank]
                if load[e] < capacity:
                    load[e] += 1
                    y[i] += weights[t, rank] * swiglu(
                        tokens[i], params["gate"][e], params["up"][e], params["down"][e]
                    )
                else:
                    dropped[i] += 1
        routed = np.bincount(choices.ravel(), minlength=E) / (group_size * k)
        balance.append(E * np.sum(routed * probs.mean(0)))
    if layer.num_shared_experts:
        y += swiglu(tokens, params["shared_gate"], params["shared_up"], params["shared_down"])
    return y.reshape(x.shape), np.mean(balance), np.mean(z), dropped.reshape(x.shape[:-1])


@pytest.mark.parametrize(
    "options",
    [
        dict(top_k=1, capacity_factor=1.0),
        dict(top_k=2, num_shared_experts=2, capacity_factor=0.75, group_size=4),
        dict(top_k=3, capacity_factor=None, normalize_weights=False),
    ],
    ids=["top1", "top2-shared-groups", "top3-dropless"],
)
def test_layer_routes_and_drops_as_a_token_by_token_reference(options):
    layer = moe.MoE(WIDTH, HIDDEN, EXPERTS, rngs=nnx.Rngs(0), **options)
    x = jax.random.normal(jax.random.key(1), (3, SEQ, WIDTH))
    y, stats = jax.jit(lambda x: layer(x))(x)
    want_y, balance, z, dropped = _numpy_moe(layer, x, options.get("group_size") or SEQ)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats.load_balance, balance, rtol=1e-5)
    np.testing.assert_allclose(stats.router_z, z, rtol=1e-5)
    np.testing.assert_array_equal(stats.dropped, dropped)
    if options["capacity_factor"] is None:
        assert not dropped.any()
    else:
        assert 0 < dropped.sum() < dropped.size * layer.top_k  # some dropped, not all


@pytest.mark.slow
def test_dropless_over_an_expert_axis_equals_grouped_matmuls():
    """Dropless routing (``capacity_factor=None``): the plain layer's grouped matmuls
    (``ragged_dot``) and the layer split over an expert axis of 4 (buffers of a whole
    group, all-to-alls) give the same outputs and gradients, and drop nothing."""
    mesh = models.pipe_mesh(4)  # one axis, named "pipe" here: the experts' axis
    layers = [
        moe.MoE(
            WIDTH,
            HIDDEN,
            EXPERTS,
            rngs=nnx.Rngs(0),
            top_k=2,
            capacity_factor=None,
            num_shared_experts=1,
            expert_axis=axis,
        )  # fmt: skip
        for axis in (None, "pipe")
    ]
    graphs = [nnx.graphdef(layer) for layer in layers]
    params = nnx.state(layers[0], nnx.Param)
    x = jax.random.normal(jax.random.key(1), (8, SEQ, WIDTH))
    r = jax.random.normal(jax.random.key(2), x.shape)

    def plain(params, x):
        y, stats = nnx.merge(graphs[0], params)(x)
        return jnp.sum(y * r) + stats.load_balance, (y, stats.dropped)

    def split(params, x):
        def local(params, x, r):
            y, stats = nnx.merge(graphs[1], params)(x)
            total = jax.lax.psum(jnp.sum(y * r) + stats.load_balance / 4, "pipe")
            return total, y, stats.dropped

        specs = moe.expert_specs(params, "pipe", leading_axes=0)
        rows = P("pipe")
        total, y, dropped = jax.shard_map(
            local, mesh=mesh, in_specs=(specs, rows, rows), out_specs=(P(), rows, rows)
        )(params, x, r)
        return total, (y, dropped)

    (want, (want_y, want_dropped)), want_grads = jax.jit(
        jax.value_and_grad(plain, argnums=(0, 1), has_aux=True)
    )(params, x)
    (got, (y, dropped)), grads = jax.jit(jax.value_and_grad(split, argnums=(0, 1), has_aux=True))(
        params, x
    )
    assert not want_dropped.any() and not dropped.any()
    assert models.relative_error(y, want_y) <= 1e-5
    assert models.relative_error(got, want) <= 1e-5
    assert models.relative_error(grads, want_grads) <= 1e-5


def test_top1_router_learns_from_the_task_loss():
    """With one expert per token the router's probability weighs it (not renormalised to
    1), so the task loss alone gives the router a gradient."""
    layer = moe.MoE(WIDTH, HIDDEN, EXPERTS, rngs=nnx.Rngs(0), top_k=1, capacity_factor=None)
    graph, params = nnx.split(layer, nnx.Param)
    x = jax.random.normal(jax.random.key(1), (2, SEQ, WIDTH))

    def task_loss(params):
        return jnp.sum(nnx.merge(graph, params)(x)[0] ** 2)

    router = jax.grad(task_loss)(params)["router"][...]
    assert float(jnp.linalg.norm(router)) > 1e-3 * float(jnp.linalg.norm(params["router"][...]))
    with pytest.raises(ValueError, match="normalize_weights=True with top_k=1"):
        moe.MoE(WIDTH, HIDDEN, EXPERTS, rngs=nnx.Rngs(0), top_k=1, normalize_weights=True)


def test_layer_refuses_what_it_cannot_route():
    with pytest.raises(ValueError, match="top_k=5 must be between 1 and num_experts=4"):
        moe.MoE(WIDTH, HIDDEN, EXPERTS, rngs=nnx.Rngs(0), top_k=5)
    with pytest.raises(ValueError, match="capacity_factor=0 must be positive"):
        moe.MoE(WIDTH, HIDDEN, EXPERTS, rngs=nnx.Rngs(0), capacity_factor=0)
    layer = moe.MoE(WIDTH, HIDDEN, EXPERTS, rngs=nnx.Rngs(0), group_size=5)
    with pytest.raises(ValueError, match="do not split into groups of group_size=5"):
        layer(jnp.ones((2, SEQ, WIDTH)))
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=f"group_size={bad!r} must be a positive int"):
            moe.MoE(WIDTH, HIDDEN, EXPERTS, rngs=nnx.Rngs(0), group_size=bad)


@pytest.mark.parametrize(
    "options",
    [dict(capacity_factor=1.0), dict(capacity_factor=None), dict(num_shared_experts=1)],
    ids=["buffered", "grouped", "shared"],
)
def test_output_has_the_inputs_dtype(options):
    """bfloat16 tokens, float32 parameters: y is bfloat16, the float32 layer's output on
    the same tokens to bfloat16 precision."""
    layer = moe.MoE(WIDTH, HIDDEN, EXPERTS, rngs=nnx.Rngs(0), **options)
    x = jax.random.normal(jax.random.key(1), (3, SEQ, WIDTH)).astype(jnp.bfloat16)
    y, _ = layer(x)
    want, _ = layer(x.astype(jnp.float32))
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(y.astype(jnp.float32), want, rtol=2e-2, atol=2e-2)


def test_tokens_without_rows_need_a_group_size():
    """``[tokens, width]`` with group_size=None would route every token alone (capacity 1,
    nothing dropped): refused. With group_size it routes as ``[rows, SEQ, width]`` does."""
    options = dict(top_k=2, capacity_factor=0.5)
    x = jax.random.normal(jax.random.key(1), (3 * SEQ, WIDTH))
    layer = moe.MoE(WIDTH, HIDDEN, EXPERTS, rngs=nnx.Rngs(0), **options)
    with pytest.raises(ValueError, match=r"input of shape \(24, 8\) with group_size=None"):
        layer(x)
    rows_y, rows_stats = layer(x.reshape(3, SEQ, WIDTH))
    grouped = moe.MoE(WIDTH, HIDDEN, EXPERTS, rngs=nnx.Rngs(0), group_size=SEQ, **options)
    y, stats = grouped(x)
    np.testing.assert_array_equal(y, rows_y.reshape(x.shape))
    np.testing.assert_array_equal(stats.dropped, rows_stats.dropped.reshape(-1))
    assert stats.dropped.sum() > 0
    np.testing.assert_allclose(stats.load_balance, rows_stats.load_balance, rtol=1e-6)


# ------------------------------------------------------------------ inside the pipeline
def _layer(key, expert_axis=None, group_size=None):
    """Two shared experts: their weights' shapes (width x 2 * hidden) differ from a routed
    expert's, so the compiled step's collectives tell them apart."""
    return moe.MoE(
        WIDTH, HIDDEN, EXPERTS, rngs=nnx.Rngs(key), top_k=2, num_shared_experts=2,
        capacity_factor=1.0, group_size=group_size, expert_axis=expert_axis,
    )  # fmt: skip


def _stage_fn(expert_axis, group_size):
    """A residual MoE block; the activations carry the block's auxiliary losses (one float
    per row) and the choices it dropped (one count per token)."""
    graph = nnx.graphdef(nnx.eval_shape(lambda: _layer(0, expert_axis, group_size)))

    def stage_fn(p, x):
        h = x["h"]
        y, stats = nnx.merge(graph, p)(h * jax.lax.rsqrt(jnp.mean(h**2, -1, keepdims=True)))
        aux = LOAD_BALANCE * stats.load_balance + Z_LOSS * stats.router_z
        return {"h": h + y, "aux": x["aux"] + aux, "dropped": x["dropped"] + stats.dropped}

    return stage_fn


def loss_fn(head, y, target):
    loss = jnp.mean((y["h"] @ head - target) ** 2) + jnp.mean(y["aux"])
    return loss, {"dropped": jnp.mean(y["dropped"].astype(jnp.float32))}


def _plain_loss_fn(head, y, target):
    return loss_fn(head, y, target)[0]


@functools.cache
def _logical(num_logical_stages):
    keys = jax.random.split(jax.random.key(0), num_logical_stages)
    return jax.jit(jax.vmap(lambda k: nnx.state(_layer(k), nnx.Param)))(keys)


def _batch(rows):
    kx, kt, kh = jax.random.split(jax.random.key(1), 3)
    x = {
        "h": jax.random.normal(kx, (rows, SEQ, WIDTH)),
        "aux": jnp.zeros(rows),
        "dropped": jnp.zeros((rows, SEQ), jnp.int32),
    }
    return x, jax.random.normal(kt, (rows, SEQ, WIDTH)), jax.random.normal(kh, (WIDTH, WIDTH))


def _plain(stage_fn, logical, head, x, target):
    """The plain model, every expert on one device: loss and gradients
    (`jaxpipe.reference`), and the last stage's outputs micro-batch by micro-batch."""
    loss, grads = jax.value_and_grad(jaxpipe.reference.loss, argnums=(2, 3))(
        stage_fn, _plain_loss_fn, logical, head, x, target, M
    )

    def stages(y, _):
        y, _ = jax.lax.scan(lambda y, p: (stage_fn(p, y), None), y, logical)
        return None, y

    split = jax.tree_util.tree_map(lambda a: jaxpipe.reference.split(a, M), x)
    _, outputs = jax.lax.scan(lambda _, y: stages(y, None), None, split)
    return loss, grads, jax.tree_util.tree_map(lambda a: a.reshape(-1, *a.shape[2:]), outputs)


@functools.cache
def _plain_results(group_size, num_logical_stages, rows):
    """`_plain` on `_logical` and `_batch`: each compiled once per process, shared by the
    meshes and schedules that run the same model on the same batch."""
    x, target, head = _batch(rows)
    plain = jax.jit(functools.partial(_plain, _stage_fn(None, group_size)))
    return plain(_logical(num_logical_stages), head, x, target)


MESHES = {  # beside pipe: both split the batch 4 ways
    "pipe-expert": (("expert", 4),),
    "pipe-expert-data": (("expert", 2), ("data", 2)),
}
SCHEDULES = {"gpipe": 1, "1f1b": 1, "zbv": 2, "dualpipev": 2, "interleaved_1f1b": 2}
CASES = [(schedule, mesh) for schedule in SCHEDULES for mesh in MESHES] + [
    # a forward and a backward in one computation per tick (`jaxpipe._executor.tick`): as the
    # GPU and CPU compilers get it, the exchanged tokens saved (dots_and_exchanges_saveable);
    # as the TPU compiler gets it (its buffer hand-over, run here), the default policy
    ("dualpipev:overlap", "pipe-expert-data"),
    ("1f1b:overlap-tpu", "pipe-expert"),
]


@pytest.mark.slow
@pytest.mark.xdist_group("moe_plain_model")  # one worker compiles each plain model once
@pytest.mark.parametrize("schedule, mesh_name", CASES, ids=[f"{s}-{m}" for s, m in CASES])
def test_expert_parallel_pipeline_equals_the_plain_model(schedule, mesh_name, monkeypatch):
    """Loss, every parameter's gradient (router, shared and routed experts, head), the
    dropped fraction reported through ``aux``, and which tokens were dropped, against the
    plain model; groups span two rows under 1f1b (a replica's rows of a micro-batch are one
    group), one row elsewhere."""
    v = SCHEDULES[schedule.split(":")[0]]
    group_size = 2 * SEQ if schedule == "1f1b" else None
    mesh = models.pipe_mesh(2, MESHES[mesh_name])
    options = {"virtual_stages": 2} if schedule == "interleaved_1f1b" else None
    keywords = {}
    if schedule == "dualpipev:overlap":
        options, keywords = {"overlap": True}, {"remat_policy": moe.dots_and_exchanges_saveable}
    if schedule == "1f1b:overlap-tpu":
        options = {"overlap": True}
        monkeypatch.setattr(executor_local, "updates_in_place", lambda mesh: True)
    pipe = jaxpipe.Pipeline(
        _stage_fn("expert", group_size), loss_fn, mesh=mesh, schedule=schedule.split(":")[0],
        num_microbatches=M, expert_axis="expert", loss_has_aux=True, schedule_options=options,
        **keywords,
    )  # fmt: skip
    assert "expert" in pipe.data_axes
    logical = _logical(2 * v)
    params = pipe.place(logical, moe.expert_specs(logical, "expert"))
    assert params["gate"].sharding.spec == P(None, "pipe", "expert")
    x, target, head = _batch(ROWS * pipe.num_replicas * M)

    def step(params, head):
        grad = jax.value_and_grad(pipe.loss, argnums=(0, 1), has_aux=True)
        return grad(params, head, x, target), pipe.forward(params, x)

    compiled = jax.jit(step).lower(params, head).compile()
    ((loss, aux), (grads, head_grads)), outputs = compiled(params, head)
    want_loss, (want_grads, want_head), want_outputs = _plain_results(
        group_size, 2 * v, ROWS * pipe.num_replicas * M
    )

    assert models.relative_error(loss, want_loss) <= 1e-5
    got = pipe.logical(grads)
    leaves = zip(
        jax.tree_util.tree_leaves_with_path(got),
        jax.tree_util.tree_leaves(want_grads),
        strict=True,
    )
    for (path, g), w in leaves:
        assert models.relative_error(g, w) <= 1e-5, jax.tree_util.keystr(path)
    assert models.relative_error(head_grads, want_head) <= 1e-5
    assert grads["gate"].sharding.spec == P(None, "pipe", "expert")
    # the very tokens the plain model drops, and some of them
    np.testing.assert_array_equal(outputs["dropped"], want_outputs["dropped"])
    assert int(jnp.sum(want_outputs["dropped"])) > 0 and jnp.any(want_outputs["dropped"] == 0)
    np.testing.assert_allclose(aux["dropped"], jnp.mean(want_outputs["dropped"]), rtol=1e-6)
    assert models.relative_error(outputs["h"], want_outputs["h"]) <= 1e-5
    _check_collectives(compiled.as_text(), pipe, x)


def _check_collectives(text, pipe, x):
    """The compiled step's collectives: all-to-alls over the expert axis only; no collective
    over the expert or pipe axis carries an expert weight or its gradient (whole, or a
    device's share), read from its result and, through bitcasts and the concatenations of
    combined collectives, its operands; only activations and their gradients (one
    micro-batch of one replica's rows, forward and backward) move between pipe ranks in the
    schedule, and after it only the losses, the head's gradient and the last stage's
    outputs. The experts' gradients are averaged over the other data axes; with an
    ``fsdp`` axis, expert weights are gathered over it alone."""
    found = hlo.collectives(text, pipe.mesh)
    definitions = hlo.Definitions(text)
    exchanges = [c for c in found if c.kind == "all-to-all"]
    assert exchanges and all(c.axes == {"expert"} for c in exchanges)
    e, f = pipe.mesh.shape["expert"], pipe.mesh.shape.get("fsdp", 1)
    weight_shapes = {
        shape
        for local in {1, e, e * f}  # whole, a device's experts, their share over fsdp
        for shape in [(EXPERTS // local, WIDTH, HIDDEN), (EXPERTS // local, HIDDEN, WIDTH)]
    }
    rows = ROWS * M * pipe.num_replicas
    leaves = jax.tree_util.tree_leaves(x)
    batch_bytes = sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in leaves)
    microbatch = batch_bytes // rows * ROWS
    others = set(pipe.data_axes) - {"expert"}  # data axes the experts are not split over
    averaged = set()  # expert-shaped arrays of collectives over those axes alone
    for c in found:
        types = [hlo_reader.result_type(c.line), *hlo.operand_types(c.line, definitions)]
        shapes = {dims[-3:] for t in types for _, dims in hlo_reader.arrays(t)}
        if c.axes and c.axes <= others:
            averaged |= shapes & weight_shapes
        if c.kind != "all-to-all" and c.axes & {"expert", "pipe"}:
            assert not shapes & weight_shapes, c.line
        if c.kind == "all-gather":  # FSDP's gathers, and only where asked
            assert "fsdp" in pipe.mesh.shape and c.axes == {"fsdp"}, c.line
        if c.kind == "collective-permute":
            assert c.axes == {"pipe"} and c.nbytes <= 2 * microbatch, c.line
        elif "pipe" in c.axes:  # after the schedule: losses, the head's gradient, outputs
            assert c.nbytes <= 4 * M + 64 + 4 * WIDTH * WIDTH + M * microbatch, c.line
    if others:
        assert averaged
    if "fsdp" in pipe.mesh.shape:
        assert any(c.kind == "all-gather" for c in found)


try:
    HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
except ModuleNotFoundError:
    HAS_CUDA_PLUGIN = False
NEEDS_LIBTPU = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed"
)
NEEDS_CUDA_PLUGIN = pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason="jax's CUDA plugin is missing")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, other",
    [
        pytest.param("v5p:2x2x2", "data", marks=NEEDS_LIBTPU),
        pytest.param("v5p:2x2x2", "fsdp", marks=NEEDS_LIBTPU),
        pytest.param("h100x8", "data", marks=NEEDS_CUDA_PLUGIN),  # its compiles are slow
    ],
)
def test_accelerator_compilers_keep_expert_weights_in_place(name, other):
    """The 1f1b step on pipe x expert x data, compiled ahead of time for TPU v5p and H100
    (`jaxpipe.target`, not run), and on TPU with the experts also split over ``fsdp`` (each
    device one expert, gathered over ``fsdp`` per use): the collectives of the scheduled
    program keep the properties `_check_collectives` reads, in the compilers' own combined
    and asynchronous forms."""
    tgt = jaxpipe.target.get(name)
    mesh = tgt.mesh((2, 2, 2), ("pipe", "expert", other))
    pipe = jaxpipe.Pipeline(
        _stage_fn("expert", 2 * SEQ), loss_fn, mesh=mesh, schedule="1f1b", num_microbatches=M,
        expert_axis="expert", loss_has_aux=True,
    )  # fmt: skip
    logical = _logical(2)
    specs = moe.expert_specs(logical, "expert")
    if other == "fsdp":
        specs = jax.tree_util.tree_map(
            lambda s: P(("expert", "fsdp"), *s[1:]) if s is not None else None,
            specs,
            is_leaf=lambda s: s is None or isinstance(s, P),
        )
    shapes = jax.eval_shape(lambda logical: pipe.place(logical, specs), logical)
    params = jaxpipe.target.abstract(shapes, pipe.layout.shardings(shapes))
    replicated = jax.sharding.NamedSharding(mesh, P())
    x, target, head = jaxpipe.target.abstract(
        jax.eval_shape(functools.partial(_batch, ROWS * pipe.num_replicas * M)), replicated
    )

    def step(params, head, x, target):
        return jax.value_and_grad(pipe.loss, argnums=(0, 1), has_aux=True)(params, head, x, target)

    compiled = jax.jit(step).lower(params, head, x, target).compile()
    _check_collectives(compiled.as_text(), pipe, x)


TENSOR_SPECS = {  # Megatron's split of each SwiGLU: hidden units over tensor
    "gate": P("expert", None, "tensor"),
    "up": P("expert", None, "tensor"),
    "down": P("expert", "tensor", None),
    "shared_gate": P(None, "tensor"),
    "shared_up": P(None, "tensor"),
    "shared_down": P("tensor", None),
}


@pytest.mark.slow
@pytest.mark.xdist_group("moe_plain_model")
@pytest.mark.parametrize("other", ["fsdp", "tensor"])
def test_expert_weights_split_over_fsdp_or_tensor_too(other):
    """Experts split over ``expert`` and their width over ``fsdp`` (gathered over ``fsdp``
    only, per use), or their hidden units over ``tensor`` (XLA's automatic sharding inside
    the stage), under 1f1b: exact against the plain model."""
    mesh = models.pipe_mesh(2, (("expert", 2), (other, 2)))
    logical = _logical(2)
    if other == "fsdp":
        specs = jax.tree_util.tree_map(
            lambda s: P(*s, "fsdp") if s is not None else None,
            moe.expert_specs(logical, "expert"),
            is_leaf=lambda s: s is None or isinstance(s, P),
        )
    else:
        specs = jax.tree_util.tree_map_with_path(
            lambda path, v: v.replace(TENSOR_SPECS.get(path[0].key)),
            logical,
            is_leaf=lambda v: isinstance(v, nnx.Variable),
        )
    pipe = jaxpipe.Pipeline(
        _stage_fn("expert", None), loss_fn, mesh=mesh, schedule="1f1b", num_microbatches=M,
        expert_axis="expert", loss_has_aux=True,
    )  # fmt: skip
    assert pipe.data_axes == (("fsdp", "expert") if other == "fsdp" else ("expert",))
    x, target, head = _batch(ROWS * pipe.num_replicas * M)
    want_loss, (want_grads, _), _ = _plain_results(None, 2, ROWS * pipe.num_replicas * M)
    params = pipe.place(logical, specs)
    spec = P(None, "pipe", *(("expert", "fsdp") if other == "fsdp" else TENSOR_SPECS["up"]))
    assert params["up"].sharding.spec == spec
    grad = jax.value_and_grad(pipe.loss, has_aux=True)
    (loss, _), grads = jax.jit(grad)(params, head, x, target)
    assert models.relative_error(loss, want_loss) <= 1e-5
    assert models.relative_error(pipe.logical(grads), want_grads) <= 1e-5
    assert grads["up"].sharding.spec == spec


def test_expert_specs_take_shapes_as_they_take_arrays():
    """Specs from ``jax.eval_shape``'s abstract parameters (a model too large to create,
    compiled ahead of time) are those of the parameters themselves."""

    def stage():
        return jax.vmap(lambda k: nnx.state(_layer(k), nnx.Param))(
            jax.random.split(jax.random.key(0), 3)
        )

    want = nnx.to_pure_dict(moe.expert_specs(stage(), "expert", leading_axes=0))
    got = nnx.to_pure_dict(moe.expert_specs(jax.eval_shape(stage), "expert", leading_axes=0))
    assert got == want and want["gate"] == P(None, "expert") and want["router"] is None


class _ExpertsOfAnyRank(nnx.Module):
    def __init__(self, rngs):
        normal = nnx.initializers.normal()
        self.w = moe.ExpertParam(normal(rngs.params(), (EXPERTS, WIDTH, HIDDEN)))
        self.b = moe.ExpertParam(normal(rngs.params(), (EXPERTS, HIDDEN)))  # a bias
        self.c = moe.ExpertParam(normal(rngs.params(), (EXPERTS, 2, 3, 4)))
        self.router = nnx.Param(normal(rngs.params(), (WIDTH, EXPERTS)))


def test_expert_specs_find_the_experts_of_any_rank():
    """2-D and 4-D expert weights, alone and stacked into blocks and stages: the spec names
    the experts' dimension, never a stacked one."""
    keys = jax.random.split(jax.random.key(0), 2 * 3)
    one = nnx.state(_ExpertsOfAnyRank(nnx.Rngs(0)), nnx.Param)
    blocks = nnx.state(nnx.vmap(_ExpertsOfAnyRank)(nnx.Rngs(keys[:3])), nnx.Param)  # [3, E]
    logical = jax.tree.map(lambda a: jnp.stack([a, 2 * a]), blocks)  # [2, 3, E, ...]
    want = {"w": P("expert"), "b": P("expert"), "c": P("expert"), "router": None}
    assert nnx.to_pure_dict(moe.expert_specs(one, "expert", leading_axes=0)) == want
    stacked = {k: None if v is None else P(None, *v) for k, v in want.items()}
    assert nnx.to_pure_dict(moe.expert_specs(blocks, "expert", leading_axes=0)) == stacked
    assert nnx.to_pure_dict(moe.expert_specs(logical, "expert")) == stacked
    # placed with them, each device holds E / 2 experts of every weight, whole blocks
    mesh = models.pipe_mesh(2, (("expert", 2),))
    pipe = jaxpipe.Pipeline(lambda p, x: x, None, mesh=mesh, num_microbatches=2)
    placed = pipe.place(logical, moe.expert_specs(logical, "expert"))
    for name in ("w", "b", "c"):
        shard = placed[name][...].addressable_shards[0].data
        assert shard.shape[:4] == (1, 1, 3, EXPERTS // 2), name
        np.testing.assert_array_equal(pipe.logical(placed)[name][...], logical[name][...])
    with pytest.raises(ValueError, match=r"expert weight \['b'\] has shape \(4, 16\)"):
        moe.expert_specs(one, "expert")


def test_expert_axis_errors():
    mesh = models.pipe_mesh(2, (("expert", 4),))
    stage_fn = _stage_fn("expert", None)
    with pytest.raises(ValueError, match="expert_axis='experts' is not a mesh axis"):
        jaxpipe.Pipeline(stage_fn, loss_fn, mesh=mesh, num_microbatches=M, expert_axis="experts")
    with pytest.raises(ValueError, match="expert_axis='pipe' is not a mesh axis other than"):
        jaxpipe.Pipeline(stage_fn, loss_fn, mesh=mesh, num_microbatches=M, expert_axis="pipe")
    with pytest.raises(ValueError, match="costs='measure' times a stage on its own"):
        jaxpipe.Pipeline(
            stage_fn, loss_fn, mesh=mesh, num_microbatches=M, expert_axis="expert", costs="measure"
        )
    pipe = jaxpipe.Pipeline(
        stage_fn, loss_fn, mesh=mesh, num_microbatches=M, expert_axis="expert",
        loss_has_aux=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"dimension 0 \(6 experts\) does not divide over"):
        pipe.place({"gate": jnp.ones((2, 6, WIDTH, HIDDEN))}, {"gate": P("expert")})
    # pipe.init says the same (it gave the layout's message, of a "dimension 0 (of size 6)")
    with pytest.raises(ValueError, match=r"dimension 0 \(6 experts\) does not divide over"):
        pipe.init(lambda k: {"gate": jnp.ones((6, WIDTH, HIDDEN))}, jax.random.key(0), P("expert"))
    # experts split over fsdp and expert on one dimension: the expert axis must be major
    mesh = models.pipe_mesh(2, (("expert", 2), ("fsdp", 2)))
    pipe2 = jaxpipe.Pipeline(stage_fn, loss_fn, mesh=mesh, num_microbatches=M, expert_axis="expert")
    gate = {"gate": jnp.ones((2, 4, WIDTH, HIDDEN))}
    with pytest.raises(ValueError, match=r"Put the expert axis first: \('expert', 'fsdp'\)"):
        pipe2.place(gate, {"gate": P(("fsdp", "expert"))})
    pipe2.place(gate, {"gate": P(("expert", "fsdp"))})
    x, target, head = _batch(ROWS * 4 * M)
    unsplit = pipe.place(_logical(2))  # no spec names the expert axis
    with pytest.raises(ValueError, match="no placement spec names it"):
        pipe.loss(unsplit, head, x, target)


# -------------------------------------- all-to-alls behind the other micro-batch's work
TPU_ASYNC_ALL_TO_ALL = {  # the TPU compiler's all-to-alls run synchronously without these
    "xla_tpu_enable_async_all_to_all": True,
    "xla_tpu_enable_all_experimental_scheduler_features": True,
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, options",
    [
        pytest.param("v5p:2x2x1", TPU_ASYNC_ALL_TO_ALL, marks=NEEDS_LIBTPU),
        pytest.param("h100x4", None, marks=NEEDS_CUDA_PLUGIN),
    ],
)
def test_paired_ticks_run_all_to_alls_behind_the_other_microbatchs_computation(name, options):
    """1f1b(overlap=True) on pipe x expert, compiled ahead of time for TPU v5p and H100, the
    stage's exchanged tokens saved for its backward (`moe.dots_and_exchanges_saveable`): in
    the computation of each tick that pairs a forward with a backward, every all-to-all is
    asynchronous with the other action's computation scheduled between its start and done;
    the backward exchanges only cotangents (two all-to-alls). (Run as two actions, a
    forward's all-to-alls could only wait for its own computation, all of which depends on
    them.)"""
    width, hidden, experts, seq, rows = 256, 512, 8, 256, 4
    tgt = jaxpipe.target.get(name)
    mesh = tgt.mesh((2, 2), ("pipe", "expert"))

    def layer(key, expert_axis=None, width=width, hidden=hidden):
        return moe.MoE(
            width, hidden, experts, rngs=nnx.Rngs(key), top_k=2, capacity_factor=1.0,
            expert_axis=expert_axis,
        )  # fmt: skip

    graph = nnx.graphdef(nnx.eval_shape(lambda: layer(0, "expert")))

    def stage_fn(p, x):
        return x + nnx.merge(graph, p)(x)[0]

    pipe = jaxpipe.Pipeline(
        stage_fn, lambda head, y, t: jnp.mean((y @ head - t) ** 2), mesh=mesh,
        schedule="1f1b", schedule_options={"overlap": True}, num_microbatches=4,
        expert_axis="expert", remat_policy=moe.dots_and_exchanges_saveable,
    )  # fmt: skip
    keys = jax.random.split(jax.random.key(0), 2)
    logical = jax.eval_shape(jax.vmap(lambda k: nnx.state(layer(k), nnx.Param)), keys)
    small = jax.vmap(lambda k: nnx.state(layer(k, width=8, hidden=8), nnx.Param))
    specs = moe.expert_specs(small(jax.random.split(jax.random.key(0), 2)), "expert")
    shapes = jax.eval_shape(lambda logical: pipe.place(logical, specs), logical)
    params = jaxpipe.target.abstract(shapes, pipe.layout.shardings(shapes))
    replicated = jax.sharding.NamedSharding(mesh, P())
    x = jax.ShapeDtypeStruct((rows * 2 * 4, seq, width), jnp.float32, sharding=replicated)
    head = jax.ShapeDtypeStruct((width, width), jnp.float32, sharding=replicated)
    step = jax.value_and_grad(pipe.loss, argnums=(0, 1))
    text = jax.jit(step).lower(params, head, x, x).compile(compiler_options=options).as_text()

    paired = 0
    computations = hlo_reader.computations(text)[0]
    for lines in computations.values():
        exchanges = _all_to_all_windows(lines, computations)
        scopes = {scope for scope, _ in exchanges}
        if scopes != {"forward", "backward"}:
            continue
        paired += 1
        assert len(exchanges) == 4, exchanges  # two each way: the backward repeats none
        assert all(window for _, window in exchanges), exchanges  # computation in each
        assert all("backward" in w for s, w in exchanges if s == "forward"), exchanges
        assert all("forward" in w for s, w in exchanges if s == "backward"), exchanges
    assert paired >= 2  # the pairs with the last stage's forward and with another's


def _all_to_all_windows(lines: list[str], computations: dict) -> list[tuple[str, set]]:
    """Per all-to-all of a scheduled computation, the action it belongs to (``"forward"``
    or ``"backward"``: the executor's named scopes in its op name, or ``"?"``) and the
    actions of the matrix products scheduled between its start and done (None for a
    synchronous all-to-all)."""

    def scope(line):
        name = re.search(r'op_name="([^"]*)"', line)
        found = re.findall(r"/(forward|backward)/", name.group(1) if name else "")
        return found[-1] if found else "?"

    def products(line, seen):
        if hlo_reader.opcode(line) in ("dot", "convolution"):
            return {scope(line)}
        for callee in hlo_reader.called(line):
            if callee in computations and callee not in seen:
                seen.add(callee)
                if any(products(inner, seen) for inner in computations[callee]):
                    return {scope(line)}
        return set()

    found = []
    for i, line in enumerate(lines):
        op = hlo_reader.opcode(line)
        if op == "all-to-all":
            found.append((scope(line), None))
        elif op == "all-to-all-start":
            start = re.match(r"\s*%?([\w.\-]+) =", line).group(1)
            window = set()
            for later in lines[i + 1 :]:
                if re.search(rf"all-to-all-done\(%?{re.escape(start)}[,)]", later):
                    break
                window |= products(later, set())
            found.append((scope(line), window))
    return found


def test_only_expert_parallel_stages_pair_a_ticks_actions(monkeypatch):
    """Under ``dualpipev(overlap=True)`` the executor runs a tick's forward and backward as
    one computation for a stage whose weights are split over the expert axis, and apart for
    a dense stage, whose transfers between stages run behind its actions (read off the
    dispatch each program's tick builds; tracing only)."""
    from jaxpipe._executor import tick

    built = []
    of = tick._PairDispatch.of
    monkeypatch.setattr(tick._PairDispatch, "of", lambda local: built.append(of(local)))

    dense = jaxpipe.Pipeline(
        models.stage_fn, models.loss_fn, mesh=models.pipe_mesh(2), schedule="dualpipev",
        num_microbatches=4, schedule_options={"overlap": True},
    )  # fmt: skip
    params, head = models.init(jax.random.key(0), dense.num_logical_stages)
    x, target = models.data(jax.random.key(1), 8)
    jax.eval_shape(jax.grad(dense.loss), dense.place(params), head, x, target)
    assert built == [None]

    pipe = jaxpipe.Pipeline(
        _stage_fn("expert", None), loss_fn, mesh=models.pipe_mesh(2, (("expert", 4),)),
        schedule="dualpipev", num_microbatches=M, expert_axis="expert", loss_has_aux=True,
        schedule_options={"overlap": True},
    )  # fmt: skip
    logical = _logical(pipe.num_logical_stages)
    x, target, head = _batch(ROWS * pipe.num_replicas * M)
    params = pipe.place(logical, moe.expert_specs(logical, "expert"))
    jax.eval_shape(jax.grad(pipe.loss, has_aux=True), params, head, x, target)
    assert built[1:] and all(dispatch is not None for dispatch in built[1:])
