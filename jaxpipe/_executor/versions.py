"""Weight updates: the optimizer step of one stage, and the weight versions of plans that
update weights inside the pipeline (PipeDream family).

`step` is the one place the optimizer is applied. A plan with an ``update`` column applies
it inside the loop, where the column says (`update`); every other plan applies it once per
stage after the schedule, from the gradient of the step's loss
(`jaxpipe._executor.steps.update`).

For the first kind, each device keeps ``plan.num_version_slots`` copies of its stage's
weights, stacked on a leading axis; an action reads the slot the plan names, and at an
update tick the optimizer turns the newest version and the gradients accumulated since the
previous update into a new version, written (in place) to the slot the plan names.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax import lax

tree_map = jax.tree_util.tree_map


def step(optimizer: optax.GradientTransformation, grads, opt_state, params):
    """One optimizer step of one stage.

    Args:
      optimizer: the optax transformation.
      grads: the stage's gradient of the step's loss, in the parameters' dtypes.
      opt_state: the stage's optimizer state.
      params: the stage's parameters.

    Returns:
      ``(params, opt_state)``, both updated.
    """
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def stack(params, slots: int):
    """``slots`` weight versions of ``params``, version 0 (the given weights) in slot 0."""
    return tree_map(lambda p: jnp.zeros((slots, *p.shape), p.dtype).at[0].set(p), params)


def select(versions, slot):
    """The weights in version slot ``slot`` (a traced index)."""
    return tree_map(lambda v: lax.dynamic_index_in_dim(v, slot, 0, keepdims=False), versions)


def update(optimizer: optax.GradientTransformation, versions, opt_state, grads, col):
    """Applies the optimizer where the plan says (column ``update``); a no-op elsewhere.

    Args:
      optimizer: the optax transformation.
      versions: the device's weight versions, leaves ``[slots, 1, ...]``.
      opt_state: the device's optimizer state.
      grads: the weight gradients accumulated since the previous update, ``[1, ...]``.
      col: this device's row of the plan, by column name.

    Returns:
      ``(versions, opt_state, grads)``: at an update tick the new version written to slot
      ``update_to``, the new state, and zeroed gradients; elsewhere all three unchanged.
    """
    is_update = col["update"] == 1

    def apply(versions, opt_state, grads):
        newest = select(versions, col["update_from"])
        size = col["update_size"].astype(jnp.float32)
        one_stage = tree_map(lambda p: p[0], newest)
        mean_grad = tree_map(lambda g, p: (g[0] / size).astype(p.dtype), grads, one_stage)
        new, opt_state = step(optimizer, mean_grad, opt_state, one_stage)
        return tree_map(lambda p: p[None], new), opt_state

    def keep(versions, opt_state, grads):
        zeros = tree_map(lambda v: jnp.zeros(v.shape[1:], v.dtype), versions)
        return zeros, opt_state

    new, opt_state = lax.cond(is_update, apply, keep, versions, opt_state, grads)
    slot = col["update_to"]
    versions = tree_map(
        lambda v, n: v.at[slot].set(jnp.where(is_update, n, v[slot])), versions, new
    )
    grads = tree_map(lambda g: jnp.where(is_update, jnp.zeros_like(g), g), grads)
    return versions, opt_state, grads
