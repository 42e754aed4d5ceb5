"""The device layout of stage parameters (`Pipeline.place`, `logical`, `init`), any mesh a
user makes, and behaviour read from the table rather than a schedule's name."""

import re

import jax
import jax.numpy as jnp
import models
import numpy as np
import optax
import pytest
from against_replay import train_against_replay
from jax.sharding import PartitionSpec as P

from jaxpipe import layout, pipeline, schedules

PLACEMENTS = [("1f1b", {}), ("interleaved_1f1b", {"virtual_stages": 2}), ("zbv", {})]
PLACEMENTS += [("circular", {"repeats": 3})]


def _pipe(name, options, S=4, M=4, mesh=None, **kwargs):
    return pipeline.Pipeline(
        models.stage_fn,
        models.loss_fn,
        mesh=mesh or models.pipe_mesh(S),
        schedule=name,
        num_microbatches=M,
        schedule_options=options,
        **kwargs,
    )


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("name,options", PLACEMENTS)
def test_each_device_holds_exactly_its_own_stages(name, options, host):
    pipe = _pipe(name, options)
    logical, _ = models.init(jax.random.key(0), pipe.num_logical_stages)
    if host:
        logical = jax.tree_util.tree_map(np.asarray, logical)
    placed = pipe.place(logical)
    v, S = pipe.schedule.stages_per_device, pipe.num_stages
    for name_, leaf in placed.items():
        assert leaf.shape == (v, S, *logical[name_].shape[1:])
        assert leaf.sharding.spec[:2] == (None, "pipe")
        for shard in leaf.addressable_shards:
            device = list(pipe.mesh.devices.flat).index(shard.device)
            want = np.stack(
                [np.asarray(logical[name_])[s] for s in pipe.schedule.device_stages(device)]
            )
            np.testing.assert_array_equal(np.asarray(shard.data)[:, 0], want)
    back = pipe.logical(placed)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), back, logical
    )


@pytest.mark.parametrize(
    ("name", "options", "S"),
    [("1f1b", {}, 8), ("interleaved_1f1b", {"virtual_stages": 2}, 4), ("zbv", {}, 4)],
)
def test_init_creates_the_layout_of_the_logical_stages(name, options, S):
    """With threefry keys, whatever the placement of the 8 logical stages: the logical
    stages of ``pipe.init`` are ``vmap(init_stage)`` of the split key."""
    pipe = _pipe(name, options, S=S)

    def init_stage(key):
        return {"w": jax.random.normal(key, (3, 5)), "b": jnp.zeros(5)}

    key = jax.random.key(3)
    placed = pipe.init(init_stage, key)
    v = 8 // S
    assert placed["w"].shape == (v, S, 3, 5) and placed["w"].sharding.spec[:2] == (None, "pipe")
    want = jax.vmap(init_stage)(jax.random.split(key, 8))
    np.testing.assert_array_equal(pipe.logical(placed)["w"], want["w"])


def test_specs_shard_the_dimensions_after_the_stage_axis():
    mesh = models.pipe_mesh(2, (("tensor", 2),))
    pipe = _pipe("1f1b", {}, S=2, mesh=mesh)
    logical, _ = models.init(jax.random.key(0), 2)
    specs = {"w1": P(None, "tensor"), "w2": P("tensor", None), "b1": None, "scale": None}
    placed = pipe.place(logical, specs)
    assert placed["w1"].sharding.spec == P(None, "pipe", None, "tensor")
    assert placed["w2"].sharding.spec == P(None, "pipe", "tensor", None)
    assert placed["b1"].sharding.spec == P(None, "pipe")
    with pytest.raises(ValueError, match="specs must be one PartitionSpec, or a pytree"):
        pipe.place(logical, {"w1": P()})
    # The shardings of placed shapes (a compile-only step's arguments) are a Placed too.
    shapes = jax.eval_shape(lambda: placed)
    shardings = pipe.layout.shardings(shapes, specs)
    assert isinstance(shardings, layout.Placed) and shardings.order == placed.order
    assert shardings["w2"] == placed["w2"].sharding


