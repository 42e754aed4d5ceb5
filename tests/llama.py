"""A small Llama-style decoder for tests: RMSNorm, rotary positions, causal grouped-query
attention, SwiGLU MLP. Plain JAX functions over parameter dicts (no Flax), so tests can
compare the pipeline with the same model run without it.

``stage_fn(p, x)`` applies ``p["attn_q"].shape[0]`` blocks (a stage of several blocks, a
``lax.scan`` over the block axis); ``x`` is ``[rows, seq, width]``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Config:
    width: int = 64
    heads: int = 4
    kv_heads: int = 2
    hidden: int = 128
    seq: int = 32
    vocab: int = 64

    @property
    def head_dim(self) -> int:
        return self.width // self.heads


def rms_norm(x, scale):
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (normed * scale).astype(x.dtype)


def rotary(x, positions):
    """Rotary position embedding of ``x`` ``[rows, seq, heads, head_dim]``."""
    half = x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    angle = positions[..., None].astype(jnp.float32) * freq  # [rows, seq, half]
    cos, sin = jnp.cos(angle)[:, :, None], jnp.sin(angle)[:, :, None]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1).astype(x.dtype)


def block(p, x, positions, config: Config):
    """One pre-norm decoder block."""
    rows, seq, _ = x.shape
    h = rms_norm(x, p["attn_norm"])
    q = (h @ p["attn_q"]).reshape(rows, seq, config.heads, config.head_dim)
    k = (h @ p["attn_k"]).reshape(rows, seq, config.kv_heads, config.head_dim)
    v = (h @ p["attn_v"]).reshape(rows, seq, config.kv_heads, config.head_dim)
    q, k = rotary(q, positions), rotary(k, positions)
    groups = config.heads // config.kv_heads
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(config.head_dim).astype(x.dtype)
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    attn = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(rows, seq, -1)
    x = x + out @ p["attn_o"]
    h = rms_norm(x, p["mlp_norm"])
    return x + (jax.nn.silu(h @ p["mlp_gate"]) * (h @ p["mlp_up"])) @ p["mlp_down"]


def make_stage_fn(config: Config):
    """``stage_fn(p, x, *, side)``: the stage's blocks in order; ``side["positions"]``."""

    def stage_fn(p, x, *, side):
        def one(x, block_params):
            return block(block_params, x, side["positions"], config), None

        return lax.scan(one, x, p)[0]

    return stage_fn


def init_blocks(key, config: Config, num_stages: int, blocks_per_stage: int):
    """Stage parameters in logical order: leaves ``[num_stages, blocks_per_stage, ...]``."""
    c = config
    shapes = {
        "attn_norm": (c.width,),
        "attn_q": (c.width, c.heads * c.head_dim),
        "attn_k": (c.width, c.kv_heads * c.head_dim),
        "attn_v": (c.width, c.kv_heads * c.head_dim),
        "attn_o": (c.heads * c.head_dim, c.width),
        "mlp_norm": (c.width,),
        "mlp_gate": (c.width, c.hidden),
        "mlp_up": (c.width, c.hidden),
        "mlp_down": (c.hidden, c.width),
    }
    keys = jax.random.split(key, len(shapes))
    params = {}
    for k, (name, shape) in zip(keys, shapes.items(), strict=True):
        full = (num_stages, blocks_per_stage, *shape)
        if name.endswith("norm"):
            params[name] = 1.0 + 0.1 * jax.random.normal(k, full)
        else:
            params[name] = jax.random.normal(k, full) / jnp.sqrt(shape[0])
    return params


def loss_fn(lp, y, target, *, side=None):
    """Final norm, untied head, token cross-entropy (mean over tokens)."""
    logits = rms_norm(y, lp["norm"]) @ lp["head"]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, target[..., None], axis=-1))


def init_outer(key, config: Config):
    k1, k2 = jax.random.split(key)
    return {
        "embed": jax.random.normal(k1, (config.vocab, config.width)) * 0.1,
        "norm": jnp.ones((config.width,)),
        "head": jax.random.normal(k2, (config.width, config.vocab)) / jnp.sqrt(config.width),
    }


def data(key, config: Config, batch: int):
    """Random tokens, next-token targets and positions."""
    tokens = jax.random.randint(key, (batch, config.seq + 1), 0, config.vocab)
    positions = jnp.broadcast_to(jnp.arange(config.seq), (batch, config.seq))
    return tokens[:, :-1], tokens[:, 1:], positions


def megatron_specs(tensor="tensor", fsdp=None):
    """Placement specs (dimensions after the stage axis: ``[blocks, in, out]``) that split
    the block the way Megatron-LM does over ``tensor``: query, key, value, gate and up
    projections by output columns (heads, hidden units), the attention output and down
    projections by input rows; the other dimension over ``fsdp`` (None: not split)."""
    column, row = P(None, fsdp, tensor), P(None, tensor, fsdp)
    return {
        "attn_norm": None,
        "attn_q": column,
        "attn_k": column,
        "attn_v": column,
        "attn_o": row,
        "mlp_norm": None,
        "mlp_gate": column,
        "mlp_up": column,
        "mlp_down": row,
    }
