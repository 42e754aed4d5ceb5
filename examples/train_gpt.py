"""Train a small GPT with pipeline parallelism: one file, top to bottom (nanoGPT style).

The token embedding runs before the pipeline, the transformer blocks are the pipeline's
stages, and the final layer norm, the tied head and the cross-entropy run in ``loss_fn`` on
the last stage. ``jax.grad`` of a plain loss function (embed, then ``pipe.loss``) trains all
of it, the embedding included.

Default task: sort 8 digits. A sequence is 8 random digits, a separator, then the same digits
sorted; the model is scored on the sorted half (token accuracy). ``--text FILE`` trains a
character-level model on any local text file instead.

    python3 examples/train_gpt.py                # jaxpipe.plan chooses mesh, schedule, M, remat
    python3 examples/train_gpt.py --schedule 1f1b --stages 4 --data 2        # chosen by hand
    python3 examples/train_gpt.py --schedule interleaved_1f1b --virtual-stages 2
    python3 examples/train_gpt.py --text input.txt --steps 2000
    python3 examples/train_gpt.py --out run          # + timeline PNG and checkpoints in run/
    python3 examples/train_gpt.py --out run --resume --schedule zbv --stages 2   # resume it
    python3 examples/train_gpt.py --target v5p:2x2x2 --width 4096   # compile only, for TPU

A checkpoint holds the blocks in logical stage order and the length of the learning-rate
schedule: it resumes under any schedule and --stages with as many stages (S x v; here 4),
on the run's own learning-rate schedule, whatever --steps says.

With no GPU or TPU, JAX's CPU backend is split into ``--devices`` host devices (default 8).
``--target`` compiles the training step for a TPU topology or GPUs (``h100x8``) without
running it, on any machine, and prints what the compiler says (`jaxpipe.target`): memory
per device against the chip's, collectives, time estimate. It needs the compiler:
``pip install "jaxpipe[tpu]"`` or ``pip install "jaxpipe[cuda-compile]"``.
"""

import argparse
import functools
import os
import sys
import time

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument(
    "--schedule", default=None,
    help="a name from jaxpipe.schedules.names(), or auto: jaxpipe.plan chooses the schedule, "
    "its table, --stages, --data, --microbatches and remat (those given are kept) for "
    "--target, or else for --plan-for. Default: auto; 1f1b with --target, --costs or "
    "--virtual-stages (they compile or pack what the flags say)",
)  # fmt: skip
parser.add_argument("--stages", type=int, default=None, help="devices on the pipe axis (S; 4)")
parser.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (M; 8)")
parser.add_argument("--virtual-stages", type=int, default=None, help="v for interleaved_1f1b")
parser.add_argument("--data", type=int, default=None, help="data-parallel size (pipe x data; 2)")
parser.add_argument(
    "--plan-for", default="v5p:2x2x2",
    help="--schedule auto without --target: the TPU or GPUs to plan for (their compiler is "
    "needed: pip install 'jaxpipe[tpu]'); the plan then trains here",
)  # fmt: skip
parser.add_argument("--steps", type=int, default=400, help="train up to this step")
parser.add_argument("--batch", type=int, default=64, help="global batch size (sequences)")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--layers", type=int, default=8, help="transformer blocks in total")
parser.add_argument("--width", type=int, default=64, help="model width (d_model)")
parser.add_argument("--heads", type=int, default=4)
parser.add_argument("--block-size", type=int, default=64, help="context length for --text")
parser.add_argument("--text", default=None, help="train a character model on this text file")
parser.add_argument("--out", default=None, help="directory for the timeline PNG and checkpoints")
parser.add_argument("--save-every", type=int, default=100, help="checkpoint interval (steps)")
parser.add_argument("--resume", action="store_true", help="restore the latest checkpoint in --out")
parser.add_argument("--log-every", type=int, default=50)
parser.add_argument("--devices", type=int, default=8, help="host devices when running on CPU")
parser.add_argument(
    "--costs",
    default=None,
    help="pack the table for the stage's costs: 'measure' (time the stage here), 'target' "
    "(the --target compiler's estimate) or F:B:W ratios such as 1:2:0.5",
)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument(
    "--target", default=None,
    help="compile only: compile the training step for this TPU topology (e.g. v5p:2x2x2, "
    "v5e:4x4), GPU type and count (h100x8) or cpu, print memory, collectives and time "
    "estimate, and exit",
)  # fmt: skip
args = parser.parse_args()
if args.resume and not args.out:
    parser.error("--resume needs --out DIR (where the checkpoints are)")

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
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxpipe  # noqa: E402

