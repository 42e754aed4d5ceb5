"""Train a small Llama-style model with pipeline parallelism: one file, top to bottom.

RMSNorm, rotary position embeddings, causal grouped-query attention and a SwiGLU MLP (or a
ReLU MLP, ``--mlp relu``); each pipeline stage is a stack of blocks run by ``lax.scan`` over
a layer axis, each block under ``jax.checkpoint`` with a remat policy. The token embedding
runs before the pipeline; the final norm, the head (untied, or ``--tied`` to the embedding)
and the cross-entropy run in ``loss_fn`` on the last stage. Rows are packed with several
documents: positions restart at every document and attention stays within it, so positions
and segment ids go to every stage as *side inputs* (sliced per micro-batch on each device,
never sent between devices).
Attention runs in the fastest kernel the platform has (``--attention auto``): splash
attention (Pallas) on a TPU, cuDNN's on an NVIDIA GPU, XLA's on a CPU. ``--dropout 0.1``
takes its randomness from the pipeline's ``key=`` (each stage and micro-batch gets its own
key, the same under every schedule); ``--bf16`` runs the pipeline on bfloat16 copies of
float32 master weights (gradients accumulate in float32).

Default task: packed sorting. A document is 2 to 6 random digits, a separator, then the same
digits sorted; the model is scored on the sorted part (token accuracy; chance is 10%).
``--text FILE`` trains a character-level model on any local text file instead.

    python3 examples/train_llama.py                        # jaxpipe.plan chooses, 8 blocks
    python3 examples/train_llama.py --schedule 1f1b --stages 4 --data 2   # chosen by hand
    python3 examples/train_llama.py --schedule zbv --dropout 0.1 --bf16
    python3 examples/train_llama.py --steps 200 --out run && \\
        python3 examples/train_llama.py --steps 400 --out run --resume
    python3 examples/train_llama.py --text input.txt --steps 2000
    python3 examples/train_llama.py --stages 2 --data 1 --fsdp 2 --tensor 2   # 3-D parallel
    python3 examples/train_llama.py --seq 128 --attention splash   # Pallas, interpret mode
    python3 examples/train_llama.py --target v5p:2x2x2 --width 4096 --hidden 14336 --bf16
    python3 examples/train_llama.py --target v5p:2x2x2 --model llama3-8b --stages 2 --data 2 \\
        --tensor 2 --microbatches 8 --batch 16      # Llama-3 8B's shapes, compile only

With no GPU or TPU, JAX's CPU backend is split into ``--devices`` host devices (default 8).
``--target`` compiles the training step for a TPU topology or GPUs (``h100x8``) without
running it, on any machine, and prints what the compiler says (`jaxpipe.target`): memory
per device against the chip's, collectives, time estimate. It needs the compiler:
``pip install "jaxpipe[tpu]"`` or ``pip install "jaxpipe[cuda-compile]"``.
"""

