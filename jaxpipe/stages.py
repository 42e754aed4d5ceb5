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
micro-batch's own dropout key (see `jaxpipe.Pipeline`). A module with further inputs
(positions, masks) takes them from the pipeline's side inputs, a dict unpacked into keywords
(``side_keywords=True``), and a module that comes with weights takes them as ``params=``.

Stages of several blocks: `stack_blocks` stacks per-block weights into leaves
``[num_stages, blocks_per_stage, ...]`` (`unstack_blocks` is its inverse), and `blocks`
makes the stage function that runs a stage's blocks in order, each with the function of its
kind (Gemma's local and global attention blocks), for any number of stages.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.reference import keywords_of

__all__ = [
    "blocks",
    "linen_stage",
    "nnx_stage",
    "shard_stage_params",
    "stack_blocks",
    "stage_slice",
    "unstack_blocks",
]


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


def nnx_stage(
    factory: Callable,
    key,
    num_stages: int,
    *,
    params=None,
    side_keywords: bool = False,
    output: Callable | None = None,
):
    """A stage function and stacked parameters for an NNX module built by ``factory``.

    Args:
        factory: ``factory(nnx.Rngs) -> nnx.Module`` builds one stage's module. It runs
            traced, never on concrete values: once under ``jax.eval_shape`` for the module's
            structure and, without ``params``, once under ``jax.vmap`` over the stage keys
            (so each stage is built from its own key), not once per stage; an array it
            stores outside an ``nnx.Variable`` is refused.
        key: a JAX PRNG key, split into one key per stage (unused, may be None, with
            ``params``).
        num_stages: the number of logical stages (``pipe.num_logical_stages``).
        params: existing weights instead of fresh ones: the modules' ``nnx.Param`` state
            with a leading stage axis of length ``num_stages`` (`stack_blocks` builds it from
            per-stage or per-block states); checked against the module's own structure,
            shapes and dtypes (its ``param_dtype``).
        side_keywords: call the module as ``module(x, **side)``: the pipeline's side inputs,
            a dict, are the module's further inputs by name (positions, masks).
        output: picks the stage's output from what the module returns, for modules that
            return more than the activations (Gemma's ``Block`` returns ``(cache, x)``:
            ``output=lambda out: out[1]``).

    Returns:
        ``(stage_fn, stage_params)``: ``stage_fn(p, x) = nnx.merge(graphdef, p)(x)``, passing
        on the keywords ``key``, ``side`` and ``stage`` where the module's ``__call__`` names
        them (``side`` unpacked with ``side_keywords``); ``stage_params`` is the modules'
        ``nnx.Param`` state stacked along a leading stage axis of length ``num_stages``
        (``params`` where given).

    Raises:
        TypeError: ``factory`` is not callable or does not return an ``nnx.Module``, or
            ``key`` is not a PRNG key.
        ValueError: ``num_stages`` is not a positive int, the module has state other than
            ``nnx.Param`` (batch statistics, RNG streams) or holds arrays outside
            ``nnx.Variable`` s, refused before any pipeline runs, or ``params`` do not fit
            the module.
    """
    from flax import nnx

    num_stages = _check_num_stages(num_stages)
    if not callable(factory):
        raise TypeError(
            f"factory must be callable as factory(rngs) -> nnx.Module, got {type(factory)}"
        )
    keys = _stage_keys(key, num_stages) if params is None else [jax.random.key(0)]

    built = {}

    def build(k):
        module = factory(nnx.Rngs(k))
        if not isinstance(module, nnx.Module):
            raise TypeError(f"factory(rngs) must return an nnx.Module, got {type(module)}")
        built["type"] = type(module)
        _refuse_bare_arrays(module, nnx)
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        return graphdef, params, rest

    graphdef, abstract, rest = _build_abstract(build, keys[0])
    if jax.tree_util.tree_leaves(rest):
        raise ValueError(_other_state_message(rest, nnx))
    if params is None:
        stage_params = jax.vmap(lambda k: build(k)[1])(keys)
    else:
        stage_params = _check_given(params, abstract, num_stages, "module's nnx.Param state")

    def call(p, x, **keywords):
        return nnx.merge(graphdef, p)(x, **keywords)

    accepted = keywords_of(built["type"].__call__)
    return _forwarding(call, accepted, side_keywords, output), stage_params


def _other_state_message(rest, nnx) -> str:
    """Names the variables of ``rest`` by kind and path, and what to do for each kind."""
    variables = jax.tree_util.tree_leaves_with_path(
        rest, is_leaf=lambda v: isinstance(v, nnx.Variable)
    )
    where = {}
    for path, v in variables:
        kind = f"nnx.{type(v).__name__}" if isinstance(v, nnx.Variable) else type(v).__name__
        where.setdefault(kind, []).append(jax.tree_util.keystr(path))
    held = "; ".join(f"{kind} at {paths[:4]}" for kind, paths in where.items())
    kinds = [v for _, v in variables]
    advice = []
    if any(isinstance(v, nnx.RngState) for v in kinds):
        advice.append(
            "for dropout, build nnx.Dropout without rngs and take a `key` keyword in the "
            "module's __call__ (the pipeline hands each stage and micro-batch its own key), "
            "and keep no nnx.Rngs in the module"
        )
    if any(isinstance(v, nnx.BatchStat) for v in kinds):
        advice.append("for normalisation, use nnx.LayerNorm or nnx.RMSNorm instead of BatchNorm")
    if any(not isinstance(v, (nnx.RngState, nnx.BatchStat)) for v in kinds):
        advice.append(
            "make a trained variable an nnx.Param (or a subclass of it) and freeze it with an "
            "optax mask if it must not change (optax.masked(optax.set_to_zero(), mask)); "
            "compute a constant in the module's __call__"
        )
    return (
        f"the stage module has state other than nnx.Param: {held}. jaxpipe stages hold "
        f"parameters only: {'; '.join(advice)}"
    )


def _refuse_bare_arrays(module, nnx) -> None:
    """A ValueError naming the arrays ``module`` holds outside ``nnx.Variable`` s.

    NNX keeps such an array in the graph definition while ``nnx_stage`` traces the module
    (it would leak as a tracer into every later call) and among the state otherwise."""
    import numpy as np

    found = []
    for path, node in nnx.iter_graph(module):
        if not isinstance(node, nnx.Module):
            continue
        leaves = jax.tree_util.tree_leaves_with_path(
            dict(vars(node)), is_leaf=lambda v: isinstance(v, (nnx.Variable, nnx.Module))
        )
        found += [
            "".join(f"[{n!r}]" for n in path) + jax.tree_util.keystr(p)
            for p, v in leaves
            if isinstance(v, (jax.Array, np.ndarray))
        ]
    if found:
        raise ValueError(
            f"the stage module holds arrays that are not nnx.Param at {found[:4]}; jaxpipe "
            "stages hold parameters (nnx.Param) only. Wrap a trainable array in nnx.Param; "
            "compute a constant (a mask, a rotary table) in the module's __call__, or keep it "
            "as a Python number or tuple"
        )


def _forwarding(
    call: Callable, accepted: set, side_keywords: bool = False, output: Callable | None = None
) -> Callable:
    """``stage_fn(params, x, *, <accepted>)`` calling ``call(params, x, **keywords)``; with
    ``side_keywords``, ``side`` (a dict) is unpacked into keywords of its own; ``output``
    picks the activations from what ``call`` returns.

    Its signature names exactly the keywords the module takes, so the pipeline passes those
    and refuses ``key=``/``side=`` a module could not use.
    """

    def stage_fn(params, x, **keywords):
        if side_keywords:
            side = keywords.pop("side", None) or {}
            keywords.update(side)
        out = call(params, x, **keywords)
        return out if output is None else output(out)

    if side_keywords:
        accepted = set(accepted) | {"side"}

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


def linen_stage(
    module,
    key,
    sample_x,
    num_stages: int,
    *,
    params=None,
    sample_side=None,
    side_keywords: bool | None = None,
    output: Callable | None = None,
):
    """A stage function and stacked parameters for a Linen module, initialised once per stage.

    Args:
        module: the ``flax.linen.Module`` of one stage.
        key: a JAX PRNG key, split into one key per stage (unused, may be None, with
            ``params``).
        sample_x: one micro-batch of stage input (an array or ``jax.ShapeDtypeStruct``).
        num_stages: the number of logical stages (``pipe.num_logical_stages``).
        params: existing weights instead of fresh ones: the module's ``'params'``
            collection with a leading stage axis of length ``num_stages`` (`stack_blocks`
            builds it from per-stage or per-block weights); checked against the module's
            own structure, shapes and dtypes (its ``param_dtype``).
        sample_side: one micro-batch of the module's further inputs, a dict by argument
            name (positions, masks); implies ``side_keywords``.
        side_keywords: call the module as ``module(x, **side)``: the pipeline's side inputs,
            a dict, are the module's further inputs by name. Default: whether
            ``sample_side`` is given.
        output: picks the stage's output from what the module returns, for modules that
            return more than the activations (Gemma's ``Block`` returns ``(cache, x)``:
            ``output=lambda out: out[1]``).

    Returns:
        ``(stage_fn, stage_params)``: ``stage_fn(p, x) = module.apply({'params': p}, x)``,
        passing on the keywords ``key``, ``side`` and ``stage`` where the module's
        ``__call__`` names them (``side`` unpacked with ``side_keywords``);
        ``stage_params`` is ``module.init(k, sample_x)['params']`` for each stage key,
        stacked along a leading stage axis (``params`` where given).

    Raises:
        TypeError: ``module`` is not a Linen module, ``sample_x`` has no shape and dtype, or
            ``key`` is not a PRNG key.
        ValueError: ``num_stages`` is not a positive int, the module has no parameters or
            has collections other than ``params`` (``batch_stats``, ...), or ``params`` do
            not fit the module.
    """
    from flax import linen as nn

    num_stages = _check_num_stages(num_stages)
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a flax.linen.Module, got {type(module).__name__}")
    if not hasattr(sample_x, "shape") or not hasattr(sample_x, "dtype"):
        raise TypeError(
            f"sample_x must be an array (one micro-batch of stage input), got {type(sample_x)}"
        )
    if side_keywords is None:
        side_keywords = sample_side is not None
    keys = _stage_keys(key, num_stages) if params is None else [jax.random.key(0)]
    x = jax.ShapeDtypeStruct(sample_x.shape, sample_x.dtype)
    side = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), sample_side)
    if side_keywords and not isinstance(side or {}, dict):
        raise TypeError(
            f"sample_side must be a dict of the module's further inputs by name, got {type(side)}"
        )
    from flax.core import meta

    # logically partitioned weights (nn.with_logical_partitioning) are stored unboxed
    variables = jax.eval_shape(
        lambda k, x, side: meta.unbox(module.init(k, x, **(side or {}))), keys[0], x, side
    )
    others = sorted(set(variables) - {"params"})
    if others:
        raise ValueError(
            f"the stage module has variable collections {others} besides 'params'; jaxpipe "
            "stages hold parameters only: remove them (e.g. use LayerNorm instead of BatchNorm)"
        )
    if "params" not in variables:
        raise ValueError("the stage module has no parameters ('params' collection is empty)")

    if params is not None:
        stage_params = _check_given(params, variables["params"], num_stages, "module's params")
    else:

        def init_one(k):
            zeros = jax.tree_util.tree_map(lambda a: jax.numpy.zeros(a.shape, a.dtype), side)
            zero_x = jax.numpy.zeros(x.shape, x.dtype)
            return meta.unbox(module.init(k, zero_x, **(zeros or {})))["params"]

        stage_params = jax.jit(jax.vmap(init_one))(keys)

    def call(p, x, **keywords):
        return module.apply({"params": p}, x, **keywords)

    accepted = keywords_of(type(module).__call__)
    return _forwarding(call, accepted, side_keywords, output), stage_params


