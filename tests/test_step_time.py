"""The report's exposed communication per tick and its predicted step time
(`jaxpipe.target.Report.exposed`, `Report.step_time`): read from a hand-written scheduled
program whose answer is known, and from small pipelines compiled for the CPU, a TPU (v5p)
and GPUs (H100; skipped without libtpu or jax's CUDA plugin), each figure checked against
the collectives of the HLO it comes from."""

import dataclasses
import functools
import importlib.util
import math
import types

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe import pipeline, schedules, target
from jaxpipe.analysis import hlo
from jaxpipe.analysis.hardware import CATALOG

try:
    HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
except ModuleNotFoundError:
    HAS_CUDA_PLUGIN = False
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
COMPILERS = [
    "cpu:8",
    pytest.param("v5p:2x2x2", marks=pytest.mark.skipif(not HAS_LIBTPU, reason="no libtpu")),
    # two 8-GPU nodes: pipe crosses them, fsdp stays inside one
    pytest.param("h100x16", marks=pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason="no CUDA")),
]
WIDTH, HIDDEN, BLOCKS, M, ROWS = 128, 512, 2, 4, 16  # per stage: BLOCKS blocks, scanned


# ----------------------------------------------------------------------------- by hand
# A tick loop of 5 trips (its count read from the condition, as the TPU compiler prints
# it) whose body runs an inner loop of 3 trips (its count printed, as the GPU compiler
# does) and a conditional of two branches; an all-gather in each branch (the second
# larger), an all-reduce in the inner loop, a transfer with a matmul in its window
# (hidden), one without; outside the loop, one all-reduce.
PROGRAM = """\
HloModule m, is_scheduled=true

%mm (p0: f32[8,8], p1: f32[8,8]) -> f32[8,8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  %p1 = f32[8,8]{1,0} parameter(1)
  ROOT %d = f32[8,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%small (q: f32[8,8]) -> f32[8,8] {
  %q = f32[8,8]{1,0} parameter(0)
  ROOT %g1 = f32[16,8]{1,0} all-gather(%q), channel_id=1, replica_groups={{0,1},{2,3}}, dimensions={0}
}

%large (r: f32[8,8]) -> f32[8,8] {
  %r = f32[8,8]{1,0} parameter(0)
  ROOT %g2 = f32[32,8]{1,0} all-gather(%r), channel_id=2, replica_groups={{0,1},{2,3}}, dimensions={0}
}

%inner_body (t: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %t = (s32[], f32[8,8]{1,0}) parameter(0)
  %v = f32[8,8]{1,0} get-tuple-element(%t), index=1
  %ar = f32[8,8]{1,0} all-reduce(%v), channel_id=3, replica_groups={{0,1},{2,3}}, to_apply=%mm
  ROOT %o = (s32[], f32[8,8]{1,0}) tuple(%i, %ar)
}

%inner_cond (t: (s32[], f32[8,8])) -> pred[] {
  %t = (s32[], f32[8,8]{1,0}) parameter(0)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%tick_body (u: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %u = (s32[], f32[8,8]{1,0}) parameter(0)
  %i0 = s32[] get-tuple-element(%u), index=0
  %one = s32[] constant(1)
  %i = s32[] add(%i0, %one)
  %x = f32[8,8]{1,0} get-tuple-element(%u), index=1
  %c = f32[8,8]{1,0} conditional(%k, %x, %x), branch_computations={%small, %large}
  %w = (s32[], f32[8,8]{1,0}) while(%u), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  %s1 = (f32[8,8]{1,0}, f32[8,8]{1,0}) collective-permute-start(%x), channel_id=4, source_target_pairs={{0,2},{2,0},{1,3},{3,1}}
  %f = f32[8,8]{1,0} fusion(%x, %x), kind=kOutput, calls=%mm
  %d1 = f32[8,8]{1,0} collective-permute-done(%s1)
  %s2 = (f32[8,8]{1,0}, f32[8,8]{1,0}) collective-permute-start(%f), channel_id=5, source_target_pairs={{0,2},{2,0},{1,3},{3,1}}
  %d2 = f32[8,8]{1,0} collective-permute-done(%s2)
  ROOT %o = (s32[], f32[8,8]{1,0}) tuple(%i, %d2)
}

%tick_cond (u: (s32[], f32[8,8])) -> pred[] {
  %u = (s32[], f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%u), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[8,8]) -> f32[8,8] {
  %x = f32[8,8]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %t0 = (s32[], f32[8,8]{1,0}) tuple(%zero, %x)
  %loop = (s32[], f32[8,8]{1,0}) while(%t0), condition=%tick_cond, body=%tick_body
  %y = f32[8,8]{1,0} get-tuple-element(%loop), index=1
  ROOT %sum = f32[8,8]{1,0} all-reduce(%y), channel_id=6, replica_groups={{0,2},{1,3}}, to_apply=%mm
}
"""  # noqa: E501
TILE = 8 * 8 * 4  # bytes of one f32[8,8]


