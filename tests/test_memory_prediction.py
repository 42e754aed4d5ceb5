"""`jaxpipe.memory.predict` against the compilers: a Llama-3 8B training step (32 blocks,
width 4096, SwiGLU 14336, 32 heads / 8 kv heads, vocabulary 128256, sequence 8192, bf16
compute over float32 masters and Adam, per-block remat of matmul results, 4 stages x tensor
2) compiled for 8 TPU v5p chips under zbv and for 8 H100s under 1f1b and zbv. The prediction is made
from shapes alone; compiling is slow, so each (target, schedule) is compiled once per
module and every assertion reads that one report.
"""

import importlib.util

import jax
import jax.numpy as jnp
import pytest

import jaxpipe
from jaxpipe import memory, target
from jaxpipe._executor.plan import make_plan
from jaxpipe.analysis import hlo
from tests import llama, llama_step

try:
    HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
except ModuleNotFoundError:
    HAS_CUDA_PLUGIN = False
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
MESH = {"pipe": 4, "tensor": 2}
MICROBATCHES = 8  # of one row each: llama_step.build's defaults
TOLERANCE = 0.10


class PeakOff(AssertionError):
    """The predicted peak per device is off the compiler's by more than `TOLERANCE`."""


def predict_step(step: llama_step.Step) -> memory.Memory:
    """The prediction for a built step: the pipeline sees bf16 copies of the blocks and the
    head, and the embedded tokens as its inputs (differentiated, for the embedding's
    gradient); the optimizer updates the float32 masters."""

    def compute(tree):
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, step.compute_dtype, sharding=a.sharding), tree
        )

    p = step.params
    width = p["embed"].shape[1]
    inputs = jax.ShapeDtypeStruct(
        (*step.tokens.shape, width), step.compute_dtype, sharding=step.tokens.sharding
    )
    return memory.predict(
        step.pipe,
        compute(p["blocks"]),
        compute({"norm": p["norm"], "head": p["head"]}),
        inputs,
        step.targets,
        side={"positions": step.positions},
        params=p,
        optimizer=step.optimizer,
        batch=(step.tokens, step.targets, step.positions),
        input_grads=True,  # the embedding is trained: its output's gradient is asked for
    )


def loop_state_bytes(hlo_text: str) -> int:
    """Bytes of the largest ``while`` loop's state in a compiled program: the schedule's
    loop, whose state holds the buffers the schedule keeps across ticks."""
    states = [
        hlo.nbytes(hlo.result_type(line))
        for line in hlo_text.splitlines()
        if hlo.opcode(line) == "while"
    ]
    return max(states, default=0)


def _compiler_params():
    tpu = pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed")
    gpu = pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason="jax's CUDA plugin is missing")
    # the scanned stage's backward reads its residuals from their slot inside its scan; the
    # TPU compiler's peak fell below the prediction's working set by more than 10% (51.74
    # against 58.20 GiB predicted, +12.5%; +9.6% while the slot was copied for the scan)
    # (raises: only the peak's check may fail; the step's other checks must pass)
    over = pytest.mark.xfail(
        strict=True,
        raises=PeakOff,
        reason="predict overestimates the v5p zbv working set by 12%",
    )
    return [
        pytest.param(
            (name, schedule),
            marks=[pytest.mark.slow, *marks],
            id=f"{name}-{schedule}",
        )
        # the TPU compile takes minutes: zbv there, both schedules on the GPU compiler
        for name, marks, schedule in (
            ("v5p:2x2x2", (tpu, over), "zbv"),
            ("h100x8", (gpu,), "1f1b"),
            ("h100x8", (gpu,), "zbv"),
        )
    ]


@pytest.fixture(scope="module", params=_compiler_params())
def compiled_8b(request):
    """(prediction, report, loop state bytes) of one 8B step, compiled once."""
    name, schedule = request.param
    tgt = target.get(name)
    step = llama_step.build(tgt, MESH, schedule)
    prediction = predict_step(step)
    compiled = step.step.lower(*step.args).compile()
    report = target.analyze(compiled, step.pipe.mesh, tgt)
    return prediction, report, loop_state_bytes(compiled.as_text())


def _close(predicted, compiled, what, error_type=AssertionError):
    error = predicted / compiled - 1
    if abs(error) > TOLERANCE:
        raise error_type(
            f"{what}: predicted {predicted / 2**30:.2f} GiB, compiled "
            f"{compiled / 2**30:.2f} GiB ({error:+.1%})"
        )


