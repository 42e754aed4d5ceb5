"""Per-action costs of a user's own stage, for the simulator: measured here, or estimated.

F, B, W and BW are the four actions a schedule table holds for one stage and one
micro-batch: F the forward (which keeps the residuals its backward needs), B the gradient
with respect to the stage input only, W the gradient with respect to the stage parameters
only, BW both at once (the full backward). `measure` times them on this machine; `estimate`
predicts them on a named accelerator from XLA's flop and byte counts. Both return
`jaxpipe.schedules.Costs` in seconds, so `predict` (or `jaxpipe.schedules.simulate`) turns a
schedule into a step time and a bubble for this model. `estimate` is `cost_analysis` (the
counts, compiled once) then `roofline` (seconds on one accelerator).

```python
from jaxpipe import costs, schedules
c = costs.estimate(stage_fn, stage_params, x, accelerator="H100")   # seconds, predicted
c = costs.measure(stage_fn, stage_params, x)                        # seconds, this machine
print(costs.predict(schedules.get("1f1b", 4, 16), c))
```

``stage_params`` is one stage's parameters (a pytree) and ``x`` one micro-batch of stage
input (an array or a pytree of arrays). With ``loss_fn`` (and ``target``), the actions are
those of the last stage as the executor runs them: F is the stage, then
``loss_fn(loss_params, y, target)`` and its backward seeded with 1, down to the gradients of
the stage output and the loss parameters; B, W and BW are the stage's backward from that
output gradient, as on a middle stage, whose backward is seeded with a random one.
Costs are per logical stage: with ``v`` stages per device, time a stage that holds ``1/v``
of a device's layers.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe._jaxpr import residuals
from jaxpipe._jaxpr.split import split_backward
from jaxpipe.analysis import hlo
from jaxpipe.analysis.hardware import (
    ACCELERATORS,
    PRECISIONS,
    Accelerator,
    get_accelerator,
    positive_number,
)
from jaxpipe.schedules import Costs, Schedule, simulate

__all__ = [
    "ACCELERATORS",
    "Accelerator",
    "Prediction",
    "activation_bytes",
    "compiler_seconds",
    "cost_analysis",
    "estimate",
    "get_accelerator",
    "measure",
    "predict",
    "roofline",
]

ACTIONS = ("forward", "backward_input", "backward_weight", "full_backward")
TRAFFIC = {"compiled": "bytes", "minimal": "minimal_bytes"}  # roofline's bytes: which count


# ------------------------------------------------------------------------ the actions
class _StageActions(NamedTuple):
    """The four actions of one stage, each jitted, and what they are called with.

    ``forward(*primals) -> (output, kept)``; ``backward_input(primals, kept, cotangent) ->
    (dx, stash)``; ``backward_weight(primals, kept, stash)``; ``full_backward(primals, kept,
    cotangent)``. ``kept`` are the residuals the forward leaves for the backward, minus the
    ``primals`` themselves (read again, as the executor does). B and W are the backward split
    on its jaxpr as the executor splits it (`jaxpipe._jaxpr.split.split_backward`): B
    computes the input gradient and the ``stash`` (the cotangents W needs), W only the
    weight gradients from it, so B + W cost about BW. ``primals = (params, x)``; W returns
    the parameter gradient, BW ``(dparams, dx)``; the cotangent is the stage output's.
    Middle stage: ``forward(params, x) -> (y, kept)``. Last stage, as the executor's
    ``forward_last``: ``forward(params, loss_params, x, target) -> ((loss, dy,
    dloss_params), kept)``, the loss and its backward inside F.
    """

    forward: Callable
    backward_input: Callable
    backward_weight: Callable
    full_backward: Callable
    primals: tuple  # (params, x): what B, W and BW are called with
    forward_args: tuple  # what F is called with
    output: Any  # ShapeDtypeStructs of the stage's output y (the backward's cotangent)
    kept: list  # ShapeDtypeStructs of the kept residuals
    stash: list  # ShapeDtypeStructs of what B hands to W


def _struct(a, sharding=None):
    return jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=sharding)


def _check_tree(name: str, tree, *, allow_structs: bool, allow_empty: bool = False) -> None:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    if not leaves and not allow_empty:
        raise ValueError(f"{name} holds no arrays; pass {name} as an array or a pytree of arrays")
    for path, leaf in leaves:
        where = name + jax.tree_util.keystr(path)
        if isinstance(leaf, jax.ShapeDtypeStruct):
            if not allow_structs:
                raise ValueError(
                    f"{where} is a jax.ShapeDtypeStruct; measure runs the stage, so it needs "
                    "arrays (estimate accepts shapes)"
                )
        elif not isinstance(leaf, (jax.Array, np.ndarray)):
            raise TypeError(
                f"{where} is a {type(leaf).__name__} ({leaf!r}); expected an array: wrap it "
                "with jnp.asarray"
            )


def _stage_actions(
    stage_fn: Callable, stage_params, x, *, loss_fn=None, loss_params=None, target=None
) -> _StageActions:
    """Builds the jitted F, B, W and BW of ``stage_fn`` (of the last stage with ``loss_fn``)."""
    if not callable(stage_fn):
        raise TypeError(f"stage_fn must be callable as stage_fn(stage_params, x), got {stage_fn!r}")
    last = loss_fn is not None
    if last and not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be callable as loss_fn(loss_params, y, target), got {loss_fn!r}"
        )
    if last and target is None:
        raise ValueError(
            "loss_fn was given without target; pass target (one micro-batch of targets) to "
            "time the last stage, or drop loss_fn to time a middle stage"
        )
    if not last and (target is not None or loss_params is not None):
        raise ValueError(
            "target or loss_params was given without loss_fn; pass loss_fn too (last stage) "
            "or neither (middle stage)"
        )
    _check_tree("stage_params", stage_params, allow_structs=True, allow_empty=True)
    _check_tree("x", x, allow_structs=True)
    if last:
        _check_tree("loss_params", loss_params, allow_structs=True, allow_empty=True)
        _check_tree("target", target, allow_structs=True)
    primals = (stage_params, x)
    layouts: list[residuals.PullbackLayout] = []

    def split(p, h):
        """``vjp(stage_fn)`` as (output, kept residuals); records how to rebuild the pullback."""
        out, pullback = jax.vjp(stage_fn, p, h)
        kept, layout = residuals.split_pullback(pullback, (p, h))
        layouts.append(layout)
        return out, kept

    def split_last(p, lp, h, tgt):
        """The executor's ``forward_last``: the stage, the loss and the loss's backward,
        seeded with 1, down to the gradients of the stage output and the loss parameters."""
        y, kept = split(p, h)
        loss, loss_vjp = jax.vjp(lambda lp, y: loss_fn(lp, y, tgt), lp, y)
        d_loss_params, dy = loss_vjp(jnp.ones((), loss.dtype))
        return (loss, dy, d_loss_params), kept

    call = "stage_fn(stage_params, x)"
    try:
        output, kept = jax.eval_shape(split, *primals)
        if last:
            call = f"loss_fn(loss_params, {call}, target)"
            loss = jax.eval_shape(loss_fn, loss_params, output, target)
    except Exception as error:  # add where it happened, keep the user's own error
        error.add_note(f"jaxpipe.costs: raised while tracing the vjp of {call}")
        raise
    if last and np.shape(loss) != ():
        raise ValueError(
            f"loss_fn must return a scalar loss, got shape {np.shape(loss)}; reduce it "
            "(for example with jnp.mean)"
        )

    def pullback(primals, kept, cotangent):
        return residuals.join_pullback(layouts[0], primals, kept)(cotangent)

    def back(kept, weights, x, cotangent):  # (d weights, dx), as split_backward wants
        return pullback((weights, x), kept, cotangent)

    halves = split_backward(back, kept, *jax.tree_util.tree_map(_struct, primals), output)

    def backward_input(primals, kept, cotangent):
        return halves.b_fn(kept, *primals, cotangent)

    def backward_weight(primals, kept, stash):
        return halves.w_fn(kept, *primals, stash)

    return _StageActions(
        forward=jax.jit(split_last if last else split),
        backward_input=jax.jit(backward_input),
        backward_weight=jax.jit(backward_weight),
        full_backward=jax.jit(pullback),
        primals=primals,
        forward_args=(stage_params, loss_params, x, target) if last else primals,
        output=output,
        kept=kept,
        stash=list(halves.stash_structs),
    )


def _cotangent(actions: _StageActions, key):
    """The seed of the backward: a random gradient of the stage's output."""
    leaves, treedef = jax.tree_util.tree_flatten(actions.output)
    grads = [
        jax.random.normal(jax.random.fold_in(key, i), s.shape, jnp.float32).astype(s.dtype)
        for i, s in enumerate(leaves)
    ]
    return jax.tree_util.tree_unflatten(treedef, grads)


