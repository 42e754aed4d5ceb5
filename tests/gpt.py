"""A tiny GPT-style decoder cut for the pipeline (shared by tests and examples).

Layout: token + position embedding before the pipeline; ``num_layers`` pre-norm transformer
blocks (causal self-attention, MLP) in NNX, ``num_layers // num_stages`` per stage; final
layer norm, a head tied to the token embedding and cross-entropy in ``loss_fn`` on the last
stage. ``loss_params = {"embedding", "position", "norm"}`` serve both ends, so the tied
embedding gets the sum of its input-side and output-side gradients from ``jax.grad``.

API (stable):

- ``Config(vocab=32, width=16, seq=8, heads=2, num_layers=4)``
- ``init(key, config, num_stages) -> (stage_fn, stage_params, loss_params)``: NNX stages via
  ``jaxpipe.stages.nnx_stage``; ``init_linen`` is the same with a Linen block per stage.
- ``embed(loss_params, tokens) -> h [B, T, D]``; ``stage_fn(p, h) -> h``;
  ``loss_fn(loss_params, h, targets) -> scalar`` (mean token cross-entropy).
- ``pipeline_loss(pipe, params, tokens, targets)`` and ``reference_loss(stage_fn, params,
  tokens, targets)`` with ``params = {"stages": stage_params, "outer": loss_params}``: the
  same model through a ``jaxpipe.pipeline.Pipeline`` and as a plain sequential model.
- ``data(key, config, batch) -> (tokens, targets)``: random int32 ``[batch, seq]``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import nnx

from jaxpipe import stages


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 32
    width: int = 16
    seq: int = 8
    heads: int = 2
    num_layers: int = 4
    mlp_ratio: int = 4


def _attention(q, k, v, heads):
    """Causal multi-head attention on ``[..., T, D]`` projections."""
    *batch, T, D = q.shape

    def split(a):
        return a.reshape(*batch, T, heads, D // heads)

    q, k, v = split(q), split(k), split(v)
    logits = jnp.einsum("...qhd,...khd->...hqk", q, k) / jnp.sqrt(D // heads).astype(q.dtype)
    causal = jnp.tril(jnp.ones((T, T), bool))
    logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
    weights = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("...hqk,...khd->...qhd", weights, v).reshape(*batch, T, D)


class Block(nnx.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: Config, *, rngs: nnx.Rngs):
        D, H = config.width, config.width * config.mlp_ratio
        self.heads = config.heads
        self.norm1 = nnx.LayerNorm(D, rngs=rngs)
        self.qkv = nnx.Linear(D, 3 * D, rngs=rngs)
        self.proj = nnx.Linear(D, D, rngs=rngs)
        self.norm2 = nnx.LayerNorm(D, rngs=rngs)
        self.mlp_in = nnx.Linear(D, H, rngs=rngs)
        self.mlp_out = nnx.Linear(H, D, rngs=rngs)

    def __call__(self, x):
        q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
        x = x + self.proj(_attention(q, k, v, self.heads))
        return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.norm2(x))))


class Stage(nnx.Module):
    """``num_blocks`` blocks applied in order: one pipeline stage."""

    def __init__(self, config: Config, num_blocks: int, *, rngs: nnx.Rngs):
        self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(num_blocks)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class LinenBlock(nn.Module):
    """The same block in Linen (for ``jaxpipe.stages.linen_stage``)."""

    config: Config

    @nn.compact
    def __call__(self, x):
        D = self.config.width
        q, k, v = jnp.split(nn.Dense(3 * D)(nn.LayerNorm()(x)), 3, axis=-1)
        x = x + nn.Dense(D)(_attention(q, k, v, self.config.heads))
        h = jax.nn.gelu(nn.Dense(D * self.config.mlp_ratio)(nn.LayerNorm()(x)))
        return x + nn.Dense(D)(h)


class LinenStage(nn.Module):
    config: Config
    num_blocks: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.num_blocks):
            x = LinenBlock(self.config)(x)
        return x


def _blocks_per_stage(config: Config, num_stages: int) -> int:
    if config.num_layers % num_stages:
        raise ValueError(
            f"num_layers={config.num_layers} does not split evenly into {num_stages} stages; "
            "use a multiple of the stage count (or jaxpipe.partition for uneven stages)"
        )
    return config.num_layers // num_stages


def init_outer(key, config: Config):
    """``loss_params``: token embedding (tied head), position embedding, final norm."""
    k1, k2 = jax.random.split(key)
    D = config.width
    return {
        "embedding": jax.random.normal(k1, (config.vocab, D)) / jnp.sqrt(D),
        "position": 0.1 * jax.random.normal(k2, (config.seq, D)),
        "norm": {"scale": jnp.ones((D,)), "bias": jnp.zeros((D,))},
    }


def init(key, config: Config, num_stages: int):
    """``(stage_fn, stage_params, loss_params)`` with NNX stages of equal block counts."""
    per_stage = _blocks_per_stage(config, num_stages)
    k_stage, k_outer = jax.random.split(key)
    stage_fn, stage_params = stages.nnx_stage(
        lambda rngs: Stage(config, per_stage, rngs=rngs), k_stage, num_stages
    )
    return stage_fn, stage_params, init_outer(k_outer, config)


def init_linen(key, config: Config, num_stages: int):
    """As `init`, with a Linen stage module."""
    per_stage = _blocks_per_stage(config, num_stages)
    k_stage, k_outer = jax.random.split(key)
    sample = jax.ShapeDtypeStruct((1, config.seq, config.width), jnp.float32)
    stage_fn, stage_params = stages.linen_stage(
        LinenStage(config, per_stage), k_stage, sample, num_stages
    )
    return stage_fn, stage_params, init_outer(k_outer, config)


def embed(loss_params, tokens):
    """``[B, T]`` int tokens -> ``[B, T, D]`` token + position embeddings."""
    return loss_params["embedding"][tokens] + loss_params["position"][: tokens.shape[-1]]


def _layer_norm(p, x, eps=1e-6):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.var(x, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def loss_fn(loss_params, h, targets):
    """Final norm, head tied to the embedding, mean token cross-entropy (float32)."""
    h = _layer_norm(loss_params["norm"], h.astype(jnp.float32))
    logits = h @ loss_params["embedding"].T
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


def pipeline_loss(pipe, params, tokens, targets):
    """Embed, run the blocks and the loss through ``pipe`` (differentiable in ``params``;
    ``params["stages"]`` in the pipeline's layout, `Pipeline.place`)."""
    outer = params["outer"]
    return pipe.loss(params["stages"], outer, embed(outer, tokens), targets)


def reference_loss(stage_fn, params, tokens, targets):
    """The same model without a pipeline: every stage in order on the whole batch."""
    outer = params["outer"]
    h = embed(outer, tokens)
    num_stages = jax.tree_util.tree_leaves(params["stages"])[0].shape[0]
    for s in range(num_stages):
        h = stage_fn(stages.stage_slice(params["stages"], s), h)
    return loss_fn(outer, h, targets)


def data(key, config: Config, batch: int):
    """Random ``(tokens, targets)``, int32 ``[batch, seq]``, targets = tokens shifted by one."""
    seq = jax.random.randint(key, (batch, config.seq + 1), 0, config.vocab, jnp.int32)
    return seq[:, :-1], seq[:, 1:]