def test_8b_prediction_is_within_10_percent_and_only_activations_cross_pipe(compiled_8b):
    """One compile, every check of it (one test, so a parallel run compiles each
    configuration once): the total against the compiler's peak per device (and it fits);
    the arguments (parameters, optimizer state, batch); what the schedule's loop carries
    (the compute copies of the weights, the gradient accumulators, the residual buffers
    and the executor's other buffers: the prediction's parts without the working set)
    against the compiled loop's state; and what crosses the pipe axis."""
    prediction, report, loop_state = compiled_8b
    assert prediction.total <= report.capacity_bytes  # fits, as the compiler says
    assert report.fits
    _close(prediction.arguments, report.argument_bytes, "arguments")
    held = prediction.during_schedule - prediction.working
    _close(held, loop_state, "schedule loop state")
    only_activations_cross_the_pipe_axis(report)
    # last, and its own error: where it is known to fail (an xfail that raises=PeakOff),
    # the checks above still run on the compile
    _close(prediction.total, report.peak_bytes, "peak per device", PeakOff)


def only_activations_cross_the_pipe_axis(report):
    """In the tick loop, only collective-permutes cross pipe, each at most one micro-batch's
    activation or gradient (on the TPU compiler each device's ``tensor`` share of it; the
    CUDA compiler without sequence parallelism sends it whole: tests/test_llama_scale.py
    checks the share with it). Outside the loop, nothing over pipe is larger than the
    pipeline's input gradients (all micro-batches', for the embedding's backward) or the
    head's float32 gradient (this device's ``tensor`` share), which leave the pipeline
    once per step; a stage's weights never cross it."""
    c8b = llama_step.LLAMA3_8B
    activation = c8b.seq * c8b.width * 2  # one row in bfloat16
    share = activation // MESH["tensor"] if report.target.startswith("v5p") else activation
    outer = max(MICROBATCHES * activation, c8b.width * c8b.vocab // MESH["tensor"] * 4)
    over_pipe = [c for c in report.collectives if "pipe" in c.axes]
    assert any(c.in_loop and c.kind == "collective-permute" for c in over_pipe), over_pipe
    for c in over_pipe:
        if c.in_loop:
            assert c.kind == "collective-permute", c.line
            assert c.nbytes <= share, (c.nbytes, share, c.line)
        else:
            assert c.nbytes <= outer, (c.nbytes, outer, c.line)


# ----------------------------------------------------------------------------- fast, no compile
SMALL = llama.Config(width=64, heads=4, kv_heads=2, hidden=128, seq=32, vocab=64)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_residual_buffers_follow_the_schedule(schedule):
    """Activations are the plan's residual slots times one micro-batch's residuals; for
    1f1b on 4 stages the slots are the first device's peak in flight (4)."""
    tgt = target.get("cpu:8")
    step = llama_step.build(tgt, MESH, schedule, config=SMALL, layers=8)
    m = predict_step(step)
    plan = make_plan(step.pipe.schedule)
    assert m.residual_slots == plan.num_res_slots
    assert m.activations == m.residual_slots * m.residual_bytes
    assert m.peak_in_flight == step.pipe.schedule.peak_activations()
    if schedule == "1f1b":
        assert m.residual_slots == max(m.peak_in_flight) == 4
    assert m.total == m.arguments + max(m.during_schedule, m.during_update)
    assert "total (peak)" in str(m)


def test_arguments_are_the_shards_of_parameters_and_adam_moments():
    """Parameters (float32), Adam's two moments split like them, and the batch: exactly the
    bytes of this device's shards."""
    tgt = target.get("cpu:8")
    step = llama_step.build(tgt, MESH, "1f1b", config=SMALL, layers=8)
    m = predict_step(step)
    assert m.params == memory.shard_bytes(step.params)
    assert m.optimizer == memory.shard_bytes(step.opt_state)
    assert m.batch == memory.shard_bytes((step.tokens, step.targets, step.positions))


def test_tensor_split_divides_the_residuals_of_split_products():
    """Column-split products (queries, keys, values, gate, up) keep half their result per
    device on tensor 2; the products over a split dimension (attention output, down) and the
    block input are whole: the residuals lie between a quarter-split and a whole model's."""
    tgt = target.get("cpu:8")
    split = predict_step(llama_step.build(tgt, MESH, "1f1b", config=SMALL, layers=8))
    whole = predict_step(llama_step.build(tgt, {"pipe": 4}, "1f1b", config=SMALL, layers=8))
    assert whole.residual_bytes / 2 < split.residual_bytes < whole.residual_bytes


def test_remat_keeps_only_the_stage_input():
    def stage_fn(p, x):
        return x + jnp.tanh(x @ p["w"])

    def loss_fn(_, y, t):
        return jnp.mean((y - t) ** 2)

    tgt = target.get("cpu:4")
    mesh = tgt.mesh((4,), ("pipe",))
    from jaxpipe import pipeline

    pipe = pipeline.Pipeline(
        stage_fn, loss_fn, mesh=mesh, schedule="1f1b", num_microbatches=8, remat=True
    )
    logical = {"w": jax.ShapeDtypeStruct((4, 32, 32), jnp.float32)}
    placed = jax.eval_shape(pipe.place, logical)
    params = target.abstract(placed, pipe.layout.shardings(placed))
    x = jax.ShapeDtypeStruct((8 * 2, 16, 32), jnp.float32)
    m = memory.predict(pipe, params, None, x, x)
    assert m.residual_bytes == 2 * 16 * 32 * 4  # one micro-batch of stage input


def test_a_stage_of_one_array_is_predicted_like_a_dict_of_it():
    """Stage parameters that are one array reach the stage bare, as in the pipeline."""
    mesh = target.get("cpu:4").mesh((4,), ("pipe",))
    x = jax.ShapeDtypeStruct((8 * 2, 16, 32), jnp.float32)
    found = []
    for wrap, unwrap in ((lambda w: w, lambda p: p), (lambda w: {"w": w}, lambda p: p["w"])):
        pipe = jaxpipe.Pipeline(
            lambda p, x, unwrap=unwrap: x + jnp.tanh(x @ unwrap(p)),
            lambda _, y, t: jnp.mean((y - t) ** 2),
            mesh=mesh,
            schedule="1f1b",
            num_microbatches=8,
        )
        logical = wrap(jax.ShapeDtypeStruct((4, 32, 32), jnp.float32))
        placed = jax.eval_shape(pipe.place, logical)
        params = target.abstract(placed, pipe.layout.shardings(placed))
        found.append(memory.predict(pipe, params, None, x, x))
    assert found[0].residual_bytes == found[1].residual_bytes > 0
    assert found[0].total == found[1].total


# ------------------------------------------------ what the tick loop holds, on the CPU compiler
WIDTH, ROWS, SEQ = 512, 2, 8


def _toy(schedule, dtype=jnp.float32, fsdp=None, seq=SEQ, side=False, **options):
    """A pipeline of one ``[WIDTH, WIDTH]`` weight per stage on 4 CPU devices (pipe 4, or
    pipe 2 x fsdp 2 with the weight's rows split over fsdp, gathered as ``fsdp``), its
    placed parameters and a batch of 4 micro-batches (inputs and targets alike); with
    ``side``, a stage that scales its update by a side input of the inputs' shape."""
    names = ("pipe",) if fsdp is None else ("pipe", "fsdp")
    mesh = target.get("cpu:4").mesh((4,) if fsdp is None else (2, 2), names)
    extra = {} if fsdp is None else {"fsdp_gather": fsdp}

    def stage_fn(p, x, side=None):
        return x + jnp.tanh(x @ p["w"]) * (1 if side is None else side["scale"])

    pipe = jaxpipe.Pipeline(
        stage_fn if side else lambda p, x: stage_fn(p, x),
        lambda _, y, t: jnp.mean((y.astype(jnp.float32) - t.astype(jnp.float32)) ** 2),
        mesh=mesh,
        schedule=schedule,
        num_microbatches=4,
        **extra,
        **options,
    )
    specs = None if fsdp is None else {"w": jax.sharding.PartitionSpec("fsdp", None)}
    logical = {"w": jax.ShapeDtypeStruct((pipe.num_logical_stages, WIDTH, WIDTH), dtype)}
    placed = jax.eval_shape(lambda p: pipe.place(p, specs), logical)
    params = target.abstract(placed, pipe.layout.shardings(placed, specs))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(pipe.data_axes or None))
    x = jax.ShapeDtypeStruct((4 * ROWS * pipe.num_replicas, seq, WIDTH), dtype, sharding=rows)
    return pipe, params, x


