"""Train a small DeepSeek-style mixture of experts with pipeline and expert parallelism.

Every block is causal grouped-query attention (RMSNorm, rotary positions) followed by a
`jaxpipe.moe.MoE` layer: shared experts that every token goes through, and routed experts,
of which a router picks each token's top k. The pipeline cuts the blocks into stages over
the ``pipe`` axis; inside a stage the routed experts are split over the ``expert`` axis
(each device holds E / expert of them) and each token travels to its experts' devices and
back by all-to-all. For everything else ``expert`` is a data axis: the batch is split over
it. The token embedding runs before the pipeline; the final norm, the head and the
cross-entropy run in ``loss_fn`` on the last stage, together with the routers'
load-balancing and z-losses, which each block adds to the activations it passes on.

Default task: sort 8 digits (as examples/train_gpt.py). A sequence is 8 random digits, a
separator, then the same digits sorted; the model is scored on the sorted half (token
accuracy). The first step's loss, and which tokens it drops for capacity, are compared
with the same model's without the pipeline and with every expert on one device.

    python3 examples/train_moe.py                  # jaxpipe.plan chooses (expert 4 kept)
    python3 examples/train_moe.py --schedule 1f1b  # chosen by hand: pipe 2 x expert 4
    python3 examples/train_moe.py --schedule 1f1b --expert 2 --data 2   # pipe 2 x expert 2 x data 2
    python3 examples/train_moe.py --schedule dualpipev --capacity-factor none   # dropless
    python3 examples/train_moe.py --model mixtral-8x7b --target v5p:2x4x4 --stages 4 \\
        --expert 8 --microbatches 16 --batch 128     # Mixtral-8x7B's shapes, compile only

With no GPU or TPU, JAX's CPU backend is split into ``--devices`` host devices (default 8).
``--target`` compiles the training step for a TPU topology or GPUs (``h100x32``) without
running it, on any machine, and prints what the compiler says (`jaxpipe.target`): memory
per device against the chip's, collectives, time estimate. It needs the compiler:
``pip install "jaxpipe[tpu]"`` or ``pip install "jaxpipe[cuda-compile]"``.
"""

import argparse
import dataclasses
import functools
import os
import sys
import time

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument(
    "--schedule", default=None,
    help="a name from jaxpipe.schedules.names(), or auto: jaxpipe.plan chooses the schedule, "
    "its table, --stages, --data, --microbatches and remat (those given are kept; --expert "
    "always) for --target, or else for --plan-for. Default: auto; 1f1b with --target or "
    "--virtual-stages (they compile what the flags say)",
)  # fmt: skip
parser.add_argument("--stages", type=int, default=None, help="devices on the pipe axis (S; 2)")
parser.add_argument("--expert", type=int, default=4, help="expert-parallel size")
parser.add_argument("--data", type=int, default=None, help="data-parallel size (1)")
parser.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (M; 4)")
parser.add_argument("--virtual-stages", type=int, default=None, help="v for interleaved_1f1b")
parser.add_argument(
    "--plan-for", default="v5p:2x2x2",
    help="--schedule auto without --target: the TPU or GPUs to plan for (their compiler is "
    "needed: pip install 'jaxpipe[tpu]'); the plan then trains here",
)  # fmt: skip
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--batch", type=int, default=64, help="global batch size (rows)")
parser.add_argument("--seq", type=int, default=None, help="tokens per row (default: the task's)")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--layers", type=int, default=4, help="transformer blocks in total")
parser.add_argument("--width", type=int, default=64, help="model width")
parser.add_argument("--heads", type=int, default=4, help="query heads")
parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (grouped-query)")
parser.add_argument("--head-dim", type=int, default=None, help="default: width / heads")
parser.add_argument("--experts", type=int, default=8, help="routed experts per block (E)")
parser.add_argument("--top-k", type=int, default=2, help="routed experts per token")
parser.add_argument("--shared-experts", type=int, default=1, help="experts every token sees")
parser.add_argument("--expert-hidden", type=int, default=64, help="SwiGLU hidden width")