import argparse
import dataclasses
import functools
import math
import os
import sys
import time

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument(
    "--schedule", default=None,
    help="a name from jaxpipe.schedules.names(), or auto: jaxpipe.plan chooses the schedule, "
    "its table, --stages, --data, --fsdp, --tensor, --microbatches, remat and FSDP gathering "
    "(those given are kept) for --target, or else for --plan-for. Default: auto; "
    "1f1b with --target, --costs or --virtual-stages (they compile or pack what the flags say)",
)  # fmt: skip
parser.add_argument("--stages", type=int, default=None, help="devices on the pipe axis (S; 4)")
parser.add_argument("--data", type=int, default=None, help="data-parallel size (pipe x data; 2)")
parser.add_argument("--fsdp", type=int, default=None, help="FSDP size: batch, weights split (1)")
parser.add_argument("--tensor", type=int, default=None, help="tensor-parallel size (Megatron; 1)")
parser.add_argument(
    "--fsdp-gather", default="auto", choices=["auto", "per_use", "once", "ahead", "per_block"],
    help="with --fsdp: gather a stage's weights for each action (per_use), once a step (once), "
    "a tick ahead of the action that uses them (ahead), or each block's just before the "
    "block runs (per_block); auto: per_block on GPUs, per_use on TPUs and CPUs; "
    "jaxpipe.Pipeline's fsdp_gather",
)  # fmt: skip
parser.add_argument(
    "--costs", default=None,
    help="pack the table for the stage's costs: 'measure' (time the stage here), 'target' "
    "(the --target compiler's estimate of one device's share of a stage, as --step-time "
    "uses it) or F:B:W ratios such as 1:2:0.5",
)  # fmt: skip
parser.add_argument(
    "--sequence-parallel", action="store_true",
    help="with --tensor: split the residual stream between blocks by sequence over tensor "
    "(Megatron-LM's sequence parallelism), so activations kept and sent are 1/tensor the size",
)  # fmt: skip
parser.add_argument(
    "--xla-option", action="append", default=[], metavar="NAME=VALUE",
    help="an XLA compiler option for the training step (repeatable), e.g. on TPU "
    "xla_tpu_all_gather_collective_matmul_mode=post_spmd: jax.jit's compiler_options",
)  # fmt: skip
parser.add_argument(
    "--split-loss-grads", action="store_true",
    help="with --data or --fsdp: accumulate the head's (and a tied embedding's) gradient split "
    "over the data axes, each micro-batch's reduce-scattered: 1/replicas of its float32 "
    "accumulator held, for a reduce-scatter per micro-batch; jaxpipe.Pipeline's split_loss_grads",
)  # fmt: skip
parser.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (M; 8)")
parser.add_argument("--virtual-stages", type=int, default=None, help="v for interleaved_1f1b")
parser.add_argument(
    "--plan-for", default="v5p:2x2x2",
    help="--schedule auto without --target: the TPU or GPUs to plan for (their compiler is "
    "needed: pip install 'jaxpipe[tpu]'); the plan then trains here",
)  # fmt: skip
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--batch", type=int, default=64, help="global batch size (rows)")
parser.add_argument("--seq", type=int, default=64, help="tokens per row")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--layers", type=int, default=8, help="transformer blocks in total")
parser.add_argument("--width", type=int, default=64, help="model width")
parser.add_argument("--heads", type=int, default=4, help="query heads")
parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (grouped-query)")
parser.add_argument("--hidden", type=int, default=176, help="the MLP's hidden width")
parser.add_argument(
    "--mlp", default="swiglu", choices=["swiglu", "relu"],
    help="the MLP: SwiGLU (Llama's: gate, up and down) or ReLU (up and down)",
)  # fmt: skip
parser.add_argument(
    "--head-dim", type=int, default=None, help="width of a head (default: --width / --heads)"
)
parser.add_argument("--tied", action="store_true", help="tie the head to the token embedding")
parser.add_argument("--dropout", type=float, default=0.0, help="dropout rate in every block")
parser.add_argument(
    "--bf16", action=argparse.BooleanOptionalAction, default=False,
    help="run the pipeline in bfloat16",
)  # fmt: skip
parser.add_argument(
    "--remat", default="dots", choices=["dots", "nothing", "everything"],
    help="per-block remat policy: keep matmul results (dots), recompute the whole block "
    "(nothing) or keep every residual (everything); under --schedule auto the plan's remat "
    "of each stage replaces it",
)  # fmt: skip
parser.add_argument("--text", default=None, help="train a character model on this text file")
parser.add_argument("--out", default=None, help="directory for checkpoints")
parser.add_argument("--save-every", type=int, default=100, help="checkpoint interval (steps)")
parser.add_argument("--resume", action="store_true", help="restore the latest checkpoint in --out")
parser.add_argument("--log-every", type=int, default=25)
parser.add_argument("--devices", type=int, default=8, help="host devices when running on CPU")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument(
    "--target", default=None,
    help="compile only: compile the training step for this TPU topology (e.g. v5p:2x2x2, "
    "v5e:4x4), GPU type and count (h100x8) or cpu, print memory, collectives and time "
    "estimate, and exit",
)  # fmt: skip
parser.add_argument(
    "--step-time", action="store_true",
    help="with --target (a TPU or H100s): also predict the step time and model FLOP "
    "utilisation from the compiler's estimate of one block and the exposed collectives",
)  # fmt: skip
parser.add_argument(
    "--model", default=None,
    choices=["llama3-8b", "llama3-70b", "llama2-70b", "maxtext-32b", "maxtext-64b",
             "megatron-70b", "megatron-119b"],
    help="published shapes (blocks, widths, heads, MLP, vocabulary, tokens per row; bf16 "
    "compute): Llama's (8192 tokens for Llama-3, 4096 for Llama-2), or those of a published "
    "training run jaxpipe is calibrated on (benchmarks/published_runs.py); flags given "
    "explicitly win",
)  # fmt: skip
parser.add_argument(
    "--vocab", type=int, default=None,
    help="rows of the embedding table (at least the data's vocabulary; default: the data's)",
)  # fmt: skip
parser.add_argument("--json", default=None, help="with --target: write the report here as JSON")
parser.add_argument(
    "--attention", default="auto", choices=["auto", "xla", "splash", "cudnn"],
    help="attention's kernel: XLA's (scores materialised), splash (the Pallas TPU kernel "
    "MaxText uses; on a CPU it runs in Pallas's interpret mode), cudnn (cuDNN's fused "
    "attention through jax.nn.dot_product_attention) or auto: the fastest the platform "
    "(--target's, else this machine's) has: splash on TPU, cudnn on GPU, xla elsewhere",
)  # fmt: skip
# Llama's published shapes (Meta's model cards and params.json: dim, n_layers, n_heads,
# n_kv_heads, ffn hidden size, vocab_size, context), with bf16 compute on float32 master
# weights. Llama-2-70B at 4096 tokens is MaxText's published v5p run (benchmarks/calibration.py).
LLAMA3 = dict(vocab=128256, seq=8192)
MODELS = {
    "llama3-8b": dict(layers=32, width=4096, hidden=14336, heads=32, kv_heads=8, **LLAMA3),
    "llama3-70b": dict(layers=80, width=8192, hidden=28672, heads=64, kv_heads=8, **LLAMA3),
    "llama2-70b": dict(
        layers=80, width=8192, hidden=28672, heads=64, kv_heads=8, vocab=32000, seq=4096
    ),
    # MaxText's 2023 32B and 64B runs on v5p: heads of 256, a ReLU MLP, the head tied to the
    # embedding, 2048 tokens a row
    **{f"maxtext-{n}b": dict(layers=layers, width=10240, hidden=32768, heads=32, kv_heads=32,
                             head_dim=256, mlp="relu", tied=True, vocab=32768, seq=2048)
       for n, layers in ((32, 32), (64, 64))},
    # Megatron-LM's 70B and 119B H100 runs: a SwiGLU MLP of their GELU MLP's parameters
    # (4 x width), full multi-head attention, 4096 tokens a row
    "megatron-70b": dict(layers=84, width=8192, hidden=21848, heads=64, kv_heads=64,
                         vocab=131072, seq=4096),
    "megatron-119b": dict(layers=92, width=10240, hidden=27312, heads=80, kv_heads=80,
                          vocab=131072, seq=4096),
}  # fmt: skip
args = parser.parse_args()
if args.model:  # the preset's values become defaults: flags given explicitly still win
    parser.set_defaults(**MODELS[args.model], bf16=True)
    args = parser.parse_args()
if args.resume and not args.out:
    parser.error("--resume needs --out DIR (where the checkpoints are)")
SPLIT_GIVEN = {"fsdp": args.fsdp, "tensor": args.tensor}  # --schedule auto plans those not
args.fsdp, args.tensor = args.fsdp or 1, args.tensor or 1  # given (a plan may change them)
if args.tensor > 1 and (args.heads % args.tensor or args.hidden % args.tensor):
    sys.exit(f"--heads {args.heads} and --hidden {args.hidden} must divide by --tensor")


def heads_here():
    """One device's query and key/value heads (kv heads that --tensor does not divide stay
    whole)."""
    kv = args.kv_heads // args.tensor if args.kv_heads % args.tensor == 0 else args.kv_heads
    return args.heads // args.tensor, kv


HEADS_HERE, KV_HERE = heads_here()
if (args.step_time or args.costs == "target") and HEADS_HERE % KV_HERE:
    sys.exit(f"--step-time and --costs target cost one device's share of a block: its "
             f"{HEADS_HERE} query heads must group over its {KV_HERE} key/value heads "
             f"(--kv-heads {args.kv_heads}, whole on each device unless --tensor "
             f"{args.tensor} divides it); give --kv-heads a multiple of --tensor")  # fmt: skip