def _check_given(params, abstract, num_stages: int, what: str):
    """``params`` if their leaves are ``abstract``'s, of its dtypes, with a leading stage
    axis of ``num_stages``; else a ValueError that names the first leaf that differs."""
    want = jax.tree_util.tree_leaves_with_path(abstract)
    got = jax.tree_util.tree_leaves_with_path(params)
    want_paths = [jax.tree_util.keystr(p) for p, _ in want]
    got_paths = [jax.tree_util.keystr(p) for p, _ in got]
    if want_paths != got_paths:
        missing = sorted(set(want_paths) - set(got_paths))[:4]
        extra = sorted(set(got_paths) - set(want_paths))[:4]
        raise ValueError(
            f"params do not have the structure of the {what}: missing {missing}, not in the "
            f"module {extra}. Pass the module's own weight tree with a leading stage axis "
            "(jaxpipe.stages.stack_blocks stacks per-stage or per-block trees)"
        )
    for (path, a), (_, b) in zip(got, want, strict=True):
        expected = (num_stages, *b.shape)
        if tuple(jax.numpy.shape(a)) != expected:
            raise ValueError(
                f"params{jax.tree_util.keystr(path)} has shape {tuple(jax.numpy.shape(a))}; "
                f"the {what} there is {tuple(b.shape)}, so with a leading stage axis of "
                f"num_stages={num_stages} it must be {expected}"
            )
        dtype = jax.numpy.result_type(a)
        if dtype != b.dtype:
            raise ValueError(
                f"params{jax.tree_util.keystr(path)} is {dtype}; the {what} there is "
                f"{b.dtype}, and the module would compute with the weights given, returning "
                f"other dtypes than it does itself. Cast the weights to the module's "
                f"(jax.tree.map(lambda a: a.astype(jnp.{b.dtype}), params)) or build the "
                f"module with param_dtype=jnp.{dtype}"
            )
    return params


