"""A whole training step of the `llama` test model as abstract arrays on a target's mesh:
float32 master weights and Adam moments, bfloat16 compute, a per-block remat policy, the
embedding before the pipeline, the head and loss on the last stage, the embedding and head
split by vocabulary over ``tensor`` (or ``fsdp``), stage weights split the Megatron way.

`build` returns everything `jaxpipe.memory.predict` takes and what ``Target.compile`` takes,
so a test can compare the prediction with the compiler's report of the same step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe import pipeline, schedules, target
from tests import llama

LLAMA3_8B = llama.Config(
    width=4096, heads=32, kv_heads=8, hidden=14336, seq=8192, vocab=128256
)  # fmt: skip
LLAMA3_8B_LAYERS = 32
POLICY = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


@dataclasses.dataclass
class Step:
    """A built step: ``step(params, opt_state, tokens, targets, positions)`` and its
    abstract arguments, the pipeline and the optimizer."""

    pipe: pipeline.Pipeline
    optimizer: optax.GradientTransformation
    step: object
    params: dict
    opt_state: object
    tokens: jax.ShapeDtypeStruct
    targets: jax.ShapeDtypeStruct
    positions: jax.ShapeDtypeStruct
    compute_dtype: object

    @property
    def args(self):
        return (self.params, self.opt_state, self.tokens, self.targets, self.positions)


def build(
    tgt: target.Target,
    mesh_shape: dict,
    schedule: str,
    *,
    config: llama.Config = LLAMA3_8B,
    layers: int = LLAMA3_8B_LAYERS,
    microbatches: int = 8,
    rows: int = 1,
    compute_dtype=jnp.bfloat16,
) -> Step:
    """The step on ``tgt.mesh`` of ``mesh_shape`` (``{"pipe": 4, "tensor": 2}``, ...):
    ``microbatches`` micro-batches of ``rows`` rows per data-parallel replica."""
    mesh = tgt.mesh(tuple(mesh_shape.values()), tuple(mesh_shape))
    tensor = "tensor" if mesh_shape.get("tensor", 1) > 1 else None
    fsdp = "fsdp" if mesh_shape.get("fsdp", 1) > 1 else None
    replicas = mesh_shape.get("data", 1) * mesh_shape.get("fsdp", 1)
    sched = schedules.get(schedule, mesh_shape["pipe"], microbatches)
    blocks_per_stage = layers // sched.num_logical_stages
    pipe = pipeline.Pipeline(
        llama.make_stage_fn(config, policy=POLICY),
        llama.loss_fn,
        mesh=mesh,
        schedule=sched,
        remat_policy=None,  # the per-block policy decides what each backward keeps
    )
    specs = llama.megatron_specs(tensor, fsdp)
    if tensor and config.kv_heads % mesh_shape["tensor"]:
        specs["attn_k"] = specs["attn_v"] = P(None, fsdp, None)
    logical = jax.eval_shape(
        lambda k: llama.init_blocks(k, config, sched.num_logical_stages, blocks_per_stage),
        jax.ShapeDtypeStruct((), jax.random.key(0).dtype),
    )
    placed = jax.eval_shape(lambda p: pipe.place(p, specs), logical)
    blocks = target.abstract(placed, pipe.layout.shardings(placed, specs))
    vocab_axis = tensor or fsdp
    outer_specs = {"embed": P(vocab_axis, None), "norm": P(), "head": P(None, vocab_axis)}
    outer = jax.eval_shape(lambda k: llama.init_outer(k, config), jax.random.key(0))
    outer = {
        name: target.abstract(s, NamedSharding(mesh, outer_specs[name]))
        for name, s in outer.items()
    }
    params = {"blocks": blocks, **outer}
    optimizer = optax.adam(1e-4)
    state_shardings = optax.tree_utils.tree_map_params(
        optimizer,
        lambda _, p: p.sharding,
        jax.eval_shape(optimizer.init, params),
        params,
        transform_non_params=lambda _: NamedSharding(mesh, P()),
    )
    opt_state = target.abstract(jax.eval_shape(optimizer.init, params), state_shardings)
    batch_axes = tuple(a for a in ("data", "fsdp") if mesh_shape.get(a, 1) > 1) or None
    batch = (microbatches * rows * replicas, config.seq)
    batch_sharding = NamedSharding(mesh, P(batch_axes))
    tokens = jax.ShapeDtypeStruct(batch, jnp.int32, sharding=batch_sharding)
    positions = jax.ShapeDtypeStruct(batch, jnp.int32, sharding=batch_sharding)

    def compute(tree):
        return jax.tree.map(lambda a: a.astype(compute_dtype), tree)

    def loss(params, tokens, targets, positions):
        x = compute(params["embed"])[tokens]
        head = compute({"norm": params["norm"], "head": params["head"]})
        return pipe.loss(compute(params["blocks"]), head, x, targets, side={"positions": positions})

    def step(params, opt_state, tokens, targets, positions):
        value, grads = jax.value_and_grad(loss)(params, tokens, targets, positions)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    jitted = jax.jit(step, donate_argnums=(0, 1))
    return Step(pipe, optimizer, jitted, params, opt_state, tokens, tokens, positions,
                compute_dtype)  # fmt: skip