def capacity_factor(text):
    """--capacity-factor: a positive number, or 'none'."""
    if text.lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a positive number nor 'none'")
    return value


parser.add_argument(
    "--capacity-factor", type=capacity_factor, default=1.25,
    help="an expert takes at most capacity-factor x its even share of a group's token "
    "choices and drops the rest; 'none': no token is dropped",
)  # fmt: skip
parser.add_argument(
    "--group-size", type=int, default=None,
    help="tokens per routing group (capacity and load balance are per group); default a row",
)  # fmt: skip
parser.add_argument("--load-balance", type=float, default=0.01, help="load-balancing loss weight")
parser.add_argument("--router-z", type=float, default=0.001, help="router z-loss weight")
parser.add_argument(
    "--bf16", action=argparse.BooleanOptionalAction, default=False,
    help="run the pipeline in bfloat16 (float32 master weights)",
)  # fmt: skip
parser.add_argument(
    "--remat", default="dots", choices=["dots", "nothing", "everything"],
    help="per-block remat policy: keep matmul results without batch dimensions (dots), "
    "recompute the whole block (nothing) or keep every residual (everything); under "
    "--schedule auto the plan's remat of each stage replaces it",
)  # fmt: skip
parser.add_argument("--log-every", type=int, default=25)
parser.add_argument("--devices", type=int, default=8, help="host devices when running on CPU")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument(
    "--target", default=None,
    help="compile only: compile the training step for this TPU topology (e.g. v5p:2x4x4), "
    "GPU type and count (h100x32) or cpu, print memory, collectives and time estimate, and exit",
)  # fmt: skip
parser.add_argument(
    "--model", default=None, choices=["mixtral-8x7b", "qwen3-30b-a3b"],
    help="the published shapes of a mixture-of-experts model (blocks, widths, heads, experts, "
    "vocabulary, 4096 tokens per row, bf16 compute); flags given explicitly win",
)  # fmt: skip
parser.add_argument(
    "--vocab", type=int, default=None,
    help="rows of the embedding table (at least the task's 11; default: the task's)",
)  # fmt: skip
# The published shapes (the models' config.json: hidden_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, head_dim, num_local_experts / num_experts,
# num_experts_per_tok, intermediate_size / moe_intermediate_size, vocab_size). Neither has
# shared experts. Qwen3's per-head query and key RMSNorms (128 weights each) are left out.
MODELS = {
    "mixtral-8x7b": dict(layers=32, width=4096, heads=32, kv_heads=8, head_dim=128, experts=8,
                         top_k=2, expert_hidden=14336, shared_experts=0, vocab=32000),
    "qwen3-30b-a3b": dict(layers=48, width=2048, heads=32, kv_heads=4, head_dim=128,
                          experts=128, top_k=8, expert_hidden=768, shared_experts=0,
                          vocab=151936),
}  # fmt: skip
args = parser.parse_args()
if args.model:  # the preset's values become defaults: flags given explicitly still win
    parser.set_defaults(**MODELS[args.model], seq=4096, bf16=True)
    args = parser.parse_args()

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
from flax import nnx  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxpipe  # noqa: E402

# ----------------------------------------------------------------------------- data
DIGITS, LENGTH = 10, 8
SEP = DIGITS  # the separator token
VOCAB = args.vocab or DIGITS + 1
T = args.seq or 2 * LENGTH  # --seq: the rows --target compiles for (the task's are 16)
if VOCAB < DIGITS + 1:
    sys.exit(f"--vocab {VOCAB} is smaller than the task's vocabulary ({DIGITS + 1})")
if T != 2 * LENGTH and not args.target:
    sys.exit(f"--seq {T}: the sorting task's rows are {2 * LENGTH} tokens (other lengths "
             "are for --target)")  # fmt: skip