def shard_stage_params(stage_params, mesh: jax.sharding.Mesh, axis: str = "pipe"):
    """Stacked stage parameters with the leading stage axis sharded over ``axis``.

    The result is still in logical stage order ``[S*v, ...]``, not the pipeline's layout:
    pass it to ``pipe.place``. ``pipe.place`` splits the other dimensions by its ``specs``
    alone, so to split a hidden dimension over ``tensor`` give it there,
    ``pipe.place(params, {"w": P(None, "tensor")})``; a split put on the arrays beforehand
    (``jax.device_put`` with ``P(axis, ..., "tensor")``) is not kept.

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
        ``stage_params`` with every leaf indexed at ``[stage]`` (also leaves split over an
        Explicit mesh axis, as ``pipe.logical`` returns them on such a mesh).
    """
    return jax.tree_util.tree_map(lambda a: _take(a, stage), stage_params)


def _take(a, index: int):
    """``a[index]`` on the leading axis; an array split on that axis over an Explicit mesh
    axis (where JAX refuses the plain index) is first made whole on it."""
    sharding = getattr(jax.typeof(a), "sharding", None) if isinstance(a, jax.Array) else None
    spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
    if not spec or spec[0] is None or mesh is None:
        return a[index]
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    names = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    if not any(types.get(n) == jax.sharding.AxisType.Explicit for n in names):
        return a[index]
    return jax.sharding.reshard(a, NamedSharding(mesh, P(None, *spec[1:])))[index]