def compiler_option(text):
    """``NAME=VALUE`` of --xla-option as jax.jit's ``compiler_options`` takes it."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        parser.error(f"--xla-option {text!r}: expected NAME=VALUE, such as "
                     "xla_tpu_all_gather_collective_matmul_mode=post_spmd")  # fmt: skip
    if value.lower() in ("true", "false"):
        return name, value.lower() == "true"
    try:
        return name, int(value)
    except ValueError:
        return name, value


XLA_OPTIONS = dict(compiler_option(text) for text in args.xla_option)


# Only the CPU backend reads this flag; GPUs and TPUs are used as they are when present.
# It must be set before jax is imported. An XLA_FLAGS that already sets it wins.
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    flags += f" --xla_force_host_platform_device_count={args.devices}"
os.environ["XLA_FLAGS"] = flags.strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxpipe  # noqa: E402

LATER = []  # lines printed once the mesh and schedule are (they may wait on a plan)

# ----------------------------------------------------------------------------- data
T = args.seq
if args.text:
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    chars = sorted(set(text))
    corpus = np.array([chars.index(c) for c in text], dtype=np.int32)
    VOCAB = len(chars)
    if len(corpus) <= T + 1:
        sys.exit(f"{args.text} has {len(corpus)} characters; need more than --seq + 1")
    LATER.append(f"data: {args.text}, {len(corpus)} characters, vocabulary {VOCAB}")
else:
    DIGITS, SHORTEST, LONGEST = 10, 4, 12
    SEP, PAD = DIGITS, DIGITS + 1
    VOCAB = DIGITS + 2
    if T < 2 * LONGEST + 1:
        sys.exit(f"--seq {T} is shorter than one document ({2 * LONGEST + 1} tokens)")
    LATER.append(f"data: packed documents of {SHORTEST}-{LONGEST} digits, a separator, the digits "
          f"sorted; accuracy on the sorted part (chance {1 / DIGITS:.0%})")  # fmt: skip
if args.vocab is not None:  # a larger table than the data needs (as a real tokenizer's)
    if args.vocab < VOCAB:
        sys.exit(f"--vocab {args.vocab} is smaller than the data's vocabulary ({VOCAB})")
    VOCAB = args.vocab


def get_batch(step, batch=args.batch):
    """A dict of ``[batch, T]`` arrays for ``step``: tokens, labels (-1: not scored),
    positions (restarting at every document) and segment ids (one per document)."""
    rng = np.random.default_rng([args.seed, step + 1])  # step -1: the evaluation batch
    if args.text:
        start = rng.integers(0, len(corpus) - T - 1, batch)
        window = corpus[start[:, None] + np.arange(T + 1)]
        positions = np.broadcast_to(np.arange(T), (batch, T))
        return dict(tokens=window[:, :-1], labels=window[:, 1:], positions=positions,
                    segment=np.zeros((batch, T), np.int32))  # fmt: skip
    tokens = np.full((batch, T + 1), PAD, np.int32)
    labels = np.full((batch, T), -1, np.int32)
    positions = np.zeros((batch, T), np.int32)
    segment = np.zeros((batch, T), np.int32)
    for row in range(batch):
        start, document = 0, 0
        while True:
            length = rng.integers(SHORTEST, LONGEST + 1)
            digits = rng.integers(0, DIGITS, length)
            doc = np.concatenate([digits, [SEP], np.sort(digits)])
            end = start + len(doc)
            if end > T + 1:
                break
            tokens[row, start:end] = doc
            labels[row, start + length : end - 1] = doc[length + 1 :]  # predict the sorted part
            stop = min(end, T)  # the last token of the last document may be a label only
            positions[row, start:stop] = np.arange(stop - start)
            segment[row, start:stop] = document
            start, document = end, document + 1
        segment[row, start:] = document  # the padding: a segment of its own, never scored
    return dict(tokens=tokens[:, :-1], labels=labels, positions=positions, segment=segment)


# ----------------------------------------------------------------------------- model
D, H, KV, HD = args.width, args.heads, args.kv_heads, args.head_dim or args.width // args.heads
COMPUTE = jnp.bfloat16 if args.bf16 else jnp.float32
# Attention's kernel. A fused kernel never materialises the [heads, seq, seq] scores: the
# Pallas TPU kernel splash attention (tiles of up to 512 x 512, MaxText's default; whole
# tiles above the diagonal skipped) or cuDNN's flash attention (bf16 only).
PLATFORM = jaxpipe.target.get(args.target).platform if args.target else jax.default_backend()
SPLASH_BLOCK = jaxpipe.kernels.tile_for("splash", T) if T % 128 == 0 else None


def cudnn_loads():
    """Whether cuDNN's library loads here (compiling for GPUs ahead of time needs it too)."""
    q = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.bfloat16)
    try:
        jax.eval_shape(lambda q: jax.nn.dot_product_attention(q, q, q, implementation="cudnn"), q)
    except (RuntimeError, ValueError, NotImplementedError):
        return False
    return True


KERNEL_FITS = {
    "splash": (PLATFORM in ("tpu", "cpu") and SPLASH_BLOCK is not None,
               f"splash attention runs on a TPU (on a CPU in interpret mode) with --seq a "
               f"multiple of 128; got platform {PLATFORM}, --seq {T}"),
    "cudnn": (PLATFORM in ("cuda", "gpu") and args.bf16 and HD % 8 == 0 and HD <= 128
              and cudnn_loads(),
              f"cuDNN's attention runs on an NVIDIA GPU with --bf16 and a head width that "
              f"is a multiple of 8 up to 128, with cuDNN's library installed (pip install "
              f"nvidia-cudnn-cu12); got platform {PLATFORM}, "
              f"{'bf16' if args.bf16 else 'float32'}, head width {HD}"),
    "xla": (True, ""),
}  # fmt: skip
if args.attention == "auto":  # the fastest the platform has, where the shapes allow it
    best = {"tpu": "splash", "cuda": "cudnn", "gpu": "cudnn"}.get(PLATFORM, "xla")
    ATTENTION = best if KERNEL_FITS[best][0] else "xla"
    if best != "xla" and ATTENTION == "xla":
        LATER.append(f"attention: xla, not {best} ({KERNEL_FITS[best][1]})")
else:
    ATTENTION = args.attention
    if not KERNEL_FITS[ATTENTION][0]:
        sys.exit(f"--attention {ATTENTION}: {KERNEL_FITS[ATTENTION][1]}; or --attention xla")
if ATTENTION != "xla":
    LATER.append(f"attention: {ATTENTION} (" + {
        "splash": f"the Pallas TPU kernel, tiles of {SPLASH_BLOCK}"
                  f"{', interpret mode' if PLATFORM == 'cpu' else ''})",
        "cudnn": "cuDNN's flash attention)"}[ATTENTION])  # fmt: skip
POLICY = {
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "nothing": jax.checkpoint_policies.nothing_saveable,
    "everything": jax.checkpoint_policies.everything_saveable,
}[args.remat]


def rms_norm(x, scale):
    x32 = x.astype(jnp.float32)
    x32 = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (x32 * scale).astype(x.dtype)


def rotary(x, positions):
    """Rotary position embedding of ``x`` ``[rows, seq, heads, HD]`` at ``positions``."""
    half = HD // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    angle = positions[..., None].astype(jnp.float32) * freq
    cos, sin = jnp.cos(angle)[:, :, None], jnp.sin(angle)[:, :, None]
    a, b = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1).astype(x.dtype)


def dropout(x, key):
    if key is None or args.dropout == 0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - args.dropout, x.shape)
    return jnp.where(keep, x / (1.0 - args.dropout), 0).astype(x.dtype)