# printed after the mesh and the schedule (which may wait on a plan)
DATA = f"data: sort {LENGTH} digits; accuracy is measured on the sorted half"


def get_batch(step, batch=args.batch):
    """(inputs, targets) of ``[batch, T]`` tokens for ``step``; target -1 is not scored."""
    rng = np.random.default_rng([args.seed, step + 1])  # step -1: the evaluation batch
    digits = rng.integers(0, DIGITS, (batch, LENGTH))
    seq = np.concatenate([digits, np.full((batch, 1), SEP), np.sort(digits, 1)], 1)
    targets = seq[:, 1:].copy()
    targets[:, :LENGTH] = -1  # the unsorted digits are random: nothing to learn there
    return seq[:, :-1].astype(np.int32), targets.astype(np.int32)


# ----------------------------------------------------------------------------- model
D, H, KV = args.width, args.heads, args.kv_heads
HD = args.head_dim or D // H
E, K = args.experts, args.top_k
COMPUTE = jnp.bfloat16 if args.bf16 else jnp.float32
POLICY = {
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "nothing": jax.checkpoint_policies.nothing_saveable,
    "everything": jax.checkpoint_policies.everything_saveable,
}[args.remat]


def rms_norm(x, scale):
    x32 = x.astype(jnp.float32)
    x32 = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (x32 * scale).astype(x.dtype)


def rotary(x):
    """Rotary position embedding of ``x`` ``[rows, seq, heads, HD]`` at positions 0, 1, ..."""
    half = HD // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    angle = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freq
    cos, sin = jnp.cos(angle)[:, None], jnp.sin(angle)[:, None]
    a, b = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1).astype(x.dtype)