# what a step may differentiate besides the parameters: predict's option for it
WRT = {"inputs": "input_grads", "targets": "target_grads", "side": "side_grads"}


@pytest.mark.parametrize(
    ("schedule", "dtype", "fsdp", "options", "wrt"),
    [
        ("1f1b", jnp.float32, None, {}, None),
        ("1f1b", jnp.float32, None, {"grad_dtype": None}, None),
        ("zbv", jnp.bfloat16, None, {}, None),
        ("1f1b", jnp.float32, "per_use", {}, None),
        ("zbv", jnp.float32, "once", {}, None),
        ("zbv", jnp.float32, "ahead", {}, None),
        ("1f1b", jnp.float32, "per_block", {}, None),
        ("1f1b", jnp.float32, None, {}, ()),
        ("1f1b", jnp.float32, None, {}, ("inputs",)),
        ("zbv", jnp.float32, None, {}, ("targets",)),
        ("1f1b", jnp.float32, None, {}, ("side",)),
    ],
    ids=[
        "f32",
        "f32-grad-dtype-none",
        "bf16-zbv",
        "per-use",
        "once-zbv",
        "ahead-zbv",
        "per-block",
        "no-input-grads",
        "input-grads",
        "target-grads-zbv",
        "side-grads",
    ],
)
def test_what_the_schedule_holds_is_the_compiled_tick_loops_state(
    schedule, dtype, fsdp, options, wrt
):
    """The prediction's held bytes (`Memory.during_schedule` without the working set)
    against the state the compiled tick loop carries, less the stored weight shards it
    carries beside them (arguments, which the prediction counts as such): within 5%, for
    the pipeline's own parameters (whose gradient accumulators it keeps for the whole
    schedule, in float32 or their dtype), bfloat16 weights, and FSDP weights gathered per
    use, once (the whole weights and whole accumulators for the schedule), ahead (the
    forward's chunk and a backward's whole gradient carried from tick to tick) and per
    block (nothing gathered carried). With
    ``wrt``, longer rows (the batch outweighs the weights), targets of one feature unless
    differentiated, and a side input for ``"side"``: the step differentiates the
    pipeline's inputs, targets or side inputs too, and their gradients are held, or not."""
    long = {} if wrt is None else {"seq": 64, "side": "side" in wrt}
    pipe, params, x = _toy(schedule, dtype, fsdp, **long, **options)
    t, side = x, None
    if wrt is not None and "targets" not in wrt:
        t = jax.ShapeDtypeStruct((*x.shape[:-1], 1), x.dtype, sharding=x.sharding)
    if wrt is not None and "side" in wrt:
        side = {"scale": x}
    asked = {option: name in (wrt or ()) for name, option in WRT.items()}
    m = memory.predict(pipe, params, None, x, t, side=side, **asked)
    argnums = (0, *(1 + list(WRT).index(name) for name in wrt or ()))
    loss = jax.grad(lambda p, x, t, s: pipe.loss(p, None, x, t, side=s), argnums=argnums)
    carried = loop_state_bytes(jax.jit(loss).lower(params, x, t, side).compile().as_text())
    stored = 0 if fsdp == "once" else memory.shard_bytes(params)  # gathered before the loop
    held = m.during_schedule - m.working
    assert abs(held + stored - carried) <= 0.05 * carried, (held, stored, carried)