# ----------------------------------------------------------------------------- data
if args.text:
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    chars = sorted(set(text))
    corpus = np.array([chars.index(c) for c in text], dtype=np.int32)
    VOCAB, T = len(chars), args.block_size
    if len(corpus) <= T + 1:
        sys.exit(f"{args.text} has {len(corpus)} characters; need more than --block-size + 1")
    print(f"data: {args.text}, {len(corpus)} characters, vocabulary {VOCAB}")
else:
    DIGITS, LENGTH = 10, 8
    SEP = DIGITS  # the separator token
    VOCAB, T = DIGITS + 1, 2 * LENGTH
    print(f"data: sort {LENGTH} digits; accuracy is measured on the sorted half")


def get_batch(step, batch=args.batch):
    """(inputs, targets) of ``[batch, T]`` tokens for ``step``; target -1 is not scored."""
    rng = np.random.default_rng([args.seed, step + 1])  # step -1: the eval batch
    if args.text:
        start = rng.integers(0, len(corpus) - T - 1, batch)
        window = corpus[start[:, None] + np.arange(T + 1)]
        return window[:, :-1], window[:, 1:]
    digits = rng.integers(0, DIGITS, (batch, LENGTH))
    seq = np.concatenate([digits, np.full((batch, 1), SEP), np.sort(digits, 1)], 1)
    targets = seq[:, 1:].copy()
    targets[:, :LENGTH] = -1  # the unsorted digits are random: nothing to learn there
    return seq[:, :-1].astype(np.int32), targets.astype(np.int32)


# ----------------------------------------------------------------------------- model
D, H = args.width, args.heads


def layer_norm(p, x):
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.var(x, -1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def block(p, x):
    """Pre-norm transformer block: causal self-attention, then an MLP."""
    b, t, _ = x.shape
    q, k, v = jnp.split(layer_norm(p["ln1"], x) @ p["qkv"], 3, axis=-1)
    q, k, v = (z.reshape(b, t, H, D // H) for z in (q, k, v))
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(D // H)
    att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
    y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, -1), v).reshape(b, t, D)
    x = x + y @ p["proj"]
    return x + jax.nn.gelu(layer_norm(p["ln2"], x) @ p["fc"]) @ p["fc_proj"]


def stage_fn(p, x):
    """One pipeline stage: LAYERS_PER_STAGE blocks (p's leaves have a leading layer axis)."""
    for i in range(LAYERS_PER_STAGE):
        x = block(jax.tree.map(lambda a, i=i: a[i], p), x)
    return x


def logits_of(head, y):
    """Final layer norm and the head, tied to the token embedding."""
    return layer_norm(head["ln_f"], y) @ head["wte"].T


def loss_fn(head, y, targets):
    """Cross-entropy on the last stage, over the positions with a target (>= 0)."""
    logits = logits_of(head, y)
    mask = targets >= 0
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(targets, 0))
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1)