class Block(nnx.Module):
    """x + attention(norm(x)), then x + MoE(norm(x)): shared and routed experts."""

    def __init__(self, rngs, expert_axis=None):
        init = nnx.initializers.lecun_normal()
        small = nnx.initializers.normal(1 / np.sqrt(2 * args.layers * H * HD))
        self.attn_norm = nnx.Param(jnp.ones(D))
        self.wq = nnx.Param(init(rngs.params(), (D, H * HD)))
        self.wk = nnx.Param(init(rngs.params(), (D, KV * HD)))
        self.wv = nnx.Param(init(rngs.params(), (D, KV * HD)))
        self.wo = nnx.Param(small(rngs.params(), (H * HD, D)))  # residual branches start small
        self.moe_norm = nnx.Param(jnp.ones(D))
        self.moe = jaxpipe.moe.MoE(
            D, args.expert_hidden, E, rngs=rngs, top_k=K,
            num_shared_experts=args.shared_experts, capacity_factor=args.capacity_factor,
            group_size=args.group_size, expert_axis=expert_axis,
        )  # fmt: skip

    def __call__(self, x):
        rows, t, _ = x.shape
        h = rms_norm(x, self.attn_norm[...])
        q = rotary((h @ self.wq[...]).reshape(rows, t, H, HD))
        k = rotary((h @ self.wk[...]).reshape(rows, t, KV, HD))
        v = (h @ self.wv[...]).reshape(rows, t, KV, HD)
        k, v = jnp.repeat(k, H // KV, axis=2), jnp.repeat(v, H // KV, axis=2)  # grouped-query
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(HD)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        attn = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(rows, t, H * HD) @ self.wo[...]
        y, stats = self.moe(rms_norm(x, self.moe_norm[...]))
        return x + y, stats


def block_of(expert_axis, checkpointed=True):
    """One block on the activations, a dict: ``h`` the residual stream, and what the blocks
    report (`jaxpipe.moe.MoEStats`), summed over blocks: ``load_balance`` and ``router_z``
    per row, ``dropped`` (expert choices dropped for capacity) per token. ``checkpointed``:
    under ``jax.checkpoint`` with --remat's policy (without it, a plan's remat decides)."""
    graph = nnx.graphdef(nnx.eval_shape(lambda: Block(nnx.Rngs(0), expert_axis)))

    def moe_block(params, h):
        return nnx.merge(graph, params)(h)

    if checkpointed:
        moe_block = jax.checkpoint(moe_block, policy=POLICY)

    def block(params, x):
        h, stats = moe_block(params, x["h"])
        return {
            "h": h,
            "load_balance": x["load_balance"] + stats.load_balance,
            "router_z": x["router_z"] + stats.router_z,
            "dropped": x["dropped"] + stats.dropped,
        }

    return block


def stage_of(expert_axis, checkpointed=True):
    """The stage function: LAYERS_PER_STAGE blocks (`block_of`), a ``lax.scan`` over the
    stage's block parameters (stacked on a leading layer axis)."""
    block = block_of(expert_axis, checkpointed)

    def stage_fn(p, x):
        return lax.scan(lambda x, params: (block(params, x), None), x, p)[0]

    return stage_fn


def logits_of(head, y):
    return rms_norm(y, head["norm"]).astype(jnp.float32) @ head["out"].astype(jnp.float32)


def loss_fn(head, y, targets):
    """Cross-entropy over the scored positions (targets >= 0) plus the routers' auxiliary
    losses; returns ``(loss, metrics)``: the metrics per block, averaged over blocks."""
    nll = optax.softmax_cross_entropy_with_integer_labels(
        logits_of(head, y["h"]), jnp.maximum(targets, 0)
    )
    scored = targets >= 0
    cross_entropy = jnp.sum(nll * scored) / jnp.maximum(jnp.sum(scored), 1)
    load_balance = jnp.mean(y["load_balance"]) / args.layers
    router_z = jnp.mean(y["router_z"]) / args.layers
    loss = cross_entropy + args.load_balance * load_balance + args.router_z * router_z
    dropped = jnp.mean(y["dropped"].astype(jnp.float32)) / (args.layers * K)
    return loss, {"cross_entropy": cross_entropy, "load_balance": load_balance,
                  "router_z": router_z, "dropped": dropped}  # fmt: skip


def init_stage(key):
    """One stage's parameters: LAYERS_PER_STAGE blocks stacked on a leading layer axis (an
    ``nnx.State``; each routed expert weight ``[layers, E, ...]``)."""
    keys = jax.random.split(key, LAYERS_PER_STAGE)
    return jax.vmap(lambda k: nnx.state(Block(nnx.Rngs(k)), nnx.Param))(keys)


# ----------------------------------------------------------------------------- devices, mesh
def choose_plan(devices):
    """--schedule auto: `jaxpipe.plan` for --target (else --plan-for), over pipe x data with
    the --stages, --data and --microbatches given kept, and --expert always; None where it
    cannot plan. The planner has no expert axis: its data axis stands for expert x data (the
    batch is split over both), its block holds every expert (the same work per token; each
    device's memory counted with all E experts' weights, the all-to-alls not charged), and
    only plans whose data axis --expert divides are run."""
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
    state = jax.eval_shape(lambda: nnx.state(Block(nnx.Rngs(0)), nnx.Param))
    one_block = jax.tree.map(lambda a: s(a.shape, COMPUTE), state)
    head = {"norm": s((D,), COMPUTE), "out": s((D, VOCAB), COMPUTE)}
    rows = args.batch
    inputs = {"h": s((rows, T, D), COMPUTE), "load_balance": s((rows,), jnp.float32),
              "router_z": s((rows,), jnp.float32)}  # fmt: skip
    block = block_of(None, checkpointed=False)

    def with_dropped(x):  # the planner differentiates every input: the int count stays out
        return {**x, "dropped": jnp.zeros(x["h"].shape[:2], jnp.int32)}

    def plan_block(params, x):
        return {k: v for k, v in block(params, with_dropped(x)).items() if k != "dropped"}

    def plan_loss(head, y, targets):
        return loss_fn(head, with_dropped(y), targets)[0]

    fixed = {"pipe": args.stages, "data": args.data and args.data * args.expert}
    try:
        plans = jaxpipe.plan(
            plan_block, one_block, args.layers, plan_loss, head, inputs, s((rows, T), jnp.int32),
            target=target, fixed={a: n for a, n in fixed.items() if n is not None},
            microbatches=None if args.microbatches is None else [args.microbatches],
            compile_top=1 if args.target else 0,
            scan_blocks=True,  # the stage runs its blocks in a lax.scan (stage_of)
        )  # fmt: skip
    except jaxpipe.planner.NothingFits as error:
        sys.exit(f"schedule auto, {name}: {error}")
    runnable = [p for p in plans if p.axes["data"] % args.expert == 0]
    if not runnable:
        print(f"schedule auto: no plan for {name} has a data axis that --expert "
              f"{args.expert} divides; running 1f1b")  # fmt: skip
        return None
    if runnable[0] is not plans[0]:  # the notes compare with a plan that cannot run here
        runnable = [dataclasses.replace(p, note=None) for p in runnable]
    plans = jaxpipe.planner.Plans(runnable, plans.budget_bytes, plans.searched, plans.rejected)
    print(f"schedule auto: the plan for {name} (jaxpipe.plan; its data axis is expert x "
          "data), and the runner-up:")  # fmt: skip
    print(plans.table(rows=2))
    return plans[0]


plan = None
if args.schedule is None:  # flags that pick by hand keep the hand-picked default
    args.schedule = "1f1b" if args.target or args.virtual_stages else "auto"
if args.schedule == "auto":
    if args.virtual_stages:
        sys.exit("--schedule auto chooses v: give a schedule name with --virtual-stages")
    plan = choose_plan(jaxpipe.target.get(args.target).devices if args.target else jax.devices())
    if plan is None:
        args.schedule = "1f1b"
S = plan.axes["pipe"] if plan else (args.stages or 2)
M = plan.num_microbatches if plan else (args.microbatches or 4)
DATA_AXIS = plan.axes["data"] // args.expert if plan else (args.data or 1)
# pipe x expert x data; the batch is split over expert and data (DP replicas in all).
axes = {"pipe": S, "expert": args.expert, "data": DATA_AXIS}
axes = {name: n for name, n in axes.items() if n > 1 or name != "data"}
DP = args.expert * DATA_AXIS
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
mesh = jax.make_mesh(
    tuple(axes.values()), tuple(axes), axis_types=(jax.sharding.AxisType.Auto,) * len(axes),
    devices=devices[:needed],
)  # fmt: skip
if not args.target:
    jax.set_mesh(mesh)  # new arrays live on the mesh: the training step compiles once
print(f"mesh: {dict(mesh.shape)}")
if args.batch % (M * DP):
    sys.exit(f"--batch {args.batch} must be a multiple of --microbatches x --expert x --data = "
             f"{M * DP}")  # fmt: skip
if args.experts % args.expert:
    sys.exit(f"--experts {args.experts} must divide over --expert {args.expert} devices")
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
if not args.target:
    print(DATA)

if plan:  # the plan's table and remat (its mesh names data for expert x data: built above)
    options = plan.pipeline_options()
    remat = {"remat": options["remat"], "remat_policy": options["remat_policy"]}
else:  # remat_policy=None: each block's jax.checkpoint decides what its backward keeps
    remat = {"remat_policy": None}
pipe = jaxpipe.Pipeline(
    stage_of("expert", checkpointed=plan is None), loss_fn, mesh=mesh, schedule=schedule,
    expert_axis="expert", loss_has_aux=True, **remat,
)  # fmt: skip


def compute(tree):
    return jax.tree.map(lambda a: a.astype(COMPUTE), tree)


def activations(params, ids):
    """The pipeline's input: the embedded tokens, and zeros for what the blocks report."""
    rows = ids.shape[0]
    return {
        "h": compute(params["embed"])[ids],
        "load_balance": jnp.zeros(rows),
        "router_z": jnp.zeros(rows),
        "dropped": jnp.zeros(ids.shape, jnp.int32),
    }


def head_of(params):
    return compute({"norm": params["norm"], "out": params["out"]})


def loss(params, ids, targets):
    """The embedding before the pipeline; blocks, head, loss and auxiliary losses in it."""
    x = activations(params, ids)
    return pipe.loss(compute(params["blocks"]), head_of(params), x, targets)


def reference_loss(params, ids, targets):
    """The same model without the pipeline and with every expert on one device
    (`jaxpipe.reference.loss` over the logical stages)."""
    blocks = pipe.logical(compute(params["blocks"]))
    x = activations(params, ids)

    def plain_loss_fn(head, y, targets):
        return loss_fn(head, y, targets)[0]  # the loss alone

    return jaxpipe.reference.loss(stage_of(None), plain_loss_fn, blocks, head_of(params), x,
                                  targets, M)  # fmt: skip


def dropped_by(params, ids):
    """Per token, the expert choices dropped for capacity in all blocks: through the
    pipeline, and through the same model without it (stage after stage on the whole batch;
    routing groups are rows, so micro-batches do not change which tokens are dropped)."""
    piped = pipe.forward(compute(params["blocks"]), activations(params, ids))["dropped"]
    blocks, y = pipe.logical(compute(params["blocks"])), activations(params, ids)
    for stage in range(N):
        y = stage_of(None)(jax.tree.map(lambda a, stage=stage: a[stage], blocks), y)
    return piped, y["dropped"]


# ----------------------------------------------------------------------------- parameters
replicated = NamedSharding(mesh, P())
one_stage = jax.eval_shape(init_stage, jax.random.key(0))
# The routed experts split over the expert axis ([layers, E, ...]: P(None, "expert")); every
# other block weight split over pipe only.
block_specs = jaxpipe.moe.expert_specs(one_stage, "expert", leading_axes=0)
outer = {"embed": (VOCAB, D), "norm": (D,), "out": (D, VOCAB)}
if args.target:  # compile only: shapes with shardings stand for every array (none is made)
    key_shape = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    blocks = jax.eval_shape(lambda key: pipe.init(init_stage, key, block_specs), key_shape)
    params = {
        "blocks": jaxpipe.target.abstract(blocks, pipe.layout.shardings(blocks)),
        **{name: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=replicated)
           for name, shape in outer.items()},
    }  # fmt: skip