def _calls(actions: _StageActions, forward_args, primals, kept, cotangent, stash) -> dict:
    """``{action: (jitted function, arguments)}`` for the four actions."""
    backward_args = (primals, kept, cotangent)
    return {
        "forward": (actions.forward, forward_args),
        "backward_input": (actions.backward_input, backward_args),
        "backward_weight": (actions.backward_weight, (primals, kept, stash)),
        "full_backward": (actions.full_backward, backward_args),
    }


# ------------------------------------------------------------------------ helpers
def activation_bytes(x) -> int:
    """Bytes of one micro-batch of stage input.

    Args:
        x: an array, a `jax.ShapeDtypeStruct`, or a pytree of them.

    Returns:
        The bytes of all its leaves.
    """
    return int(
        sum(
            math.prod(np.shape(a)) * np.dtype(a.dtype).itemsize
            for a in jax.tree_util.tree_leaves(x)
        )
    )


def _communication(x, communication, bandwidth) -> float:
    """Seconds to send one activation: given, or ``activation_bytes(x) / bandwidth``."""
    if communication is not None and bandwidth is not None:
        raise ValueError(
            f"pass communication (seconds, got {communication!r}) or bandwidth (bytes/s, got "
            f"{bandwidth!r}), not both"
        )
    if communication is not None:
        if not (positive_number(communication) or communication == 0):
            raise ValueError(f"communication must be seconds >= 0 (finite), got {communication!r}")
        return float(communication)
    if bandwidth is None:
        return 0.0
    if not positive_number(bandwidth):
        raise ValueError(f"bandwidth must be bytes/s > 0 (finite), got {bandwidth!r}")
    return activation_bytes(x) / bandwidth


