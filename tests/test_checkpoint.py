"""Orbax checkpoints of pipeline training state: kill-and-resume in a fresh process,
restore into another pipeline layout, and the error for a checkpoint of another model."""

import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import multihost_worker as worker
import numpy as np
import optax
import pytest

import jaxpipe
from jaxpipe import checkpoint, layout

HERE = os.path.dirname(os.path.abspath(__file__))
SAVE_STEP = 3
SUBPROCESS_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def run_with_checkpoint(tmp_path_factory):
    """The reference: S = 4, 1f1b, 6 uninterrupted Adam steps, saving after step 3."""
    directory = tmp_path_factory.mktemp("ckpt") / "run"
    shape, names, schedule, options = worker.CONFIGS["pipe4"]
    mesh = worker.make_mesh(shape, names)
    state, losses = worker.train(mesh, schedule, options, SAVE_STEP)
    pipe = worker.make_pipeline(mesh, schedule, options)
    checkpoint.save(directory, SAVE_STEP, state, pipeline=pipe)
    saved = worker.host_tree(_logical(pipe, state))
    state, more = worker.train(
        mesh, schedule, options, worker.RESUME_STEPS - SAVE_STEP, state, SAVE_STEP
    )
    return dict(
        directory=directory, saved=saved, final=worker.host_tree(state), losses=losses + more
    )


@pytest.mark.slow
def test_kill_and_resume_in_a_fresh_process_is_bitwise_equal(run_with_checkpoint, tmp_path):
    out = tmp_path / "resumed.npz"
    command = [
        sys.executable,
        os.path.join(HERE, "multihost_worker.py"),
        "resume",
        "--checkpoint",
        str(run_with_checkpoint["directory"]),
        "--out",
        str(out),
    ]
    # subprocess.run kills the child if it outlives the timeout.
    done = subprocess.run(command, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    resumed = np.load(out)
    assert int(resumed["restored_step"]) == SAVE_STEP
    want = jax.tree_util.tree_leaves(run_with_checkpoint["final"])
    assert len(resumed.files) == len(want) + 2
    for i, leaf in enumerate(want):
        got = resumed[f"arr_{i}"]
        assert got.dtype == leaf.dtype and got.shape == leaf.shape
        np.testing.assert_array_equal(got, leaf, strict=True)  # bitwise
    np.testing.assert_array_equal(resumed["losses"], run_with_checkpoint["losses"][SAVE_STEP:])


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule,options", [("interleaved_1f1b", {"virtual_stages": 2}), ("zbv", {})]
)
def test_restore_into_another_layout_and_continue(run_with_checkpoint, schedule, options):
    """Saved with S = 4 (1f1b, devices 0-3, layout [1, 4]), restored into S = 2 with two
    stages per device (devices 4-5, layout [2, 2]; interleaved or V placement): the same
    logical stages, another mesh, layout and sharding. Training continues with the same
    losses."""
    mesh = worker.make_mesh((2,), ("pipe",), devices=jax.devices()[4:6])
    pipe = worker.make_pipeline(mesh, schedule, options)
    assert pipe.num_logical_stages == worker.NUM_LOGICAL_STAGES
    template = worker.shard_state(pipe, *worker.initial_state(pipe.num_logical_stages))
    target = checkpoint.abstract(template)
    state = checkpoint.restore(run_with_checkpoint["directory"], target=target, pipeline=pipe)

    assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(template)
    for got, want in zip(
        jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(target), strict=True
    ):
        assert got.sharding == want.sharding
        assert set(got.sharding.device_set) <= set(jax.devices()[4:6])
    jax.tree_util.tree_map(
        lambda got, want: np.testing.assert_array_equal(np.asarray(got), want, strict=True),
        _logical(pipe, state),
        run_with_checkpoint["saved"],
    )

    _, losses = worker.train(
        mesh,
        schedule,
        options,
        worker.RESUME_STEPS - SAVE_STEP,
        state,
        first_step=SAVE_STEP,
    )
    np.testing.assert_allclose(losses, run_with_checkpoint["losses"][SAVE_STEP:], rtol=1e-6)