def test_schedules_that_update_weights_and_expert_axes_are_refused():
    """What predict does not model is refused, saying what to do instead."""
    pipe, params, x = _toy("pipedream")
    with pytest.raises(ValueError, match="updates weights inside the pipeline.*jaxpipe.target"):
        memory.predict(pipe, params, None, x, x)
    mesh = target.get("cpu:4").mesh((2, 2), ("pipe", "expert"))
    moe = jaxpipe.Pipeline(
        lambda p, x: x @ p["w"], lambda _, y, t: jnp.mean(y - t), mesh=mesh, schedule="1f1b",
        num_microbatches=4, expert_axis="expert",
    )  # fmt: skip
    with pytest.raises(ValueError, match="expert parallelism.*jaxpipe.target"):
        memory.predict(moe, params, None, x, x)


def test_shard_bytes_counts_typed_keys_and_python_scalars():
    """A typed PRNG key (an array or its ``ShapeDtypeStruct``) counts its key data's bytes,
    a Python scalar the bytes of the array JAX makes of it, beside an array split 2 ways."""
    key = jax.random.key(0)
    mesh = target.get("cpu:4").mesh((2,), ("data",))
    split = jax.ShapeDtypeStruct(
        (4, 3),
        jnp.float32,
        sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")),
    )
    tree = {"key": key, "keys": jax.ShapeDtypeStruct((3,), key.dtype), "lr": 0.1, "step": 3}
    key_bytes = jax.random.key_data(key).nbytes
    assert memory.shard_bytes({**tree, "w": split}) == 4 * key_bytes + 4 + 4 + 2 * 3 * 4