def fake_compiled(text: str):
    """What `target.analyze` reads of a compiled program, for a program written by hand."""
    memory = types.SimpleNamespace(
        argument_size_in_bytes=2**20, output_size_in_bytes=2**20, alias_size_in_bytes=0,
        temp_size_in_bytes=0, generated_code_size_in_bytes=0,
    )  # fmt: skip
    return types.SimpleNamespace(
        as_text=lambda: text, memory_analysis=lambda: memory, cost_analysis=lambda: {}
    )


def test_exposed_per_tick_counts_the_heaviest_branch_and_inner_loops_by_their_trips():
    mesh = jax.make_mesh((2, 2), ("pipe", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])  # fmt: skip
    tpu = target.Target("v5p:2x2x1", "tpu", tuple(mesh.devices.flat), CATALOG["v5p"].memory,
                        links=CATALOG["v5p"].links, peaks=CATALOG["v5p"].peaks)  # fmt: skip
    report = target.analyze(fake_compiled(PROGRAM), mesh, tpu)
    assert report.ticks == 5
    tick = {(e["kind"], tuple(e["axes"])): e for e in report.exposed("tick")}
    assert set(tick) == {
        ("all-gather", ("fsdp",)), ("all-reduce", ("fsdp",)), ("collective-permute", ("pipe",))
    }  # fmt: skip
    # the larger branch's gather only; the inner all-reduce 3 times; the hidden transfer not
    assert (tick["all-gather", ("fsdp",)]["count"], tick["all-gather", ("fsdp",)]["bytes"]) == (
        1, 4 * TILE
    )  # fmt: skip
    assert (tick["all-reduce", ("fsdp",)]["count"], tick["all-reduce", ("fsdp",)]["bytes"]) == (
        3, 3 * TILE
    )  # fmt: skip
    assert tick["collective-permute", ("pipe",)]["count"] == 1
    step = report.exposed("step")
    assert [(e["kind"], e["axes"], e["count"], e["bytes"]) for e in step] == [
        ("all-reduce", ["pipe"], 1, TILE)
    ]
    # ring traffic over groups of 2 at ICI's bandwidth
    ici = CATALOG["v5p"].links.within.bandwidth
    traffic = 4 * TILE / 2 + 3 * TILE * 2 * (1 / 2) + TILE
    assert report.exposed_seconds("tick") == pytest.approx(traffic / ici, rel=1e-12)
    timing = report.step_time(1e-3, "given")
    assert timing.step_seconds == pytest.approx(
        5 * (1e-3 + traffic / ici) + TILE / ici + 2 * 2**20 / CATALOG["v5p"].peaks.memory_bandwidth,
        rel=1e-12,
    )