BAD_SPECS = [
    (P("model"), r"it names axis 'model', which the mesh does not have"),
    (P(None, None, "tensor"), r"it has 3 entries for 2 dimensions"),
    (P(None, "tensor"), r"dimension 1 \(of size 5\) does not split over 2 devices"),
    (P("tensor", "tensor"), r"it names axis 'tensor' twice"),
    (P("pipe"), r"it names the pipe axis 'pipe'"),
]


@pytest.mark.parametrize("spec,problem", BAD_SPECS)
def test_specs_the_mesh_cannot_apply_are_refused_naming_leaf_spec_shape_and_axes(spec, problem):
    pipe = _pipe("1f1b", {}, S=2, mesh=models.pipe_mesh(2, (("tensor", 2),)))
    logical = {"b": np.zeros((2, 4)), "w": models.numpy_rng(jax.random.key(0)).random((2, 4, 5))}
    specs = {"b": None, "w": spec}

    def message(what, shape):
        given = (
            f"{what} leaf ['w'] of shape {shape} is given placement spec {spec}, for its "
            "dimensions after the stage axis (4, 5), on a mesh of axes "
            "{'pipe': 2, 'tensor': 2} (pipe axis 'pipe'): "
        )
        return re.escape(given) + problem

    for params in (logical, jax.tree.map(jnp.asarray, logical)):
        with pytest.raises(ValueError, match=message("logical_params", (2, 4, 5))):
            pipe.place(params, specs)
    with pytest.raises(ValueError, match=message("init_stage's parameters", (1, 2, 4, 5))):
        pipe.init(lambda key: {"b": jnp.zeros(4), "w": jnp.zeros((4, 5))}, jax.random.key(0), specs)


def test_specs_travel_with_the_placed_parameters():
    """The specs a tree was placed with are part of the `Placed`: they survive jit, grad
    and optax, a conversion into another layout keeps them, and each step is compiled for
    the specs of the parameters it is given, whichever tree the pipeline placed last."""
    mesh = models.pipe_mesh(2, (("tensor", 2),))
    pipe = _pipe("interleaved_1f1b", {"virtual_stages": 2}, S=2, mesh=mesh)
    zbv = _pipe("zbv", {}, S=2, mesh=mesh)
    logical, loss_params = models.init(jax.random.key(0), 4)
    x, t = models.data(jax.random.key(1), 8)
    split = pipe.place(logical, {"w1": P(None, "tensor"), "w2": P("tensor", None),
                                 "b1": None, "scale": None})  # fmt: skip
    plain = pipe.place(logical)  # placed last
    assert split.specs is not None and plain.specs is None
    grad = jax.jit(jax.grad(pipe.loss))
    for params in (split, plain):
        grads = grad(params, loss_params, x, t)
        assert isinstance(grads, layout.Placed) and grads.specs == params.specs
        for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params), strict=True):
            assert g.sharding.is_equivalent_to(p.sharding, g.ndim)
    moments = optax.adam(1e-2).init(split)[0].mu
    assert moments.specs == split.specs
    state = pipe.init_optimizer(optax.adam(1e-2), split)
    assert state.tree[0].mu["w1"].sharding == split["w1"].sharding
    converted = zbv.place(split)
    assert converted.order == zbv.layout.order != split.order
    assert converted.specs == split.specs
    assert converted["w1"].sharding.spec == P(None, "pipe", None, "tensor")


