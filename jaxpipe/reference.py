"""The model a pipeline computes, run without one: the definition tests and benchmarks hold
the pipeline to.

``loss(...)`` applies every logical stage in order to every micro-batch, on one device, with
the keywords a `jaxpipe.pipeline.Pipeline` passes (``side``: the micro-batch's side inputs;
``key``: ``fold_in(fold_in(key, m), s)`` for micro-batch ``m`` and logical stage ``s``, and
``fold_in(fold_in(key, m), N)`` for the loss after the ``N`` stages, so its random numbers are
its own; ``stage``: ``s``, ``N - 1`` for the loss), and returns the mean of ``loss_fn`` over
micro-batches. Its gradients are
the pipeline's, to floating-point rounding, under every schedule.

With ``R > 1`` data-parallel replicas and a ``key``, the pipeline's loss is the mean over
replicas ``r`` of ``loss`` on replica ``r``'s rows (the ``r``-th of ``R`` contiguous blocks
of the batch) with the key ``fold_in(key, r)``: each replica draws its own random numbers.
Without a key, the split makes no difference (``loss_fn`` a mean over rows).

``accumulation_step(...)`` is the plain training step people write without a pipeline: a
``lax.scan`` over micro-batches of ``jax.value_and_grad``, gradients added into the carry.
Its memory and time are what the pipeline's are measured against.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

tree_map = jax.tree_util.tree_map
KEYWORDS = ("key", "side", "stage")

__all__ = ["accumulation_step", "loss", "microbatch", "keywords_of"]


def keywords_of(fn) -> set[str]:
    """The names among ``key``, ``side``, ``stage`` that ``fn`` accepts as keywords (all of
    them if it takes ``**kwargs``).

    Args:
      fn: a stage or loss function.

    Returns:
      The set of keyword names to pass.
    """
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return set(KEYWORDS)
    return {p.name for p in parameters if p.name in KEYWORDS}


def microbatch(tree, m: int, num_microbatches: int):
    """Micro-batch ``m`` of a batch pytree: the ``m``-th of ``M`` contiguous blocks of rows
    of every leaf (the pipeline's split with one replica).

    Args:
      tree: a batch pytree, rows on axis 0.
      m: the micro-batch.
      num_microbatches: ``M``.

    Returns:
      ``tree`` with every leaf cut to micro-batch ``m``'s rows.
    """
    return tree_map(lambda a: split(a, num_microbatches)[m], tree)


def split(a, num_microbatches: int):
    """``[B, ...] -> [M, B // M, ...]``: micro-batch ``m`` is the ``m``-th block of rows.

    Args:
      a: an array, rows on axis 0.
      num_microbatches: ``M``.

    Returns:
      The array reshaped to ``[M, B // M, ...]``.
    """
    return a.reshape(num_microbatches, a.shape[0] // num_microbatches, *a.shape[1:])


def loss(
    stage_fn: Callable,
    loss_fn: Callable,
    stage_params,
    loss_params,
    inputs,
    targets,
    num_microbatches: int,
    *,
    side=None,
    key=None,
):
    """Mean over micro-batches of ``loss_fn`` after every stage in order.

    ``stage_params`` leaves are in logical stage order, ``[S * v, ...]`` (`Pipeline.logical`).
    Micro-batch ``m`` is the ``m``-th block of ``B // M`` rows (`microbatch`). The stages run as a
    ``lax.scan`` over the stage axis inside a ``lax.scan`` over micro-batches, so a stage is
    traced and compiled once however many stages and micro-batches there are; the loss
    values are added in micro-batch order.

    Args:
      stage_fn: ``(params, x, **keywords) -> y``.
      loss_fn: ``(loss_params, y, target, **keywords) -> scalar``.
      stage_params: logical stage parameters, leaves ``[N, ...]``.
      loss_params: the loss function's parameters.
      inputs: the batch of inputs, a pytree with rows on axis 0.
      targets: the batch of targets, a pytree with rows on axis 0.
      num_microbatches: ``M``.
      side: side inputs, a pytree with rows on axis 0, or None.
      key: a PRNG key, or None.

    Returns:
      The mean loss, a scalar.
    """
    M = num_microbatches
    stage_kw, loss_kw = keywords_of(stage_fn), keywords_of(loss_fn)
    num_stages = jax.tree_util.tree_leaves(stage_params)[0].shape[0]

    def one_microbatch(_, batch):
        m, h, target, mb_side = batch
        mb_key = None if key is None else jax.random.fold_in(key, m)

        def one_stage(h, stage):
            s, params = stage
            values = _keywords(mb_side, mb_key, s)
            return stage_fn(params, h, **_pick(values, stage_kw)), None

        stages = (jnp.arange(num_stages, dtype=jnp.int32), stage_params)
        h, _ = lax.scan(one_stage, h, stages)
        values = _keywords(mb_side, mb_key, jnp.int32(num_stages - 1))  # the last stage's
        if mb_key is not None:  # the loss's own key: the one a stage N would get
            values["key"] = jax.random.fold_in(mb_key, num_stages)
        return None, loss_fn(loss_params, h, target, **_pick(values, loss_kw))

    batches = (
        jnp.arange(M, dtype=jnp.int32),
        tree_map(lambda a: split(a, M), inputs),
        tree_map(lambda a: split(a, M), targets),
        None if side is None else tree_map(lambda a: split(a, M), side),
    )
    _, values = lax.scan(one_microbatch, None, batches)
    total = values[0]
    for m in range(1, M):
        total = total + values[m]
    return total / M


def _keywords(side, key, stage) -> dict:
    return {
        "side": side,
        "key": None if key is None else jax.random.fold_in(key, stage),
        "stage": stage,
    }


def accumulation_step(stage_fn: Callable, loss_fn: Callable, num_microbatches: int):
    """``jit(step)`` with ``step(stage_params, loss_params, inputs, targets, side=None,
    key=None) -> (loss, (stage_grads, loss_grads))``: every stage of ``stage_params`` (leaves
    ``[N, ...]``, applied in order) and the loss on one micro-batch at a time, a ``lax.scan``
    over the micro-batches of ``jax.value_and_grad``, the gradients summed in the carry and
    averaged. Each function gets the keywords it names as a pipeline passes them (`loss`):
    ``side`` (the micro-batch's rows of the batch pytree ``side``), ``key`` and ``stage``;
    so the step's loss is `loss`'s.

    Args:
      stage_fn: ``(params, x, **keywords) -> y``.
      loss_fn: ``(loss_params, y, target, **keywords) -> scalar``.
      num_microbatches: ``M``.

    Returns:
      The jitted ``step``.
    """
    M = num_microbatches
    stage_kw, loss_kw = keywords_of(stage_fn), keywords_of(loss_fn)

    def step(stage_params, loss_params, inputs, targets, side=None, key=None):
        num_stages = jax.tree_util.tree_leaves(stage_params)[0].shape[0]
        extra = {} if side is None else {"side": side}

        def one_loss(p, lp, x, t, s, m):
            mb_key = None if key is None else jax.random.fold_in(key, m)
            for k in range(num_stages):
                values = _keywords(s, mb_key, jnp.int32(k))
                x = stage_fn(tree_map(lambda a, k=k: a[k], p), x, **_pick(values, stage_kw))
            values = _keywords(s, mb_key, jnp.int32(num_stages - 1))
            if mb_key is not None:  # the loss's own key, as in `loss`
                values["key"] = jax.random.fold_in(mb_key, num_stages)
            return loss_fn(lp, x, t, **_pick(values, loss_kw))

        def one(total, batch):
            value, grads = jax.value_and_grad(one_loss, argnums=(0, 1))(
                stage_params, loss_params, batch["x"], batch["t"], batch.get("side"), batch["m"]
            )
            return tree_map(jnp.add, total, grads), value

        zeros = tree_map(jnp.zeros_like, (stage_params, loss_params))
        batches = tree_map(lambda a: split(a, M), {"x": inputs, "t": targets, **extra})
        batches["m"] = jnp.arange(M, dtype=jnp.int32)
        grads, values = lax.scan(one, zeros, batches)
        return jnp.mean(values), tree_map(lambda g: g / M, grads)

    return jax.jit(step)


def _pick(values: dict, accepted: set) -> dict:
    return {k: v for k, v in values.items() if k in accepted and v is not None}