def xla_attention(q, k, v, segment):
    """Causal attention within documents, ``q`` ``[rows, seq, heads, HD]``, ``k`` and ``v``
    ``[rows, seq, kv heads, HD]``: the scores materialised, as XLA computes them."""
    t, heads, kv_heads = q.shape[1], q.shape[2], k.shape[2]
    k, v = jnp.repeat(k, heads // kv_heads, axis=2), jnp.repeat(v, heads // kv_heads, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(HD)
    same_document = segment[:, None, :, None] == segment[:, None, None, :]
    allowed = jnp.tril(jnp.ones((t, t), bool)) & same_document
    scores = jnp.where(allowed, scores, -1e9)
    attn = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", attn, v)


def cudnn_attention(q, k, v, segment):
    """The same through cuDNN's fused kernel (grouped-query heads as they are; the
    documents' mask goes in as cuDNN's mask, the causal one as its own)."""
    same_document = segment[:, None, :, None] == segment[:, None, None, :]
    return jax.nn.dot_product_attention(
        q, k, v, mask=same_document, is_causal=True, implementation="cudnn"
    )


def splash_kernel(heads, t):
    """Splash attention for one row: ``kernel(q [heads, t, HD], k, v [kv heads, t, HD],
    SegmentIds)``, causal on every head."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    mask = splash.MultiHeadMask([splash.CausalMask((t, t))] * heads)
    b = SPLASH_BLOCK
    sizes = splash.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b,
                              block_kv_dkv=b, block_kv_dkv_compute=b, block_q_dq=b,
                              block_kv_dq=b)  # fmt: skip
    return splash.make_splash_mha(
        mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=PLATFORM == "cpu"
    )


def splash_attention(q, k, v, segment):
    """The same through splash attention (the query scaled first, as the kernel does not)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    q = q * jnp.asarray(1 / np.sqrt(HD), q.dtype)
    q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))  # [rows, heads, seq, HD]
    kernel = jax.vmap(splash_kernel(q.shape[1], q.shape[2]))
    return kernel(q, k, v, SegmentIds(q=segment, kv=segment)).transpose(0, 2, 1, 3)