def test_per_block_gathers_two_blocks_of_a_stacked_stage():
    """A stage that scans 4 stacked blocks, split over fsdp: with ``"per_block"`` the
    working set holds two blocks' gathered weights where ``"per_use"``'s holds the whole
    stage's; the rest of the prediction is the same."""
    blocks = 4
    mesh = target.get("cpu:4").mesh((2, 2), ("pipe", "fsdp"))

    def stage_fn(p, x):
        return jax.lax.scan(lambda x, w: (x + jnp.tanh(x @ w), None), x, p["w"])[0]

    specs = {"w": jax.sharding.PartitionSpec(None, "fsdp", None)}
    logical = {"w": jax.ShapeDtypeStruct((2, blocks, WIDTH, WIDTH), jnp.float32)}
    found = {}
    for gather in ("per_use", "per_block"):
        pipe = jaxpipe.Pipeline(
            stage_fn, lambda _, y, t: jnp.mean((y - t) ** 2), mesh=mesh, schedule="1f1b",
            num_microbatches=4, fsdp_gather=gather,
        )  # fmt: skip
        placed = jax.eval_shape(lambda p, pipe=pipe: pipe.place(p, specs), logical)
        params = target.abstract(placed, pipe.layout.shardings(placed, specs))
        rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
        x = jax.ShapeDtypeStruct((4 * ROWS * 2, WIDTH), jnp.float32, sharding=rows)
        found[gather] = memory.predict(pipe, params, None, x, x)
    stage = blocks * WIDTH * WIDTH * 4
    use, block = found["per_use"], found["per_block"]
    assert use.working - block.working == stage - 2 * stage // blocks, (use, block)
    assert use.during_schedule - use.working == block.during_schedule - block.working


@pytest.mark.parametrize("split_loss_grads", [False, True])
def test_the_loss_parameters_accumulator_is_whole_unless_split(split_loss_grads):
    """A head split by vocabulary over fsdp 2: its float32 gradient accumulator is counted
    whole on every device by default, as the compiled loop carries it
    (tests/test_compiled_memory.py), and half of it with ``split_loss_grads``; the stage's
    accumulators are split like its weights either way."""
    mesh = target.get("cpu:4").mesh((2, 2), ("pipe", "fsdp"))
    vocab = 512
    pipe = jaxpipe.Pipeline(
        lambda p, x: x + jnp.tanh(x @ p["w"]), lambda h, y, t: jnp.mean((y @ h - t) ** 2),
        mesh=mesh, schedule="1f1b", num_microbatches=4, split_loss_grads=split_loss_grads,
    )  # fmt: skip
    specs = {"w": jax.sharding.PartitionSpec("fsdp", None)}
    logical = {"w": jax.ShapeDtypeStruct((2, WIDTH, WIDTH), jnp.bfloat16)}
    placed = jax.eval_shape(lambda p: pipe.place(p, specs), logical)
    params = target.abstract(placed, pipe.layout.shardings(placed, specs))
    head = jax.ShapeDtypeStruct(
        (WIDTH, vocab), jnp.bfloat16,
        sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "fsdp")),
    )  # fmt: skip
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    x = jax.ShapeDtypeStruct((4 * ROWS * 2, WIDTH), jnp.bfloat16, sharding=rows)
    t = jax.ShapeDtypeStruct((4 * ROWS * 2, vocab), jnp.bfloat16, sharding=rows)
    m = memory.predict(pipe, params, head, x, t)
    stage = WIDTH * WIDTH * 4 // 2  # this device's stage, its fsdp half, in float32
    head_bytes = WIDTH * vocab * 4 // (2 if split_loss_grads else 1)
    assert m.grad_accumulators == stage + head_bytes, m