@pytest.mark.slow
def test_restore_into_another_number_of_stages_says_what_it_holds(run_with_checkpoint):
    pipe = worker.make_pipeline(worker.make_mesh((2,), ("pipe",)), "1f1b")
    target = checkpoint.abstract(worker.shard_state(pipe, *worker.initial_state(2)))
    with pytest.raises(
        ValueError,
        match=r"holds 4 logical stages \(schedule '1f1b', S=4, v=1\), but the target's placed "
        r"trees have 2 \(schedule '1f1b', S=2, v=1\); use a schedule and S with S\*v = 4, "
        r"or, if every stage is a stack of identical blocks .*recut=True",
    ):
        checkpoint.restore(run_with_checkpoint["directory"], target=target, pipeline=pipe)


def _logical(pipe, state):
    """``state`` with its placed trees (`jaxpipe.layout.Placed`) in logical order."""
    return jax.tree_util.tree_map(
        lambda x: pipe.logical(x) if layout.is_placed(x) else x, state, is_leaf=layout.is_placed
    )


def _small_state(width):
    mesh = worker.make_mesh((4,), ("pipe",))
    stage_params, loss_params = worker.initial_state(width=width)
    return worker.shard_state(worker.make_pipeline(mesh), stage_params, loss_params)


def test_checkpoint_from_a_different_model_names_the_leaf_and_both_shapes(tmp_path):
    checkpoint.save(tmp_path, 1, _small_state(width=8))
    target = checkpoint.abstract(_small_state(width=6))
    with pytest.raises(
        ValueError,
        match=r"checkpoint from a different model \(.*, step 1\): leaf \['opt'\]\[0\]\['mu'\]"
        r"\[0\]\['b1'\] has shape \(4, 16\) in the checkpoint but \(4, 12\) in the target",
    ):
        checkpoint.restore(tmp_path, target=target)


def test_saving_with_a_pipeline_of_another_stage_count_is_refused(tmp_path):
    """State placed for 4 logical stages (1f1b on pipe 4) saved with ``pipeline=`` a zbv
    pipeline (8 logical stages) would record 8 and be refused by the restore that fits it:
    refused at the save, naming both counts."""
    mesh = worker.make_mesh((4,), ("pipe",))
    zbv = worker.make_pipeline(mesh, "zbv", {})
    with pytest.raises(ValueError, match=r"4 logical stages, but pipeline= runs 8 \('zbv'"):
        checkpoint.save(tmp_path, 1, _small_state(width=8), pipeline=zbv)
    assert checkpoint.latest_step(tmp_path) is None


def test_missing_checkpoint_and_step(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint under"):
        checkpoint.restore(tmp_path / "nothing")
    assert checkpoint.latest_step(tmp_path / "nothing") is None
    state = {"w": np.arange(6.0, dtype=np.float32).reshape(2, 3)}
    checkpoint.save(tmp_path, 2, state)
    assert checkpoint.latest_step(tmp_path) == 2
    with pytest.raises(FileNotFoundError, match=r"no step 5 .*saved steps: \[2\]"):
        checkpoint.restore(tmp_path, 5)
    with pytest.raises(ValueError, match="step 2 already exists"):
        checkpoint.save(tmp_path, 2, state)
    mesh = worker.make_mesh((2,), ("pipe",))
    restored = checkpoint.restore(tmp_path, target=state, mesh=mesh)
    np.testing.assert_array_equal(restored["w"], state["w"], strict=True)


def test_nnx_state_with_optax_moments_restores_under_another_schedule(tmp_path):
    """Stage parameters as an ``nnx.State`` of ``nnx.Param`` (each Variable stored with its
    value, as orbax writes it) and adam moments of the same structure, saved from ``1f1b``
    and restored into ``gpipe``: the same values."""
    import optax
    from flax import nnx

    import jaxpipe

    mesh = jax.make_mesh((2,), ("pipe",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])  # fmt: skip

    def make(schedule):
        return jaxpipe.Pipeline(lambda p, x: x, None, mesh=mesh, schedule=schedule,
                                num_microbatches=2)  # fmt: skip

    pipe = make("1f1b")
    params = pipe.init(lambda k: nnx.state(nnx.Linear(4, 4, rngs=nnx.Rngs(k)), nnx.Param),
                       jax.random.key(0))  # fmt: skip
    opt_state = optax.adam(1e-2).init(params)
    checkpoint.save(tmp_path / "run", 3, (params, opt_state), pipeline=pipe)
    target = checkpoint.abstract((params, opt_state))
    restored = checkpoint.restore(tmp_path / "run", 3, target=target, pipeline=make("gpipe"))
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves((params, opt_state)),
                         strict=True):  # fmt: skip
        np.testing.assert_array_equal(got, want)
        if want.ndim:  # the layout (adam's count, on one device, comes back replicated)
            assert got.sharding == want.sharding