def on_each_device(attention):
    """``attention`` on each device's rows and heads: XLA does not split a kernel's call
    (a Pallas kernel's, or cuDNN's inside the pipeline), so it runs under a shard_map over
    the mesh axes still automatic here (the pipeline makes pipe, data and fsdp manual;
    tensor splits the heads)."""

    def run(q, k, v, segment):
        if k.shape[2] % args.tensor:  # kv heads whole on each device: one per query head
            k, v = (jnp.repeat(a, q.shape[2] // k.shape[2], axis=2) for a in (k, v))
        mesh = jax.sharding.get_abstract_mesh()
        automatic = [] if mesh.empty else [
            a for a, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
            if kind != jax.sharding.AxisType.Manual]  # fmt: skip
        rows = tuple(a for a in ("data", "fsdp") if a in automatic) or None
        heads = "tensor" if "tensor" in automatic else None
        if not (rows or heads):
            return attention(q, k, v, segment)
        spec = P(rows, None, heads, None)
        return jax.shard_map(
            attention, in_specs=(spec, spec, spec, P(rows, None)), out_specs=spec,
            axis_names=frozenset((rows or ()) + ((heads,) if heads else ())), check_vma=False,
        )(q, k, v, segment)  # fmt: skip

    return run


ATTENTIONS = {
    "xla": xla_attention,
    "cudnn": on_each_device(cudnn_attention),
    "splash": on_each_device(splash_attention),
    # what stands in for a fused kernel where a block's cost is estimated around it
    "stand-in": lambda q, k, v, segment: q,
}  # fmt: skip


def block(p, x, side, key, attention=ATTENTION):
    """One pre-norm Llama block: x + attention(norm(x)), then x + SwiGLU(norm(x)) (a ReLU
    MLP where ``p`` has no ``w_gate``)."""
    rows, t, _ = x.shape
    H, KV = p["wq"].shape[-1] // HD, p["wk"].shape[-1] // HD  # the heads these weights hold
    h = rms_norm(x, p["attn_norm"])
    q = rotary((h @ p["wq"]).reshape(rows, t, H, HD), side["positions"])
    k = rotary((h @ p["wk"]).reshape(rows, t, KV, HD), side["positions"])
    v = (h @ p["wv"]).reshape(rows, t, KV, HD)
    out = ATTENTIONS[attention](q, k, v, side["segment"]).reshape(rows, t, H * HD)
    k_attn, k_mlp = (None, None) if key is None else jax.random.split(key)
    x = x + dropout(out @ p["wo"], k_attn)
    h = rms_norm(x, p["mlp_norm"])
    if "w_gate" not in p:
        return x + dropout(jax.nn.relu(h @ p["w_up"]) @ p["w_down"], k_mlp)
    return x + dropout((jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"], k_mlp)


# Each block under jax.checkpoint: what its backward keeps (one per attention kernel).
BLOCKS = {name: jax.checkpoint(functools.partial(block, attention=name), policy=POLICY)
          for name in ATTENTIONS}  # fmt: skip


def residual_stream(x):
    """``x`` ``[rows, seq, width]`` between blocks: split by sequence over tensor with
    ``--sequence-parallel`` (XLA gathers it before attention and the MLP and reduce-scatters
    their outputs), else as XLA places it. Unchanged outside the mesh, where the pipeline
    first traces a stage on one micro-batch."""
    mesh = jax.sharding.get_abstract_mesh()
    if not args.sequence_parallel or mesh.empty or "tensor" not in mesh.axis_names:
        return x
    return lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, "tensor", None)))


def stage_fn(p, x, *, side, key=None, attention=ATTENTION):
    """One pipeline stage: LAYERS_PER_STAGE blocks, a ``lax.scan`` over p's layer axis.

    ``side`` is this micro-batch's positions and segment ids; ``key`` (with ``key=`` given
    to the pipeline) is this stage's and micro-batch's, split once per block."""
    keys = None if key is None else jax.random.split(key, LAYERS_PER_STAGE)

    def one(x, layer):
        layer_params, layer_key = layer
        y = BLOCKS[attention](layer_params, residual_stream(x), side, layer_key)
        return residual_stream(y), None

    return lax.scan(one, x, (p, keys))[0]


def logits_of(head, y):
    """The head's logits in float32 for the loss, multiplied in the compute dtype and
    accumulated in float32: no float32 copy of the head, its gradient or ``y``."""
    out = head["embed"].T if args.tied else head["out"]
    return jnp.matmul(rms_norm(y, head["norm"]), out, preferred_element_type=jnp.float32)


def loss_fn(head, y, labels):
    """Cross-entropy on the last stage: each row's mean over its scored tokens (labels >= 0),
    then the mean over rows (a mean over rows, as data parallelism assumes)."""
    nll = optax.softmax_cross_entropy_with_integer_labels(
        logits_of(head, y), jnp.maximum(labels, 0)
    )
    scored = labels >= 0
    per_row = jnp.sum(nll * scored, axis=-1) / jnp.maximum(jnp.sum(scored, axis=-1), 1)
    return jnp.mean(per_row)


def init_stage(key):
    """One stage's parameters: LAYERS_PER_STAGE blocks stacked on a leading layer axis."""
    return init_stage_of(LAYERS_PER_STAGE, key)


def init_stage_of(L, key=None):
    """``L`` blocks' parameters stacked on a leading layer axis (key None: any)."""
    k = jax.random.split(jax.random.key(0) if key is None else key, 7)

    def dense(key, fan_in, fan_out, scale=1.0):
        return scale * jax.random.normal(key, (L, fan_in, fan_out)) / np.sqrt(fan_in)

    out_scale = 1.0 / np.sqrt(2 * args.layers)  # residual branches start small
    return without_gate(
        {
            "attn_norm": jnp.ones((L, D)),
            "wq": dense(k[0], D, H * HD),
            "wk": dense(k[1], D, KV * HD),
            "wv": dense(k[2], D, KV * HD),
            "wo": dense(k[3], H * HD, D, out_scale),
            "mlp_norm": jnp.ones((L, D)),
            "w_gate": dense(k[4], D, args.hidden),
            "w_up": dense(k[5], D, args.hidden),
            "w_down": dense(k[6], args.hidden, D, out_scale),
        }
    )


def without_gate(block_tree):
    """``block_tree`` (a block's weights, specs or shapes) without ``w_gate`` for --mlp relu."""
    return {k: v for k, v in block_tree.items() if k != "w_gate" or args.mlp == "swiglu"}


def kernel_seconds(rows, heads, peak):
    """The fused kernel's seconds in one block's F, B, W and BW (`jaxpipe.kernels`:
    its matrix products over the causal tiles at 50% of the chip's peak, which no compiler's
    estimate sees). Under --remat dots or nothing its output (no matrix product of the
    weights) is not kept, so B and W run its forward again."""
    costs = jaxpipe.kernels.attention_costs(
        ATTENTION, rows=rows, seq=T, heads=heads, head_dim=HD, peak_flops=peak,
        recompute_forward=args.remat != "everything",
    )  # fmt: skip
    return dataclasses.asdict(costs)


@functools.cache
def target_block_costs():
    """(Costs, how, around, kernel) of one block as a device runs it on --target: the
    compiler's estimate of the block on one device's share (its heads and hidden width, split
    over tensor; its rows of a micro-batch, split over data x fsdp); with a fused kernel, the
    compiler's estimate of the block around it (``around``: the kernel's output stood in by
    its query) plus `kernel_seconds` (``kernel``, per action); both None for XLA's."""
    tgt = jaxpipe.target.get(args.target)
    tp, rows = args.tensor, args.batch // (M * DP)
    shard = {"wq": (D, HEADS_HERE * HD), "wk": (D, KV_HERE * HD), "wv": (D, KV_HERE * HD),
             "wo": (HEADS_HERE * HD, D), "w_gate": (D, args.hidden // tp),
             "w_up": (D, args.hidden // tp), "w_down": (args.hidden // tp, D),
             "attn_norm": (D,), "mlp_norm": (D,)}  # fmt: skip
    one = {k: jax.ShapeDtypeStruct(shape, COMPUTE) for k, shape in without_gate(shard).items()}
    x = jax.ShapeDtypeStruct((rows, T, D), COMPUTE)
    side = {k: jax.ShapeDtypeStruct((rows, T), jnp.int32) for k in ("positions", "segment")}
    tpu = tgt.platform == "tpu"  # the TPU compiler estimates time; for GPUs, a roofline
    costed = "xla" if ATTENTION == "xla" else "stand-in"
    counts = jaxpipe.costs.cost_analysis(
        lambda p, xs: BLOCKS[costed](p, xs[0], xs[1], None), one, (x, side),
        device=tgt.devices[0] if tpu else None,
    )  # fmt: skip
    if tpu:
        per_block = jaxpipe.costs.compiler_seconds(counts)
        how = "the TPU compiler's optimal_seconds"
    else:
        per_block = jaxpipe.costs.roofline(counts, tgt.peaks)
        how = f"XLA's flop and byte counts (CPU compiler) at the {tgt.peaks.name}'s peaks"
    how += " of one block on one device's share"
    if ATTENTION == "xla":
        return per_block, how, None, None
    peak = tgt.peaks.peak_flops if args.bf16 else tgt.peaks.peak_flops_fp32 or tgt.peaks.peak_flops
    kernel = kernel_seconds(rows, HEADS_HERE, peak)
    around = per_block
    per_block = jaxpipe.schedules.Costs(**{a: getattr(around, a) + kernel[a] for a in kernel})
    how += (f" around {ATTENTION}'s kernel, plus the kernel's matrix products at "
            f"{jaxpipe.kernels.EFFICIENCY:.0%} of the chip's peak")  # fmt: skip
    return per_block, how, around, kernel


def target_stage_costs():
    """(Costs, how) of one stage as a device runs it on --target: `target_block_costs`
    times the blocks of a stage. A whole stage on one chip is not what a device runs, and
    need not fit one (a 70B stage does not)."""
    per_block, how, *_ = target_block_costs()
    costs = jaxpipe.schedules.Costs(
        *(LAYERS_PER_STAGE * getattr(per_block, f) for f in
          ("forward", "backward_input", "backward_weight", "full_backward"))
    )  # fmt: skip
    return costs, f"{how}, x{LAYERS_PER_STAGE} blocks a stage"


def stage_costs(text):
    """--costs as Pipeline takes it: None, "measure", or Costs (the target's, or F:B:W)."""
    if text == "target" and not args.target:
        sys.exit("--costs target needs --target (the compiler whose estimates to use)")
    if text in (None, "measure"):
        return text
    if text == "target":
        return target_stage_costs()[0]
    return jaxpipe.schedules.Costs.from_text(text)


def print_costs():
    """The costs the table was packed for, and its predicted bubbles beside the default's."""
    if pipe.costs is not None:
        if args.costs == "target":
            print(f"stage costs on {args.target}: {target_stage_costs()[1]}")
        print(jaxpipe.schedules.describe_fit(pipe.schedule, pipe.costs, schedule))


def weight_specs(fsdp, tensor, kv_tensor, vocab):
    """(block_specs, outer_specs): how the weights split over the mesh axes named (None: not
    split; ``kv_tensor`` for the key/value projections, ``vocab`` the embedding's and head's
    vocabulary)."""
    # How each block weight is split ([layers, in, out] after the stage axis): the way
    # Megatron-LM splits it over tensor (query/key/value/gate/up by output columns, the
    # attention output and down projections by input rows), the other dimension over fsdp.
    column, row = P(None, fsdp, tensor), P(None, tensor, fsdp)
    block_specs = {
        "attn_norm": None, "wq": column, "wk": P(None, fsdp, kv_tensor),
        "wv": P(None, fsdp, kv_tensor), "wo": row, "mlp_norm": None, "w_gate": column,
        "w_up": column, "w_down": row,
    }  # fmt: skip
    return without_gate(block_specs), {"embed": P(vocab, None), "norm": P(), "out": P(None, vocab)}


# ----------------------------------------------------------------------------- devices, mesh
def choose_plan(devices):
    """--schedule auto: `jaxpipe.plan` for --target (else --plan-for), over pipe x data x
    fsdp x tensor with the --stages, --data, --fsdp, --tensor and --microbatches given kept;
    None where it cannot plan. Tensor sizes are powers of two up to 8 that divide the heads,
    kv heads and hidden width. It plans with XLA's attention (the planner cannot cost a
    kernel's custom call); the run then uses --attention's kernel."""
    name = args.target or args.plan_for
    try:
        target = jaxpipe.target.get(name)
    except jaxpipe.target.TargetError as error:
        print(f"schedule auto: cannot plan for {name} ({error}); running 1f1b")
        return None
    if target.peaks is None or target.links is None:
        print(f"schedule auto: {name} has no peak or link figures to plan with; running 1f1b")
        return None
    if not args.target and len(target.devices) > len(devices):
        print(f"schedule auto: {name} has {len(target.devices)} devices, this machine "
              f"{len(devices)}; running 1f1b")  # fmt: skip
        return None
    s = jax.ShapeDtypeStruct
    one_block = jax.tree.map(
        lambda a: s(a.shape[1:], COMPUTE), jax.eval_shape(lambda: init_stage_of(1))
    )
    vocab = ("tensor", "fsdp") if VOCAB % len(target.devices) == 0 else None  # any split divides
    block_specs, outer_specs = weight_specs("fsdp", "tensor", "tensor", vocab)
    specs = {k: v and P(*v[1:]) for k, v in block_specs.items()}  # one block's, no layer axis
    table = "embed" if args.tied else "out"
    head = {"norm": s((D,), COMPUTE), table: s((VOCAB, D) if args.tied else (D, VOCAB), COMPUTE)}
    side = {k: s((args.batch, T), jnp.int32) for k in ("positions", "segment")}

    def xla_block(p, x, side):
        return block(p, x, side, None, attention="xla")

    fixed = {"pipe": args.stages, "data": args.data, **SPLIT_GIVEN}
    split = math.gcd(args.heads, args.kv_heads, args.hidden)
    try:
        plans = jaxpipe.plan(
            xla_block, one_block, args.layers, loss_fn, head, s((args.batch, T, D), COMPUTE),
            s((args.batch, T), jnp.int32), side=side, target=target, block_specs=specs,
            loss_specs={k: outer_specs[k] for k in head},
            fixed={a: n for a, n in fixed.items() if n is not None},
            microbatches=None if args.microbatches is None else [args.microbatches],
            max_tensor=min(8, split & -split), compile_top=1 if args.target else 0,
            scan_blocks=True,  # the stage runs its blocks in a lax.scan (stage below)
        )  # fmt: skip
    except jaxpipe.planner.NothingFits as error:
        sys.exit(f"schedule auto, {name}: {error}")
    print(f"schedule auto: the plan for {name} (jaxpipe.plan), and the runner-up:")
    print(plans.table(rows=2))
    return plans[0]


plan = None
if args.schedule is None:  # flags that pick by hand keep the hand-picked default
    args.schedule = "1f1b" if args.target or args.costs or args.virtual_stages else "auto"
if args.schedule == "auto":
    if args.costs or args.virtual_stages:
        sys.exit("--schedule auto chooses the table (packed where that wins) and v: give a "
                 "schedule name with --costs or --virtual-stages")  # fmt: skip
    plan = choose_plan(jaxpipe.target.get(args.target).devices if args.target else jax.devices())
    if plan is None:
        args.schedule = "1f1b"
    else:  # the plan's remat, on each stage: the blocks run without their own
        BLOCKS = {name: functools.partial(block, attention=name) for name in ATTENTIONS}
        args.fsdp, args.tensor = plan.axes["fsdp"], plan.axes["tensor"]
        HEADS_HERE, KV_HERE = heads_here()
TENSOR = "tensor" if args.tensor > 1 else None
FSDP = "fsdp" if args.fsdp > 1 else None
KV_TENSOR = TENSOR if KV % args.tensor == 0 else None  # fewer kv heads: replicate them
# The embedding and the head split by vocabulary over tensor and fsdp (where they divide it).
VOCAB_AXIS = tuple(axis for axis in (TENSOR, FSDP) if axis) or None
VOCAB_AXIS = VOCAB_AXIS if VOCAB % (args.tensor * args.fsdp) == 0 else None
block_specs, outer_specs = weight_specs(FSDP, TENSOR, KV_TENSOR, VOCAB_AXIS)
S = plan.axes["pipe"] if plan else (args.stages or 4)
M = plan.num_microbatches if plan else (args.microbatches or 8)
DATA_AXIS = plan.axes["data"] if plan else (args.data or 2)
# pipe x data x fsdp x tensor; the batch is split over data and fsdp (DP replicas in all).
axes = {"pipe": S, "data": DATA_AXIS, "fsdp": args.fsdp, "tensor": args.tensor}
axes = {name: n for name, n in axes.items() if n > 1 or name in ("pipe", "data")}
DP = DATA_AXIS * args.fsdp
if args.target:  # compile only: the target's devices, not attached to this machine
    try:
        devices = jaxpipe.target.get(args.target).devices
    except jaxpipe.target.TargetError as error:
        sys.exit(f"--target: {error}")
    print(f"target: {args.target}, {len(devices)} devices: {devices[0].device_kind} (compile only)")
else:
    devices = jax.devices()
    print(f"platform: {jax.default_backend()}, {len(devices)} devices: {devices[0].device_kind}")
needed = int(np.prod(list(axes.values())))
if len(devices) < needed:
    sys.exit(f"mesh {axes} needs {needed} devices, found {len(devices)}")
if args.target:  # as jax.make_mesh, and also where an axis splits a physical one
    across = plan.across if plan else None  # the plan's axis across slices or nodes
    mesh = jaxpipe.target.get(args.target).mesh(tuple(axes.values()), tuple(axes), across=across)
else:
    mesh = jax.make_mesh(
        tuple(axes.values()), tuple(axes), axis_types=(jax.sharding.AxisType.Auto,) * len(axes),
        devices=devices[:needed],
    )  # fmt: skip
print(f"mesh: {dict(mesh.shape)}")
if args.batch % (M * DP):
    sys.exit(f"--batch {args.batch} must be a multiple of --microbatches x --data x --fsdp = "
             f"{M * DP}")  # fmt: skip
if args.sequence_parallel and (args.tensor == 1 or args.seq % args.tensor):
    sys.exit(f"--sequence-parallel splits --seq {args.seq} over --tensor {args.tensor}: "
             "it needs --tensor > 1 dividing --seq")  # fmt: skip
options = {}
if args.virtual_stages is not None:
    options = {"virtual_stages": args.virtual_stages}
elif args.schedule == "interleaved_1f1b":
    options = {"virtual_stages": 2}
schedule = plan.schedule if plan else jaxpipe.schedules.get(args.schedule, S, M, **options)
N = schedule.num_logical_stages  # S * v stages in the model
if args.layers % N:
    sys.exit(f"--layers {args.layers} must be a multiple of the {N} pipeline stages")
LAYERS_PER_STAGE = args.layers // N
print(f"schedule: {schedule.name} S={S} M={M} v={schedule.stages_per_device}, {N} stages of "
      f"{LAYERS_PER_STAGE} block(s), "
      f"bubble {jaxpipe.schedules.bubble_fraction(schedule).lockstep:.1%}")  # fmt: skip
for line in LATER:
    print(line)

# The plan sets the table, remat and FSDP gathering; else remat_policy=None: the per-block
# jax.checkpoint above decides what each backward keeps.
chosen = {"schedule": plan} if plan else {
    "schedule": schedule, "remat_policy": None, "fsdp_gather": args.fsdp_gather}  # fmt: skip
pipe = jaxpipe.Pipeline(
    stage_fn, loss_fn, mesh=mesh, costs=stage_costs(args.costs),
    split_loss_grads=args.split_loss_grads, **chosen,
)  # fmt: skip


def compute(tree):
    return jax.tree.map(lambda a: a.astype(COMPUTE), tree)


def split_params(params):
    """(blocks, head, embedding table) in the compute dtype (bf16 copies under --bf16: the
    cast is elementwise, so the blocks stay in the pipeline's layout)."""
    head = {"norm": params["norm"]}
    head["embed" if args.tied else "out"] = params["embed" if args.tied else "out"]
    return compute(params["blocks"]), compute(head), compute(params["embed"])


def side_of(batch):
    return {"positions": batch["positions"], "segment": batch["segment"]}


def loss(params, batch, key):
    """The embedding before the pipeline; blocks, head and loss inside it."""
    blocks, head, embed = split_params(params)
    x = embed[batch["tokens"]]
    return pipe.loss(blocks, head, x, batch["labels"], side=side_of(batch), key=key)


def reference_loss(params, batch, key, attention=ATTENTION):
    """The same model without the pipeline (jaxpipe.reference.loss, same keys)."""
    blocks, head, embed = split_params(params)
    return jaxpipe.reference.loss(
        functools.partial(stage_fn, attention=attention), loss_fn, pipe.logical(blocks), head,
        embed[batch["tokens"]], batch["labels"], M, side=side_of(batch), key=key,
    )  # fmt: skip


# ----------------------------------------------------------------------------- parameters
replicated = NamedSharding(mesh, P())
if args.target:  # compile only: shapes with shardings stand for every array (none is made)
    key_shape = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    blocks = jax.eval_shape(lambda key: pipe.init(init_stage, key, block_specs), key_shape)
    outer = {"embed": (VOCAB, D), "norm": (D,), **({} if args.tied else {"out": (D, VOCAB)})}
    params = {
        "blocks": jaxpipe.target.abstract(blocks, pipe.layout.shardings(blocks, block_specs)),
        **{name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in outer.items()},
    }
    for name in outer:  # the embedding and head: shardings as outer_specs say
        params[name] = jaxpipe.target.abstract(params[name], NamedSharding(mesh, outer_specs[name]))
else:
    key_blocks, key_embed, key_out = jax.random.split(jax.random.key(args.seed), 3)
    params = {
        # Each device creates only its own stages, in the pipeline's layout [v, S, LAYERS, ...].
        "blocks": pipe.init(init_stage, key_blocks, block_specs),
        **{name: jax.device_put(value, NamedSharding(mesh, outer_specs[name])) for name, value in {
            "embed": jax.random.normal(key_embed, (VOCAB, D)) * (D**-0.5 if args.tied else 1.0),
            "norm": jnp.ones((D,)),
            **({} if args.tied else {"out": jax.random.normal(key_out, (D, VOCAB)) / np.sqrt(D)}),
        }.items()},
    }  # fmt: skip
count = sum(x.size for x in jax.tree.leaves(params))
REMAT = args.remat if plan is None else f"{plan.remat} (the plan's, of each stage)"
MLP = "SwiGLU" if args.mlp == "swiglu" else "ReLU"
heads_of = "" if HD * H == D else f" of {HD}"
print(f"model: {args.layers} blocks (width {D}, {H} heads{heads_of}, {KV} kv heads, {MLP} "
      f"{args.hidden}),"
      f" vocabulary {VOCAB}, {'tied' if args.tied else 'untied'} head, {count / 1e6:.2f}M "
      f"parameters, compute "
      f"{jnp.dtype(COMPUTE).name}, dropout {args.dropout}, remat {REMAT}")  # fmt: skip

learning_rate = optax.warmup_cosine_decay_schedule(
    0.0, args.lr, 20, max(args.steps, 21), 0.1 * args.lr
)
optimizer = optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(learning_rate, weight_decay=0.01)
)
# The moments in the parameters' layout: under a bare jax.jit(optimizer.init) they land on
# one device (init reads no parameter values), and the train step would compile twice.
state_shardings = optax.tree_utils.tree_map_params(
    optimizer, lambda _, p: p.sharding, jax.eval_shape(optimizer.init, params), params,
    transform_non_params=lambda leaf: replicated,
)  # fmt: skip
if args.target:
    opt_state = jaxpipe.target.abstract(jax.eval_shape(optimizer.init, params), state_shardings)
else:
    opt_state = jax.jit(optimizer.init, out_shardings=state_shardings)(params)


def step_key(step):
    return jax.random.fold_in(jax.random.key(args.seed + 1), step) if args.dropout else None


def model_flops():
    """FLOPs of one step's model (all devices): 6 per parameter of the blocks and the head
    per token, and 12 x layers x heads x head width x seq per token for attention's two
    matmuls (PaLM's count, Chowdhery et al. 2022, appendix B; causal masking not
    subtracted, recomputation not counted)."""
    block = 2 * D * H * HD + 2 * D * KV * HD + (3 if args.mlp == "swiglu" else 2) * D * args.hidden
    tokens = args.batch * T
    return tokens * (6 * (args.layers * block + D * VOCAB) + 12 * args.layers * H * HD * T)


def predict_step_time(report):
    """`report.step_time`: one tick's computation from the stage's costs on the target
    (`target_stage_costs`), run through the table in lock-step."""
    if report.links is None or report.ticks is None:
        print(f"step time: no link figures for {args.target} or no tick loop; not predicted")
        return None
    costs, how = target_stage_costs()
    tick = jaxpipe.target.lockstep_tick_seconds(pipe.schedule, costs)
    source = (f"{how}, {pipe.schedule.name}'s table in lock-step over its "
              f"{pipe.schedule.num_ticks} ticks; the loss's head not counted")  # fmt: skip
    return report.step_time(
        tick, source, model_flops=model_flops(), flops_source="the model's own count",
        ticks=pipe.schedule.num_ticks,
        calibration=jaxpipe.calibration.get(jaxpipe.target.get(args.target).platform),
    )  # fmt: skip


@functools.partial(jax.jit, donate_argnums=(0, 1), compiler_options=XLA_OPTIONS or None)
def train_step(params, opt_state, batch, key):
    value, grads = jax.value_and_grad(loss)(params, batch, key)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


if args.target:  # compile the step for the target, print what its compiler says, and stop
    data = NamedSharding(mesh, P(pipe.data_axes))
    batch = {name: jax.ShapeDtypeStruct((args.batch, T), jnp.int32, sharding=data)
             for name in ("tokens", "labels", "positions", "segment")}  # fmt: skip
    key = jax.eval_shape(lambda: step_key(0)) if args.dropout else None
    try:
        report = jaxpipe.target.get(args.target).compile(train_step, params, opt_state, batch, key)
    except jaxpipe.target.DoesNotFit as error:
        sys.exit(str(error))
    print(report)
    print_costs()
    step_time = predict_step_time(report) if args.step_time else None
    if step_time is not None:
        print(step_time)
    if args.json:  # every number of the report, and what was compiled
        import json

        gather = args.fsdp_gather
        if gather == "auto":  # the mode the step ran
            blocks = jax.eval_shape(lambda p: split_params(p)[0], params)
            x = jax.ShapeDtypeStruct((args.batch, T, D), COMPUTE, sharding=data)
            gather = pipe.gather_mode(blocks, x, side=side_of(batch))
        run = {"model": args.model, "layers": args.layers, "width": D, "hidden": args.hidden,
               "heads": H, "kv_heads": KV, "vocab": VOCAB, "seq": T, "batch": args.batch,
               "schedule": schedule.name, "stages": S, "microbatches": M,
               "virtual_stages": schedule.stages_per_device, "remat": args.remat,
               "sequence_parallel": args.sequence_parallel, "fsdp_gather": gather,
               "split_loss_grads": args.split_loss_grads,
               "xla_options": XLA_OPTIONS, "compute": jnp.dtype(COMPUTE).name,
               "attention": ATTENTION,
               "parameters": int(count),
               "bubble": jaxpipe.schedules.bubble_fraction(pipe.schedule).lockstep}  # fmt: skip
        with open(args.json, "w", encoding="utf-8") as f:
            out = {"run": run, "report": report.as_dict()}
            if pipe.costs is not None:  # what the table was packed for, in seconds with target
                out["stage_costs"] = dataclasses.asdict(pipe.costs)
            if step_time is not None:
                out["step_time"] = step_time.as_dict()
            if args.step_time or args.costs == "target":  # one block's, and its kernel's
                per_block, how, around, kernel = target_block_costs()
                out["block_costs"] = {
                    **dataclasses.asdict(per_block),
                    "how": how,
                    "around": around and dataclasses.asdict(around),
                    "kernel": kernel,
                    "kernel_efficiency": jaxpipe.kernels.EFFICIENCY,
                }
            json.dump(out, f, indent=1, default=str)
    sys.exit(0)


@jax.jit
def accuracy(params, batch):
    """Token accuracy over the scored positions (forward-only pipeline, no dropout)."""
    blocks, head, embed = split_params(params)
    y = pipe.forward(blocks, embed[batch["tokens"]], side=side_of(batch))
    hit = (jnp.argmax(logits_of(head, y), -1) == batch["labels"]) & (batch["labels"] >= 0)
    return jnp.sum(hit) / jnp.sum(batch["labels"] >= 0)


def place_batch(batch):
    """Every array of the batch sharded over the data axis (rows)."""
    return jax.device_put(batch, NamedSharding(mesh, P(pipe.data_axes)))


start_step, checkpoints = 0, None
if args.out:
    checkpoints = os.path.join(args.out, "checkpoints")
    if args.resume:
        step = jaxpipe.checkpoint.latest_step(checkpoints)
        if step is None:
            sys.exit(f"--resume: no checkpoint in {checkpoints}")
        target = jaxpipe.checkpoint.abstract((params, opt_state))
        params, opt_state = jaxpipe.checkpoint.restore(
            checkpoints, step, target=target, pipeline=pipe
        )
        start_step = step + 1
        print(f"resumed from step {step}")

# ----------------------------------------------------------------------------- step 0 check
# The first batch through the pipeline and through the same model without it. Dropout off:
# with a data axis, replica r draws its masks from fold_in(key, r), not the plain model's
# one mask per micro-batch (jaxpipe.reference, tests/test_transformers.py).
batch = place_batch(get_batch(start_step))
piped = float(jax.jit(loss)(params, batch, None))
plain = float(jax.jit(reference_loss)(params, batch, None))
print(f"step {start_step} loss: pipeline {piped:.6f}, same model without the pipeline "
      f"{plain:.6f} (relative difference {abs(piped - plain) / abs(plain):.1e}"
      f"{', dropout off' if args.dropout else ''})")  # fmt: skip
if ATTENTION != "xla":  # the kernel against XLA's attention: the loss and every gradient
    shardings = (replicated, jax.tree.map(lambda a: a.sharding, params))
    grads = {name: jax.jit(jax.value_and_grad(reference_loss), static_argnums=3,
                           out_shardings=shardings)(params, batch, None, name)
             for name in (ATTENTION, "xla")}  # fmt: skip
    (fused, fused_grads), (xla, xla_grads) = grads.values()
    pairs = zip(jax.tree.leaves(fused_grads), jax.tree.leaves(xla_grads), strict=True)
    worst = max(float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) for a, b in pairs)
    print(f"step {start_step} {ATTENTION} against XLA's attention: loss {float(fused):.6f} "
          f"against {float(xla):.6f} (relative difference "
          f"{abs(float(fused) - float(xla)) / abs(float(xla)):.1e}), gradients' largest "
          f"relative difference {worst:.1e}")  # fmt: skip

# ----------------------------------------------------------------------------- training
eval_batch = place_batch(get_batch(-1))  # no step trains on it
start = t0 = time.perf_counter()
timed_from, timed_steps = None, 0
tokens, value, acc = 0, float("nan"), float("nan")
for step in range(start_step, args.steps):
    batch = place_batch(get_batch(step))
    params, opt_state, value = train_step(params, opt_state, batch, step_key(step))
    if step == start_step:
        print_costs()  # known once the first step is traced ("measure", a target)
    tokens += batch["tokens"].size
    if checkpoints and (step % args.save_every == 0 or step == args.steps - 1):
        jaxpipe.checkpoint.save(checkpoints, step, (params, opt_state), pipeline=pipe)
    if step % args.log_every == 0 or step == args.steps - 1:
        value = float(value)  # waits for the step to finish
        now = time.perf_counter()
        if timed_from is None:  # the first step compiles: time the ones after it
            timed_from, timed_steps, speed = now, 0, "compiled"
        else:
            eta = (now - timed_from) / timed_steps * (args.steps - 1 - step)
            speed = f"{tokens / (now - t0):,.0f} tokens/s | ETA {eta:.0f} s"
        acc = float(accuracy(params, eval_batch))
        print(f"step {step:5d} | loss {value:.4f} | accuracy {acc:.3f} | {speed}", flush=True)
        t0, tokens = time.perf_counter(), 0
        if speed == "compiled":  # time from here: not the evaluation's compilation either
            timed_from = t0
    timed_steps += 1
chance = 1 / DIGITS if not args.text else 1 / VOCAB
print(f"final: loss {float(value):.4f} accuracy {acc:.3f} (chance {chance:.3f}) in "
      f"{time.perf_counter() - start:.0f} s")  # fmt: skip
