"""What one device sees inside the ``shard_map`` body: its arrays and the static facts
every action needs (structures, residual split, the loss cotangent)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpipe._executor.activations import Activation, float_leaves, with_floats
from jaxpipe._executor.plan import COLUMN, BackwardOp
from jaxpipe._executor.program import Context, Program
from jaxpipe._executor.sharding import LossGradSplit
from jaxpipe._jaxpr import residuals
from jaxpipe._jaxpr.slots import scanned_leaves
from jaxpipe._jaxpr.split import SplitBackward, narrows_stash, split_backward, stacks_stash

tree_map = jax.tree_util.tree_map


@dataclasses.dataclass(frozen=True)
class Local:
    """One device's view of a step.

    ``params`` leaves are this device's chunks ``[v, ...]``; ``inputs``, ``targets`` and
    ``side`` leaves are this device's rows of every micro-batch, ``[M, rows, ...]``.
    """

    program: Program
    params: Any
    loss_params: Any
    inputs: Any
    targets: Any
    side: Any
    key: Any
    activation: Activation
    residuals: residuals.Residuals | None
    seed: jax.Array  # per micro-batch ``[M]``: its loss's weight in the step's (`seeds`)
    split: SplitBackward | None = None  # the backward as B and W (split-backward plans)
    in_place: bool = False  # `updates_in_place`: how the tick hands buffers to a switch
    gathers_outside: bool = False  # `gathers_outside_actions`: FSDP collectives in the tick
    scanned_residuals: tuple = ()  # per residual leaf: read by the backward's scans in place
    # the loss parameters' gradient kept split over the batch axes, or None: whole
    loss_split: LossGradSplit | None = None

    @classmethod
    def build(cls, program, params, loss_params, inputs, targets, side, key) -> Local:
        x = tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), inputs)
        activation = Activation.like(x)
        if program.weights.gather == "once":  # the device's chunks, whole, for the step
            params = program.weights.gather_tree(params, offset=1)
        local = cls(program, params, loss_params, inputs, targets, side, key, activation, None, 0)
        local = dataclasses.replace(
            local,
            in_place=updates_in_place(program.mesh),
            gathers_outside=gathers_outside_actions(program),
            loss_split=loss_grad_split(program, loss_params),
        )
        seed = seeds(program, targets)
        if not program.trains:
            return dataclasses.replace(local, seed=seed)
        chunk = jax.eval_shape(lambda p: local.whole(chunk_of(p, 0)), params)
        context = local.context(jnp.int32(0), jnp.int32(0))
        spec = residuals.analyse(
            local.stage_fn, local.stage_args(chunk, context), x, context, program.remat
        )
        local = dataclasses.replace(local, residuals=spec, seed=seed)
        args = local._backward_args(chunk, context)
        local = dataclasses.replace(local, scanned_residuals=scanned_leaves(local._backward, *args))
        if (program.plan.table[:, :, COLUMN["b_op"]] == BackwardOp.INPUT).any():
            local = dataclasses.replace(local, split=local._split(chunk, context))
        return local

    def _split(self, chunk, context) -> SplitBackward:
        """The stage's backward as B (input gradient and a stash) and W (weight gradient
        from the stash), so that W does not recompute B's chain of cotangents; with
        ``remat`` and W's held back or a stash made by a scan, a narrower stash
        (`narrows_stash`)."""
        program = self.program
        args = self._backward_args(chunk, context)
        stacked = program.remat and stacks_stash(self._backward, *args)
        narrow = narrows_stash(program.remat, program.plan.num_stash_slots, stacked)
        return split_backward(self._backward, *args, narrow_stash=narrow)

    def _backward(self, stored, params, context, cotangent):
        """The stage's backward from its residuals: ``(d_params, dx)``."""
        vjp_fn = residuals.vjp(
            self.residuals, self.stage_fn, params, self.x_like(), context, stored
        )
        d_params, dx = vjp_fn(self.activation.cotangent(cotangent))
        return d_params, self.activation.float_cotangents(dx)

    def _backward_args(self, chunk, context) -> tuple:
        """Shapes of `_backward`'s arguments for chunk ``chunk``'s parameters."""
        return (list(self.residuals.structs), self.stage_args(chunk, context), context,
                list(self.activation.float_leaves))  # fmt: skip

    @property
    def stage_fn(self):
        """The stage the actions run and differentiate, ``(args, x, context) -> y`` with
        ``args`` from `stage_args`: with side gradients, a stage whose side inputs' float
        leaves are differentiated like its parameters."""
        stage_fn = self.program.stage_fn
        if not self.program.side_grad:
            return stage_fn

        def stage_with_side(args, x, context):
            params, side = args
            return stage_fn(params, x, context._replace(side=with_floats(context.side, side)))

        return stage_with_side

    def stage_args(self, params, context):
        """What `stage_fn` is differentiated with respect to besides its input: one chunk's
        ``params``, and with side gradients also the float leaves of ``context.side``."""
        if not self.program.side_grad:
            return params
        return params, float_leaves(context.side)

    def args_grads(self, d_args) -> tuple:
        """``(d_params, d_side)`` from the gradient of `stage_args` (``d_side`` a list of
        the side inputs' float leaves, empty without side gradients)."""
        if not self.program.side_grad:
            return d_args, []
        return d_args

    def side_zeros(self) -> list:
        """Zeros for one micro-batch's side gradient (empty without side gradients)."""
        if not self.program.side_grad:
            return []
        return [jnp.zeros_like(a[0]) for a in float_leaves(self.side)]

    def target_zeros(self) -> list:
        """Zeros for one micro-batch's target gradient (empty without target gradients)."""
        if not self.program.target_grad:
            return []
        return [jnp.zeros_like(a[0]) for a in float_leaves(self.targets)]

    @property
    def aux(self) -> Activation:
        """Shapes of one micro-batch's ``aux``, its leaves float32."""
        structs = jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), self.program.aux
        )
        return Activation.like(structs)

    @property
    def stash_structs(self) -> list:
        """Shapes of what a B keeps for its W (nothing without split backwards)."""
        return [] if self.split is None else list(self.split.stash_structs)

    @property
    def num_microbatches(self) -> int:
        return self.program.plan.schedule.num_microbatches

    def context(self, microbatch, stage) -> Context:
        """The `Context` of ``stage`` applied to ``microbatch``."""
        side = None if self.side is None else microbatch_of(self.side, microbatch)
        key = None
        if self.key is not None:
            key = jax.random.fold_in(jax.random.fold_in(self.key, microbatch), stage)
        return Context(side=side, key=key, stage=stage, microbatch=microbatch)

    def loss_context(self, context: Context) -> Context:
        """The loss's `Context` from its last stage's: the key ``fold_in(fold_in(key,
        microbatch), N)``, the one a stage ``N`` after the last would get, so the loss draws
        random numbers of its own."""
        if self.key is None:
            return context
        N = self.program.plan.schedule.num_logical_stages
        key = jax.random.fold_in(jax.random.fold_in(self.key, context.microbatch), N)
        return context._replace(key=key)

    def weights(self, params, chunk, version):
        """One chunk's whole parameters: ``params`` are this device's chunks ``[v, ...]``,
        or in a program that updates weights its weight versions ``[slots, v, ...]``
        (version slot ``version``). Read (and gathered, for FSDP per use) inside the
        action, so only one action's copy is live at once; where the tick gathers them
        (``gathers_outside``), ``params`` are the action's chunk, gathered, as they are."""
        if self.gathers_outside:
            return params
        if self.program.updates_weights:
            params = tree_map(
                lambda p: lax.dynamic_index_in_dim(p, version, 0, keepdims=False), params
            )
        return self.whole(chunk_of(params, chunk))

    def whole(self, one):
        """One chunk's parameters, gathered over the batch axes if stored split and
        gathered per use."""
        if self.program.weights.per_action:
            one = self.program.weights.gather_tree(one, offset=0)
        return one

    def accumulate(self, grads, chunk, d_params):
        """``grads[chunk] += d_params``, reduce-scattered first where the weights are
        split over batch axes and gathered per use; where the tick reduce-scatters them
        (``gathers_outside``), ``grads`` is one chunk's whole gradient, ``grads + d_params``."""
        if self.gathers_outside:
            return tree_map(lambda g, d: g + d.astype(g.dtype), grads, d_params)
        if self.program.weights.per_action:
            d_params = self.program.weights.scatter_tree(d_params, offset=0)
        return add_to_chunk(grads, chunk, d_params)

    def input(self, microbatch):
        return microbatch_of(self.inputs, microbatch)

    def target(self, microbatch):
        return microbatch_of(self.targets, microbatch)

    def x_like(self):
        """A tree of the activation's shapes and dtypes."""
        return self.activation.unflatten(list(self.activation.leaves))