def _analysis_dict(analysis) -> dict:
    """``Compiled.cost_analysis()`` as one dict, whether jax gives a dict or a list with
    one dict per computation (the first is the program's)."""
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else None
    if not analysis:
        raise RuntimeError(
            "XLA gave no cost analysis for this stage on the "
            f"{jax.default_backend()!r} backend; estimate needs one (use measure instead)"
        )
    return dict(analysis)


# ------------------------------------------------------------------------ measure
def measure(
    stage_fn: Callable,
    stage_params: Any,
    x: Any,
    *,
    loss_fn: Callable | None = None,
    loss_params: Any = None,
    target: Any = None,
    repeats: int = 20,
    warmup: int = 2,
    communication: float | None = None,
    bandwidth: float | None = None,
) -> Costs:
    """Times F, B, W and BW of ``stage_fn`` on this machine; returns `Costs` in seconds.

    Each action is compiled with `jax.jit` (compile time excluded), run ``warmup`` times,
    then ``repeats`` times, the four actions interleaved round-robin; each figure is the
    median wall time of one call until `jax.block_until_ready`, on the default device. On
    CPU host devices these are CPU timings, dispatch included.

    Args:
        stage_fn: ``stage_fn(stage_params, x) -> y``, one stage.
        stage_params: one stage's parameters (a pytree of arrays).
        x: one micro-batch of stage input (an array or a pytree of arrays).
        loss_fn: ``loss_fn(loss_params, y, target) -> scalar``: time the last stage instead.
        loss_params: the loss's parameters (with ``loss_fn``).
        target: one micro-batch of targets (with ``loss_fn``).
        repeats: timed calls per action (the median is kept).
        warmup: untimed calls per action first.
        communication: seconds to send one activation, passed through to the result.
        bandwidth: bytes/s instead: ``communication = activation_bytes(x) / bandwidth``.

    Returns:
        ``Costs(forward, backward_input, backward_weight, full_backward, communication)``,
        in seconds (communication 0 unless given).
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1 (timed calls per action), got {repeats!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0 (untimed calls first), got {warmup!r}")
    _check_tree("stage_params", stage_params, allow_structs=False, allow_empty=True)
    _check_tree("x", x, allow_structs=False)
    if loss_fn is not None:
        _check_tree("loss_params", loss_params, allow_structs=False, allow_empty=True)
        if target is not None:
            _check_tree("target", target, allow_structs=False)
    comm = _communication(x, communication, bandwidth)
    actions = _stage_actions(
        stage_fn, stage_params, x, loss_fn=loss_fn, loss_params=loss_params, target=target
    )
    forward = actions.forward.lower(*actions.forward_args).compile()
    _, kept = jax.block_until_ready(forward(*actions.forward_args))
    cotangent = _cotangent(actions, jax.random.key(0))
    calls = {"forward": (forward, actions.forward_args)}
    _, stash = actions.backward_input(actions.primals, kept, cotangent)
    calls_of = _calls(actions, actions.forward_args, actions.primals, kept, cotangent, stash)
    for name, (fn, args) in calls_of.items():
        if name != "forward":
            calls[name] = (fn.lower(*args).compile(), args)
    for compiled, args in calls.values():
        for _ in range(warmup):
            jax.block_until_ready(compiled(*args))
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, (compiled, args) in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            samples[name].append(time.perf_counter() - start)
    seconds = {name: statistics.median(times) for name, times in samples.items()}
    return Costs(**seconds, communication=comm)


def of_stage(source, stage_fn: Callable, stage_params: Any, x: Any, *, seed: int = 0) -> Costs:
    """`Costs` of one stage from ``source``, given only its shapes.

    Args:
        source: ``"measure"``: `measure` on this machine's default device, the stage run
            on random parameters and inputs of the given shapes; or a
            `jaxpipe.target.Target` (``jaxpipe.target.get("v5p:4x4x8")``): its compiler's
            own estimate of each action (`cost_analysis` then `compiler_seconds`).
        stage_fn: ``stage_fn(stage_params, x) -> y``, one stage.
        stage_params: one stage's parameters: arrays, tracers or `jax.ShapeDtypeStruct`.
        x: one micro-batch of stage input, the same.
        seed: the seed of the random parameters and inputs ``"measure"`` runs on.

    Returns:
        ``Costs`` in seconds.

    Raises:
        ValueError: an unknown ``source``, a target whose compiler gives no time
            estimate (CPU and GPU targets: use ``"measure"``, or `estimate`), or a stage
            too large for one device of the target.
    """
    shapes = jax.tree_util.tree_map(_struct, (stage_params, x))
    if isinstance(source, str) and source == "measure":
        with jax.ensure_compile_time_eval():  # run now, also while a caller is being traced
            params, inputs = _random_like(shapes, seed)
            return measure(stage_fn, params, inputs)
    devices = getattr(source, "devices", None)
    if isinstance(source, str) or not devices:
        raise ValueError(
            f"costs must be a jaxpipe.schedules.Costs, 'measure' or a jaxpipe.target.Target "
            f"(jaxpipe.target.get('v5p:4x4x8')), got {source!r}"
        )
    name = getattr(source, "name", source)
    try:
        counts = cost_analysis(stage_fn, *shapes, device=devices[0])
    except Exception as e:  # the compiler's out-of-memory error: a JaxRuntimeError
        if "RESOURCE_EXHAUSTED" not in str(e) and "Ran out of memory" not in str(e):
            raise
        says = str(e).strip().splitlines()[0].rstrip(".")
        raise ValueError(
            f"target {name!r}: a target's costs come from compiling one whole stage (all its "
            "parameters, a whole micro-batch of its input) for one device, and that does not "
            f"fit one device's memory (the compiler: {says}). "
            "Pass costs=jaxpipe.schedules.Costs instead, from the actions of one device's "
            "share of the stage (the weights split over tensor, the micro-batch's rows over "
            "the data axes; a scanned stack of blocks as one block times their number): "
            "jaxpipe.costs.cost_analysis(..., device=target.devices[0]), then "
            "jaxpipe.costs.compiler_seconds"
        ) from e
    try:
        return compiler_seconds(counts)
    except ValueError as e:
        raise ValueError(
            f"target {name!r}: its compiler gives no time estimate "
            "per action (only the TPU compiler does); pass costs='measure' to time the stage "
            "here, or Costs from jaxpipe.costs.estimate"
        ) from e


def _random_like(shapes, seed: int):
    """Arrays of ``shapes``: standard normal floats, zeros otherwise."""
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    keys = jax.random.split(jax.random.key(seed), max(len(leaves), 1))
    arrays = [
        jax.random.normal(k, s.shape, s.dtype)
        if jnp.issubdtype(s.dtype, jnp.floating)
        else jnp.zeros(s.shape, s.dtype)
        for k, s in zip(keys, leaves, strict=False)
    ]
    return jax.tree_util.tree_unflatten(treedef, arrays)


# ------------------------------------------------------------------------ estimate
def cost_analysis(
    stage_fn: Callable,
    stage_params: Any,
    x: Any,
    *,
    loss_fn: Callable | None = None,
    loss_params: Any = None,
    target: Any = None,
    device: jax.Device | None = None,
) -> dict[str, dict[str, float | None]]:
    """XLA's flop and byte counts of F, B, W and BW of ``stage_fn``, and its time estimate.

    Each action is compiled for ``device`` and its ``cost_analysis()`` read; nothing runs.

    Args:
        stage_fn: ``stage_fn(stage_params, x) -> y``, one stage.
        stage_params: one stage's parameters: arrays or `jax.ShapeDtypeStruct`.
        x: one micro-batch of stage input (arrays or `jax.ShapeDtypeStruct`).
        loss_fn: ``loss_fn(loss_params, y, target) -> scalar``: the last stage instead.
        loss_params: the loss's parameters (with ``loss_fn``).
        target: one micro-batch of targets (with ``loss_fn``).
        device: the device to compile for (default: the default backend's first). It may
            be a device of a chip this machine does not have, from `jaxpipe.target`
            (``target.get("v5p:2x2x1").devices[0]``): the counts are then that chip's
            compiler's.

    Returns:
        ``{"forward": {"flops": ..., "bytes": ..., "minimal_bytes": ...,
        "optimal_seconds": ..., "precision": ...}, "backward_input": ...}``: ``bytes`` is
        XLA's ``bytes accessed``; ``minimal_bytes`` the bytes of the action's arguments and
        results, each read or written once and nothing else (every intermediate kept on
        chip), about the least memory traffic any compiler can reach; ``optimal_seconds``
        the compiler's own estimate of the action's time on that chip, or None where the
        compiler gives none (the TPU compiler gives one; `compiler_seconds` turns it into
        `Costs`); ``precision`` the peak the stage's dtypes run at, as `estimate` picks it
        (``"bf16"`` if every floating-point input is bfloat16 or float16, else ``"fp32"``),
        which `roofline` uses by default.

    Raises:
        TypeError: ``device`` is not a `jax.Device`.
    """
    lowered = _lowered_actions(
        stage_fn, stage_params, x, loss_fn=loss_fn, loss_params=loss_params, target=target,
        device=device,
    )  # fmt: skip
    return _counts(lowered, _precision_of((stage_params, x, loss_params)))


def _lowered_actions(stage_fn, stage_params, x, *, loss_fn=None, loss_params=None, target=None,
                     device=None) -> dict:  # fmt: skip
    """`cost_analysis`'s tracing: ``{action: (lowered, args)}`` for ``device``. Tracing is
    kept apart from compiling so that a caller compiling in threads can trace one at a
    time (a kernel's custom_vjp is not safe to trace from two threads at once)."""
    actions = _stage_actions(
        stage_fn, stage_params, x, loss_fn=loss_fn, loss_params=loss_params, target=target
    )
    primals = jax.tree_util.tree_map(_struct, actions.primals)
    forward_args = jax.tree_util.tree_map(_struct, actions.forward_args)
    cotangent = jax.tree_util.tree_map(_struct, actions.output)
    calls = _calls(actions, forward_args, primals, actions.kept, cotangent, actions.stash)
    if device is not None and not isinstance(device, jax.Device):
        raise TypeError(
            "device must be a jax.Device (for example jaxpipe.target.get('v5p:2x2x1')"
            f".devices[0]), got {type(device).__name__}"
        )
    on_device = None if device is None else jax.sharding.SingleDeviceSharding(device)
    out = {}
    for name, (fn, args) in calls.items():
        if on_device is not None:
            args = jax.tree_util.tree_map(lambda a: _struct(a, on_device), args)
        out[name] = (fn.lower(*args), activation_bytes((args, jax.eval_shape(fn, *args))))
    return out


def _counts(lowered: dict, precision: str) -> dict[str, dict[str, float | None]]:
    """`cost_analysis`'s compiling: each lowered action compiled and its counts read."""
    out = {}
    for name, (low, minimal_bytes) in lowered.items():
        compiled = low.compile()
        if name == "forward" and hlo.has_loop(compiled.as_text() or ""):
            warnings.warn(
                "the stage compiles to a loop (a while op, from lax.scan, nnx.scan or "
                "fori_loop); XLA's cost analysis counts a loop body once, not once per "
                "iteration, so these counts are too low. Unroll the loop to estimate (a Python "
                "for loop, or lax.scan(..., unroll=True))",
                stacklevel=3,
            )
        analysis = _analysis_dict(compiled.cost_analysis())
        out[name] = {
            "flops": max(float(analysis.get("flops", 0.0)), 0.0),
            "bytes": max(float(analysis.get("bytes accessed", 0.0)), 0.0),
            "minimal_bytes": float(minimal_bytes),
            "optimal_seconds": _optimal_seconds(analysis),
            "precision": precision,
        }
    return out


def _optimal_seconds(analysis: dict) -> float | None:
    """The compiler's ``optimal_seconds``, or None where it gives none (or a negative one)."""
    seconds = analysis.get("optimal_seconds")
    return float(seconds) if seconds is not None and seconds >= 0 else None


def compiler_seconds(counts: dict[str, dict], *, communication: float = 0.0) -> Costs:
    """`Costs` in seconds from the compiler's own time estimate of each action.

    Where `roofline` assumes the chip's peak or its memory bandwidth, whichever binds, this
    is the compiler's model of the program it built (``benchmarks/predict.py --compiler``
    compares the two).

    Args:
        counts: `cost_analysis` of the stage compiled for a device whose compiler gives
            ``optimal_seconds`` (a TPU: ``device=jaxpipe.target.get("v5p:2x2x1").devices[0]``).
        communication: seconds to send one activation, passed through.

    Returns:
        ``Costs(forward, backward_input, backward_weight, full_backward, communication)``.

    Raises:
        ValueError: ``counts`` not from `cost_analysis`, or without the compiler's estimate.
    """
    if not isinstance(counts, dict) or set(counts) != set(ACTIONS):
        got = sorted(counts) if isinstance(counts, dict) else type(counts).__name__
        raise ValueError(
            f"counts must be a dict with keys {ACTIONS} (from jaxpipe.costs.cost_analysis), "
            f"got {got}"
        )
    missing = [name for name, c in counts.items() if c.get("optimal_seconds") is None]
    if missing:
        raise ValueError(
            f"the compiler gave no optimal_seconds for {missing}: compile for a device whose "
            "compiler estimates time, cost_analysis(..., device=jaxpipe.target.get("
            '"v5p:2x2x1").devices[0]) (needs libtpu), or use roofline'
        )
    if not (positive_number(communication) or communication == 0):
        raise ValueError(f"communication must be seconds >= 0 (finite), got {communication!r}")
    seconds = {name: float(c["optimal_seconds"]) for name, c in counts.items()}
    return Costs(**seconds, communication=float(communication))


def _precision_of(trees) -> str:
    dtypes = {
        np.dtype(a.dtype)
        for a in jax.tree_util.tree_leaves(trees)
        if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)
    }
    low = {np.dtype(jnp.bfloat16), np.dtype(jnp.float16)}
    return "bf16" if dtypes and dtypes <= low else "fp32"


def estimate(
    stage_fn: Callable,
    stage_params: Any,
    x: Any,
    accelerator: str | Accelerator = "H100",
    *,
    loss_fn: Callable | None = None,
    loss_params: Any = None,
    target: Any = None,
    precision: str | None = None,
    efficiency: float = 1.0,
    communication: float | None = None,
    bandwidth: float | None = None,
    traffic: str = "compiled",
) -> Costs:
    """Predicts F, B, W and BW of ``stage_fn`` on ``accelerator``; returns `Costs` in seconds.

    A roofline per action: ``max(flops / peak, bytes / memory_bandwidth) / efficiency``,
    with ``flops`` and ``bytes`` from XLA's ``cost_analysis()`` of the action compiled for
    the local backend (see `cost_analysis`). Assumptions: the action runs at the chip's
    dense peak or its memory bandwidth, whichever binds, with compute and memory traffic
    fully overlapped; the byte count is the local compiler's (on CPU it fuses less than
    GPU/TPU compilers and computes bfloat16 in float32, so memory-bound figures are upper
    bounds); a single chip runs the stage; nothing else (optimizer, gradient reduction,
    launch latency) is counted. It is an estimate, not a measurement.

    Args:
        stage_fn: ``stage_fn(stage_params, x) -> y``, one stage.
        stage_params: one stage's parameters: arrays or `jax.ShapeDtypeStruct` (nothing
            runs, so the shapes of a large model suffice).
        x: one micro-batch of stage input (arrays or `jax.ShapeDtypeStruct`).
        accelerator: a name from `ACCELERATORS` or an `Accelerator`.
        precision: ``"bf16"`` (the chip's ``peak_flops``) or ``"fp32"``
            (``peak_flops_fp32``); None picks ``"bf16"`` if every floating-point input is
            bfloat16 or float16, else ``"fp32"``.
        efficiency: fraction of the roofline reached, in (0, 1]; times are divided by it.
        communication: seconds to send one activation, passed through.
        bandwidth: bytes/s of the link to the next stage; None uses the accelerator's
            ``interconnect_bandwidth`` (within a node or slice; 0 if unknown). The result's
            ``communication`` is ``activation_bytes(x) / bandwidth``.
        traffic: ``"compiled"``: the bytes XLA counts (an upper bound when compiled on
            CPU); ``"minimal"``: the action's arguments and results only, each moved once
            (a lower bound).
        loss_fn: ``loss_fn(loss_params, y, target) -> scalar``: the last stage instead.
        loss_params: the loss's parameters (with ``loss_fn``).
        target: one micro-batch of targets (with ``loss_fn``).

    Returns:
        ``Costs(forward, backward_input, backward_weight, full_backward, communication)``,
        in seconds.
    """
    _check_tree("stage_params", stage_params, allow_structs=True, allow_empty=True)
    _check_tree("x", x, allow_structs=True)
    chip = get_accelerator(accelerator)
    if precision is None:
        precision = _precision_of((stage_params, x, loss_params))
    _roofline_arguments(chip, precision, efficiency)  # fail before compiling
    if traffic not in TRAFFIC:
        raise ValueError(f"traffic must be one of {tuple(TRAFFIC)}, got {traffic!r}")
    if communication is None and bandwidth is None:
        bandwidth = chip.interconnect_bandwidth
    comm = _communication(x, communication, bandwidth)
    counts = cost_analysis(
        stage_fn, stage_params, x, loss_fn=loss_fn, loss_params=loss_params, target=target
    )
    return roofline(
        counts,
        chip,
        precision=precision,
        efficiency=efficiency,
        communication=comm,
        traffic=traffic,
    )


def _roofline_arguments(accelerator, precision, efficiency) -> tuple[Accelerator, float]:
    chip = get_accelerator(accelerator)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if not positive_number(efficiency) or efficiency > 1:
        raise ValueError(
            f"efficiency must be in (0, 1] (the fraction of peak reached), got {efficiency!r}"
        )
    return chip, chip.peak(precision)


def roofline(
    counts: dict[str, dict[str, float]],
    accelerator: str | Accelerator = "H100",
    *,
    precision: str | None = None,
    efficiency: float = 1.0,
    communication: float = 0.0,
    traffic: str = "compiled",
) -> Costs:
    """`Costs` in seconds from flop and byte counts (the output of `cost_analysis`).

    Each action takes ``max(flops / peak, bytes / memory_bandwidth) / efficiency``. One
    `cost_analysis` serves every accelerator: `estimate` is `cost_analysis` followed by
    `roofline`, and gives the same `Costs`.

    Args:
        counts: `cost_analysis` of a stage.
        accelerator: a name from `ACCELERATORS` or an `Accelerator`.
        precision: ``"bf16"`` or ``"fp32"``: which of the accelerator's peaks is ``peak``.
            None: the precision `cost_analysis` read from the stage's dtypes, as
            `estimate` picks it (``"bf16"`` for counts that do not say).
        efficiency: fraction of the roofline reached, in (0, 1].
        communication: seconds to send one activation, passed through.
        traffic: ``"compiled"``: ``bytes`` is XLA's count; ``"minimal"``: the action's
            arguments and results only (a lower bound).

    Returns:
        ``Costs(forward, backward_input, backward_weight, full_backward, communication)``.

    Raises:
        ValueError: an unknown precision or traffic, an efficiency outside (0, 1], or
            ``counts`` not from `cost_analysis`.
    """
    if not isinstance(counts, dict) or set(counts) != set(ACTIONS):
        got = sorted(counts) if isinstance(counts, dict) else type(counts).__name__
        raise ValueError(
            f"counts must be a dict with keys {ACTIONS} (from jaxpipe.costs.cost_analysis), "
            f"got {got}"
        )
    if traffic not in TRAFFIC:
        raise ValueError(f"traffic must be one of {tuple(TRAFFIC)}, got {traffic!r}")
    key = TRAFFIC[traffic]
    if precision is None:
        precision = counts["forward"].get("precision", "bf16")
    chip, peak = _roofline_arguments(accelerator, precision, efficiency)
    seconds = {
        name: max(c["flops"] / peak, c[key] / chip.memory_bandwidth) / efficiency
        for name, c in counts.items()
    }
    return Costs(**seconds, communication=communication)


# ------------------------------------------------------------------------ predict
class Prediction(NamedTuple):
    """Step time and bubble of one schedule under given costs (time unit of the costs)."""

    step_time: float  # lock-step makespan: how the executor runs the table
    ideal_step_time: float  # every action as soon as its inputs and device are free
    lockstep_bubble: float
    ideal_bubble: float


def predict(schedule: Schedule, costs: Costs) -> Prediction:
    """Step time and bubble of ``schedule`` under ``costs``, in lock-step and ideal.

    The figures of `jaxpipe.schedules.simulate` in both modes: the pipeline part of one
    step (every F, B, W of every micro-batch and the sends between devices).

    Args:
        schedule: a `jaxpipe.schedules.Schedule`.
        costs: per-action costs (`measure`, `estimate`).

    Returns:
        A `Prediction`, in the unit of ``costs`` (seconds for `measure` and `estimate`).

    Raises:
        TypeError: ``schedule`` or ``costs`` of another type.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(
            f"schedule must be a jaxpipe.schedules.Schedule (from schedules.get(name, S, M)), "
            f"got {type(schedule).__name__}"
        )
    if not isinstance(costs, Costs):
        raise TypeError(
            f"costs must be a jaxpipe.schedules.Costs (from measure or estimate), "
            f"got {type(costs).__name__}"
        )
    lockstep = simulate(schedule, costs, "lockstep")
    ideal = simulate(schedule, costs, "ideal")
    return Prediction(lockstep.makespan, ideal.makespan, lockstep.bubble, ideal.bubble)