# The GPU and CPU form of a tick: each backward kind a while loop of one trip or none,
# guarded by a carried flag (B gathers, W reduce-scatters; a device runs one of them), after
# the forward's conditional (nothing exposed there); an inner loop from 3 to 10 with an
# all-reduce; one counting down, whose trips the reader cannot tell, with another.
FLAGS = """\
HloModule m, is_scheduled=true

%mm (p0: f32[8,8], p1: f32[8,8]) -> f32[8,8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  %p1 = f32[8,8]{1,0} parameter(1)
  ROOT %d = f32[8,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%b_body (t: (pred[], f32[8,8])) -> (pred[], f32[8,8]) {
  %t = (pred[], f32[8,8]{1,0}) parameter(0)
  %v = f32[8,8]{1,0} get-tuple-element(%t), index=1
  %g = f32[32,8]{1,0} all-gather(%v), channel_id=1, replica_groups={{0,1},{2,3}}, dimensions={0}
  %f = pred[] constant(false)
  ROOT %o = (pred[], f32[8,8]{1,0}) tuple(%f, %v)
}

%w_body (t: (pred[], f32[8,8])) -> (pred[], f32[8,8]) {
  %t = (pred[], f32[8,8]{1,0}) parameter(0)
  %v = f32[8,8]{1,0} get-tuple-element(%t), index=1
  %rs = f32[4,8]{1,0} reduce-scatter(%v), channel_id=2, replica_groups={{0,1},{2,3}}, dimensions={0}, to_apply=%mm
  %f = pred[] constant(false)
  ROOT %o = (pred[], f32[8,8]{1,0}) tuple(%f, %rs)
}

%flag_cond (t: (pred[], f32[8,8])) -> pred[] {
  %t = (pred[], f32[8,8]{1,0}) parameter(0)
  ROOT %run = pred[] get-tuple-element(%t), index=0
}

%up_body (t: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %t = (s32[], f32[8,8]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%t), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%j, %one)
  %v = f32[8,8]{1,0} get-tuple-element(%t), index=1
  %ar = f32[8,8]{1,0} all-reduce(%v), channel_id=3, replica_groups={{0,1},{2,3}}, to_apply=%mm
  ROOT %o = (s32[], f32[8,8]{1,0}) tuple(%next, %ar)
}

%up_cond (t: (s32[], f32[8,8])) -> pred[] {
  %t = (s32[], f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(10)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%down_body (t: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %t = (s32[], f32[8,8]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%t), index=0
  %minus = s32[] constant(-1)
  %next = s32[] add(%j, %minus)
  %v = f32[8,8]{1,0} get-tuple-element(%t), index=1
  %ar = f32[8,8]{1,0} all-reduce(%v), channel_id=4, replica_groups={{0,2},{1,3}}, to_apply=%mm
  ROOT %o = (s32[], f32[8,8]{1,0}) tuple(%next, %ar)
}

%down_cond (t: (s32[], f32[8,8])) -> pred[] {
  %t = (s32[], f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(0)
  ROOT %lt = pred[] compare(%n, %i), direction=LT
}

%tick_body (u: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %u = (s32[], f32[8,8]{1,0}) parameter(0)
  %i0 = s32[] get-tuple-element(%u), index=0
  %one = s32[] constant(1)
  %i = s32[] add(%i0, %one)
  %x = f32[8,8]{1,0} get-tuple-element(%u), index=1
  %c = f32[8,8]{1,0} conditional(%k, %x, %x), branch_computations={%mm, %mm}
  %bf = pred[] compare(%i0, %i0), direction=EQ
  %bt = (pred[], f32[8,8]{1,0}) tuple(%bf, %c)
  %b = (pred[], f32[8,8]{1,0}) while(%bt), condition=%flag_cond, body=%b_body
  %wt = (pred[], f32[8,8]{1,0}) tuple(%bf, %c)
  %w = (pred[], f32[8,8]{1,0}) while(%wt), condition=%flag_cond, body=%w_body
  %three = s32[] constant(3)
  %ut = (s32[], f32[8,8]{1,0}) tuple(%three, %x)
  %up = (s32[], f32[8,8]{1,0}) while(%ut), condition=%up_cond, body=%up_body
  %ten = s32[] constant(10)
  %dt = (s32[], f32[8,8]{1,0}) tuple(%ten, %x)
  %down = (s32[], f32[8,8]{1,0}) while(%dt), condition=%down_cond, body=%down_body
  ROOT %o = (s32[], f32[8,8]{1,0}) tuple(%i, %x)
}

%tick_cond (u: (s32[], f32[8,8])) -> pred[] {
  %u = (s32[], f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%u), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[8,8]) -> f32[8,8] {
  %x = f32[8,8]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %t0 = (s32[], f32[8,8]{1,0}) tuple(%zero, %x)
  %loop = (s32[], f32[8,8]{1,0}) while(%t0), condition=%tick_cond, body=%tick_body
  ROOT %y = f32[8,8]{1,0} get-tuple-element(%loop), index=1
}
"""  # noqa: E501


