"""The device layout of stage parameters (`Pipeline.place`, `logical`, `init`), any mesh a
user makes, and behaviour read from the table rather than a schedule's name."""

import jax
import jax.numpy as jnp
import models
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxpipe import pipeline, replay, schedules

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
    opt = optax.sgd(0.1)
    S = pipe.num_stages
    params, loss_params = models.init(jax.random.key(S), pipe.num_logical_stages)
    ref, ref_states = params, replay.init_opt_states(opt, params)
    placed = pipe.place(params)
    state = pipe.init_optimizer(opt, placed)
    step = jax.jit(lambda p, o, lp, x, t: pipe.train(opt, p, o, lp, x, t))
    M = pipe.num_microbatches
    for k in range(steps):
        x, t = models.data(jax.random.key(10 + k), 2 * M)
        placed, state, losses = step(placed, state, loss_params, x, t)
        ref, ref_states, ref_losses = replay.replay(
            pipe.schedule, models.stage_fn, models.loss_fn, ref, loss_params, opt, ref_states, x, t
        )
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert models.relative_error(pipe.logical(placed), ref) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name,S,M", [("pipedream", 2, 1), ("pipedream_2bw", 2, 2)])
def test_smallest_asynchronous_tables_train(name, S, M):
    _train_against_replay(_pipe(name, {}, S=S, M=M))


@pytest.mark.slow
def test_a_pipedream_table_loaded_from_csv_under_another_name_trains_the_same(tmp_path):
    path = tmp_path / "table.csv"
    text = schedules.get("pipedream", 3, 5).to_csv()
    path.write_text(text.replace("# name: pipedream", "# name: my_table"))
    loaded = schedules.Schedule.from_csv(path)
    assert loaded.name == "my_table" and loaded.has_updates
    pipe = pipeline.Pipeline(
        models.stage_fn, models.loss_fn, mesh=models.pipe_mesh(3), schedule=loaded
    )
    assert pipe.updates_weights
    _train_against_replay(pipe)