# ------------------------------------------- resuming under another number of stages
BLOCKS, WIDTH, STEPS = 8, 8, 2


def _blocks_stage(p, x):
    """A stage: its blocks (``p["w"]`` is ``[B, WIDTH, WIDTH]``) one after another."""
    for w, b in zip(p["w"], p["b"], strict=True):
        x = x + jnp.tanh(x @ w + b)
    return x


def _mse(_, y, target):
    return jnp.mean((y - target) ** 2)


def _blocks_pipeline(schedule, num_microbatches=4, **options):
    mesh = jax.make_mesh((4,), ("pipe",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:4])  # fmt: skip
    return jaxpipe.Pipeline(
        _blocks_stage,
        _mse,
        mesh=mesh,
        schedule=schedule,
        num_microbatches=num_microbatches,
        schedule_options=options,
    )


def _adam_steps(pipe, state, first, steps):
    optimizer = optax.adam(1e-2)

    @jax.jit
    def step(state, x, t):
        loss, grads = jax.value_and_grad(pipe.loss)(state["params"], None, x, t)
        updates, opt = optimizer.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    losses = []
    for i in range(first, first + steps):
        rng = np.random.default_rng(i)
        x = jnp.asarray(rng.standard_normal((16, WIDTH)), jnp.float32)
        state, loss = step(state, x, jnp.sin(x))
        losses.append(float(loss))
    return state, losses


@pytest.mark.slow
def test_a_1f1b_run_of_4_stages_resumes_under_zbv_with_8_stages_by_recut(tmp_path):
    """8 blocks: 1f1b on 4 devices holds 4 stages of 2, zbv on the same devices 8 of 1.
    Saved from 1f1b after 2 Adam steps and restored into zbv with ``recut=True``: the
    restored parameters and moments are the saved blocks exactly, and 2 more steps give the
    losses of 2 more 1f1b steps."""
    rng = np.random.default_rng(0)
    blocks = {"w": rng.standard_normal((BLOCKS, WIDTH, WIDTH)) / np.sqrt(WIDTH),
              "b": 0.1 * rng.standard_normal((BLOCKS, WIDTH))}  # fmt: skip
    blocks = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), blocks)
    one_f_one_b, zbv = _blocks_pipeline("1f1b"), _blocks_pipeline("zbv")
    params = one_f_one_b.place(layout.recut(jax.tree.map(lambda a: a[None], blocks), 4))
    state = {"params": params, "opt": optax.adam(1e-2).init(params)}
    state, _ = _adam_steps(one_f_one_b, state, 0, STEPS)
    checkpoint.save(tmp_path, STEPS, state, pipeline=one_f_one_b)
    _, want = _adam_steps(one_f_one_b, state, STEPS, STEPS)

    target = {"params": zbv.place(layout.recut(jax.tree.map(lambda a: a[None], blocks), 8))}
    target["opt"] = optax.adam(1e-2).init(target["params"])
    with pytest.raises(ValueError, match=r"holds 4 logical stages.*have 8.*recut=True"):
        checkpoint.restore(tmp_path, target=checkpoint.abstract(target), pipeline=zbv)
    restored = checkpoint.restore(tmp_path, target=checkpoint.abstract(target), pipeline=zbv,
                                  recut=True)  # fmt: skip
    assert restored["params"].order == zbv.layout.order
    for tree in ("params", "opt"):
        got = jax.tree.map(lambda x: zbv.logical(x) if layout.is_placed(x) else x,
                           restored[tree], is_leaf=layout.is_placed)  # fmt: skip
        saved = jax.tree.map(
            lambda x: layout.recut(one_f_one_b.logical(x), 8) if layout.is_placed(x) else x,
            state[tree], is_leaf=layout.is_placed)  # fmt: skip
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b, strict=True), got, saved)
    _, losses = _adam_steps(zbv, restored, STEPS, STEPS)
    np.testing.assert_allclose(losses, want, rtol=1e-5)