else:
    key_blocks, key_embed, key_out = jax.random.split(jax.random.key(args.seed), 3)
    params = {
        # Each device creates only its own stages and experts, in the pipeline's layout.
        "blocks": pipe.init(init_stage, key_blocks, block_specs),
        **jax.device_put({
            "embed": jax.random.normal(key_embed, (VOCAB, D)),
            "norm": jnp.ones((D,)),
            "out": jax.random.normal(key_out, (D, VOCAB)) / np.sqrt(D),
        }, replicated),
    }  # fmt: skip
count = sum(x.size for x in jax.tree.leaves(params))
routed = 3 * args.layers * E * D * args.expert_hidden
active = count - routed + routed * K // E
print(f"model: {args.layers} blocks (width {D}, {H} heads, {KV} kv heads; {E} routed experts "
      f"top-{K} and {args.shared_experts} shared, SwiGLU {args.expert_hidden}), vocabulary "
      f"{VOCAB}, {count / 1e6:.2f}M parameters ({active / 1e6:.2f}M active per token), "
      f"capacity factor {args.capacity_factor}, compute {jnp.dtype(COMPUTE).name}")  # fmt: skip

learning_rate = optax.warmup_cosine_decay_schedule(
    0.0, args.lr, 20, max(args.steps, 21), 0.1 * args.lr
)
optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(learning_rate, 0.01))
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