def init_params(key):
    """Blocks stacked as [N stages, LAYERS_PER_STAGE, ...]; GPT-2 style initialisation."""
    k = jax.random.split(key, 6)
    shape = (N, LAYERS_PER_STAGE)
    std, proj_std = 0.02, 0.02 / np.sqrt(2 * args.layers)
    norm = {"scale": jnp.ones((*shape, D)), "bias": jnp.zeros((*shape, D))}
    blocks = {
        "ln1": norm,
        "qkv": std * jax.random.normal(k[0], (*shape, D, 3 * D)),
        "proj": proj_std * jax.random.normal(k[1], (*shape, D, D)),
        "ln2": norm,
        "fc": std * jax.random.normal(k[2], (*shape, D, 4 * D)),
        "fc_proj": proj_std * jax.random.normal(k[3], (*shape, 4 * D, D)),
    }
    head = {
        "wte": std * jax.random.normal(k[4], (VOCAB, D)),
        "ln_f": {"scale": jnp.ones(D), "bias": jnp.zeros(D)},
    }
    return {"blocks": blocks, "head": head, "wpe": std * jax.random.normal(k[5], (T, D))}


def embed(params, ids):
    return params["head"]["wte"][ids] + params["wpe"][: ids.shape[1]]


# ----------------------------------------------------------------------------- devices, mesh
def choose_plan(devices):
    """--schedule auto: `jaxpipe.plan` for --target (else --plan-for), over pipe x data
    with the --stages, --data and --microbatches given kept; None where it cannot plan."""
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
    s, f32 = jax.ShapeDtypeStruct, jnp.float32
    norm = {"scale": s((D,), f32), "bias": s((D,), f32)}
    one_block = {"ln1": norm, "qkv": s((D, 3 * D), f32), "proj": s((D, D), f32), "ln2": norm,
                 "fc": s((D, 4 * D), f32), "fc_proj": s((4 * D, D), f32)}  # fmt: skip
    head = {"wte": s((VOCAB, D), f32), "ln_f": norm}
    fixed = {"pipe": args.stages, "data": args.data}
    plans = jaxpipe.plan(
        block, one_block, args.layers, loss_fn, head, s((args.batch, T, D), f32),
        s((args.batch, T), jnp.int32), target=target,
        fixed={a: n for a, n in fixed.items() if n is not None},
        microbatches=None if args.microbatches is None else [args.microbatches],
        compile_top=1 if args.target else 0,
    )  # fmt: skip
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
S = plan.axes["pipe"] if plan else (args.stages or 4)
DP = plan.axes["data"] if plan else (args.data or 2)
M = plan.num_microbatches if plan else (args.microbatches or 8)
if args.target:  # compile only: the target's devices, not attached to this machine
    try:
        devices = jaxpipe.target.get(args.target).devices
    except jaxpipe.target.TargetError as error:
        sys.exit(f"--target: {error}")
    print(f"target: {args.target}, {len(devices)} devices: {devices[0].device_kind} (compile only)")
else:
    devices = jax.devices()
    print(f"platform: {jax.default_backend()}, {len(devices)} devices: {devices[0].device_kind}")
if len(devices) < S * DP:
    sys.exit(f"--stages {S} x --data {DP} needs {S * DP} devices, found {len(devices)}")
mesh = jax.make_mesh(
    (S, DP),
    ("pipe", "data"),
    axis_types=(jax.sharding.AxisType.Auto,) * 2,
    devices=devices[: S * DP],
)
if not args.target:  # (compile only: no arrays, and the target's devices run nothing here)
    jax.set_mesh(mesh)  # new arrays live on the mesh: the training step compiles once
print(f"mesh: {dict(mesh.shape)}")
if args.batch % (M * DP):
    sys.exit(f"--batch {args.batch} must be a multiple of --microbatches x --data = {M * DP}")
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


def stage_costs(text):
    """--costs as Pipeline takes it: None, "measure", a target, or Costs from F:B:W."""
    if text == "target" and not args.target:
        sys.exit("--costs target needs --target (the compiler whose estimates to use)")
    if text in (None, "measure"):
        return text
    return (
        jaxpipe.target.get(args.target)
        if text == "target"
        else jaxpipe.schedules.Costs.from_text(text)
    )