def test_flag_loops_count_as_alternatives_and_unread_trip_counts_are_reported():
    mesh = jax.make_mesh((2, 2), ("pipe", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])  # fmt: skip
    h100 = target.Target("h100x4", "cuda", tuple(mesh.devices.flat), CATALOG["h100"].memory,
                         links=CATALOG["h100"].links, peaks=CATALOG["h100"].peaks)  # fmt: skip
    report = target.analyze(fake_compiled(FLAGS), mesh, h100)
    assert report.ticks == 4
    tick = {(e["kind"], tuple(e["axes"])): (e["count"], e["bytes"]) for e in report.exposed()}
    # B's gather (2 tiles sent) outweighs W's reduce-scatter (half a tile): one runs, not both;
    # the loop from 3 to 10 runs 7 times; the one counting down is counted once, and said
    assert tick == {
        ("all-gather", ("fsdp",)): (1, 4 * TILE),
        ("all-reduce", ("fsdp",)): (7, 7 * TILE),
        ("all-reduce", ("pipe",)): (1, TILE),
    }
    assert report.uncounted_loops == ("down",)
    nvlink = CATALOG["h100"].links.within.bandwidth
    traffic = 2 * TILE + 7 * TILE + TILE
    assert report.exposed_seconds() == pytest.approx(traffic / nvlink, rel=1e-12)
    timing = report.step_time(1e-3, "given")
    assert timing.uncounted_loops == ("down",)
    assert "UNDERCOUNTED: 1 loop(s)" in str(timing) and "down" in str(timing)
    assert "UNDERCOUNTED" not in str(target.analyze(fake_compiled(PROGRAM), mesh, h100)
                                     .step_time(1e-3, "given"))  # fmt: skip


def test_collectives_crossing_nodes_take_the_network():
    links = CATALOG["h100"].links
    devices = [types.SimpleNamespace(id=i) for i in range(16)]
    assert links.of_groups([[0, 7], [8, 15]], devices) is links.within
    assert links.of_groups([[0, 8]], devices) is links.across
    assert links.across.bandwidth < links.within.bandwidth
    assert "ConnectX-7" in links.across.source and "NVLink" in links.within.source


def _hand_report(text: str):
    """The report of the hand-written program ``text`` on pipe 2 x fsdp 2 of a v5p."""
    mesh = jax.make_mesh((2, 2), ("pipe", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])  # fmt: skip
    tpu = target.Target("v5p:2x2x1", "tpu", tuple(mesh.devices.flat), CATALOG["v5p"].memory,
                        links=CATALOG["v5p"].links, peaks=CATALOG["v5p"].peaks)  # fmt: skip
    return target.analyze(fake_compiled(text), mesh, tpu)


INNER_TRIPS = '"known_trip_count":{"n":"3"}'


