"""A mixture-of-experts layer for pipeline stages, with expert parallelism.

`MoE` is a Flax NNX module: a router sends each token to its ``top_k`` experts (SwiGLU
MLPs), optional shared experts see every token, and each expert takes at most a capacity
of tokens per group; the tokens beyond it are dropped (their expert contributes nothing)
and counted. With ``expert_axis`` the layer runs inside a `jaxpipe.Pipeline` built with
the same ``expert_axis``: each device holds ``E / e`` of the experts and tokens travel to
their experts' devices and back with ``jax.lax.all_to_all`` over that axis. With
``expert_axis=None`` the same code is the plain model, every expert on one device.

Tokens are routed in groups: the tokens of one row of the input (``x[i]``), or
consecutive blocks of ``group_size`` tokens. Capacity and the load-balancing loss are per
group, so a group's tokens are kept or dropped alike wherever the group is computed: a
pipeline that splits the batch into micro-batches and replicas drops exactly the tokens
the plain model drops, as long as a replica's rows of a micro-batch hold whole groups.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P


class ExpertParam(nnx.Param):
    """A parameter with a leading experts dimension ``[E, ...]`` (of any rank: ``[E, d, h]``
    weights, ``[E, h]`` biases): split over the expert axis in a pipeline (`expert_specs`),
    never gathered. It records its rank when made (metadata ``expert_ndim``), so the experts'
    dimension is found after stage and block axes are stacked in front."""

    def __init__(self, value, **metadata):
        metadata.setdefault("expert_ndim", len(jnp.shape(value)))
        super().__init__(value, **metadata)


class MoEStats(NamedTuple):
    """What a `MoE` call reports besides its output.

    Attributes:
      load_balance: the load-balancing loss, ``E * sum_e f_e * p_e`` per group (``f_e``:
        the fraction of the group's token choices routed to expert ``e`` before capacity;
        ``p_e``: the group's mean router probability of ``e``), averaged over groups; 1
        when routing is uniform. A float32 scalar.
      router_z: the router z-loss, the mean over tokens of ``logsumexp(logits) ** 2``. A
        float32 scalar.
      dropped: per token (the input's shape without its last dimension), how many of its
        ``top_k`` choices were dropped for capacity. int32.
    """

    load_balance: jax.Array
    router_z: jax.Array
    dropped: jax.Array


class MoE(nnx.Module):
    """Top-k routed SwiGLU experts with optional shared experts.

    ``y = sum_j w_j * expert_{e_j}(x) + shared(x)`` over the token's ``top_k`` experts
    ``e_j`` that still had room, ``w_j`` their router probabilities (renormalised over the
    ``top_k`` with ``normalize_weights``).

    Args:
      width: the model width (input and output features).
      hidden: the hidden width of one expert.
      num_experts: ``E``, the routed experts.
      rngs: an ``nnx.Rngs`` for the initial weights.
      top_k: how many experts each token goes to (>= 1).
      num_shared_experts: shared experts (each of width ``hidden``) every token goes
        through, as one SwiGLU MLP of hidden width ``num_shared_experts * hidden``.
      capacity_factor: each expert takes at most
        ``ceil(capacity_factor * top_k * group_size / E)`` tokens of a group; choices
        beyond it are dropped (choices ranked first by the rank of the choice, then by
        token order). None: no token is ever dropped; without an expert axis the experts
        then run as grouped matmuls (``jax.lax.ragged_dot``) over the token choices
        sorted by expert; with an expert axis each expert's buffer holds a whole group.
      group_size: tokens per routing group (a positive int), consecutive in the flattened
        input; None: each row ``x[i]`` of the input is a group, so the input must be
        ``[rows, tokens, ..., width]`` (a 2-D ``[tokens, width]`` is refused: every token
        would be its own group, never dropped, its load-balancing loss its own).
      normalize_weights: renormalise each token's ``top_k`` router probabilities to sum
        to 1. None (the default): when ``top_k > 1``. With ``top_k = 1`` the weight
        stays the router's probability (as Switch Transformer's): renormalised it would
        be 1, and the router would learn from the auxiliary losses only.
      expert_axis: the mesh axis the experts are split over inside a pipeline (the
        Pipeline's ``expert_axis``), or None: every expert is local.
      param_dtype: the parameters' dtype.

    Raises:
      ValueError: ``top_k`` not in ``1..E``, a capacity factor that is not positive, a
        ``group_size`` that is neither None nor a positive int, or
        ``normalize_weights=True`` with ``top_k = 1``.
    """

    def __init__(
        self,
        width: int,
        hidden: int,
        num_experts: int,
        *,
        rngs: nnx.Rngs,
        top_k: int = 2,
        num_shared_experts: int = 0,
        capacity_factor: float | None = 1.25,
        group_size: int | None = None,
        normalize_weights: bool | None = None,
        expert_axis: str | None = None,
        param_dtype=jnp.float32,
    ):
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"top_k={top_k} must be between 1 and num_experts={num_experts}: each token "
                "goes to top_k different experts"
            )
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(
                f"capacity_factor={capacity_factor} must be positive (1.0: an expert takes its "
                "even share of a group's token choices), or None for no dropped tokens"
            )
        if group_size is not None and (
            isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1
        ):
            raise ValueError(
                f"group_size={group_size!r} must be a positive int (tokens per routing "
                "group), or None for one group per row of the input"
            )
        if normalize_weights and top_k == 1:
            raise ValueError(
                "normalize_weights=True with top_k=1 makes every routed token's weight 1, so "
                "the task loss gives the router no gradient; leave normalize_weights=None "
                "(the router's probability weighs the expert, as in Switch Transformer)"
            )
        if normalize_weights is None:
            normalize_weights = top_k > 1
        init = nnx.initializers.lecun_normal()
        E = num_experts
        self.router = nnx.Param(init(rngs.params(), (width, E), param_dtype))
        self.gate = ExpertParam(init(rngs.params(), (E, width, hidden), param_dtype))
        self.up = ExpertParam(init(rngs.params(), (E, width, hidden), param_dtype))
        self.down = ExpertParam(init(rngs.params(), (E, hidden, width), param_dtype))
        shared = num_shared_experts * hidden
        if shared:
            self.shared_gate = nnx.Param(init(rngs.params(), (width, shared), param_dtype))
            self.shared_up = nnx.Param(init(rngs.params(), (width, shared), param_dtype))
            self.shared_down = nnx.Param(init(rngs.params(), (shared, width), param_dtype))
        self.num_experts = E
        self.top_k = top_k
        self.num_shared_experts = num_shared_experts
        self.capacity_factor = capacity_factor
        self.group_size = group_size
        self.normalize_weights = normalize_weights
        self.expert_axis = expert_axis

    def capacity(self, group_size: int) -> int:
        """The most token choices one expert takes from a group of ``group_size`` tokens."""
        if self.capacity_factor is None:
            return group_size
        share = self.capacity_factor * self.top_k * group_size / self.num_experts
        return min(group_size, max(1, math.ceil(share)))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, MoEStats]:
        """The layer on ``x``.

        Args:
          x: ``[rows, ..., width]`` tokens.

        Returns:
          ``(y, stats)``: ``y`` of ``x``'s shape and dtype, and `MoEStats`.

        Raises:
          ValueError: the tokens do not split into whole groups, ``x`` has fewer than 3
            dimensions and ``group_size`` is None, or the local experts times the expert
            axis's size is not ``E``.
        """
        E, k = self.num_experts, self.top_k
        if self.group_size is None and x.ndim < 3:
            raise ValueError(
                f"the MoE layer got input of shape {x.shape} with group_size=None, which "
                "routes each row x[i] as one group: on [tokens, width] every token would be "
                "its own group (capacity 1, nothing dropped, a load-balancing loss per "
                "token). Pass the input as [batch, tokens, width], or set group_size"
            )
        width = x.shape[-1]
        tokens = x.reshape(-1, width)
        group = self.group_size or tokens.shape[0] // x.shape[0]
        if tokens.shape[0] % group:
            raise ValueError(
                f"the MoE layer's {tokens.shape[0]} tokens (input {x.shape}) do not split "
                f"into groups of group_size={group}; pick a group size that divides the "
                "tokens of each replica's micro-batch"
            )
        groups = tokens.reshape(-1, group, width)  # [G, g, width]
        capacity = self.capacity(group)

        logits = jnp.einsum(
            "gtd,de->gte", groups.astype(jnp.float32), self.router[...].astype(jnp.float32)
        )
        probs = jax.nn.softmax(logits, axis=-1)
        _, experts = lax.top_k(lax.stop_gradient(probs), k)  # [G, g, k]
        chosen = jax.nn.one_hot(experts, E, dtype=jnp.int32)  # [G, g, k, E]
        # the chosen probabilities read by a product, not a gather: the backward is a
        # product too (a gather's is a scatter-add)
        weights = jnp.einsum("gte,gtke->gtk", probs, chosen.astype(probs.dtype))
        if self.normalize_weights:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        if self.capacity_factor is None and self.expert_axis is None:
            routed = self._grouped(tokens, experts.reshape(-1, k), weights.reshape(-1, k))
            kept = jnp.ones(experts.shape, bool)
        else:
            routed, kept = self._buffered(groups, chosen, weights, capacity)
        y = routed.reshape(x.shape)
        if self.num_shared_experts:
            y = y + _swiglu(x, self.shared_gate[...], self.shared_up[...], self.shared_down[...])
        y = y.astype(x.dtype)  # parameters of a wider dtype would promote it

        fraction = jnp.mean(jnp.sum(chosen, axis=2), axis=1) / k  # [G, E]
        load_balance = E * jnp.mean(jnp.sum(fraction * jnp.mean(probs, axis=1), axis=-1))
        router_z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
        dropped = (k - jnp.sum(kept, axis=-1)).astype(jnp.int32).reshape(x.shape[:-1])
        return y, MoEStats(load_balance=load_balance, router_z=router_z, dropped=dropped)

    def _buffered(self, groups, chosen, weights, capacity):
        """The routed experts' output ``[G, g, width]`` through per-expert buffers of
        ``capacity`` slots per group, and which choices found a slot ``[G, g, k]``."""
        k, E, group = self.top_k, self.num_experts, groups.shape[1]
        # a choice's place in its expert's buffer: first choices before second ones, then
        # token order
        by_rank = jnp.swapaxes(chosen, 1, 2).reshape(chosen.shape[0], k * group, E)
        place = jnp.cumsum(by_rank, axis=1) - 1
        place = jnp.swapaxes(place.reshape(-1, k, group, E), 1, 2)  # [G, g, k, E]
        position = jnp.sum(place * chosen, axis=-1)  # [G, g, k]
        kept = position < capacity
        dtype = groups.dtype
        slot = jax.nn.one_hot(jnp.where(kept, position, capacity), capacity, dtype=dtype)
        dispatch = jnp.einsum("gtke,gtkc->gtec", chosen.astype(dtype), slot)
        combine = jnp.einsum(
            "gtke,gtkc,gtk->gtec", chosen.astype(jnp.float32), slot.astype(jnp.float32), weights
        ).astype(dtype)
        expert_in = jnp.einsum("gtec,gtd->egcd", dispatch, groups)  # [E, G, C, width]
        expert_out = self._experts(expert_in)
        return jnp.einsum("gtec,egcd->gtd", combine, expert_out), kept

    def _grouped(self, tokens, experts, weights):
        """The routed experts' output ``[N, width]`` with no buffers: the ``N * k`` token
        choices sorted by expert, each expert's run of them one grouped matmul
        (``jax.lax.ragged_dot``)."""
        N, k = experts.shape
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
        sorted_in = tokens[order // k]  # [N * k, width]
        hidden = jax.nn.silu(lax.ragged_dot(sorted_in, self.gate[...], sizes))
        hidden = hidden * lax.ragged_dot(sorted_in, self.up[...], sizes)
        sorted_out = lax.ragged_dot(hidden, self.down[...], sizes)
        out = sorted_out[jnp.argsort(order)].reshape(N, k, -1)  # back in token order
        return jnp.einsum("nkd,nk->nd", out, weights.astype(out.dtype))

    def _experts(self, expert_in):
        """The experts on their buffers ``[E, G, C, width]``: over the expert axis, each
        device's buffers for other devices' experts are sent there, its own experts run on
        every device's buffers for them, and the results go back."""
        gate, up, down = self.gate[...], self.up[...], self.down[...]
        if self.expert_axis is not None:
            local, size = gate.shape[0], lax.axis_size(self.expert_axis)
            if local * size != self.num_experts:
                raise ValueError(
                    f"the MoE layer holds {local} experts on each of the {size} devices of "
                    f"expert axis {self.expert_axis!r}, not num_experts={self.num_experts}: "
                    "place its expert weights split over that axis (jaxpipe.moe.expert_specs)"
                )
            # [E, G, C, d] -> [E / e, e * G, C, d]: the buffers of this device's experts
            expert_in = lax.all_to_all(expert_in, self.expert_axis, 0, 1, tiled=True)
            expert_in = checkpoint_name(expert_in, "moe_dispatched")
        hidden = jax.nn.silu(jnp.einsum("egcd,edh->egch", expert_in, gate))
        hidden = hidden * jnp.einsum("egcd,edh->egch", expert_in, up)
        out = jnp.einsum("egch,ehd->egcd", hidden, down)
        if self.expert_axis is not None:
            out = lax.all_to_all(out, self.expert_axis, 1, 0, tiled=True)
            out = checkpoint_name(out, "moe_combined")
        return out


def dots_and_exchanges_saveable(*args, **kwargs) -> bool:
    """A ``jax.checkpoint`` policy (a `jaxpipe.Pipeline`'s ``remat_policy``) that saves
    what ``jax.checkpoint_policies.dots_saveable`` saves and the tokens a `MoE` layer's
    all-to-alls deliver (``"moe_dispatched"``, ``"moe_combined"``): the backward then
    exchanges only the cotangents, not the forward's tokens again.

    Args:
      *args: what ``jax.checkpoint`` passes a policy (a primitive and its operands).
      **kwargs: the primitive's parameters.

    Returns:
      Whether to save the primitive's result.
    """
    return _SAVES_EXCHANGES(*args, **kwargs)


_SAVES_EXCHANGES = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_saveable,
    jax.checkpoint_policies.save_only_these_names("moe_dispatched", "moe_combined"),
)


def _swiglu(x, gate, up, down):
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def expert_specs(params, expert_axis: str, leading_axes: int = 1):
    """Placement specs that split every `ExpertParam` over ``expert_axis``.

    Args:
      params: parameters as ``nnx.state(module, nnx.Param)`` gives them (an
        ``nnx.State``), or a pytree of such states.
      expert_axis: the Pipeline's ``expert_axis``.
      leading_axes: how many leading axes of ``params``' leaves come before the
        dimensions a placement spec describes: 1 for the logical parameters ``[S*v, ...]``
        that `jaxpipe.Pipeline.place` takes, 0 for one stage's (`jaxpipe.Pipeline.init`).
        Axes after those and before an expert weight's ``[E, ...]`` (blocks stacked within
        a stage) are left unsplit; the experts' dimension is the first of the rank the
        `ExpertParam` had when made.

    Returns:
      A pytree of ``params``' structure: ``P(None, ..., expert_axis)`` on the experts'
      dimension of every expert weight, None for every other leaf.

    Raises:
      ValueError: an expert weight has fewer dimensions than ``leading_axes`` plus its
        own rank.
    """

    def spec(path, variable):
        if not isinstance(variable, ExpertParam):
            return variable.replace(None) if isinstance(variable, nnx.Variable) else None
        ndim = len(jnp.shape(variable.get_value()))
        own = variable.get_metadata().get("expert_ndim", 3)
        before = ndim - own - leading_axes
        if before < 0:
            raise ValueError(
                f"expert weight {jax.tree_util.keystr(path)} has shape "
                f"{jnp.shape(variable.get_value())}, fewer dimensions than leading_axes="
                f"{leading_axes} plus its own {own} ([E, ...]); pass leading_axes=0 for one "
                "stage's parameters, 1 for logical ones [S*v, ...]"
            )
        return variable.replace(P(*([None] * before), expert_axis))

    return jax.tree_util.tree_map_with_path(
        spec, params, is_leaf=lambda v: isinstance(v, nnx.Variable)
    )