def blocks(
    block_fn: Callable | Mapping[str, Callable],
    pattern: Sequence[str] | None = None,
    *,
    scan: bool = False,
):
    """A stage function that runs a stage's blocks in order, each with the function of its
    kind, for any number of stages.

    A stage's parameters hold its blocks on a leading axis, leaves ``[k, ...]`` (logical
    stage parameters ``[S*v, k, ...]``, e.g. from `stack_blocks`): logical stage ``s`` holds
    the model's blocks ``s*k`` to ``s*k + k - 1``. Block ``b`` is of kind
    ``pattern[b % len(pattern)]``, so the pattern is the model's (Gemma 3: five local
    attention blocks, then one global) whatever the pipeline's number of stages.

    Args:
        block_fn: ``block_fn(block_params, x, **keywords) -> x`` for every block; or a
            mapping from kind to such a function, all taking parameters of one structure.
            Keywords a function names: ``side`` (the micro-batch's side inputs), ``key``
            (block ``j`` of a stage gets ``fold_in(key, j)`` of the stage's key) and
            ``block`` (the model's block index ``b``, a traced int32).
        pattern: with a mapping, the kinds of the model's blocks ``0, 1, 2, ...``, repeated
            over all blocks.
        scan: run the blocks in a ``lax.scan`` over the stage's block axis (a group of
            ``len(pattern)`` blocks a step where ``k`` is a multiple of it), as MaxText and
            the examples run their layers, rather than one after another in Python. The
            same values either way, but the compiled programs may differ (the pipeline
            writes a short scan out as a loop): for Llama-3 70B under tensor parallelism
            the scan compiled to a faster program holding less (docs/planning.md).

    Returns:
        ``stage_fn(params, x, *, stage, ...)`` for `jaxpipe.Pipeline`. Where ``k`` is a
        multiple of ``len(pattern)`` every block's kind is known while tracing; otherwise
        it is chosen by ``lax.switch`` on the block index.

    Raises:
        TypeError: ``block_fn`` is neither a function nor a mapping of functions; with
            ``scan``, a block that returns another shape or dtype than its ``x``.
        ValueError: a mapping without ``pattern``, or a pattern naming a kind the mapping
            does not have.
    """
    if isinstance(block_fn, Mapping):
        kinds = list(block_fn)
        if not pattern:
            raise ValueError(
                f"block_fn is a mapping of kinds {kinds}; pass pattern=, the kinds of the "
                "model's blocks 0, 1, 2, ... (repeated), e.g. ('local',) * 5 + ('global',)"
            )
        unknown = sorted({k for k in pattern if k not in block_fn})
        if unknown:
            raise ValueError(f"pattern names kinds {unknown} that block_fn {kinds} does not have")
        functions = [block_fn[k] for k in kinds]
        table = [kinds.index(k) for k in pattern]
    elif callable(block_fn):
        functions, table = [block_fn], [0]
    else:
        raise TypeError(
            "block_fn must be a function or a mapping from kind to function, got "
            f"{type(block_fn).__name__}"
        )
    if not all(map(callable, functions)):
        raise TypeError("every block function must be callable")
    names = ("side", "key", "block")
    accepted = [_names_taken(f, names) for f in functions]
    branches = [
        lambda p, x, kw, f=f, a=a: f(p, x, **{k: v for k, v in kw.items() if k in a})
        for f, a in zip(functions, accepted, strict=True)
    ]

    def stage_fn(params, x, **keywords):
        stage, key, side = keywords["stage"], keywords.get("key"), keywords.get("side")
        leaves = jax.tree_util.tree_leaves(params)
        if not leaves or any(jax.numpy.ndim(a) == 0 for a in leaves):
            raise ValueError(
                "a stage of jaxpipe.stages.blocks takes parameters with its blocks on a "
                "leading axis, leaves [blocks, ...]; build them with jaxpipe.stages."
                "stack_blocks(per_block_params, num_stages)"
            )
        k = leaves[0].shape[0]
        counts = {a.shape[0] for a in leaves}
        if len(counts) > 1:
            raise ValueError(
                "a stage of jaxpipe.stages.blocks takes parameters whose leaves all hold "
                f"the same number of blocks on their leading axis, got {sorted(counts)} "
                f"(leaf shapes {sorted({tuple(a.shape) for a in leaves})}); build them "
                "with jaxpipe.stages.stack_blocks(per_block_params, num_stages)"
            )
        # every stage starts its pattern anew where k is a multiple of it: kinds are static
        group = len(table) if k % len(table) == 0 else 1

        def run_group(x, first, block_params):  # blocks first .. first + group - 1
            for i in range(group):
                j = first + i
                block = stage * k + j
                kw = {"side": side, "block": block}
                kw["key"] = None if key is None else jax.random.fold_in(key, j)
                kw = {name: value for name, value in kw.items() if value is not None}
                p = block_params(i)
                if len(functions) == 1:
                    x = branches[0](p, x, kw)
                elif group == len(table):
                    x = branches[table[i]](p, x, kw)
                else:
                    kind = jax.numpy.asarray(table, jax.numpy.int32)[block % len(table)]
                    x = jax.lax.switch(kind, branches, p, x, kw)
            return x

        def take(tree, j):
            return jax.tree_util.tree_map(lambda a: a[j], tree)

        if not scan:
            for first in range(0, k, group):
                x = run_group(x, first, lambda i, first=first: take(params, first + i))
            return x
        grouped = jax.tree_util.tree_map(
            lambda a: a.reshape(k // group, group, *a.shape[1:]), params
        )
        firsts = jax.numpy.arange(0, k, group, dtype=jax.numpy.int32)

        def body(x, step):
            first, group_params = step
            return run_group(x, first, lambda i: take(group_params, i)), None

        try:
            return jax.lax.scan(body, x, (firsts, grouped))[0]
        except TypeError as error:
            if "carry" not in str(error):
                raise
            raise TypeError(
                "jaxpipe.stages.blocks(..., scan=True) carries x from block to block, so "
                f"every block must return x's shape and dtype ({x.shape}, {x.dtype}); "
                f"{error}. Return x's dtype from the block, or run the blocks in a loop "
                "(scan=False)"
            ) from error

    taken = set().union(*accepted) & {"side", "key"}
    kind = inspect.Parameter
    stage_fn.__signature__ = inspect.Signature(
        [kind("params", kind.POSITIONAL_OR_KEYWORD), kind("x", kind.POSITIONAL_OR_KEYWORD)]
        + [kind("stage", kind.KEYWORD_ONLY)]
        + [kind(name, kind.KEYWORD_ONLY, default=None) for name in sorted(taken)]
    )
    return stage_fn


def _names_taken(fn: Callable, names) -> set:
    """The names among ``names`` that ``fn`` takes as keywords (all with ``**kwargs``)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return set(names)
    return {p.name for p in parameters if p.name in names}


def stack_blocks(per_block, num_stages: int | None = None):
    """Per-block (or per-stage) weights stacked into leaves with leading stage axes.

    Args:
        per_block: a sequence of pytrees of one structure, the weights of blocks
            ``0, 1, ...`` in model order (e.g. Gemma's ``params["layer_0"]``, ...).
        num_stages: the number of logical stages, to group ``k = len(per_block) //
            num_stages`` consecutive blocks per stage; None stacks one block per entry.

    Returns:
        A pytree of that structure with leaves ``[num_stages, k, ...]`` (stage ``s`` holds
        blocks ``s*k`` to ``s*k + k - 1``, as `blocks` runs them), or ``[len(per_block),
        ...]`` without ``num_stages``.

    Raises:
        ValueError: ``per_block`` is empty, its trees differ in structure, shapes or
            dtypes, or its length is not a multiple of ``num_stages``.
    """
    per_block = list(per_block)
    if not per_block:
        raise ValueError("per_block is empty; pass the weights of every block, in order")
    first = jax.tree_util.tree_structure(per_block[0])
    for i, tree in enumerate(per_block):
        if jax.tree_util.tree_structure(tree) != first:
            raise ValueError(
                f"per_block[{i}] has another structure than per_block[0]; blocks stacked "
                "together need the same weight tree (blocks of another structure belong "
                f"in a stack of their own): {jax.tree_util.tree_structure(tree)} vs {first}"
            )
    shapes = [tuple(jax.numpy.shape(a)) for a in jax.tree_util.tree_leaves(per_block[0])]
    dtypes = [jax.numpy.result_type(a) for a in jax.tree_util.tree_leaves(per_block[0])]
    for i, tree in enumerate(per_block):
        leaves = jax.tree_util.tree_leaves(tree)
        if [tuple(jax.numpy.shape(a)) for a in leaves] != shapes:
            raise ValueError(f"per_block[{i}] has other leaf shapes than per_block[0]")
        if [jax.numpy.result_type(a) for a in leaves] != dtypes:
            raise ValueError(
                f"per_block[{i}] has other leaf dtypes than per_block[0] "
                f"({[str(jax.numpy.result_type(a)) for a in leaves]} vs "
                f"{[str(d) for d in dtypes]}); stacking would promote them to one; cast "
                "the blocks to the dtype they should train in first"
            )
    stacked = jax.tree_util.tree_map(lambda *a: jax.numpy.stack(a), *per_block)
    if num_stages is None:
        return stacked
    num_stages = _check_num_stages(num_stages)
    if len(per_block) % num_stages:
        raise ValueError(
            f"{len(per_block)} blocks do not split evenly over num_stages={num_stages}; "
            "pass a number of logical stages that divides the number of blocks"
        )
    k = len(per_block) // num_stages
    return jax.tree_util.tree_map(lambda a: a.reshape(num_stages, k, *a.shape[1:]), stacked)


def unstack_blocks(stacked, blocks_per_stage: bool = True) -> list:
    """The inverse of `stack_blocks`: the per-block weights, in model order.

    Args:
        stacked: a pytree with leaves ``[num_stages, k, ...]`` (logical stage order, e.g.
            from ``pipe.logical``), or ``[num_blocks, ...]``.
        blocks_per_stage: whether the leaves have the two leading axes (stage, block).

    Returns:
        A list of ``num_stages * k`` (or ``num_blocks``) pytrees, block ``b`` at index ``b``.
    """
    if blocks_per_stage:
        stacked = jax.tree_util.tree_map(
            lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), stacked
        )
    leaves = jax.tree_util.tree_leaves(stacked)
    count = leaves[0].shape[0] if leaves else 0
    return [jax.tree_util.tree_map(lambda a, b=b: _take(a, b), stacked) for b in range(count)]