def test_an_inner_loop_of_no_trips_exposes_nothing():
    """An inner loop the compiler says runs 0 times adds none of its collectives."""
    report = _hand_report(PROGRAM.replace(INNER_TRIPS, '"known_trip_count":{"n":"0"}'))
    assert {e["kind"] for e in report.exposed("tick")} == {"all-gather", "collective-permute"}


# A second loop at the top level after the tick loop, of more trips, that chooses no action
LONGER_LOOP = """%other_body (t: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %t = (s32[], f32[8,8]{1,0}) parameter(0)
  %v = f32[8,8]{1,0} get-tuple-element(%t), index=1
  ROOT %o = (s32[], f32[8,8]{1,0}) tuple(%i, %v)
}

%other_cond (t: (s32[], f32[8,8])) -> pred[] {
  %t = (s32[], f32[8,8]{1,0}) parameter(0)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY"""
OTHER = '  %other = (s32[], f32[8,8]{1,0}) while(%t0), condition=%other_cond, body=%other_body, backend_config={"known_trip_count":{"n":"64"}}\n'  # noqa: E501


def test_the_tick_loop_is_the_loop_that_chooses_actions_not_the_longest():
    """Of two loops at the top level, the one whose body chooses among actions (a
    conditional) is the tick loop, though the other runs more trips."""
    text = PROGRAM.replace("ENTRY", LONGER_LOOP).replace("  ROOT %sum", OTHER + "  ROOT %sum")
    report, plain = _hand_report(text), _hand_report(PROGRAM)
    assert report.ticks == plain.ticks == 5
    assert report.exposed("tick") == plain.exposed("tick") != []


def test_a_loop_that_is_its_computations_root_is_named_when_its_trips_are_unread():
    """A loop of unread trip count that ends its computation (``ROOT %w2 = ... while``) is
    named by its own name in the report."""
    wrapped = PROGRAM.replace(
        "%w = (s32[], f32[8,8]{1,0}) while(%u), condition=%inner_cond, body=%inner_body, "
        "backend_config={" + INNER_TRIPS + "}",
        "%w = (s32[], f32[8,8]{1,0}) call(%u), to_apply=%wrap",
    ).replace(
        "%tick_body (u:",
        "%wrap (u: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {\n"
        "  %u = (s32[], f32[8,8]{1,0}) parameter(0)\n"
        "  ROOT %w2 = (s32[], f32[8,8]{1,0}) while(%u), condition=%inner_cond, "
        "body=%inner_body\n}\n\n%tick_body (u:",
    )
    report = _hand_report(wrapped)
    assert report.uncounted_loops == ("w2",)
    assert "counted once per run: w2;" in str(report.step_time(1e-3, "given"))


def test_a_collective_whose_groups_are_not_read_counts_as_every_device_and_is_named():
    """The step's all-reduce with replica groups in a form the reader does not know is
    not free: it counts as one group of all 4 devices, as the same all-reduce written
    ``{{0,1,2,3}}``, and the report, its JSON and the step time name it."""
    groups = "replica_groups={{0,2},{1,3}}, to_apply=%mm\n}"
    unread = _hand_report(PROGRAM.replace(groups, "replica_groups=<new form>, to_apply=%mm\n}"))
    every = _hand_report(PROGRAM.replace(groups, "replica_groups={{0,1,2,3}}, to_apply=%mm\n}"))
    assert unread.unread_collectives == ("sum",) and every.unread_collectives == ()
    (step,) = unread.exposed("step")
    assert step["traffic"] == 2 * 3 / 4 * TILE and step["seconds"] > 0
    assert unread.exposed("step") == every.exposed("step")
    assert unread.exposed("tick") == _hand_report(PROGRAM).exposed("tick")
    assert unread.as_dict()["unread_collectives"] == ["sum"]
    assert "UNREAD: 1 collective(s)" in str(unread) and "UNREAD" not in str(every)
    timing = unread.step_time(1e-3, "given")
    assert timing.as_dict()["unread_collectives"] == ["sum"]
    assert "UNREAD: 1 collective(s)" in str(timing) and ": sum" in str(timing)


