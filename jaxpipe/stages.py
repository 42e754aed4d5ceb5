"""Flax modules as pipeline stages: one module per stage, parameters stacked on a stage axis.

```python
import jaxpipe
# NNX: factory(rngs) builds one stage (e.g. a few transformer blocks)
stage_fn, stage_params = jaxpipe.stages.nnx_stage(lambda rngs: Blocks(config, rngs=rngs), key, 8)
# Linen: one module, initialised once per stage
stage_fn, stage_params = jaxpipe.stages.linen_stage(Block(), key, sample_x, 8)
pipe = jaxpipe.Pipeline(stage_fn, loss_fn, mesh=mesh, ...)
params = pipe.place(stage_params)  # the pipeline's device layout
```

Every stage is initialised with its own key (``jax.random.split(key, num_stages)``), so
stages differ. ``stage_params`` is an ordinary pytree whose leaves carry a leading axis of
length ``num_stages`` in logical stage order (an ``nnx.State`` for NNX, a dict for Linen);
``pipe.place`` moves it into the pipeline's device layout.

``stage_fn`` passes on the pipeline's keywords ``key``, ``side`` and ``stage`` that the
module's ``__call__`` names: a module called as ``block(x, key=None)`` gets each stage's and
micro-batch's own dropout key (see `jaxpipe.Pipeline`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.reference import keywords_of

__all__ = ["linen_stage", "nnx_stage", "shard_stage_params", "stage_slice"]


def _check_num_stages(num_stages) -> int:
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(
            f"num_stages must be a positive int, got {num_stages!r}; pass the number of "
            "logical stages, pipeline.num_logical_stages (S * virtual_stages)"
        )
    return num_stages


def _stage_keys(key, num_stages: int):
    typed = hasattr(key, "dtype") and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    raw = hasattr(key, "shape") and key.shape == (2,)
    if not (typed or raw):
        raise TypeError(f"key must be a JAX PRNG key (jax.random.key(0)), got {type(key).__name__}")
    return jax.random.split(key, num_stages)


def nnx_stage(factory: Callable, key, num_stages: int):
    """A stage function and stacked parameters for an NNX module built by ``factory``.

    Args:
        factory: ``factory(nnx.Rngs) -> nnx.Module`` builds one stage's module; it is called
            once per stage (under ``jax.vmap``), each time with the stage's own key.
        key: a JAX PRNG key, split into one key per stage.
        num_stages: the number of logical stages (``pipe.num_logical_stages``).

    Returns:
        ``(stage_fn, stage_params)``: ``stage_fn(p, x) = nnx.merge(graphdef, p)(x)``, passing
        on the keywords ``key``, ``side`` and ``stage`` where the module's ``__call__`` names
        them; ``stage_params`` is the modules' ``nnx.Param`` state stacked along a leading
        stage axis of length ``num_stages``.

    Raises:
        TypeError: ``factory`` is not callable or does not return an ``nnx.Module``, or
            ``key`` is not a PRNG key.
        ValueError: ``num_stages`` is not a positive int, or the module has state other than
            ``nnx.Param`` (batch statistics, RNG streams), refused before any pipeline runs.
    """
    from flax import nnx

    num_stages = _check_num_stages(num_stages)
    if not callable(factory):
        raise TypeError(
            f"factory must be callable as factory(rngs) -> nnx.Module, got {type(factory)}"
        )
    keys = _stage_keys(key, num_stages)

    built = {}

    def build(k):
        module = factory(nnx.Rngs(k))
        if not isinstance(module, nnx.Module):
            raise TypeError(f"factory(rngs) must return an nnx.Module, got {type(module)}")
        built["type"] = type(module)
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        return graphdef, params, rest

    graphdef, _, rest = _build_abstract(build, keys[0])
    if jax.tree_util.tree_leaves(rest):
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(rest)]
        raise ValueError(
            f"the stage module has state other than nnx.Param at {paths[:4]}; jaxpipe stages "
            "hold parameters only. For dropout, build nnx.Dropout without rngs and take a "
            "`key` keyword in the module's __call__ (the pipeline hands each stage and "
            "micro-batch its own key); for normalisation, use nnx.LayerNorm or nnx.RMSNorm "
            "instead of BatchNorm"
        )
    stage_params = jax.vmap(lambda k: build(k)[1])(keys)

    def call(p, x, **keywords):
        return nnx.merge(graphdef, p)(x, **keywords)

    return _forwarding(call, keywords_of(built["type"].__call__)), stage_params


def _forwarding(call: Callable, accepted: set) -> Callable:
    """``stage_fn(params, x, *, <accepted>)`` calling ``call(params, x, **keywords)``.

    Its signature names exactly the keywords the module takes, so the pipeline passes those
    and refuses ``key=``/``side=`` a module could not use.
    """

    def stage_fn(params, x, **keywords):
        return call(params, x, **keywords)

    kind = inspect.Parameter
    stage_fn.__signature__ = inspect.Signature(
        [kind("params", kind.POSITIONAL_OR_KEYWORD), kind("x", kind.POSITIONAL_OR_KEYWORD)]
        + [kind(name, kind.KEYWORD_ONLY, default=None) for name in sorted(accepted)]
    )
    return stage_fn


def _build_abstract(build, key):
    """``build(key)`` without computing arrays: ``(graphdef, params, rest)`` of shapes."""
    out = {}

    def run(k):
        graphdef, params, rest = build(k)
        out["graphdef"] = graphdef
        return params, rest

    params, rest = jax.eval_shape(run, key)
    return out["graphdef"], params, rest


def linen_stage(module, key, sample_x, num_stages: int):
    """A stage function and stacked parameters for a Linen module, initialised once per stage.

    Args:
        module: the ``flax.linen.Module`` of one stage.
        key: a JAX PRNG key, split into one key per stage.
        sample_x: one micro-batch of stage input (an array or ``jax.ShapeDtypeStruct``).
        num_stages: the number of logical stages (``pipe.num_logical_stages``).

    Returns:
        ``(stage_fn, stage_params)``: ``stage_fn(p, x) = module.apply({'params': p}, x)``,
        passing on the keywords ``key``, ``side`` and ``stage`` where the module's
        ``__call__`` names them; ``stage_params`` is ``module.init(k, sample_x)['params']``
        for each stage key, stacked along a leading stage axis.

    Raises:
        TypeError: ``module`` is not a Linen module, ``sample_x`` has no shape and dtype, or
            ``key`` is not a PRNG key.
        ValueError: ``num_stages`` is not a positive int, or the module has no parameters or
            has collections other than ``params`` (``batch_stats``, ...).
    """
    from flax import linen as nn

    num_stages = _check_num_stages(num_stages)
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a flax.linen.Module, got {type(module).__name__}")
    if not hasattr(sample_x, "shape") or not hasattr(sample_x, "dtype"):
        raise TypeError(
            f"sample_x must be an array (one micro-batch of stage input), got {type(sample_x)}"
        )
    keys = _stage_keys(key, num_stages)
    x = jax.ShapeDtypeStruct(sample_x.shape, sample_x.dtype)
    variables = jax.eval_shape(module.init, keys[0], x)
    others = sorted(set(variables) - {"params"})
    if others:
        raise ValueError(
            f"the stage module has variable collections {others} besides 'params'; jaxpipe "
            "stages hold parameters only: remove them (e.g. use LayerNorm instead of BatchNorm)"
        )
    if "params" not in variables:
        raise ValueError("the stage module has no parameters ('params' collection is empty)")

    def init_one(k):
        return module.init(k, jax.numpy.zeros(x.shape, x.dtype))["params"]

    stage_params = jax.jit(jax.vmap(init_one))(keys)

    def call(p, x, **keywords):
        return module.apply({"params": p}, x, **keywords)

    return _forwarding(call, keywords_of(type(module).__call__)), stage_params


def shard_stage_params(stage_params, mesh: jax.sharding.Mesh, axis: str = "pipe"):
    """Stacked stage parameters with the leading stage axis sharded over ``axis``.

    For more (e.g. a hidden dimension over ``tensor``), ``jax.device_put`` a leaf with
    ``NamedSharding(mesh, P(axis, ..., 'tensor'))`` yourself: the pipeline keeps it.

    Args:
        stage_params: a pytree whose leaves have a leading stage axis.
        mesh: the mesh holding ``axis``.
        axis: the mesh axis the stage axis is split over.

    Returns:
        ``stage_params`` put on ``mesh``, the stage axis split over ``axis`` and every other
        axis replicated.

    Raises:
        TypeError: ``mesh`` is not a ``jax.sharding.Mesh``.
        ValueError: ``mesh`` has no axis ``axis``, or a leaf's leading axis is not a multiple
            of its size.
    """
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.shape:
        raise ValueError(f"mesh has axes {tuple(mesh.shape)} but no axis named {axis!r}")
    size = mesh.shape[axis]
    for path, leaf in jax.tree_util.tree_leaves_with_path(stage_params):
        if jax.numpy.ndim(leaf) == 0 or leaf.shape[0] % size:
            raise ValueError(
                f"stage_params leaf {jax.tree_util.keystr(path)} has shape "
                f"{jax.numpy.shape(leaf)}; its leading stage axis must be a multiple of the "
                f"{axis!r} axis size {size}"
            )
    sharding = NamedSharding(mesh, P(axis))
    return jax.device_put(stage_params, sharding)


def stage_slice(stage_params, stage: int):
    """The parameters of one stage.

    Args:
        stage_params: a pytree whose leaves have a leading stage axis.
        stage: the index on that axis.

    Returns:
        ``stage_params`` with every leaf indexed at ``[stage]``.
    """
    return jax.tree_util.tree_map(lambda a: a[stage], stage_params)
