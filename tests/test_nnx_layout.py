"""An NNX model that holds its placed stage parameters keeps their layout: a pipeline of
another layout refuses them, a `jaxpipe.Placed` wrapped around them by hand cannot claim
another layout, `place` re-lays them out; `jaxpipe.layout.block_mask` decides optax masks
from each stage leaf's per-block shape."""

import jax
import jax.numpy as jnp
import models
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpipe

S, M, WIDTH, ROWS = 2, 4, 8, 8


class Block(nnx.Module):
    def __init__(self, width, rngs):
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 2 * width, rngs=rngs)
        self.down = nnx.Linear(2 * width, width, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(self.norm(x))))


class Model(nnx.Module):
    """Blocks stacked on a leading stage axis (logical order), and a final norm."""

    def __init__(self, num_stages, rngs):
        @nnx.split_rngs(splits=num_stages)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs):
            return Block(WIDTH, rngs)

        self.blocks = make_blocks(rngs)
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)


def _pipes():
    mesh = models.pipe_mesh(S)
    block_def = nnx.graphdef(Model(S, nnx.Rngs(0)).blocks)

    def stage_fn(p, x):
        return nnx.merge(block_def, p)(x)

    def loss_fn(_, y, t):
        return jnp.mean((y - t) ** 2)

    def pipe(schedule, **options):
        return jaxpipe.Pipeline(
            stage_fn, loss_fn, mesh=mesh, schedule=schedule, num_microbatches=M,
            schedule_options=options,
        )  # fmt: skip

    return pipe("interleaved_1f1b", virtual_stages=2), pipe("zbv"), block_def


def _plain_loss(logical_blocks, block_def, x, t):
    """The blocks applied in logical order to the whole batch, without a pipeline."""
    for s in range(2 * S):
        x = nnx.merge(block_def, jax.tree.map(lambda a, s=s: a[s], logical_blocks))(x)
    return jnp.mean((x - t) ** 2)


def _placed_model(pipe):
    """A model whose blocks ``pipe`` placed, its logical blocks (copies), a batch."""
    model = Model(2 * S, nnx.Rngs(0))
    logical = jax.tree.map(jnp.copy, nnx.state(model.blocks, nnx.Param))  # not the module's
    nnx.update(model.blocks, pipe.place(logical))
    keys = jax.random.split(jax.random.key(1))
    x, t = (jax.random.normal(k, (ROWS, WIDTH)) for k in keys)
    return model, logical, x, t


def test_a_module_placed_for_one_layout_is_refused_by_another_even_wrapped_in_placed():
    interleaved, zbv, _ = _pipes()
    assert interleaved.layout.order != zbv.layout.order
    assert interleaved.layout.order.shape == zbv.layout.order.shape == (2, S)
    model, logical, x, t = _placed_model(interleaved)
    blocks = nnx.state(model.blocks, nnx.Param)
    assert blocks["up"]["kernel"].shape == (2, S, WIDTH, 2 * WIDTH)
    # zbv keeps leaves of the same shapes in another order: refused, with the fix ...
    with pytest.raises(ValueError, match=r"placed for another layout.*nnx\.update\(module"):
        zbv.loss(blocks, None, x, t)
    # ... also when the state is wrapped in a Placed that claims zbv's order by hand
    with pytest.raises(ValueError, match=r"Placed.*around NNX variables that pipe.place put"):
        zbv.loss(jaxpipe.Placed(blocks, zbv.layout.order), None, x, t)
    # and a Placed around a module's values that no pipeline placed (a hand reshape)
    reshaped = jax.tree.map(lambda a: a.reshape(2, S, *a.shape[1:]), logical)
    with pytest.raises(ValueError, match="record no layout"):
        zbv.loss(jaxpipe.Placed(reshaped, zbv.layout.order), None, x, t)
    with pytest.raises(ValueError, match="mixes NNX variables placed for two layouts"):
        zbv.loss({"a": blocks, "b": zbv.place(logical)}, None, x, t)
    with pytest.raises(ValueError, match="variables that record no layout"):
        interleaved.loss({"a": blocks, "b": reshaped}, None, x, t)