def test_an_asynchronous_collective_of_a_scalar_counts_its_bytes():
    """An ``all-reduce-start`` whose type is its result, a scalar: 4 bytes, as the
    synchronous all-reduce of the same value."""
    mesh = jax.make_mesh((2, 2), ("pipe", "fsdp"), devices=jax.devices()[:4])
    line = "  %ar = f32[] all-reduce(%v), channel_id=9, replica_groups={{0,1},{2,3}}, to_apply=%mm"
    for form in ("all-reduce-start(", "all-reduce("):
        text = "ENTRY %e () -> f32[] {\n" + line.replace("all-reduce(", form) + "\n}\n"
        assert [c.nbytes for c in hlo.collectives(text, mesh)] == [4]


def test_a_ticks_computation_leaves_the_all_to_alls_to_the_program():
    """`target.lockstep_tick_seconds` counts no all-to-all time: the report reads the
    program's all-to-alls as exposed communication, so counting them in the computation
    too would count them twice."""
    schedule = schedules.get("zbv", 2, 4)
    costs = schedules.Costs(forward=1.0, backward_input=1.3, backward_weight=0.7)
    with_all_to_alls = dataclasses.replace(
        costs, all_to_all_forward=0.5, all_to_all_backward=0.5, all_to_all_weight=0.2
    )
    plain = target.lockstep_tick_seconds(schedule, costs)
    assert plain > 0
    assert target.lockstep_tick_seconds(schedule, with_all_to_alls) == plain


# ----------------------------------------------------------------------------- compiled
def stage_fn(p, x):
    def block(x, w):
        return x + jax.nn.silu(x @ w["up"]) @ w["down"], None

    return jax.lax.scan(block, x, p)[0]


@functools.cache
def compiled(name: str, gather: str, schedule: str = "1f1b", options: tuple = ()):
    """A pipe 2 x fsdp 2 value_and_grad step (``schedule``, M micro-batches, stage weights
    split over fsdp) compiled for ``name`` (with compiler ``options``, name-value pairs), and
    its pipeline."""
    tgt = target.get(name)
    mesh = tgt.mesh((2, 2), ("pipe", "fsdp"))
    if name.startswith("h100"):  # pipe across the two nodes: devices 0-7 and 8-15
        devices = [tgt.devices[i] for i in (0, 1, 8, 9)]
        mesh = jax.make_mesh((2, 2), ("pipe", "fsdp"), devices=devices,
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)  # fmt: skip
    pipe = pipeline.Pipeline(stage_fn, lambda _, y, t: jnp.mean((y - t) ** 2), mesh=mesh,
                             schedule=schedule, num_microbatches=M, fsdp_gather=gather)  # fmt: skip
    stages = pipe.schedule.num_logical_stages
    logical = {
        "up": jax.ShapeDtypeStruct((stages, BLOCKS, WIDTH, HIDDEN), jnp.float32),
        "down": jax.ShapeDtypeStruct((stages, BLOCKS, HIDDEN, WIDTH), jnp.float32),
    }
    specs = {"up": P(None, None, "fsdp"), "down": P(None, "fsdp", None)}
    shapes = jax.eval_shape(lambda tree: pipe.place(tree, specs), logical)
    params = target.abstract(shapes, pipe.layout.shardings(shapes, specs))
    x = jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))

    def step(params, x):
        return jax.value_and_grad(lambda p: pipe.loss(p, None, x, x))(params)

    program = jax.jit(step).lower(params, x).compile(compiler_options=dict(options) or None)
    TEXTS[name, gather, schedule] = program.as_text()
    return target.analyze(program, mesh, tgt), pipe


TEXTS = {}  # (name, gather, schedule) -> the program `compiled` compiled, as text