def test_restored_without_pipeline_placed_trees_land_in_the_targets_own_layout(tmp_path):
    """Saved from interleaved_1f1b (v = 2) without ``pipeline=``, restored into a zbv
    state (the same shapes, [2, 4, ...], another order) without ``pipeline=``: zbv's order,
    the same logical stages. A bare [2, 4, ...] target, which names no order, is refused."""
    interleaved = _blocks_pipeline("interleaved_1f1b", 8, virtual_stages=2)
    zbv = _blocks_pipeline("zbv", 8)
    rng = np.random.default_rng(1)
    logical = {"w": jnp.asarray(rng.standard_normal((8, 1, WIDTH, WIDTH)), jnp.float32)}
    params = interleaved.place(logical)
    state = {"params": params, "opt": optax.adam(1e-2).init(params)}
    checkpoint.save(tmp_path, 1, state)
    assert checkpoint.info(tmp_path)["num_logical_stages"] == 8

    template = zbv.place(jax.tree.map(jnp.zeros_like, logical))
    template = {"params": template, "opt": optax.adam(1e-2).init(template)}
    restored = checkpoint.restore(tmp_path, target=checkpoint.abstract(template))
    assert restored["params"].order == zbv.layout.order != params.order
    np.testing.assert_array_equal(zbv.logical(restored["params"])["w"], logical["w"])
    np.testing.assert_array_equal(restored["params"]["w"].sharding.spec[:2], (None, "pipe"))
    assert restored["opt"][0].mu.order == zbv.layout.order
    into_zbv = checkpoint.restore(tmp_path, target=checkpoint.abstract(state), pipeline=zbv)
    assert into_zbv["params"].order == zbv.layout.order  # pipeline= decides
    np.testing.assert_array_equal(zbv.logical(into_zbv["params"])["w"], logical["w"])

    bare = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), template["params"].tree)
    message = r"leaf \['params'\]\['w'\] in logical stage order, shape \(8, 1, 8, 8\), as a stage"
    with pytest.raises(ValueError, match=message + r".*bare arrays \(2, 4, 1, 8, 8\) \(\[v, S"):
        checkpoint.restore(tmp_path, target={"params": bare, "opt": template["opt"]},
                           mesh=zbv.mesh)  # fmt: skip


def test_a_leaf_shaped_like_a_stage_leaf_but_not_split_over_pipe_keeps_its_sharding(tmp_path):
    """With a pipeline that takes bare arrays (1f1b), a leaf ``[1, S, ...]`` of the loss's
    parameters, replicated (a positional table, say), is not a stage leaf: saved and
    restored into gpipe (the same stages, other ticks) it keeps its values and its
    replicated sharding, where the stage leaf keeps its split over pipe."""
    one_f_one_b, gpipe = _blocks_pipeline("1f1b"), _blocks_pipeline("gpipe")
    rng = np.random.default_rng(2)
    params = one_f_one_b.place({"w": jnp.asarray(rng.standard_normal((4, 1, WIDTH, WIDTH)))})
    replicated = jax.sharding.NamedSharding(one_f_one_b.mesh, jax.sharding.PartitionSpec())
    table = jax.device_put(jnp.asarray(rng.standard_normal((1, 4, 5)), jnp.float32), replicated)
    state = {"params": params, "loss": {"table": table}}
    checkpoint.save(tmp_path, 1, state, pipeline=one_f_one_b)
    restored = checkpoint.restore(tmp_path, target=checkpoint.abstract(state), pipeline=gpipe)
    np.testing.assert_array_equal(restored["loss"]["table"], table, strict=True)
    assert restored["loss"]["table"].sharding.is_equivalent_to(replicated, 3)
    stage = jax.tree.leaves(restored["params"])[0]
    assert tuple(stage.sharding.spec)[:2] == (None, "pipe")
    np.testing.assert_array_equal(
        gpipe.logical(restored["params"])["w"], one_f_one_b.logical(params)["w"]
    )