def test_specs_given_for_a_tree_holding_placed_nodes_apply_to_each_node():
    """From this layout and from another: per node, or one spec for every placed leaf;
    leaves that are not placed take no spec."""
    mesh = models.pipe_mesh(2, (("tensor", 2),))
    pipe = _pipe("interleaved_1f1b", {"virtual_stages": 2}, S=2, mesh=mesh)
    zbv = _pipe("zbv", {}, S=2, mesh=mesh)
    logical, _ = models.init(jax.random.key(0), 4)
    specs = {"w1": P(None, "tensor"), "w2": P("tensor", None), "b1": None, "scale": None}
    step = jnp.asarray(7)
    for source in (pipe.place(logical), zbv.place(logical)):
        tree = {"params": source, "step": step}
        for given, node_specs in (({"params": specs, "step": None}, specs), (P("tensor"),) * 2):
            moved = pipe.place(tree, given)
            fresh = pipe.place(logical, node_specs)
            assert moved["step"] is step and moved["params"].order == pipe.layout.order
            assert moved["params"].specs == fresh.specs is not None
            for name, leaf in moved["params"].items():
                assert leaf.sharding == fresh[name].sharding
            back = pipe.logical(moved["params"])
            for name in logical:
                np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(logical[name]))
        with pytest.raises(
            ValueError, match=r"specs give leaf \['step'\] spec P\(\), but it is not"
        ):
            pipe.place(tree, {"params": specs, "step": P()})
        with pytest.raises(ValueError, match="pytree of the tree's structure up to its placed"):
            pipe.place(tree, {"params": specs})


def test_place_moves_a_tree_placed_on_another_mesh_onto_its_own():
    """In the same order or another, as a Placed or inside a tree, and logical arrays of
    the other mesh: on the new mesh, with the specs they were placed with."""

    def mesh(devices):
        auto = (jax.sharding.AxisType.Auto,) * 2
        return jax.make_mesh((2, 2), ("pipe", "tensor"), axis_types=auto, devices=devices)

    interleaved = ("interleaved_1f1b", {"virtual_stages": 2})
    old = _pipe(*interleaved, S=2, mesh=mesh(jax.devices()[:4]))
    same = _pipe(*interleaved, S=2, mesh=mesh(jax.devices()[4:]))
    zbv = _pipe("zbv", {}, S=2, mesh=mesh(jax.devices()[4:]))
    logical, _ = models.init(jax.random.key(0), 4)
    specs = {"w1": P(None, "tensor"), "w2": P("tensor", None), "b1": None, "scale": None}
    placed = old.place(logical, specs)
    for pipe in (same, zbv):
        want = pipe.place(logical, specs)
        for moved in (
            pipe.place(placed),
            pipe.place({"params": placed})["params"],
            pipe.place(old.logical(placed), specs),
        ):
            assert moved.order == pipe.layout.order and moved.specs == want.specs
            for name, leaf in moved.items():
                assert leaf.sharding.is_equivalent_to(want[name].sharding, leaf.ndim)
                assert leaf.sharding.mesh == pipe.mesh != old.mesh
            back = pipe.logical(moved)
            for name in logical:
                np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(logical[name]))


def test_place_and_logical_say_what_they_expected():
    pipe = _pipe("interleaved_1f1b", {"virtual_stages": 2})
    with pytest.raises(
        ValueError,
        match=r"logical_params leaf \['w'\] has shape \(4, 3\); "
        r"place\(\) takes leaves with a leading stage axis of length S\*v = 4\*2 = 8",
    ):
        pipe.place({"w": jnp.zeros((4, 3))})
    with pytest.raises(
        ValueError, match=r"params leaf \['w'\] has shape \(8, 3\).*\[2, 4, \.\.\.\]"
    ):
        pipe.logical({"w": jnp.zeros((8, 3))})


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["default", "explicit", "auto"])
def test_any_mesh_users_make(kind):
    """jax.make_mesh's default axis types (explicit on current JAX), Explicit and Auto:
    pipe x data meshes all run the schedule exactly."""
    devices = jax.devices()[:4]
    if kind == "default":
        mesh = jax.make_mesh((2, 2), ("pipe", "data"), devices=devices)
    else:
        axis_type = getattr(jax.sharding.AxisType, kind.capitalize())
        mesh = jax.make_mesh((2, 2), ("pipe", "data"), axis_types=(axis_type,) * 2, devices=devices)
    pipe = _pipe("zbv", {}, S=2, mesh=mesh)
    sp, lp = models.init(jax.random.key(1), pipe.num_logical_stages)
    x, t = models.data(jax.random.key(2), 16)
    loss, grads = jax.jit(jax.value_and_grad(pipe.loss))(pipe.place(sp), lp, x, t)
    ref_loss, ref = jax.value_and_grad(models.sequential_loss)(sp, lp, x, t, 4)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert models.relative_error(pipe.logical(grads), ref) < 1e-5


