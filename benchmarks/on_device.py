"""One Llama-3-8B-wide stage on one GPU: its costs, steps and memory, measured and predicted.

The stage is two Llama blocks (width 4096, SwiGLU hidden 14336, 32 query heads, 8 key/value
heads, bf16, 8192 tokens a micro-batch) with causal attention by
``jax.nn.dot_product_attention``: cuDNN's kernel where it compiles, on one row of 8192
tokens; else XLA's, on two rows of 4096 (its score matrices would not fit at 8192); the
results say which ran. On the default device it measures:

- F, B and W of the stage (`jaxpipe.costs.measure`: warm-up, then the actions interleaved,
  medians of ``--repeats``), beside their roofline predictions for the GPU
  (`jaxpipe.costs.cost_analysis` then `jaxpipe.costs.roofline` at the H100's or H200's
  peaks, `jaxpipe.analysis.hardware`);
- the S = 1 jaxpipe step (`jaxpipe.Pipeline` on a one-device mesh, M micro-batches,
  ``jax.value_and_grad(pipe.loss)``) against the plain step (a ``lax.scan`` over the
  micro-batches of ``jax.value_and_grad`` of the blocks as a ``lax.scan`` over their
  stacked weights, a float32 gradient accumulator, the same remat policy), timed side by
  side (interleaved repeats, medians), and the step time `jaxpipe.costs.predict` gives for
  the table from the predicted and from the measured F, B and W;
- peak memory of each step, each run in a fresh subprocess (``memory_stats()``'s
  ``peak_bytes_in_use``), the compiler's figure for it (``memory_analysis()``) and, for the
  jaxpipe step, `jaxpipe.memory.predict`'s;
- MFU: the model's FLOPs (matrix products and the causal half of attention; 3x the forward
  for a training pass) over time x the chip's dense bf16 peak.

    python benchmarks/on_device.py                 # on one H100 or H200
    python benchmarks/on_device.py --microbatches 4 --seq 4096
    python benchmarks/on_device.py --tiny          # a tiny model, on a CPU too

Writes ``benchmarks/results/on_device_<device>.json`` (the device kind, e.g.
``nvidia_h100_80gb_hbm3``) and prints its tables. It needs jax (``jax[cuda12]`` on a GPU),
this repository and jaxpipe's own dependencies (flax, optax), nothing else. On a device
that is neither an H100 nor an H200 the predictions and MFU use the H100's peaks unless
``--accelerator`` names another chip (the JSON says which).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import traceback

import common

# Llama-3-8B's block (Meta's params.json: dim 4096, ffn 14336, 32 heads, 8 kv heads).
LLAMA3_8B = dict(width=4096, hidden=14336, heads=32, kv_heads=8, seq=8192, rows=1)
TINY = dict(width=64, hidden=128, heads=4, kv_heads=2, seq=32, rows=2)
# XLA's attention holds a row's whole score matrix in float32, and its backward several: at
# 1 x 8192 tokens the plain step compiled for an H100 (jaxpipe.target.get("h100")) takes
# 58 GiB, beyond the 75% of the chip's memory jax takes; at 2 x 4096, 33 GiB. Its 8192
# tokens are then 2 rows of 4096.
XLA_ATTENTION_8B = dict(seq=4096, rows=2)
CASES = ("plain", "jaxpipe")
CASE_MARK = "ON_DEVICE_CASE "  # a child's line of JSON on stdout


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model (runs on a CPU)")
    parser.add_argument("--blocks", type=int, default=2, help="blocks in the stage")
    parser.add_argument("--microbatches", type=int, default=None, help="M (default 8; tiny 2)")
    parser.add_argument(
        "--seq",
        type=int,
        default=None,
        help="tokens a row (default 8192; 4096 with XLA's attention)",
    )
    parser.add_argument(
        "--rows",
        type=int,
        default=None,
        help="rows a micro-batch (default 1; 2 with XLA's attention)",
    )
    parser.add_argument(
        "--attention", default="auto", choices=["auto", "cudnn", "xla"],
        help="jax.nn.dot_product_attention's implementation: cudnn where it compiles (auto)",
    )  # fmt: skip
    parser.add_argument(
        "--remat", default="dots", choices=["dots", "nothing", "everything"],
        help="what a stage's backward keeps: the matrix products with the weights (dots: "
        "dots_with_no_batch_dims_saveable), nothing, or every residual",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=10, help="timed calls of each F, B, W")
    parser.add_argument("--step-repeats", type=int, default=5, help="timed calls of each step")
    parser.add_argument(
        "--accelerator", default=None,
        help="the chip whose peaks predict and give MFU (default: the device's, H100 or H200)",
    )  # fmt: skip
    parser.add_argument("--out", default=None, help="JSON path (default results/on_device_*)")
    parser.add_argument("--case", default=None, choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shape = TINY if args.tiny else LLAMA3_8B
    args.microbatches = args.microbatches or (2 if args.tiny else 8)
    for name in ("width", "hidden", "heads", "kv_heads"):
        setattr(args, name, shape[name])
    for name in ("blocks", "microbatches", "seq", "rows", "repeats", "step_repeats"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(
                f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
            )
    return args


# ----------------------------------------------------------------------------- the model
class Model:
    """The stage, the loss, their parameters and a batch; ``attention`` is ``"cudnn"`` or
    ``"xla"``."""

    def __init__(self, args, attention: str):
        import jax
        import jax.numpy as jnp

        self.args, self.attention = args, attention
        self.dtype = jnp.bfloat16
        self.head_dim = args.width // args.heads
        self.policy = {
            "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
            "nothing": jax.checkpoint_policies.nothing_saveable,
            "everything": jax.checkpoint_policies.everything_saveable,
        }[args.remat]

    # -- the block: tests/llama.py's, with jax.nn.dot_product_attention
    def block(self, p, x):
        import jax
        import jax.numpy as jnp
        from jax import lax

        a, HD = self.args, self.head_dim
        rows, seq, _ = x.shape
        positions = jnp.arange(seq)

        def rms_norm(x, scale):
            x32 = x.astype(jnp.float32)
            x32 = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
            return (x32 * scale).astype(x.dtype)

        def rotary(x):
            half = HD // 2
            freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
            angle = positions[:, None].astype(jnp.float32) * freq  # [seq, half]
            cos, sin = jnp.cos(angle)[:, None], jnp.sin(angle)[:, None]
            first, second = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
            both = [first * cos - second * sin, first * sin + second * cos]
            return jnp.concatenate(both, axis=-1).astype(x.dtype)

        h = rms_norm(x, p["attn_norm"])
        q = rotary((h @ p["wq"]).reshape(rows, seq, a.heads, HD))
        k = rotary((h @ p["wk"]).reshape(rows, seq, a.kv_heads, HD))
        v = (h @ p["wv"]).reshape(rows, seq, a.kv_heads, HD)
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.attention)
        x = x + out.reshape(rows, seq, a.heads * HD) @ p["wo"]
        h = rms_norm(x, p["mlp_norm"])
        return x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]

    def stage_fn(self, p, x, *, unroll: bool = False):
        """The stage: a ``lax.scan`` over its blocks' stacked weights (unrolled on request:
        XLA's cost analysis counts a loop's body once)."""
        from jax import lax

        return lax.scan(lambda h, q: (self.block(q, h), None), x, p, unroll=unroll)[0]

    def costed_stage(self, p, x):
        """The stage as the pipeline runs it (under the remat policy) and unrolled: what F, B
        and W are measured and predicted of. The pipeline runs a two-block scan as a loop."""
        import jax

        return jax.checkpoint(lambda p, x: self.stage_fn(p, x, unroll=True), policy=self.policy)(
            p, x
        )

    @staticmethod
    def loss_fn(head, y, target):
        import jax.numpy as jnp

        return jnp.mean(jnp.square(y.astype(jnp.float32) @ head["out"] - target))

    # -- shapes and arrays
    def shapes(self):
        """``{name: shape}`` of one block's weights."""
        a, HD = self.args, self.head_dim
        D = a.width
        return {
            "attn_norm": (D,), "wq": (D, a.heads * HD), "wk": (D, a.kv_heads * HD),
            "wv": (D, a.kv_heads * HD), "wo": (a.heads * HD, D), "mlp_norm": (D,),
            "w_gate": (D, a.hidden), "w_up": (D, a.hidden), "w_down": (a.hidden, D),
        }  # fmt: skip

    def init(self, key):
        """``(blocks, head, inputs, targets)``: the stage's weights ``[blocks, ...]`` (bf16),
        the loss head (f32) and a batch of M micro-batches, all random (one jitted call)."""
        import jax
        import jax.numpy as jnp

        a = self.args

        def make(key):
            keys = jax.random.split(key, len(self.shapes()) + 3)
            blocks = {}
            for k, (name, shape) in zip(keys, self.shapes().items(), strict=False):
                noise = jax.random.normal(k, (a.blocks, *shape))
                weight = 1 + 0.1 * noise if name.endswith("norm") else noise / shape[0] ** 0.5
                blocks[name] = weight.astype(self.dtype)
            head = {"out": jax.random.normal(keys[-3], (a.width, 8)) / a.width**0.5}
            batch = a.rows * a.microbatches
            inputs = jax.random.normal(keys[-2], (batch, a.seq, a.width), self.dtype)
            targets = jax.random.normal(keys[-1], (batch, a.seq, 8), jnp.float32)
            return blocks, head, inputs, targets

        return jax.jit(make)(key)

    def model_flops(self) -> float:
        """FLOPs of one micro-batch's forward through the stage: 2 per multiply-add of the
        matrix products with the weights, and of attention's two products over the causal
        half (a query attends to itself and the keys before it)."""
        a, HD = self.args, self.head_dim
        tokens = a.rows * a.seq
        weights = sum(
            s[0] * s[1] for n, s in self.shapes().items() if not n.endswith("norm")
        )  # fmt: skip
        attention = 2 * 2 * a.rows * a.heads * HD * a.seq * (a.seq + 1) / 2
        return a.blocks * (2 * tokens * weights + attention)