@pytest.mark.parametrize("name", COMPILERS)
def test_step_time_is_ticks_times_tick_plus_step_and_exposed_is_the_listed_collectives(name):
    report, pipe = compiled(name, "per_use")
    assert report.ticks == pipe.schedule.num_ticks
    runs = {"tick": report.tick_runs, "step": report.step_runs}
    for per, counts in runs.items():
        triples = zip(report.collectives, counts, report.links_of, strict=True)
        listed = [(c, n, link) for c, n, link in triples if n]
        # what is counted is exactly the collectives not behind computation, where they run
        assert all(not c.hidden and c.in_loop == (per == "tick") for c, _, _ in listed)
        assert sum(e["bytes"] for e in report.exposed(per)) == sum(
            c.nbytes * n for c, n, _ in listed
        )
        assert sum(e["count"] for e in report.exposed(per)) == sum(n for _, n, _ in listed)
        if report.links is not None:
            seconds = sum(c.traffic * n / link.bandwidth for c, n, link in listed)
            assert report.exposed_seconds(per) == pytest.approx(seconds, rel=1e-12)
    # in one tick a device gathers every weight of its stage (split over fsdp) at least
    # once, in float32 or in bf16 (the TPU compiler casts before it gathers, to the
    # precision of its matmuls)
    chunk = 2 * BLOCKS * WIDTH * HIDDEN * 2
    listed = [c for c, n in zip(report.collectives, report.tick_runs, strict=True) if n]
    gathers = [c for c in report.collectives if c.kind == "all-gather" and c.axes == ("fsdp",)
               and c.in_loop]  # fmt: skip
    if not any(c.hidden for c in gathers):  # gathered per use and not behind computation
        fsdp = [e for e in report.exposed("tick") if e["kind"] == "all-gather"
                and e["axes"] == ["fsdp"]]  # fmt: skip
        assert fsdp and fsdp[0]["bytes"] >= chunk
    if report.links is None:  # the CPU: no bandwidth, so no time
        assert report.exposed_seconds() is None
        with pytest.raises(ValueError, match="no link bandwidth"):
            report.step_time(1e-3, "given")
        return
    if name.startswith("h100"):
        kinds = {(c.axes, link.name) for c, link in zip(report.collectives, report.links_of,
                                                        strict=True) if c.axes}  # fmt: skip
        assert (("fsdp",), "NVLink") in kinds and (("pipe",), "network") in kinds
    assert listed
    timing = report.step_time(2e-3, "given", model_flops=1e12, flops_source="given")
    per_step = timing.step_compute_seconds + report.exposed_seconds("step")
    assert timing.tick_seconds == 2e-3 + report.exposed_seconds("tick")
    assert timing.step_seconds == pytest.approx(
        report.ticks * timing.tick_seconds + per_step, rel=1e-12
    )
    devices = math.prod(report.mesh.values())
    assert timing.mfu == pytest.approx(
        1e12 / (devices * report.peaks.peak_flops * timing.step_seconds), rel=1e-12
    )
    text = str(timing)
    assert f"{report.ticks} ticks x" in text and report.links.within.source in text


@pytest.mark.parametrize("name", COMPILERS[1:2])
def test_gathered_once_no_weight_is_gathered_in_a_tick(name):
    once, _ = compiled(name, "once")
    per_use, _ = compiled(name, "per_use")
    weight = WIDTH * HIDDEN * 4  # one block's weight, whole
    in_tick = [e for e in once.exposed("tick") if e["kind"] == "all-gather"]
    assert all(e["bytes"] < weight for e in in_tick)
    assert any(e["kind"] == "all-gather" and e["bytes"] >= weight for e in once.exposed("step"))
    assert once.exposed_seconds("step") > per_use.exposed_seconds("step")