# ------------------------------------------------- behaviour from the table, not the name
def _train_against_replay(pipe, steps=2):
    params, loss_params = models.init(jax.random.key(pipe.num_stages), pipe.num_logical_stages)
    batches = [
        models.batch(jax.random.key(10 + k), 2 * pipe.num_microbatches) for k in range(steps)
    ]
    train_against_replay(
        pipe, optax.sgd(0.1), models.stage_fn, models.loss_fn, params, loss_params, batches
    )


@pytest.mark.slow
@pytest.mark.parametrize("name,S,M", [("pipedream", 2, 1), ("pipedream_2bw", 2, 2)])
def test_smallest_asynchronous_tables_train(name, S, M):
    _train_against_replay(_pipe(name, {}, S=S, M=M))


@pytest.mark.slow
def test_a_pipedream_table_loaded_from_csv_under_another_name_trains_the_same(tmp_path):
    path = tmp_path / "table.csv"
    text = schedules.to_csv(schedules.get("pipedream", 3, 5))
    path.write_text(text.replace("# name: pipedream", "# name: my_table"))
    loaded = schedules.from_csv(path)
    assert loaded.name == "my_table" and loaded.has_updates
    pipe = pipeline.Pipeline(
        models.stage_fn, models.loss_fn, mesh=models.pipe_mesh(3), schedule=loaded
    )
    assert pipe.updates_weights
    _train_against_replay(pipe)


# ------------------------------------------------- layouts that cannot be mixed up
def _interleaved_and_zbv(M=4):
    """Two pipelines whose layouts have the same shapes, [2, 4, ...], in other orders."""
    return _pipe("interleaved_1f1b", {"virtual_stages": 2}, M=M), _pipe("zbv", {}, M=M)


def _problem(seed, num_stages=8, M=4):
    sp, lp = models.init(jax.random.key(seed), num_stages)
    x, t = models.data(jax.random.key(seed + 1), 2 * M)
    return sp, lp, x, t


def test_parameters_placed_by_another_pipeline_are_refused_and_convert_with_place():
    interleaved, zbv = _interleaved_and_zbv()
    sp, lp, x, t = _problem(5)
    wrong = interleaved.place(sp)
    assert jax.tree_util.tree_leaves(wrong)[0].shape[:2] == (2, 4)  # zbv's shapes too
    message = r"stage_params were placed for another layout.*d0: 0, 4.*d0: 0, 7.*pipe\.place"
    for call in (
        lambda: zbv.loss(wrong, lp, x, t),
        lambda: zbv.loss_and_grads(wrong, lp, x, t),
        lambda: zbv.forward(wrong, x),
        lambda: jax.jit(jax.grad(zbv.loss))(wrong, lp, x, t),
    ):
        with pytest.raises(ValueError, match=message):
            call()
    converted = zbv.place(wrong)
    want = models.sequential_loss(sp, lp, x, t, 4)
    np.testing.assert_allclose(zbv.loss(converted, lp, x, t), want, rtol=1e-6)
    jax.tree_util.tree_map(
        np.testing.assert_array_equal, zbv.logical(converted), interleaved.logical(wrong)
    )


def test_a_hand_reshape_is_refused_where_layouts_share_shapes_and_read_where_they_do_not():
    _, zbv = _interleaved_and_zbv()
    sp, lp, x, t = _problem(6)
    by_hand = jax.tree_util.tree_map(lambda a: a.reshape(2, 4, *a.shape[1:]), sp)
    with pytest.raises(ValueError, match=r"bare arrays \[v, S, \.\.\.\] = \[2, 4, \.\.\.\].*"
                       r"pipe\.place\(logical_params\)"):  # fmt: skip
        zbv.loss(by_hand, lp, x, t)
    with pytest.raises(ValueError, match="bare arrays"):
        zbv.logical(by_hand)
    # One stage per device in order: [1, S] has one layout, so a reshape is that layout.
    one = _pipe("1f1b", {}, S=8)
    by_hand = jax.tree_util.tree_map(lambda a: a.reshape(1, 8, *a.shape[1:]), sp)
    want = models.sequential_loss(sp, lp, x, t, 4)
    np.testing.assert_allclose(one.loss(by_hand, lp, x, t), want, rtol=1e-6)