def resolve(args) -> tuple[str, str]:
    """Picks the attention (`attention_implementation`) and, where ``--seq`` and ``--rows``
    were not given, the micro-batch's shape for it: 1 row of 8192 tokens, or 2 rows of 4096
    with XLA's attention (``XLA_ATTENTION_8B``). Returns ``(implementation, why)``."""
    attention, why = attention_implementation(args)
    shape = TINY if args.tiny else LLAMA3_8B
    if not args.tiny and attention == "xla" and args.seq is None and args.rows is None:
        shape = XLA_ATTENTION_8B
        why += "; with XLA's attention the 8192 tokens are 2 rows of 4096, to fit"
    args.seq = args.seq or shape["seq"]
    args.rows = args.rows or shape["rows"]
    return attention, why


def attention_implementation(args) -> tuple[str, str]:
    """``(implementation, why)``: cuDNN's where its forward and backward compile for one
    micro-batch on the default device (with ``--attention auto``), else XLA's."""
    if args.attention == "xla":
        return "xla", "--attention xla"
    import jax
    import jax.numpy as jnp

    shape = TINY if args.tiny else LLAMA3_8B
    rows, seq = args.rows or shape["rows"], args.seq or shape["seq"]
    HD = args.width // args.heads
    q = jax.ShapeDtypeStruct((rows, seq, args.heads, HD), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((rows, seq, args.kv_heads, HD), jnp.bfloat16)

    def loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return jnp.sum(out.astype(jnp.float32))

    try:
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
    except Exception as error:  # cuDNN missing, too old, or not a GPU
        if args.attention == "cudnn":
            raise
        reason = " ".join(str(error).split())[:300]
        return "xla", f"cudnn did not compile here ({type(error).__name__}: {reason})"
    return "cudnn", "cudnn compiled for this device"


# ----------------------------------------------------------------------------- the two steps
def plain_step(model: Model):
    """``(blocks, head, inputs, targets) -> (loss, (block_grads, head_grads))``: a
    ``lax.scan`` over micro-batches of ``jax.value_and_grad``, float32 accumulator."""
    import jax
    import jax.numpy as jnp

    M = model.args.microbatches
    stage = jax.checkpoint(model.stage_fn, policy=model.policy)
    tree_map = jax.tree_util.tree_map

    def step(blocks, head, inputs, targets):
        def split(a):
            return a.reshape(M, a.shape[0] // M, *a.shape[1:])

        def one(total, batch):
            x, t = batch

            def loss(p, lp):
                return model.loss_fn(lp, stage(p, x), t)

            value, grads = jax.value_and_grad(loss, argnums=(0, 1))(blocks, head)
            return tree_map(lambda s, g: s + g.astype(jnp.float32), total, grads), value

        zeros = tree_map(lambda a: jnp.zeros(a.shape, jnp.float32), (blocks, head))
        total, values = jax.lax.scan(one, zeros, (split(inputs), split(targets)))
        grads = tree_map(lambda g, a: (g / M).astype(a.dtype), total, (blocks, head))
        return jnp.mean(values), grads

    return jax.jit(step)


def jaxpipe_setup(model: Model, blocks, head, inputs, targets):
    """``(pipe, step, arguments)``: the one-device pipeline, its jitted gradient step and
    the arguments placed on its mesh."""
    import jax

    from jaxpipe import pipeline

    mesh = jax.make_mesh(
        (1,), ("pipe",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1]
    )
    pipe = pipeline.Pipeline(
        model.stage_fn,
        model.loss_fn,
        mesh=mesh,
        schedule="1f1b",
        num_microbatches=model.args.microbatches,
        remat_policy=model.policy,
    )
    placed = pipe.place(jax.tree_util.tree_map(lambda a: a[None], blocks))
    arguments = (placed, pipe.replicate(head), *pipe.place_batch((inputs, targets)))
    return pipe, jax.jit(jax.value_and_grad(pipe.loss, argnums=(0, 1))), arguments


def setup_case(case: str, model: Model, key):
    """``(step, arguments, pipe or None)`` of one case on fresh random arrays."""
    blocks, head, inputs, targets = model.init(key)
    if case == "plain":
        return plain_step(model), (blocks, head, inputs, targets), None
    pipe, step, arguments = jaxpipe_setup(model, blocks, head, inputs, targets)
    return step, arguments, pipe


def compiled_memory(compiled) -> dict:
    """The compiler's figures (``memory_analysis()``), bytes."""
    m = compiled.memory_analysis()
    out = {
        name: int(getattr(m, f"{name}_size_in_bytes"))
        for name in ("argument", "output", "alias", "temp")
    }
    out["sum"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    peak = getattr(m, "peak_memory_in_bytes", None)  # the compiler's own, where it gives one
    out["peak"] = int(peak) if peak else out["sum"]
    return out


def run_case(args) -> dict:
    """A child process: compile one step, run it twice, and read the device's peak."""
    import jax

    attention, why = resolve(args)
    model = Model(args, attention)
    step, arguments, _ = setup_case(args.case, model, jax.random.key(0))
    device = jax.devices()[0]
    stats = device.memory_stats()
    before = None if stats is None else int(stats.get("bytes_in_use", 0))
    peak_before = None if stats is None else int(stats.get("peak_bytes_in_use", 0))
    compiled = step.lower(*arguments).compile()
    for _ in range(2):
        jax.block_until_ready(compiled(*arguments))
    stats = device.memory_stats()
    return {
        "case": args.case,
        "attention": attention,
        "rows_per_microbatch": args.rows,
        "seq": args.seq,
        "device_kind": device.device_kind,
        "compiled": compiled_memory(compiled),
        "measured": None
        if stats is None
        else {
            "peak_bytes_in_use": int(stats["peak_bytes_in_use"]),
            "bytes_in_use_before_step": before,
            "peak_bytes_in_use_before_step": peak_before,
            "bytes_limit": int(stats["bytes_limit"]) if "bytes_limit" in stats else None,
        },
        "measured_unavailable": None
        if stats is not None
        else f"memory_stats() gives nothing on {device.platform}",
    }


def case_in_subprocess(case: str, argv: list[str]) -> dict:
    """`run_case` in a fresh process, so that each peak is of that case alone."""
    command = [sys.executable, os.path.abspath(__file__), *argv, "--case", case]
    began = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    lines = [line for line in result.stdout.splitlines() if line.startswith(CASE_MARK)]
    if result.returncode != 0 or not lines:
        tail = (result.stderr or result.stdout)[-2000:]
        print(f"memory of the {case} step: the subprocess failed:\n{tail}", flush=True)
        return {"case": case, "error": tail, "returncode": result.returncode}
    out = json.loads(lines[-1][len(CASE_MARK) :])
    out["seconds"] = round(time.perf_counter() - began, 1)
    return out


# ----------------------------------------------------------------------------- timing
def interleaved_medians(functions: dict, repeats: int) -> dict:
    """Median seconds per call of each ``name: (compiled, args)``, calls interleaved after
    one warm-up call each."""
    import jax

    for fn, arguments in functions.values():
        jax.block_until_ready(fn(*arguments))
    times = {name: [] for name in functions}
    for _ in range(repeats):
        for name, (fn, arguments) in functions.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*arguments))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def relative_difference(a, b) -> float:
    """``|a - b| / |b|`` over every leaf of two pytrees, in float32."""
    import jax
    import jax.numpy as jnp

    pairs = zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    diff = norm = 0.0
    for x, y in pairs:
        x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
        diff += float(jnp.sum(jnp.square(x - y)))
        norm += float(jnp.sum(jnp.square(y)))
    return (diff / norm) ** 0.5 if norm else diff**0.5


def device_slug(kind: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_") or "device"


def peaks_for(kind: str, name: str | None):
    """``(Accelerator, whether it is this device's chip)``."""
    from jaxpipe.analysis.hardware import get_accelerator

    if name is not None:
        chip = get_accelerator(name)
    else:
        chip = get_accelerator("H200" if "h200" in kind.lower() else "H100")
    return chip, chip.name.lower() in kind.lower()


def costs_dict(costs) -> dict:
    return {
        "F": costs.forward,
        "B": costs.backward_input,
        "W": costs.backward_weight,
        "BW": costs.full_backward,
    }


# ----------------------------------------------------------------------------- main
def measure_stage(model: Model, blocks, x, device, chip) -> dict:
    """F, B, W and BW of the stage: measured here, and the roofline at ``chip``'s peaks."""
    import jax

    import jaxpipe

    measured = jaxpipe.costs.measure(model.costed_stage, blocks, x, repeats=model.args.repeats)
    shapes = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (blocks, x))
    try:
        counts = jaxpipe.costs.cost_analysis(model.costed_stage, *shapes)
        counted_by = f"the {device.platform} compiler"
    except RuntimeError as error:  # a compiler that gives no counts: the CPU compiler's
        cpu = jax.devices("cpu")[0]
        counts = jaxpipe.costs.cost_analysis(model.costed_stage, *shapes, device=cpu)
        counted_by = f"the cpu compiler ({' '.join(str(error).split())[:200]})"
    return {
        "measured_seconds": costs_dict(measured),
        "predicted_seconds": costs_dict(jaxpipe.costs.roofline(counts, chip)),
        "predicted_seconds_minimal_traffic": costs_dict(
            jaxpipe.costs.roofline(counts, chip, traffic="minimal")
        ),
        "xla_counts": counts,
        "counted_by": counted_by,
        "repeats": model.args.repeats,
        "costs": (measured, jaxpipe.costs.roofline(counts, chip)),  # dropped before writing
    }


def time_steps(model: Model, blocks, head, inputs, targets) -> dict:
    """The plain and the jaxpipe step: compiled, compared, timed side by side."""
    import jax

    plain = plain_step(model)
    pipe, piped, piped_args = jaxpipe_setup(model, blocks, head, inputs, targets)
    plain_args = (blocks, head, inputs, targets)
    compiled, compile_seconds = {}, {}
    for name, (fn, arguments) in (("plain", (plain, plain_args)), ("jaxpipe", (piped, piped_args))):
        start = time.perf_counter()
        compiled[name] = fn.lower(*arguments).compile()
        compile_seconds[name] = time.perf_counter() - start
    plain_loss, plain_grads = compiled["plain"](*plain_args)
    piped_loss, (piped_blocks, piped_head) = compiled["jaxpipe"](*piped_args)
    piped_grads = (jax.tree_util.tree_map(lambda a: a[0], pipe.logical(piped_blocks)), piped_head)
    medians = interleaved_medians(
        {"plain": (compiled["plain"], plain_args), "jaxpipe": (compiled["jaxpipe"], piped_args)},
        model.args.step_repeats,
    )
    return {
        "schedule": pipe.schedule.name,
        "measured_seconds": medians,
        "jaxpipe_over_plain": medians["jaxpipe"] / medians["plain"],
        "compile_seconds": compile_seconds,
        "repeats": model.args.step_repeats,
        "loss_relative_difference": abs(float(piped_loss) - float(plain_loss))
        / max(abs(float(plain_loss)), 1e-30),
        "grads_relative_difference": relative_difference(piped_grads, plain_grads),
        "pipe": (pipe, piped_args),  # dropped before writing
    }


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.case:
        print(CASE_MARK + json.dumps(run_case(args)), flush=True)
        return
    began = time.time()
    # Memory first, each step alone in a fresh process, before this one takes the device.
    memory = {case: case_in_subprocess(case, argv) for case in CASES}

    import jax

    import jaxpipe

    device = jax.devices()[0]
    kind = device.device_kind
    chip, same_chip = peaks_for(kind, args.accelerator)
    attention, why = resolve(args)
    print(f"device: {kind} ({device.platform}); attention: {attention} ({why})", flush=True)
    for case, m in memory.items():
        if "error" not in m:
            ran = (m["attention"], m["rows_per_microbatch"], m["seq"])
            m["same_stage_as_timed"] = ran == (attention, args.rows, args.seq)
            if not m["same_stage_as_timed"]:
                print(f"memory of the {case} step was measured with attention, rows, seq {ran}")
    model = Model(args, attention)
    blocks, head, inputs, targets = model.init(jax.random.key(0))
    forward_flops = model.model_flops()
    train_flops = 3 * forward_flops  # the forward, and a backward of twice its products
    errors = {}

    def attempt(section, fn, *arguments):
        """``fn(*arguments)``, or None with the error kept: the other sections still run."""
        try:
            return fn(*arguments)
        except Exception as error:
            traceback.print_exc()
            errors[section] = f"{type(error).__name__}: {error}"[-3000:]
            return None

    stage = attempt("stage", measure_stage, model, blocks, inputs[: args.rows], device, chip)
    step = attempt("step", time_steps, model, blocks, head, inputs, targets)
    measured_costs, predicted_costs = stage.pop("costs") if stage else (None, None)
    pipe, piped_args = step.pop("pipe") if step else (None, None)
    if stage and step:  # the step time the table takes at the stage's costs
        for name, costs in (("", predicted_costs), ("_from_measured_stage", measured_costs)):
            step[f"predicted{name}_seconds"] = jaxpipe.costs.predict(pipe.schedule, costs).step_time
    if step:
        predicted = attempt("memory", jaxpipe.memory.predict, pipe, *piped_args)
        memory["jaxpipe"]["predicted"] = predicted.as_dict() if predicted else None
    memory["plain"]["predicted"] = None  # jaxpipe.memory.predict models pipeline steps

    # MFU: the model's FLOPs over time x the chip's peak
    peak, M = chip.peak_flops, args.microbatches
    mfu = {}
    if stage:
        seconds = stage["measured_seconds"]
        mfu["stage_forward"] = forward_flops / (seconds["F"] * peak)
        mfu["stage_forward_and_backward"] = train_flops / ((seconds["F"] + seconds["BW"]) * peak)
    if step:
        for case in CASES:
            mfu[f"{case}_step"] = M * train_flops / (step["measured_seconds"][case] * peak)

    meta = common.metadata()
    meta.update(seconds=round(time.time() - began, 1))
    result = {
        "meta": meta,
        "device": kind,
        "platform": device.platform,
        "peaks": {
            "name": chip.name,
            "is_this_device": same_chip,
            "peak_flops_bf16": chip.peak_flops,
            "memory_bandwidth": chip.memory_bandwidth,
            "source": chip.source,
        },
        "attention": {"implementation": attention, "why": why},
        "model": {
            "blocks": args.blocks,
            "width": args.width,
            "hidden": args.hidden,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "seq": args.seq,
            "rows_per_microbatch": args.rows,
            "tokens_per_microbatch": args.rows * args.seq,
            "microbatches": M,
            "dtype": "bfloat16",
            "remat": args.remat,
            "tiny": args.tiny,
        },  # fmt: skip
        "stage": stage,
        "step": step,
        "memory": memory,
        "model_flops": {
            "forward_per_microbatch": forward_flops,
            "training_per_microbatch": train_flops,
            "counted": "matrix products with the weights and the causal half of attention; "
            "training = 3 x forward (remat's recomputation not counted)",
        },
        "mfu": mfu,
        "errors": errors,
    }
    out = args.out or os.path.join(
        common.RESULTS, f"on_device_{device_slug(kind)}{'_tiny' if args.tiny else ''}.json"
    )
    print_tables(result)
    common.write_json(result, out)
    failed = sorted(errors) + [c for c in CASES if "error" in memory[c]]
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (the JSON holds the rest, and each error)")


def print_tables(r: dict) -> None:
    ms = 1e3
    stage, step, mfu = r["stage"], r["step"], r["mfu"]
    if stage:
        common.print_table(
            [
                "action",
                "measured ms",
                f"predicted ms ({r['peaks']['name']})",
                "measured / predicted",
            ],
            [
                [
                    a,
                    ms * stage["measured_seconds"][a],
                    ms * stage["predicted_seconds"][a],
                    stage["measured_seconds"][a] / stage["predicted_seconds"][a],
                ]
                for a in ("F", "B", "W", "BW")
            ],  # fmt: skip
            title=f"Stage of {r['model']['blocks']} blocks on {r['device']}, attention "
            f"{r['attention']['implementation']}, {r['model']['tokens_per_microbatch']} tokens",
        )
    if step:
        rows = [[case, ms * step["measured_seconds"][case], mfu[f"{case}_step"]] for case in CASES]
        if "predicted_seconds" in step:
            rows += [
                ["predicted (roofline F/B/W)", ms * step["predicted_seconds"], ""],
                ["predicted (measured F/B/W)",
                 ms * step["predicted_from_measured_stage_seconds"], ""],
            ]  # fmt: skip
        common.print_table(
            ["step", "measured ms", "MFU"],
            rows,
            title=f"S = 1, M = {r['model']['microbatches']} ({step['schedule']}): jaxpipe / "
            f"plain {step['jaxpipe_over_plain']:.3f}; MFU of the {r['peaks']['name']}'s peak",
        )
    GiB = 2**30

    def gib(x):
        return "" if x is None else x / GiB

    rows = []
    for case in CASES:
        m = r["memory"][case]
        if "error" in m:
            rows.append([case, "failed", "", "", ""])
            continue
        measured = (m.get("measured") or {}).get("peak_bytes_in_use")
        predicted = (m.get("predicted") or {}).get("total")
        compiled = m["compiled"]
        rows.append([case, gib(measured), gib(compiled["peak"]), gib(compiled["temp"]),
                     gib(predicted)])  # fmt: skip
    common.print_table(
        ["step", "measured peak GiB", "compiled peak GiB", "compiled temp GiB", "predicted GiB"],
        rows,
        title="Peak memory of each step, each in a fresh process",
    )


if __name__ == "__main__":
    main()