def seeds(program: Program, targets) -> jax.Array:
    """Each micro-batch loss's weight in the step's loss, ``[M]`` float32, inside the
    ``shard_map``: the cotangent its backward starts from. The step's loss is the mean over
    replicas of ``sum(seeds * losses)``, so a weight holds the replicas' count ``R``: ``1 /
    M`` for ``"mean"``, ``R`` for ``"sum"``, ``R * w / W`` for a weight function (``w``:
    the micro-batch's weight, ``W``: the weights' sum over micro-batches and replicas); 1
    in a program that updates weights (each micro-batch's own gradient)."""
    M = program.plan.schedule.num_microbatches
    R = int(np.prod([program.mesh.shape[a] for a in program.data_axes]))
    reduction = program.loss_reduction
    if program.updates_weights or reduction == "mean":
        value = 1.0 if program.updates_weights else 1.0 / M
        return jnp.full((M,), value, jnp.float32)
    if reduction == "sum":
        return jnp.full((M,), float(R), jnp.float32)
    if targets is None:  # refused before tracing: `jaxpipe._checks.loss_weights`
        raise ValueError("loss_reduction is a weight function of the targets: pass targets")
    weights = microbatch_weights(reduction, targets)
    total = jnp.sum(weights)
    if program.data_axes:
        total = lax.psum(total, program.data_axes)
    return R * weights / total