def test_an_optimizer_state_without_arrays_is_saved_restored_and_moved(tmp_path):
    """Plain SGD's state holds no arrays: saved with or without ``pipeline=``, restored into
    another layout (as a `Placed` of that layout), and moved by ``place``, beside the
    parameters, which arrive in their logical order."""
    interleaved = _blocks_pipeline("interleaved_1f1b", 8, virtual_stages=2)
    zbv = _blocks_pipeline("zbv", 8)
    logical = {"w": jnp.asarray(np.random.default_rng(3).standard_normal((8, 1, WIDTH, WIDTH)))}
    params = interleaved.place(logical)
    state = {"params": params, "opt": interleaved.init_optimizer(optax.sgd(0.1), params)}
    assert jax.tree.leaves(state["opt"]) == []
    checkpoint.save(tmp_path, 1, state)
    checkpoint.save(tmp_path, 2, state, pipeline=interleaved)
    template = zbv.place(jax.tree.map(jnp.zeros_like, logical))
    target = {"params": template, "opt": zbv.init_optimizer(optax.sgd(0.1), template)}
    for step, extra in ((1, {}), (2, {"pipeline": zbv})):
        restored = checkpoint.restore(tmp_path, step, target=checkpoint.abstract(target), **extra)
        assert restored["opt"].order == zbv.layout.order
        assert jax.tree.structure(restored["opt"].tree) == jax.tree.structure(state["opt"].tree)
        np.testing.assert_array_equal(zbv.logical(restored["params"])["w"], logical["w"])
    assert zbv.place(state["opt"]).order == zbv.layout.order


def test_restoring_into_other_dtypes_warns_naming_the_leaves_and_both_dtypes(tmp_path):
    """bfloat16 parameters and loss parameters restored into a float32 target: converted
    exactly (float32 holds every bfloat16), with a warning naming each leaf and both dtypes;
    restored into their own dtypes: no warning."""
    interleaved = _blocks_pipeline("interleaved_1f1b", 8, virtual_stages=2)
    rng = np.random.default_rng(4)
    logical = {"w": jnp.asarray(rng.standard_normal((8, 1, WIDTH, WIDTH)), jnp.bfloat16)}
    head = jnp.asarray(rng.standard_normal((WIDTH, 3)), jnp.bfloat16)
    state = {"params": interleaved.place(logical), "head": head}
    checkpoint.save(tmp_path, 1, state, pipeline=interleaved)
    wide = checkpoint.abstract(jax.tree.map(lambda a: a.astype(jnp.float32), state))
    with pytest.warns(UserWarning, match=r"step 1 holds 2 leaves in another dtype than the ") as w:
        restored = checkpoint.restore(tmp_path, target=wide, pipeline=interleaved)
    assert len(w) == 1
    assert "['head'] bfloat16 -> float32, ['params']['w'] bfloat16 -> float32" in str(w[0].message)
    assert restored["head"].dtype == restored["params"]["w"].dtype == jnp.float32
    np.testing.assert_array_equal(restored["head"], head.astype(jnp.float32), strict=True)
    got = interleaved.logical(restored["params"])["w"]
    np.testing.assert_array_equal(got, logical["w"].astype(jnp.float32), strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same = checkpoint.restore(tmp_path, target=checkpoint.abstract(state), pipeline=interleaved)
    np.testing.assert_array_equal(same["head"], head, strict=True)
    np.testing.assert_array_equal(
        interleaved.logical(same["params"])["w"], logical["w"], strict=True
    )


def test_bare_state_restored_with_pipeline_says_what_was_given_and_what_to_do(tmp_path):
    """Bare ``[1, S, ...]`` arrays saved without ``pipeline=`` are held as they are; a
    pipeline that reads bare arrays as its stage leaves would place them from logical
    order: refused, naming the leaf and the fix, which restores them."""
    one_f_one_b = _blocks_pipeline("1f1b")
    rng = np.random.default_rng(5)
    logical = {"w": jnp.asarray(rng.standard_normal((4, 1, WIDTH, WIDTH)), jnp.float32)}
    bare = {"params": one_f_one_b.place(logical).tree}
    checkpoint.save(tmp_path, 1, bare)
    with pytest.raises(
        ValueError,
        match=r"holds arrays as they were \(no placed trees\): it was saved without pipeline=, "
        r"from bare arrays\. With pipeline=, the target's bare \[v, S, \.\.\.\] leaves split "
        r"over the pipe axis \(\['params'\]\['w'\], \.\.\.\) .*Restore it without pipeline=",
    ):
        checkpoint.restore(tmp_path, target=checkpoint.abstract(bare), pipeline=one_f_one_b)
    restored = checkpoint.restore(tmp_path, target=checkpoint.abstract(bare))
    np.testing.assert_array_equal(restored["params"]["w"], bare["params"]["w"], strict=True)