def print_costs():
    """The costs the table was packed for, and its predicted bubbles beside the default's."""
    if pipe.costs is not None:
        print(jaxpipe.schedules.describe_fit(pipe.schedule, pipe.costs, schedule))


pipe = jaxpipe.Pipeline(
    stage_fn, loss_fn, mesh=mesh, schedule=plan or schedule, costs=stage_costs(args.costs)
)


def loss(params, ids, targets):
    """Embedding before the pipeline; blocks, head and loss inside it."""
    return pipe.loss(params["blocks"], params["head"], embed(params, ids), targets)


# ----------------------------------------------------------------------------- training
def make_optimizer(total_steps):
    """Adam with warm-up and cosine decay over ``total_steps``: the schedule of the whole
    run, which a resumed run takes from its checkpoint (not from --steps)."""
    warmup = min(20, max(1, total_steps // 10))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup, max(total_steps, warmup + 1), 0.1 * args.lr
    )
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule)), schedule


@functools.partial(jax.jit, donate_argnums=(0, 1))
def train_step(params, opt_state, ids, targets):
    value, grads = jax.value_and_grad(loss)(params, ids, targets)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


@jax.jit
def accuracy(params, ids, targets):
    """Token accuracy over the scored positions, with a forward-only pipeline run."""
    y = pipe.forward(params["blocks"], embed(params, ids))
    hit = (jnp.argmax(logits_of(params["head"], y), -1) == targets) & (targets >= 0)
    return jnp.sum(hit) / jnp.sum(targets >= 0)


def place(params):
    """Blocks in the pipeline's device layout (each device holds its own stages, never
    gathered); embedding and head replicated."""
    rest = {k: v for k, v in params.items() if k != "blocks"}
    return {"blocks": pipe.place(params["blocks"]), **jax.device_put(rest, replicated)}


def place_batch(batch):
    """A batch sharded over the data axis."""
    return jax.device_put(batch, NamedSharding(mesh, P("data")))


replicated = NamedSharding(mesh, P())
if args.target:
    # Compile only: shapes with shardings stand for the arrays (jax.ShapeDtypeStruct), so
    # nothing is allocated and the model may be far larger than this machine.
    shapes = jax.eval_shape(lambda: init_params(jax.random.key(args.seed)))
    shapes["blocks"] = jax.eval_shape(pipe.place, shapes["blocks"])
    shardings = {**jax.tree.map(lambda _: replicated, shapes), "blocks": None}
    shardings["blocks"] = pipe.layout.shardings(shapes["blocks"])
    params = jaxpipe.target.abstract(shapes, shardings)
    optimizer = make_optimizer(args.steps)[0]
    state_shardings = optax.tree_utils.tree_map_params(
        optimizer,
        lambda _, p: p.sharding,
        jax.eval_shape(optimizer.init, params),
        params,
        transform_non_params=lambda leaf: replicated,
    )  # fmt: skip Adam's moments sharded like the parameters, as optimizer.init makes them
    opt_state = jaxpipe.target.abstract(jax.eval_shape(optimizer.init, params), state_shardings)
    batch = jax.ShapeDtypeStruct(
        (args.batch, T), jnp.int32, sharding=NamedSharding(mesh, P("data"))
    )
    count = sum(x.size for x in jax.tree.leaves(params))
    print(f"model: {args.layers} blocks, width {D}, {count / 1e6:.1f}M parameters")
    try:
        print(jaxpipe.target.get(args.target).compile(train_step, params, opt_state, batch, batch))
    except jaxpipe.target.DoesNotFit as error:
        sys.exit(str(error))
    print_costs()
    sys.exit(0)
params = place(jax.device_get(init_params(jax.random.key(args.seed))))
total_steps = args.steps  # the length of the learning-rate schedule
opt_state = make_optimizer(total_steps)[0].init(params)  # Adam's moments: params' shardings
count = sum(x.size for x in jax.tree.leaves(params))
print(f"model: {args.layers} blocks, width {D}, {count / 1e3:.1f}k parameters")