def microbatch_weights(weight_fn, targets) -> jax.Array:
    """``weight_fn`` of each micro-batch's targets (leaves ``[M, rows, ...]``), ``[M]``."""
    return jax.vmap(lambda t: jnp.asarray(weight_fn(t), jnp.float32))(targets)


def loss_grad_split(program: Program, loss_params) -> LossGradSplit | None:
    """How ``program`` keeps the gradient of ``loss_params`` inside the step: split over
    its batch axes (``split_loss_grads``), or None: whole."""
    if not program.split_loss_grads:
        return None
    return LossGradSplit.of(loss_params, program.mesh, program.data_axes)


def gathers_outside_actions(program: Program) -> bool:
    """Whether the tick, not the actions, gathers the stage weights split over batch axes
    and reduce-scatters their gradients (`jaxpipe._executor.tick`): weights gathered
    ``"ahead"``, and one version of them (a program that updates weights inside the loop
    gathers inside its actions, as ``"per_use"``). Outside the ``lax.switch`` of the
    actions a compiler can run these collectives while another action computes; inside a
    branch it cannot."""
    weights = program.weights
    return weights.active and weights.gather == "ahead" and not program.updates_weights


def updates_in_place(mesh) -> bool:
    """Whether the compiler of ``mesh``'s devices updates a buffer passed through a
    ``lax.switch`` in place, and relays out the whole of a buffer that a branch slices where
    the branches want it in different layouts: the TPU compiler does both. The GPU and CPU
    compilers copy a buffer passed through a switch whole (and a branch's slice of a buffer
    fuses into its computation, wanting no layout of its own). See
    `jaxpipe._executor.tick`."""
    return mesh.devices.flat[0].platform == "tpu"


def add_to_chunk(grads, chunk, d_params):
    """``grads[chunk] += d_params`` for ``[v, ...]`` gradient leaves, in their dtype."""

    def add(g, d):
        if g.shape[0] == 1:  # one chunk: a plain sum, which a matmul can accumulate into
            return g + d[None].astype(g.dtype)
        return g.at[chunk].add(d.astype(g.dtype))

    return tree_map(add, grads, d_params)


def microbatch_of(tree, microbatch):
    """Micro-batch ``microbatch`` of ``[M, rows, ...]`` leaves: ``[rows, ...]``."""
    return tree_map(lambda a: lax.dynamic_index_in_dim(a, microbatch, 0, keepdims=False), tree)


def chunk_of(params, chunk):
    """Chunk ``chunk`` of ``[v, ...]`` leaves."""
    return tree_map(lambda p: lax.dynamic_index_in_dim(p, chunk, 0, keepdims=False), params)