def test_a_loop_without_collectives_exposes_nothing():
    tpu = target.get("v5p:2x2x1") if HAS_LIBTPU else None
    if tpu is None:
        pytest.skip("no libtpu")
    mesh = tpu.mesh((1,), ("pipe",))

    def loop(x):
        return jax.lax.fori_loop(0, 7, lambda _, y: jnp.tanh(y @ y), x)

    x = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=NamedSharding(mesh, P()))
    report = tpu.compile(loop, x)
    assert report.collectives == () and report.ticks == 7
    timing = report.step_time(1e-3, "given", step_compute_seconds=0.0, step_compute_source="-")
    assert timing.tick_exposed_seconds == 0 and timing.step_exposed_seconds == 0
    assert timing.step_seconds == pytest.approx(7e-3, rel=1e-12)


@pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason="no CUDA")
def test_zbv_on_gpus_charges_a_tick_one_backward_kind():
    """Off TPU each backward kind of a tick is a loop of one trip or none (B gathers the
    chunk's weights, W reduce-scatters its gradients); a device runs one of them in a
    tick, so a tick is charged the exposed collectives of one of those loops, not both."""
    report, pipe = compiled("h100x16", "per_use", "zbv")
    assert report.ticks == pipe.schedule.num_ticks
    comps, _ = hlo.computations(TEXTS["h100x16", "per_use", "zbv"])
    flag_loops = [line for lines in comps.values() for line in lines
                  if hlo.opcode(line) == "while" and hlo.flag_loop(line, comps)]  # fmt: skip
    inside = [hlo.reachable(comps, hlo.called(line, ("body",))) for line in flag_loops]
    exposed = [[c for c in report.collectives if c.computation in names and not c.hidden]
               for names in inside]  # fmt: skip
    assert len(flag_loops) == 2 and all(exposed)  # B's and W's, each with exposed collectives
    assert {c.kind for c in exposed[0] + exposed[1]} >= {"all-gather", "reduce-scatter"}
    runs = dict(zip(report.collectives, report.tick_runs, strict=True))
    charged = [i for i, found in enumerate(exposed) if any(runs[c] for c in found)]
    assert len(charged) == 1
    tick = {(e["kind"], tuple(e["axes"])): e["count"] for e in report.exposed()}
    heavier = {c.kind for c in exposed[charged[0]]}
    lighter = {c.kind for c in exposed[1 - charged[0]]} - heavier
    assert all((kind, ("fsdp",)) not in tick for kind in lighter)


@pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason="no CUDA")
def test_two_ticks_a_trip_count_as_the_schedules_ticks():
    """With XLA's while-loop double buffering the GPU compiler runs two ticks in each trip
    of the tick loop. Given the schedule's ticks, the prediction counts every tick, each
    with half of a trip's exposed communication; counting trips as ticks would halve the
    computation."""
    options = (("xla_gpu_enable_while_loop_double_buffering", True),)
    report, pipe = compiled("h100x16", "per_use", "1f1b", options)
    ticks = pipe.schedule.num_ticks
    assert report.ticks == ticks // 2 and ticks % 2 == 0  # trips
    assert report.exposed_seconds("tick") > 0
    timing = report.step_time(1e-3, "given", ticks=ticks)
    assert timing.ticks == ticks and timing.trips == ticks // 2
    assert timing.tick_exposed_seconds == pytest.approx(report.exposed_seconds("tick") / 2)
    assert timing.step_seconds == pytest.approx(
        ticks * (1e-3 + report.exposed_seconds("tick") / 2) + timing.per_step_seconds, rel=1e-12
    )
    assert f"its {ticks} ticks run in {ticks // 2} trips" in str(timing)
    with pytest.raises(ValueError, match="each trip runs at least one tick"):
        report.step_time(1e-3, "given", ticks=report.ticks - 1)
    plain = compiled("h100x16", "per_use", "1f1b")[0].step_time(1e-3, "given", ticks=ticks)
    assert plain.trips == plain.ticks == ticks and "trips" not in str(plain)
