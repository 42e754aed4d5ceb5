"""Small models shared by the executor tests: a residual MLP stage with layer norm."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe import reference

WIDTH = 8
OUT = 3


def stage_fn(p, x):
    """One residual block: x + W2 tanh(W1 layernorm(x) + b1)."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.var(x, axis=-1, keepdims=True)
    h = (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"]
    return x + jnp.tanh(h @ p["w1"] + p["b1"]) @ p["w2"]


def loss_fn(lp, y, target):
    """Mean squared error of a linear head."""
    return jnp.mean((y @ lp["head"] - target) ** 2)


def numpy_rng(key) -> np.random.Generator:
    """A NumPy generator seeded by a JAX key's data: test data drawn with it cost no XLA
    compilation (threefry's bits compile once per array shape, and the tests use many)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return np.random.default_rng(np.asarray(key).ravel().tolist())


def init(key, num_stages, width=WIDTH):
    """Random stage params with a leading stage axis, loss params, distinct per stage."""
    normal = numpy_rng(key).standard_normal
    stage_params = {
        "scale": 1.0 + 0.1 * normal((num_stages, width)),
        "w1": normal((num_stages, width, 2 * width)) / np.sqrt(width),
        "b1": 0.1 * normal((num_stages, 2 * width)),
        "w2": normal((num_stages, 2 * width, width)) / np.sqrt(2 * width),
    }
    loss_params = {"head": normal((width, OUT)) / np.sqrt(width)}
    return float32((stage_params, loss_params))


def data(key, batch, width=WIDTH):
    normal = numpy_rng(key).standard_normal
    return float32((normal((batch, width)), normal((batch, OUT))))


def batch(key, rows, width=WIDTH):
    """`data` as the dict ``{"inputs", "targets"}`` of one training step."""
    inputs, targets = data(key, rows, width)
    return {"inputs": inputs, "targets": targets}


def float32(tree):
    """NumPy arrays -> float32 JAX arrays."""
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), tree)


@functools.partial(jax.jit, static_argnames="num_microbatches")
def sequential_loss(stage_params, loss_params, inputs, targets, num_microbatches):
    """The plain reference: stages one after another, mean of the loss over micro-batches.
    Jitted: run eagerly, every call traced and compiled its scans again."""
    return reference.loss(
        stage_fn, loss_fn, stage_params, loss_params, inputs, targets, num_microbatches
    )


@jax.jit
def sequential_forward(stage_params, inputs):
    """The plain reference's outputs: stages one after another."""
    num_stages = jax.tree_util.tree_leaves(stage_params)[0].shape[0]
    h = inputs
    for s in range(num_stages):
        h = stage_fn(jax.tree_util.tree_map(lambda a, s=s: a[s], stage_params), h)
    return h


def pipe_mesh(num_stages, extra=()):
    """A mesh with a ``pipe`` axis of ``num_stages`` host devices (Auto axis types)."""
    shape = (num_stages,) + tuple(n for _, n in extra)
    names = ("pipe",) + tuple(a for a, _ in extra)
    count = 1
    for n in shape:
        count *= n
    return jax.make_mesh(
        shape,
        names,
        axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
        devices=jax.devices()[:count],
    )


def relative_error(a, b):
    """Largest relative error (by norm) over the leaves of two pytrees."""
    errs = jax.tree_util.tree_map(
        lambda x, y: float(jnp.linalg.norm(x - y) / (jnp.linalg.norm(y) + 1e-30)), a, b
    )
    return max(jax.tree_util.tree_leaves(errs))


def on_mesh(tree, mesh):
    """``tree`` with every leaf not yet on ``mesh`` put there, replicated: how a jitted step
    over arrays on the mesh returns such leaves (a loss head, Adam's step count), so that the
    step's second call finds them where its first left them and does not compile again."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def put(leaf):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh == mesh:
            return leaf
        return jax.device_put(leaf, replicated)

    return jax.tree_util.tree_map(put, tree)