@functools.partial(jax.jit, donate_argnums=(0, 1))
def train_step(params, opt_state, ids, targets):
    (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params, ids, targets)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value, metrics


if args.target:  # compile the step for the target, print what its compiler says, and stop
    batch = jax.ShapeDtypeStruct(
        (args.batch, T), jnp.int32, sharding=NamedSharding(mesh, P(pipe.data_axes))
    )
    try:
        report = jaxpipe.target.get(args.target).compile(
            train_step, params, opt_state, batch, batch
        )
    except jaxpipe.target.DoesNotFit as error:
        sys.exit(str(error))
    print(report)
    sys.exit(0)


@jax.jit
def accuracy(params, ids, targets):
    """Token accuracy over the scored positions (forward-only pipeline)."""
    y = pipe.forward(compute(params["blocks"]), activations(params, ids))
    hit = (jnp.argmax(logits_of(head_of(params), y["h"]), -1) == targets) & (targets >= 0)
    return jnp.sum(hit) / jnp.sum(targets >= 0)


def place_batch(batch):
    """The batch sharded over the data axes (expert and data)."""
    return jax.device_put(batch, NamedSharding(mesh, P(pipe.data_axes)))


# ----------------------------------------------------------------------------- step 0 check
# The first batch through the pipeline, and through the same model without it and with every
# expert on one device: the same loss, and the very same tokens dropped for capacity.
# The first step's loss is compared below, once the training step has computed it.
ids, targets = place_batch(get_batch(0))
plain = float(jax.jit(reference_loss)(params, ids, targets))
piped_dropped, plain_dropped = jax.jit(dropped_by)(params, ids)


