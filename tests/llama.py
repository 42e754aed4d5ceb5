"""A small Llama-style decoder for tests: RMSNorm, rotary positions, causal grouped-query
attention, SwiGLU MLP. Plain JAX functions over parameter dicts (no Flax), so tests can
compare the pipeline with the same model run without it.

``stage_fn(p, x)`` applies ``p["attn_q"].shape[0]`` blocks (a stage of several blocks, a
``lax.scan`` over the block axis); ``x`` is ``[rows, seq, width]``.

The *packed* variant (`make_packed_stage_fn`, `packed_loss_fn`, `packed_batch`) is the model
of a real training run: a data loader's dict batch of packed documents (tokens, positions
that restart per document, segment ids, a loss mask), activations that are a dict
``{"h": float, "segment": int32, "aux": float32 per row}``, attention within a document,
dropout from the pipeline's key, and a mixture-of-experts MLP whose load-balancing loss each
stage adds to ``aux`` (``loss_fn`` adds its mean).
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
    experts: int = 0  # > 0: a soft mixture of this many SwiGLU experts with a router

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


def block(p, x, positions, config: Config, *, segment=None, key=None, dropout=0.0):
    """One pre-norm decoder block. With ``segment`` ids ``[rows, seq]`` a token attends only
    to earlier tokens of its own segment (packed documents); with a ``key`` and ``dropout``
    > 0, dropout on the attention and MLP outputs."""
    x, _ = block_with_aux(p, x, positions, config, segment=segment, key=key, dropout=dropout)
    return x


def block_with_aux(p, x, positions, config: Config, *, segment=None, key=None, dropout=0.0):
    """`block` and its auxiliary loss (a scalar: the experts' load-balancing loss, 0 without
    experts)."""
    rows, seq, _ = x.shape
    h = rms_norm(x, p["attn_norm"])
    q = (h @ p["attn_q"]).reshape(rows, seq, config.heads, config.head_dim)
    k = (h @ p["attn_k"]).reshape(rows, seq, config.kv_heads, config.head_dim)
    v = (h @ p["attn_v"]).reshape(rows, seq, config.kv_heads, config.head_dim)
    q, k = rotary(q, positions), rotary(k, positions)
    groups = config.heads // config.kv_heads
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(config.head_dim).astype(x.dtype)
    allowed = jnp.tril(jnp.ones((seq, seq), bool))
    if segment is not None:
        allowed = allowed & (segment[:, None, :, None] == segment[:, None, None, :])
    scores = jnp.where(allowed, scores, jnp.finfo(scores.dtype).min)
    attn = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(rows, seq, -1)
    drop_attn = drop_mlp = None
    if key is not None and dropout > 0:
        drop_attn, drop_mlp = jax.random.split(key)
    x = x + _dropout(out @ p["attn_o"], drop_attn, dropout)
    h = rms_norm(x, p["mlp_norm"])
    if config.experts:
        out, aux = moe_mlp(p, h, config)
    else:
        out, aux = swiglu(p["mlp_gate"], p["mlp_up"], p["mlp_down"], h), jnp.float32(0.0)
    return x + _dropout(out, drop_mlp, dropout), aux


def swiglu(gate, up, down, h):
    return (jax.nn.silu(h @ gate) * (h @ up)) @ down


def moe_mlp(p, h, config: Config):
    """A soft mixture of ``config.experts`` SwiGLU experts (every expert runs; the router's
    probabilities weight their outputs) and the Switch Transformer load-balancing loss
    ``E * sum_e f_e P_e`` (``f_e``: fraction of tokens whose top expert is ``e``, ``P_e``:
    mean router probability of ``e``)."""
    E = config.experts
    probs = jax.nn.softmax((h @ p["router"]).astype(jnp.float32), axis=-1)  # [rows, seq, E]
    outs = jax.vmap(swiglu, in_axes=(0, 0, 0, None), out_axes=-2)(
        p["moe_gate"], p["moe_up"], p["moe_down"], h
    )  # [rows, seq, E, width]
    out = jnp.einsum("bse,bsew->bsw", probs.astype(h.dtype), outs)
    top = jax.lax.stop_gradient(jax.nn.one_hot(jnp.argmax(probs, -1), E))
    aux = E * jnp.sum(jnp.mean(top, axis=(0, 1)) * jnp.mean(probs, axis=(0, 1)))
    return out, aux


def _dropout(x, key, rate):
    if key is None or rate == 0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def make_stage_fn(config: Config, policy=None):
    """``stage_fn(p, x, *, side)``: the stage's blocks in order; ``side["positions"]``. With
    a ``policy``, each block runs under ``jax.checkpoint(policy=policy)``."""

    def one_block(p, x, positions):
        return block(p, x, positions, config)

    if policy is not None:
        one_block = jax.checkpoint(one_block, policy=policy)

    def stage_fn(p, x, *, side):
        def one(x, block_params):
            return one_block(block_params, x, side["positions"]), None

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
    if c.experts:
        del shapes["mlp_gate"], shapes["mlp_up"], shapes["mlp_down"]
        shapes["router"] = (c.width, c.experts)
        shapes["moe_gate"] = (c.experts, c.width, c.hidden)
        shapes["moe_up"] = (c.experts, c.width, c.hidden)
        shapes["moe_down"] = (c.experts, c.hidden, c.width)
    keys = jax.random.split(key, len(shapes))
    params = {}
    for k, (name, shape) in zip(keys, shapes.items(), strict=True):
        full = (num_stages, blocks_per_stage, *shape)
        if name.endswith("norm"):
            params[name] = 1.0 + 0.1 * jax.random.normal(k, full)
        else:
            fan_in = shape[-2] if name.startswith("moe") else shape[0]
            params[name] = jax.random.normal(k, full) / jnp.sqrt(fan_in)
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


# ----------------------------------------------------------------------------- packed batches


def make_packed_stage_fn(
    config: Config, dropout: float = 0.0, aux_weight: float = 0.01, policy=None
):
    """``stage_fn(p, x, *, side, key=None)`` on dict activations ``{"h", "segment", "aux"}``:
    the stage's blocks (a ``lax.scan``, each block under ``jax.checkpoint(policy=policy)`` if
    a policy is given), attention within ``segment``, rotary ``side["positions"]``, dropout
    from ``key`` (block ``i`` uses ``fold_in(key, i)``), and ``aux_weight`` times the blocks'
    load-balancing losses added to every row of ``aux``."""

    def one_block(p, h, segment, positions, key):
        return block_with_aux(p, h, positions, config, segment=segment, key=key, dropout=dropout)

    if policy is not None:
        one_block = jax.checkpoint(one_block, policy=policy)

    def stage_fn(p, x, *, side, key=None):
        num_blocks = jax.tree_util.tree_leaves(p)[0].shape[0]
        keys = (
            None
            if key is None
            else jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(num_blocks))
        )

        def one(carry, xs):
            h, aux = carry
            block_params, block_key = xs
            h, block_aux = one_block(block_params, h, x["segment"], side["positions"], block_key)
            return (h, aux + block_aux), None

        (h, aux), _ = lax.scan(one, (x["h"], jnp.float32(0.0)), (p, keys))
        return {"h": h, "segment": x["segment"], "aux": x["aux"] + aux_weight * aux}

    return stage_fn


def packed_loss_fn(lp, y, target, *, side):
    """Token cross-entropy over the tokens of ``side["loss_mask"]``, plus the mean auxiliary
    loss."""
    logits = rms_norm(y["h"], lp["norm"]) @ lp["head"]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, target["labels"][..., None], axis=-1)[..., 0]
    mask = side["loss_mask"]
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0) + jnp.mean(y["aux"])


def packed_batch(key, config: Config, batch: int):
    """What a data loader yields for packed documents: ``{"tokens", "positions",
    "segment", "loss_mask", "labels"}``, ``[batch, seq]`` each. Two documents per row (a
    random boundary), positions restart at the boundary, the token before a boundary is not
    scored (its next token starts another document)."""
    k1, k2 = jax.random.split(key)
    tokens = jax.random.randint(k1, (batch, config.seq + 1), 0, config.vocab)
    boundary = jax.random.randint(k2, (batch, 1), 1, config.seq)
    index = jnp.arange(config.seq)[None, :]
    segment = (index >= boundary).astype(jnp.int32)
    positions = jnp.where(segment == 0, index, index - boundary)
    loss_mask = (index != boundary - 1).astype(jnp.float32)
    return {
        "tokens": tokens[:, :-1],
        "positions": positions,
        "segment": segment,
        "loss_mask": loss_mask,
        "labels": tokens[:, 1:],
    }


def packed_inputs(embed, batch):
    """The pipeline's ``(inputs, targets, side)`` from a `packed_batch`: the embedding runs
    before the pipeline, ``aux`` starts at zero; positions and the loss mask are side inputs
    (read by the stages and by ``loss_fn``), the labels are the targets."""
    rows = batch["tokens"].shape[0]
    inputs = {
        "h": embed[batch["tokens"]],
        "segment": batch["segment"],
        "aux": jnp.zeros((rows,), jnp.float32),
    }
    side = {"positions": batch["positions"], "loss_mask": batch["loss_mask"]}
    return inputs, {"labels": batch["labels"]}, side
