"""Layers to stages: balanced contiguous ranges, per-layer costs, per-stage memory, uneven stacks.

```python
import jaxpipe
costs = jaxpipe.partition.layer_costs(layer_fn, layer_params, x)      # XLA flops per layer
ranges = jaxpipe.partition.partition(costs, num_logical_stages)       # [(start, stop), ...]
stage_params = jaxpipe.partition.stack_layers(layer_params, ranges)   # padded, with "active"
stage_fn = jaxpipe.partition.layered_stage_fn(layer_fn)
pipe = jaxpipe.Pipeline(stage_fn, loss_fn, mesh=mesh, ...)
print(jaxpipe.partition.stage_memory_report(pipe.schedule, ranges, activation_bytes))
```

``layer_params`` is a list with one pytree per layer (all of the same structure, shapes and
dtypes) or one pytree whose leaves carry a leading layer axis.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe.stages import stage_slice

__all__ = [
    "layer_costs",
    "layered_stage_fn",
    "partition",
    "stack_layers",
    "stage_memory_report",
    "unstack_layers",
]


# ----------------------------------------------------------------------- partition
def _check_costs(costs, num_stages) -> np.ndarray:
    costs = np.asarray(costs, dtype=np.float64)
    if costs.ndim != 1 or costs.size == 0:
        raise ValueError(f"costs must be a non-empty 1-D sequence (one per layer), got {costs!r}")
    if not np.all(np.isfinite(costs)) or np.any(costs < 0):
        raise ValueError(f"costs must be finite and >= 0, got {costs.tolist()}")
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    if num_stages > costs.size:
        raise ValueError(
            f"{costs.size} layers cannot fill {num_stages} stages (every stage needs a layer); "
            "use fewer stages or split layers finer"
        )
    return costs


def _min_cost_dp(costs, num_stages, stage_cost, allowed):
    """Exact DP over contiguous splits: min over splits of sum(stage_cost), subject to
    ``allowed(stage, start, stop)``. Returns ``(value, ranges)`` or ``(inf, None)``."""
    L = costs.size
    inf = float("inf")
    best = [[inf] * (L + 1) for _ in range(num_stages + 1)]
    arg = [[-1] * (L + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        # stage s-1 covers [i, j); the remaining stages need one layer each
        for j in range(s, L - (num_stages - s) + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == inf or not allowed(s - 1, i, j):
                    continue
                value = best[s - 1][i] + stage_cost(i, j)
                if value < best[s][j]:
                    best[s][j], arg[s][j] = value, i
    if best[num_stages][L] == inf:
        return inf, None
    ranges, j = [], L
    for s in range(num_stages, 0, -1):
        i = arg[s][j]
        ranges.append((i, j))
        j = i
    return best[num_stages][L], ranges[::-1]


def partition(
    costs: Sequence[float],
    num_stages: int,
    *,
    memory: Sequence[float] | None = None,
    memory_limit: float | Sequence[float] | None = None,
) -> list[tuple[int, int]]:
    """Contiguous layer ranges, one per stage, minimising the slowest stage.

    The slowest stage's summed cost is minimal (exact); among such splits the one with the
    smallest sum of squared stage costs is returned (as even as possible).

    Args:
        costs: one cost per layer (finite, >= 0), e.g. from `layer_costs`.
        num_stages: the number of stages (``pipe.num_logical_stages``), at most the number
            of layers.
        memory: per-layer bytes; give it together with ``memory_limit``.
        memory_limit: one number, or one per stage (e.g. a device's free bytes divided by
            the stage's in-flight micro-batches from ``Schedule.peak_activations``): stage
            ``s`` may hold only layers whose memory sums to at most ``memory_limit[s]``.

    Returns:
        ``[(start, stop), ...]``, one range per stage, in order, covering every layer.

    Raises:
        ValueError: the costs are empty, negative or not finite; ``num_stages`` is not a
            positive int or exceeds the layers; only one of ``memory`` and ``memory_limit``
            is given; or no split fits the memory limit.
    """
    costs = _check_costs(costs, num_stages)
    L = costs.size
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    if (memory is None) != (memory_limit is None):
        raise ValueError("pass both memory (per layer) and memory_limit, or neither")
    if memory is not None:
        memory = np.asarray(memory, dtype=np.float64)
        if memory.shape != (L,):
            raise ValueError(f"memory has shape {memory.shape}; expected one value per layer ({L})")
        limits = np.asarray(memory_limit, dtype=np.float64)
        if limits.ndim > 1 or (limits.ndim == 1 and limits.shape != (num_stages,)):
            raise ValueError(
                f"memory_limit has shape {limits.shape}; give one number for every stage, or "
                f"one per stage ({num_stages} values)"
            )
        limits = np.broadcast_to(limits, (num_stages,))
        mem_prefix = np.concatenate([[0.0], np.cumsum(memory)])

        def fits(s, i, j):
            return mem_prefix[j] - mem_prefix[i] <= limits[s] * (1 + 1e-12)
    else:

        def fits(s, i, j):
            return True

    def cost(i, j):
        return prefix[j] - prefix[i]

    # Phase 1: the optimal bottleneck (a DP on max; sums do not matter here).
    bottleneck = _bottleneck(costs, num_stages, fits)
    if bottleneck is None:
        raise ValueError(
            f"no split of {L} layers into {num_stages} stages keeps every stage within "
            f"memory_limit={memory_limit}; raise the limit or use more stages"
        )
    tolerance = bottleneck * 1e-12 + 1e-300

    # Phase 2: the most even split among those with that bottleneck.
    def allowed(s, i, j):
        return cost(i, j) <= bottleneck + tolerance and fits(s, i, j)

    _, ranges = _min_cost_dp(costs, num_stages, lambda i, j: cost(i, j) ** 2, allowed)
    return ranges


def _bottleneck(costs, num_stages, fits):
    """The smallest possible maximum stage cost (exact DP), or None if nothing fits."""
    L = costs.size
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    inf = float("inf")
    best = [[inf] * (L + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, L - (num_stages - s) + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == inf or not fits(s - 1, i, j):
                    continue
                value = max(best[s - 1][i], prefix[j] - prefix[i])
                if value < best[s][j]:
                    best[s][j] = value
    value = best[num_stages][L]
    return None if value == inf else value


# ----------------------------------------------------------------------- costs
def _layer_list(layer_params) -> list:
    if isinstance(layer_params, (list, tuple)):
        if not layer_params:
            raise ValueError("layer_params is an empty list; pass one pytree per layer")
        return list(layer_params)
    leaves = jax.tree_util.tree_leaves(layer_params)
    if not leaves or any(jnp.ndim(x) == 0 for x in leaves):
        raise ValueError(
            "layer_params must be a list of per-layer pytrees or a pytree whose every leaf "
            "has a leading layer axis"
        )
    count = leaves[0].shape[0]
    if any(x.shape[0] != count for x in leaves):
        raise ValueError(
            f"leaves of layer_params have different leading (layer) axes: "
            f"{sorted({x.shape[0] for x in leaves})}"
        )
    return [jax.tree_util.tree_map(lambda a, i=i: a[i], layer_params) for i in range(count)]


def layer_costs(layer_fn: Callable, layer_params, x, *, measure: str = "flops") -> list[float]:
    """One cost per layer: XLA's flop count of ``layer_fn(params, x)`` or the parameter count.

    Args:
        layer_fn: ``layer_fn(params, x) -> y``, one layer.
        layer_params: a list with one pytree per layer, or one pytree whose leaves carry a
            leading layer axis.
        x: one micro-batch of layer input (an array or ``jax.ShapeDtypeStruct``).
        measure: ``"flops"`` compiles ``layer_fn`` once per distinct parameter shape and
            reads ``cost_analysis()['flops']``; ``"params"`` counts parameter elements.

    Returns:
        One float per layer, in layer order.

    Raises:
        ValueError: ``measure`` is neither ``"flops"`` nor ``"params"``, ``layer_params`` is
            empty or its leaves disagree on the layer axis, or XLA reports no flops on this
            backend (use ``measure="params"`` then).
    """
    layers = _layer_list(layer_params)
    if measure == "params":
        return [float(sum(np.size(a) for a in jax.tree_util.tree_leaves(p))) for p in layers]
    if measure != "flops":
        raise ValueError(f"measure must be 'flops' or 'params', got {measure!r}")
    x = jax.ShapeDtypeStruct(np.shape(x), x.dtype)
    cache: dict = {}
    out = []
    for p in layers:
        abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), p)
        signature = (
            jax.tree_util.tree_structure(abstract),
            tuple((a.shape, str(a.dtype)) for a in jax.tree_util.tree_leaves(abstract)),
        )
        if signature not in cache:
            analysis = jax.jit(layer_fn).lower(abstract, x).compile().cost_analysis()
            if isinstance(analysis, (list, tuple)):  # one dict per computation on some JAX
                analysis = analysis[0] if analysis else {}
            flops = float((analysis or {}).get("flops", 0.0))
            if flops <= 0:
                raise ValueError(
                    "XLA reported no flops for layer_fn on this backend; use "
                    "measure='params' or pass your own costs to partition()"
                )
            cache[signature] = flops
        out.append(cache[signature])
    return out


# ----------------------------------------------------------------------- memory
def stage_memory_report(
    schedule, layer_ranges: Sequence[tuple[int, int]], activation_bytes_per_layer
) -> list[dict]:
    """Per logical stage: layers, in-flight micro-batches on its device and activation bytes.

    For each device the peak is taken over ticks of the bytes of every (stage, micro-batch)
    alive there (from its F to its last backward action, as in
    ``Schedule.peak_activations``), so early stages, which hold more micro-batches under
    1F1B, show more.

    Args:
        schedule: the `jaxpipe.schedules.Schedule` the pipeline runs.
        layer_ranges: one ``(start, stop)`` per logical stage, as `partition` returns.
        activation_bytes_per_layer: one number (every layer alike) or one per layer: the
            bytes one layer keeps for its backward per micro-batch.

    Returns:
        One dict per logical stage with ``stage``, ``device``, ``layers`` (its range),
        ``in_flight`` (its peak of live micro-batches), ``stage_bytes`` (this stage's peak
        alone) and ``device_peak_bytes`` (all stages of the device together).

    Raises:
        ValueError: the ranges are not one contiguous, non-empty range per logical stage
            starting at 0.
    """
    from jaxpipe.schedules import F

    N = schedule.num_logical_stages
    ranges = _check_ranges(layer_ranges, N)
    L = ranges[-1][1]
    per_layer = np.broadcast_to(np.asarray(activation_bytes_per_layer, np.float64), (L,))
    stage_bytes = [float(per_layer[i:j].sum()) for i, j in ranges]
    first, last = {}, {}
    for t, _, a in schedule.timed_actions():
        key = (a.stage, a.microbatch)
        if a.op == F:
            first[key] = t
        else:
            last[key] = max(last.get(key, t), t)
    T = schedule.num_ticks
    live = np.zeros((N, T), np.int64)  # micro-batches alive per stage and tick
    for key, start in first.items():
        live[key[0], start : last.get(key, T - 1) + 1] += 1
    weighted = live * np.asarray(stage_bytes)[:, None]
    rows = []
    for s in range(N):
        d = schedule.stage_device[s]
        on_device = [u for u in range(N) if schedule.stage_device[u] == d]
        rows.append(
            {
                "stage": s,
                "device": d,
                "layers": ranges[s],
                "in_flight": int(live[s].max()),
                "stage_bytes": float(weighted[s].max()),
                "device_peak_bytes": float(weighted[on_device].sum(axis=0).max()),
            }
        )
    return rows


def _check_ranges(layer_ranges, num_stages) -> list[tuple[int, int]]:
    ranges = [tuple(int(v) for v in r) for r in layer_ranges]
    if len(ranges) != num_stages:
        raise ValueError(
            f"{len(ranges)} layer ranges for {num_stages} logical stages; partition the layers "
            f"into num_logical_stages={num_stages} ranges"
        )
    start = 0
    for i, (a, b) in enumerate(ranges):
        if a != start or b <= a:
            raise ValueError(
                f"layer ranges must be contiguous, non-empty and start at 0; range {i} is "
                f"{(a, b)} after stop {start}: {ranges}"
            )
        start = b
    return ranges


# ----------------------------------------------------------------------- uneven stacks
def stack_layers(layer_params, layer_ranges: Sequence[tuple[int, int]]) -> dict:
    """Stage parameters for stages with different numbers of layers.

    ``K`` is the largest stage's layer count; stage ``s`` holds its layers first and pads the
    rest with copies of its last layer, marked inactive (``active`` 0.0 instead of 1.0;
    skipped by `layered_stage_fn`, zero gradient). ``active`` is float so optimizers accept
    it; its gradient is always zero.

    The mask needs no masking from the optimizer: `layered_stage_fn` runs a layer whose
    ``active`` is non-zero. With a zero gradient, Adam, Lion, SGD and momentum leave a 0.0
    at exactly 0.0, and weight decay only scales a 1.0 (momentum with weight decay can
    also swing it negative), which keeps it non-zero. Only a float underflow after about
    ``87 / (learning_rate * weight_decay)`` steps of decoupled decay would turn a layer
    off; for runs that long, keep ``active`` out of the decay (``optax.masked``).

    Args:
        layer_params: a list with one pytree per layer, or one pytree whose leaves carry a
            leading layer axis.
        layer_ranges: one ``(start, stop)`` per stage, as `partition` returns.

    Returns:
        ``{"layers": [N, K, ...], "active": [N, K]}`` for ``N`` stages, logical stage order.

    Raises:
        ValueError: the ranges are not contiguous from 0 or do not cover every layer.
    """
    layers = _layer_list(layer_params)
    ranges = _check_ranges(layer_ranges, len(layer_ranges))
    if ranges[-1][1] != len(layers):
        raise ValueError(
            f"layer ranges cover {ranges[-1][1]} layers but layer_params has {len(layers)}"
        )
    K = max(b - a for a, b in ranges)
    index = np.array([[min(a + k, b - 1) for k in range(K)] for a, b in ranges])
    active = np.array([[a + k < b for k in range(K)] for a, b in ranges], np.float32)
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *layers)
    return {
        "layers": jax.tree_util.tree_map(lambda a: a[index], stacked),
        "active": jnp.asarray(active),
    }


def unstack_layers(stage_params, layer_ranges: Sequence[tuple[int, int]]) -> list:
    """The inverse of `stack_layers`, for parameters or their gradients.

    Args:
        stage_params: ``{"layers": [N, K, ...], ...}`` as `stack_layers` returns it (in
            logical stage order: ``pipe.logical`` of placed parameters, on any mesh).
        layer_ranges: the ranges given to `stack_layers`.

    Returns:
        The list of per-layer pytrees, padding left out.

    Raises:
        ValueError: the ranges are not contiguous, non-empty and starting at 0.
    """
    ranges = _check_ranges(layer_ranges, len(layer_ranges))
    out = []
    for s, (a, b) in enumerate(ranges):
        for k in range(b - a):
            out.append(stage_slice(stage_slice(stage_params["layers"], s), k))
    return out


def layered_stage_fn(layer_fn: Callable) -> Callable:
    """A stage function for parameters made by `stack_layers`.

    Args:
        layer_fn: ``layer_fn(params, x) -> y``, one layer; ``x`` an array or a pytree of
            arrays, ``y`` of its structure and shapes (each leaf cast to ``x``'s dtype).

    Returns:
        ``stage_fn(p, x)``: ``layer_fn`` applied over the stage's active layers in order (a
        ``lax.scan``; a padding layer, ``active`` exactly 0, passes ``x`` through). Any
        non-zero ``active`` counts as active, so weight decay on the mask (which shrinks
        it) does not turn layers off (`stack_layers`).
    """

    def stage_fn(p, x):
        def step(h, layer):
            params, active = layer

            def run(h):
                return jax.tree_util.tree_map(
                    lambda y, a: y.astype(a.dtype), layer_fn(params, h), h
                )

            h = jax.lax.cond(active != 0, run, lambda h: h, h)
            return h, None

        h, _ = jax.lax.scan(step, x, (p["layers"], p["active"]))
        return h

    return stage_fn