def print_check(piped):
    choices = piped_dropped.size * args.layers * K
    same = bool(jnp.array_equal(piped_dropped, plain_dropped))
    print(f"step 0 loss: pipeline {piped:.6f}, same model without the pipeline {plain:.6f} "
          f"(relative difference {abs(piped - plain) / abs(plain):.1e}); expert choices "
          f"dropped: pipeline {int(piped_dropped.sum())}, without it "
          f"{int(plain_dropped.sum())} of {choices}, the same tokens: {same}")  # fmt: skip


# ----------------------------------------------------------------------------- training
eval_ids, eval_targets = place_batch(get_batch(-1))  # no step trains on it
start = t0 = time.perf_counter()
timed_from, timed_steps = None, 0
tokens, value, acc = 0, float("nan"), float("nan")
for step in range(args.steps):
    ids, targets = place_batch(get_batch(step))
    params, opt_state, value, metrics = train_step(params, opt_state, ids, targets)
    tokens += ids.size
    if step % args.log_every == 0 or step == args.steps - 1:
        value, metrics = float(value), {k: float(v) for k, v in metrics.items()}
        if step == 0:
            print_check(value)
        now = time.perf_counter()
        if timed_from is None:  # the first step compiles: time the ones after it
            timed_from, timed_steps, speed = now, 0, "compiled"
        else:
            eta = (now - timed_from) / timed_steps * (args.steps - 1 - step)
            speed = f"{tokens / (now - t0):,.0f} tokens/s | ETA {eta:.0f} s"
        acc = float(accuracy(params, eval_ids, eval_targets))
        print(f"step {step:4d} | loss {value:.4f} | cross-entropy {metrics['cross_entropy']:.4f} "
              f"| load balance {metrics['load_balance']:.3f} | router z "
              f"{metrics['router_z']:.3f} | dropped {metrics['dropped']:.2%} | accuracy "
              f"{acc:.3f} | {speed}", flush=True)  # fmt: skip
        t0, tokens = time.perf_counter(), 0
        if speed == "compiled":  # time from here: not the evaluation's compilation either
            timed_from = t0
    timed_steps += 1
print(f"final: loss {float(value):.4f} accuracy {acc:.3f} in "
      f"{time.perf_counter() - start:.0f} s")  # fmt: skip
