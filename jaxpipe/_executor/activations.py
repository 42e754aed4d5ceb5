"""The structure of what flows between stages: a pytree of arrays, some of them floats.

Activations may hold integer and boolean leaves (token ids, masks) next to float ones. Only
float leaves have gradients: cotangents are kept as the list of float leaves, and are turned
back into a full cotangent tree (``float0`` zeros for the others) only where ``jax.vjp``
needs one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_float(struct) -> bool:
    return jnp.issubdtype(struct.dtype, jnp.inexact)


@dataclasses.dataclass(frozen=True)
class Activation:
    """Shapes and dtypes of one micro-batch's activation pytree (per device)."""

    treedef: Any
    leaves: tuple[jax.ShapeDtypeStruct, ...]

    @classmethod
    def like(cls, tree) -> Activation:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        structs = tuple(jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in leaves)
        return cls(treedef, structs)

    @property
    def float_leaves(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        return tuple(s for s in self.leaves if is_float(s))

    def unflatten(self, leaves):
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def zeros(self):
        """A tree of zeros of this structure."""
        return self.unflatten([jnp.zeros(s.shape, s.dtype) for s in self.leaves])

    def floats(self, tree) -> list:
        """The float leaves of ``tree`` (a tree of this structure), in leaf order."""
        leaves = self.treedef.flatten_up_to(tree)
        return [x for x, s in zip(leaves, self.leaves, strict=True) if is_float(s)]

    def float_zeros(self) -> list:
        return [jnp.zeros(s.shape, s.dtype) for s in self.float_leaves]

    def cotangent(self, floats: list):
        """The full cotangent tree from its float leaves (``float0`` zeros elsewhere)."""
        it = iter(floats)
        leaves = [
            next(it).astype(s.dtype) if is_float(s) else np.zeros(s.shape, jax.dtypes.float0)
            for s in self.leaves
        ]
        return self.unflatten(leaves)

    def float_cotangents(self, cotangent) -> list:
        """The float leaves of a cotangent tree returned by ``jax.vjp``."""
        leaves = self.treedef.flatten_up_to(cotangent)
        return [x for x, s in zip(leaves, self.leaves, strict=True) if is_float(s)]


def slot_buffer(slots: int, structs) -> list:
    """One ``[slots, ...]`` zero buffer per struct."""
    return [jnp.zeros((slots, *s.shape), s.dtype) for s in structs]


def read(buffers: list, slot) -> list:
    return [b[slot] for b in buffers]


def write(buffers: list, slot, values: list) -> list:
    return [b.at[slot].set(v.astype(b.dtype)) for b, v in zip(buffers, values, strict=True)]


def float_leaves(tree) -> list:
    """The float leaves of ``tree``, in leaf order (what has a gradient)."""
    return [x for x in jax.tree_util.tree_leaves(tree) if is_float(x)]


def with_floats(tree, floats: list):
    """``tree`` with its float leaves replaced, in leaf order, by ``floats``."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    it = iter(floats)
    return treedef.unflatten([next(it) if is_float(x) else x for x in leaves])