start_step, checkpoints = 0, None
if args.out:
    os.makedirs(args.out, exist_ok=True)
    try:
        jaxpipe.checkpoint  # noqa: B018 (loading the module checks that orbax is installed)
    except ImportError as error:
        sys.exit(f"--out saves checkpoints: {error}")
    checkpoints = os.path.join(args.out, "checkpoints")
    if args.resume:
        # Stage parameters are stored in logical stage order: any schedule and --stages with
        # as many logical stages (S * v) resumes; anything else stops with one line.
        state = {"params": params, "opt_state": opt_state, "total_steps": jnp.int32(0)}
        try:
            state = jaxpipe.checkpoint.restore(
                checkpoints, target=jaxpipe.checkpoint.abstract(state), pipeline=pipe
            )
        except (FileNotFoundError, ValueError) as error:
            sys.exit(f"--resume: {error}")
        params, opt_state = state["params"], state["opt_state"]
        total_steps = int(state["total_steps"])
        start_step = jaxpipe.checkpoint.latest_step(checkpoints) + 1
        print(f"resumed from step {start_step - 1} of a {total_steps}-step learning-rate "
              f"schedule (from the checkpoint), training to step {args.steps}")  # fmt: skip
        if args.steps > total_steps:
            print(f"after step {total_steps} the learning rate stays at its final value")
    try:
        jaxpipe.viz.draw(pipe.schedule, os.path.join(args.out, "schedule.png"))
        print(f"timeline: {os.path.join(args.out, 'schedule.png')}")
    except ImportError as error:  # matplotlib is an extra; training goes on without it
        print(f"timeline: not drawn, {error}")

optimizer, learning_rate = make_optimizer(total_steps)  # train_step's optimizer


def minutes(seconds):
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


eval_ids, eval_targets = place_batch(get_batch(-1))  # no step trains on it
start = time.perf_counter()
t0, first_logged, tokens = start, None, 0
value, acc = float("nan"), float("nan")
for step in range(start_step, args.steps):
    ids, targets = place_batch(get_batch(step))
    params, opt_state, value = train_step(params, opt_state, ids, targets)
    if step == start_step:
        print_costs()  # known once the first step is traced ("measure", a target)
    tokens += ids.size
    if checkpoints and (step % args.save_every == 0 or step == args.steps - 1):
        state = {"params": params, "opt_state": opt_state, "total_steps": jnp.int32(total_steps)}
        jaxpipe.checkpoint.save(checkpoints, step, state, pipeline=pipe)
    if step % args.log_every == 0 or step == args.steps - 1:
        value = float(value)  # waits for the step to finish
        if not np.isfinite(value):
            blocks, head, x = params["blocks"], params["head"], embed(params, ids)
            where = pipe.first_nonfinite(blocks, head, x, targets)
            sys.exit(f"step {step}: loss {value}; first non-finite value in the pipeline: {where}")
        speed = tokens / (time.perf_counter() - t0)
        acc = float(accuracy(params, eval_ids, eval_targets))
        now, eta = time.perf_counter(), "-"  # the first logged step includes compilation
        if first_logged is None:
            first_logged = (step, now)
        else:
            per_step = (now - first_logged[1]) / (step - first_logged[0])
            eta = minutes(per_step * (args.steps - 1 - step))
        print(f"step {step:5d}/{args.steps} | loss {value:.4f} | accuracy {acc:.3f} | "
              f"lr {float(learning_rate(step)):.2e} | {speed:,.0f} tokens/s | ETA {eta}",
              flush=True)  # fmt: skip
        t0, tokens = now, 0
if start_step >= args.steps:
    print(f"nothing to train: the checkpoint is at step {start_step - 1}, --steps {args.steps}")
print(f"final: loss {float(value):.4f} accuracy {acc:.3f} in {time.perf_counter() - start:.0f} s "
      "(compilation included)")  # fmt: skip