@pytest.mark.slow
def test_optimizer_state_of_another_layout_is_refused_by_the_pipeline_and_by_optax():
    interleaved, zbv = _interleaved_and_zbv()
    sp, lp, x, t = _problem(7)
    optimizer = optax.adam(1e-2)
    params = zbv.place(sp)
    with pytest.raises(ValueError, match="opt_state were placed for another layout") as info:
        zbv.train(optimizer, params, interleaved.init_optimizer(optimizer, interleaved.place(sp)),
                  lp, x, t)  # fmt: skip
    assert str(info.value).count("opt_state = pipe.place(opt_state)") == 1  # said once
    grads = jax.grad(zbv.loss)(params, lp, x, t)
    other_state = optimizer.init(interleaved.place(sp))
    with pytest.raises(ValueError, match=r"jaxpipe layout \(\(0, 1, 2, 3\), \(4, 5, 6, 7\)\)"):
        optimizer.update(grads, other_state, params)
    state = zbv.place(other_state)  # moments move into zbv's layout, the count stays
    assert state[0].mu.order == params.order
    jax.tree_util.tree_map(  # the same logical moments, read each in its own layout
        np.testing.assert_array_equal, zbv.logical(state), interleaved.logical(other_state)
    )
    updates, state = optimizer.update(grads, state, params)
    assert isinstance(updates, layout.Placed) and updates.order == params.order


@pytest.mark.slow
def test_an_optax_loop_on_placed_parameters_equals_one_on_logical_parameters():
    """Adam on placed parameters with the pipeline's gradients, and Adam on logical
    parameters with the plain model's: the same parameters after three steps."""
    _, zbv = _interleaved_and_zbv()
    sp, lp, x, t = _problem(8)
    optimizer = optax.adam(1e-2)

    def step(loss, params, state):
        grads = jax.grad(loss)(params, lp, x, t)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    placed, logical = zbv.place(sp), sp
    placed_state, logical_state = optimizer.init(placed), optimizer.init(logical)
    plain = jax.jit(lambda p, s: step(lambda *a: models.sequential_loss(*a, 4), p, s))
    piped = jax.jit(lambda p, s: step(zbv.loss, p, s))
    for _ in range(3):
        placed, placed_state = piped(placed, placed_state)
        logical, logical_state = plain(logical, logical_state)
    assert isinstance(placed, layout.Placed)
    assert models.relative_error(zbv.logical(placed), logical) < 1e-5


def test_recut_regroups_stacked_blocks_in_order_and_refuses_what_is_not_a_stack():
    blocks = np.arange(8 * 3 * 2, dtype=np.float32).reshape(8, 3, 2)  # 8 blocks, [3, 2] each
    four_by_two = {"w": blocks.reshape(4, 2, 3, 2), "b": blocks[:, 0].reshape(4, 2, 2)}
    eight = layout.recut(four_by_two, 8)
    assert eight["w"].shape == (8, 1, 3, 2)
    np.testing.assert_array_equal(eight["w"][:, 0], blocks)
    np.testing.assert_array_equal(layout.recut(eight, 2)["b"].reshape(8, 2), blocks[:, 0])
    with pytest.raises(ValueError, match=r"8 blocks do not split into 3 stages"):
        layout.recut(four_by_two, 3)
    with pytest.raises(ValueError, match=r"leaf \['count'\] has shape \(4,\).*block"):
        layout.recut({"w": four_by_two["w"], "count": np.zeros(4)}, 8)
    with pytest.raises(ValueError, match=r"recut\(pipe\.logical\(params\)"):
        layout.recut(_pipe("1f1b", {}).place({"w": jnp.ones((4, 2, 3))}), 8)
