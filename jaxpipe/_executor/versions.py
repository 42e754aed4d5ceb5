"""Weight versions for schedules that update weights inside the pipeline (PipeDream family).

Each device keeps ``plan.num_version_slots`` copies of its stage's weights, stacked on a
leading axis; an action reads the slot the plan names, and at an update tick the optimizer
turns the newest version and the gradients accumulated since the previous update into a new
version, written (in place) to the slot the plan names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import optax
from jax import lax

if TYPE_CHECKING:
    from jaxpipe._executor.state import State

tree_map = jax.tree_util.tree_map


def stack(params, slots: int):
    """``slots`` weight versions of ``params``, version 0 (the given weights) in slot 0."""
    return tree_map(lambda p: jnp.zeros((slots, *p.shape), p.dtype).at[0].set(p), params)


def select(versions, slot):
    """The weights in version slot ``slot`` (a traced index)."""
    return tree_map(lambda v: lax.dynamic_index_in_dim(v, slot, 0, keepdims=False), versions)


def update(optimizer: optax.GradientTransformation, state: State, col) -> State:
    """Applies the optimizer where the plan says (column ``update``); a no-op elsewhere."""
    is_update = col["update"] == 1

    def apply(versions, opt_state, grads):
        newest = select(versions, col["update_from"])
        size = col["update_size"].astype(jnp.float32)
        one_stage = tree_map(lambda p: p[0], newest)
        mean_grad = tree_map(lambda g, p: (g[0] / size).astype(p.dtype), grads, one_stage)
        updates, opt_state = optimizer.update(mean_grad, opt_state, one_stage)
        new = optax.apply_updates(one_stage, updates)
        return tree_map(lambda p: p[None], new), opt_state

    def keep(versions, opt_state, grads):
        zeros = tree_map(lambda v: jnp.zeros(v.shape[1:], v.dtype), versions)
        return zeros, opt_state

    new, opt_state = lax.cond(is_update, apply, keep, state.versions, state.opt_state, state.grads)
    slot = col["update_to"]
    versions = tree_map(
        lambda v, n: v.at[slot].set(jnp.where(is_update, n, v[slot])), state.versions, new
    )
    grads = tree_map(lambda g: jnp.where(is_update, jnp.zeros_like(g), g), state.grads)
    return state._replace(versions=versions, opt_state=opt_state, grads=grads)