@pytest.mark.slow
def test_a_module_relaid_out_by_place_trains_exactly_under_the_other_layout():
    interleaved, zbv, block_def = _pipes()
    model, logical, x, t = _placed_model(interleaved)
    plain_loss, plain_grads = jax.value_and_grad(_plain_loss)(logical, block_def, x, t)
    nnx.update(model.blocks, zbv.place(nnx.state(model.blocks, nnx.Param)))

    def loss(model):  # the module's state, bare: its variables say where they were placed
        return zbv.loss(nnx.state(model.blocks, nnx.Param), None, x, t)

    value, grads = nnx.value_and_grad(loss)(model)
    np.testing.assert_allclose(value, plain_loss, rtol=1e-5)
    grads = nnx.state(grads, nnx.Param)["blocks"]
    assert models.relative_error(zbv.logical(grads), plain_grads) < 1e-5
    back = zbv.logical(nnx.state(model.blocks, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, back, logical)  # structure too: no record


def test_block_mask_decides_on_each_stage_leafs_per_block_shape():
    """Weight decay with ``x.ndim > 1`` decided per block: the kernels of the placed
    blocks and the model's own matrices decay, norm scales and biases do not; one AdamW
    step on the placed model equals one on the logical model with the plain mask."""
    _, zbv, _ = _pipes()
    model = Model(2 * S, nnx.Rngs(0))
    model.head = nnx.Linear(WIDTH, 3, rngs=nnx.Rngs(1))
    logical = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    nnx.update(model.blocks, zbv.place(nnx.state(model.blocks, nnx.Param)))
    params = nnx.state(model, nnx.Param)

    decay = jaxpipe.layout.block_mask(lambda x: x.ndim > 1)(params)
    one_block = nnx.state(Block(WIDTH, nnx.Rngs(0)), nnx.Param)
    want = {
        "blocks": jax.tree.map(lambda x: x.ndim > 1, one_block),
        "norm": {"scale": False, "bias": False},
        "head": {"kernel": True, "bias": False},
    }
    got = nnx.to_pure_dict(decay)
    assert got == nnx.to_pure_dict(nnx.State(want))
    assert got["blocks"]["up"] == {"kernel": True, "bias": False}
    assert not any(jax.tree.leaves(got["blocks"]["norm"]))
    # x.ndim > 1 on the stacked leaves would have decayed everything in the blocks
    assert all(jax.tree.leaves(jax.tree.map(lambda x: x.ndim > 1, params["blocks"])))

    grads = jax.tree.map(lambda a: jnp.full_like(a, 0.5), params)
    logical_grads = jax.tree.map(lambda a: jnp.full_like(a, 0.5), logical)
    optimizer = optax.adamw(0.1, weight_decay=0.5, mask=jaxpipe.layout.block_mask(
        lambda x: x.ndim > 1))  # fmt: skip
    plain = optax.adamw(0.1, weight_decay=0.5, mask=lambda p: jax.tree_util.tree_map_with_path(
        lambda path, x: x.ndim > (2 if path[0].key == "blocks" else 1), p))  # fmt: skip

    def step(optimizer, grads, params):
        updates, _ = optimizer.update(grads, optimizer.init(params), params)
        return optax.apply_updates(params, updates)

    stepped = jax.jit(step, static_argnums=0)(optimizer, grads, params)
    want_params = jax.jit(step, static_argnums=0)(plain, logical_grads, logical)
    assert models.relative_error(zbv.logical(stepped["blocks"]), want_params["blocks"]) < 1e-6
    assert models.relative_error(stepped["head"], want_params["head"]) < 1e-6

    # a Placed dict of stages that each stack two blocks: block_axes=1
    stacked = zbv.place({"w": jnp.ones((2 * S, 2, 3, 3)), "b": jnp.ones((2 * S, 2, 3))})
    mask = jaxpipe.layout.block_mask(lambda x: x.ndim > 1, block_axes=1)(stacked)
    assert isinstance(mask, jaxpipe.Placed) and dict(mask.tree) == {"w": True, "b": False}


@pytest.mark.slow
def test_a_module_state_saved_under_one_layout_restores_into_another(tmp_path):
    """A module's state (bare, its variables recording the interleaved layout) goes to the
    checkpoint in logical order and comes back into a zbv-placed module's state: zbv's
    placement of the same logical values, recording zbv's layout."""
    from jaxpipe import checkpoint

    interleaved, zbv, _ = _pipes()
    model, logical, _, _ = _placed_model(interleaved)
    checkpoint.save(tmp_path / "run", 1, nnx.state(model.blocks, nnx.Param), interleaved)
    other, _, _, _ = _placed_model(zbv)  # the same init, placed for zbv: the target's form
    target = checkpoint.abstract(nnx.state(other.blocks, nnx.Param))
    restored = checkpoint.restore(tmp_path / "run", 1, target=target, pipeline=zbv)
    want = zbv.place(logical).tree
    assert jax.tree.structure(restored) == jax.tree.structure(want)
    jax.tree.map(np.testing.assert_array_equal, restored, want)
    nnx.update(other.blocks, restored)
    jax.tree.map(np.testing.assert_array_equal, zbv.logical(nnx.state(other.blocks)), logical)


def test_recut_refuses_nnx_state_a_pipeline_placed():
    """``recut`` of a module's placed state would read ``[v, S]`` as ``[N, B]`` and regroup
    the blocks out of order (zbv's V): refused, as a `Placed` is, with the fix; the state
    ``pipe.logical`` gives back is recut."""
    _, zbv, _ = _pipes()
    model, logical, _, _ = _placed_model(zbv)
    placed = nnx.state(model.blocks, nnx.Param)
    with pytest.raises(ValueError, match=r"recut\(pipe\.logical\(params\)"):
        jaxpipe.layout.recut(placed, 1)
    regrouped = jaxpipe.layout.recut(jax.tree.map(lambda a: a[:, None], logical), 1)
    kernel = regrouped["up"]["kernel"]
    assert kernel.shape[:2] == (1, 2 * S)
    np.testing.assert_array_equal(kernel[0], logical["up"]["kernel"])


def test_specs_given_to_place_a_module_state_apply_to_its_variables():
    """A module's placed state, moved to another layout or re-placed in its own with specs:
    every variable is split as the specs say and records them; the values are kept."""
    mesh = models.pipe_mesh(S, (("tensor", 2),))
    interleaved, zbv = (
        jaxpipe.Pipeline(lambda p, x: x, lambda _, y, t: jnp.mean(y), mesh=mesh, schedule=name,
                         num_microbatches=M, schedule_options=options)
        for name, options in (("interleaved_1f1b", {"virtual_stages": 2}), ("zbv", {}))
    )  # fmt: skip
    model, logical, _, _ = _placed_model(interleaved)
    for pipe in (interleaved, zbv):
        moved = pipe.place(nnx.state(model.blocks, nnx.Param), P("tensor"))
        for path, variable in jax.tree.leaves_with_path(
            moved, is_leaf=lambda x: isinstance(x, nnx.Variable)
        ):
            order, spec = variable.get_metadata()[jaxpipe.layout.NNX_METADATA]
            assert order == pipe.layout.order and spec == P("tensor"), path
            assert jax.tree.leaves(variable)[0].sharding.spec == P(None, "pipe", "tensor"), path
        jax.tree.map(np.testing.assert_array_equal, pipe.logical(moved), logical)
