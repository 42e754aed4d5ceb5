"""The HLO reader (`jaxpipe.analysis.hlo`) and the tests' helpers on it (`tests/hlo.py`), on
lines in the forms XLA prints them: iota, listed and mesh-named replica groups, float8
types, async collectives. A reader that misses a form makes the memory and collective
tests pass or fail for the wrong reason."""

from __future__ import annotations

import hlo
import numpy as np
import pytest

from jaxpipe.analysis import hlo as reader


class Mesh:  # the two attributes the reader reads of a jax Mesh
    axis_names = ("pipe", "fsdp")
    devices = np.empty((4, 2), dtype=object)


LINES = {
    "mesh-named": (
        "%rs = f32[1,8,16]{2,0,1} reduce-scatter(%x), channel_id=1, "
        "replica_groups=mesh['pipe'=4,'fsdp'=2] {'fsdp'}, use_global_device_ids=true"
    ),
    "iota": (
        "%rs = f32[1,8,16]{2,0,1} reduce-scatter(%x), replica_groups=[4,2]<=[8], dimensions={1}"
    ),
    "listed": (
        "%rs = f32[1,8,16]{2,0,1} reduce-scatter(%x), "
        "replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={1}"
    ),
}


def _module(*lines: str) -> str:
    """An entry computation holding ``lines``."""
    body = "\n".join(f"  {line}" for line in lines)
    return f"HloModule m\n\nENTRY %main (p: f32[8]) -> f32[8] {{\n{body}\n}}\n"


@pytest.mark.parametrize("form", LINES)
def test_each_form_of_replica_groups_reads_as_the_same_axes(form):
    (found,) = reader.collectives(_module(LINES[form]), Mesh())
    assert (found.kind, found.axes, found.nbytes) == ("reduce-scatter", ("fsdp",), 4 * 8 * 16)
    (found,) = hlo.collectives(_module(LINES[form]), Mesh())
    assert found.axes == {"fsdp"}


def test_mesh_named_groups_over_the_leading_axis():
    line = "%ar = f32[2]{0} all-reduce(%x), replica_groups=mesh['pipe'=4,'fsdp'=2] {'pipe'}"
    assert reader.device_groups("all-reduce", line.split("all-reduce(")[1], 8) == [
        [0, 2, 4, 6],
        [1, 3, 5, 7],
    ]
    (found,) = reader.collectives(_module(line), Mesh())
    assert found.axes == ("pipe",)


def test_groups_in_an_unknown_form_are_refused_when_strict():
    line = "%ar = f32[2]{0} all-reduce(%x), replica_groups=<new form>"
    with pytest.raises(ValueError, match="does not know"):
        reader.collectives(_module(line), Mesh(), strict=True)
    with pytest.raises(ValueError, match="does not know"):
        hlo.collectives(_module(line), Mesh())
    (found,) = reader.collectives(_module(line), Mesh())
    assert found.unread and found.axes == ("pipe", "fsdp") and found.group_size == 8


@pytest.mark.parametrize(
    "line",
    [
        # an iota form with a part the reader does not know after it
        "%ar = f32[2]{0} all-reduce(%x), replica_groups=[4,2]<=[8]S(1), to_apply=%add",
        "%ar = f32[2]{0} all-reduce(%x), replica_groups={{0,1}, {2,3}}, to_apply=%add",
        "%cp = f32[2]{0} collective-permute(%x), source_target_pairs=<new form>",
    ],
)
def test_groups_in_an_unknown_form_count_as_every_device_and_say_so(line):
    """Not free: one group of all 8 devices (the most traffic), marked unread."""
    (found,) = reader.collectives(_module(line), Mesh())
    assert found.unread and found.groups == (tuple(range(8)),)
    assert found.traffic == {"all-reduce": 2 * 7 / 8 * 8, "collective-permute": 8}[found.kind]
    with pytest.raises(ValueError, match="does not know"):
        reader.collectives(_module(line), Mesh(), strict=True)
    known = reader.collectives(_module(LINES["iota"]), Mesh())
    assert not known[0].unread


def test_types_with_float8_and_tuples():
    assert reader.arrays("(f8e4m3fn[4,8]{1,0}, f8e5m2[2]{0}, bf16[], f32[3,2]{1,0})") == [
        ("f8e4m3fn", (4, 8)),
        ("f8e5m2", (2,)),
        ("bf16", ()),
        ("f32", (3, 2)),
    ]
    assert reader.nbytes("(f8e4m3fn[4,8]{1,0}, f8e5m2[2]{0}, bf16[], f32[3,2]{1,0})") == (
        32 + 2 + 2 + 24
    )
    assert reader.nbytes("f8e4m3fnuz[16]{0}") == 16
    line = "%ag = f8e4m3fn[8,16]{1,0} all-gather(%x), replica_groups=[4,2]<=[8], dimensions={0}"
    (found,) = reader.collectives(_module(line), Mesh())
    assert (found.kind, found.nbytes, found.axes) == ("all-gather", 8 * 16, ("fsdp",))


def test_an_async_collective_counts_once_with_its_results():
    """A -start typed ((operands...), results...) counts its results, once; its -done is
    not a second collective; scalars of a flat -start tuple are context words."""
    lines = [
        "%ag = ((f8e5m2[1,4,16]{2,1,0}, f32[1,8]{1,0}), (f8e5m2[2,4,16]{2,1,0}, "
        "f32[2,8]{1,0})) all-gather-start(%y, %z), channel_id=2, replica_groups=[4,2]<=[8], "
        "dimensions={0}, use_global_device_ids=true",
        "%agd = (f8e5m2[2,4,16]{2,1,0}, f32[2,8]{1,0}) all-gather-done(%ag)",
        "%cp = (f32[4,256]{1,0}, f32[4,256]{1,0}, u32[], u32[]) collective-permute-start(%d), "
        "channel_id=1, source_target_pairs={{0,2},{2,4},{4,6},{6,0},{1,3},{3,5},{5,7},{7,1}}",
        "%cpd = f32[4,256]{1,0} collective-permute-done(%cp)",
    ]
    found = reader.collectives(_module(*lines), Mesh())
    assert [(c.kind, c.axes) for c in found] == [
        ("all-gather", ("fsdp",)),
        ("collective-permute", ("pipe",)),
    ]
    assert found[0].nbytes == 2 * 4 * 16 + 4 * 2 * 8
    assert found[1].nbytes == 4 * 4 * 256
    assert [c.hidden for c in found] == [False, False]  # nothing between start and done
    assert [c.nbytes for c in hlo.collectives(_module(*lines), Mesh())] == [c.nbytes for c in found]


def test_computations_calls_and_loops():
    text = _program("ROOT %g = pred[] get-tuple-element(%p), index=0")
    comps, entry = reader.computations(text)
    assert entry == "main"
    assert set(comps) == {"inner_body", "inner_cond", "tick_body", "tick_cond", "main"}
    (loop,) = [line for line in comps["main"] if reader.opcode(line) == "while"]
    assert reader.called(loop) == ["tick_cond", "tick_body"]
    assert reader.called(loop, ("body",)) == ["tick_body"]
    assert reader.result_type(loop) == "(pred[], f32[4,4])"
    assert reader.nbytes(reader.result_type(loop)) == 1 + 4 * 4 * 4
    tpu = (
        "%w = (s32[]{:T(128)}, f32[8,128]{1,0:T(8,128)}, /*index=2*/bf16[4]{0:T(512)}) "
        "while(%t), condition=%c, body=%b"
    )
    assert reader.opcode(tpu) == "while"
    assert reader.nbytes(reader.result_type(tpu)) == 4 + 4 * 8 * 128 + 2 * 4
    assert reader.loop_computations(comps) == set(comps) - {"main"}
    assert reader.reachable(comps, ["main"], ("calls", "to_apply")) == {"main"}
    assert reader.has_loop(text) and not reader.has_loop(_module(LINES["iota"]))


def _program(inner_condition: str) -> str:
    """A tick loop whose body runs an inner while loop with a dot in its body."""
    return f"""
%inner_body (p: (pred[], f32[4,4])) -> (pred[], f32[4,4]) {{
  %p = (pred[], f32[4,4]) parameter(0)
  %x = f32[4,4] get-tuple-element(%p), index=1
  %d = f32[4,4] dot(%x, %x), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %f = pred[] constant(false)
  ROOT %t = (pred[], f32[4,4]) tuple(%f, %d)
}}
%inner_cond (p: (pred[], f32[4,4])) -> pred[] {{
  %p = (pred[], f32[4,4]) parameter(0)
  {inner_condition}
}}
%tick_body (q: (pred[], f32[4,4])) -> (pred[], f32[4,4]) {{
  %q = (pred[], f32[4,4]) parameter(0)
  ROOT %w = (pred[], f32[4,4]) while(%q), condition=%inner_cond, body=%inner_body
}}
%tick_cond (q: (pred[], f32[4,4])) -> pred[] {{
  %q = (pred[], f32[4,4]) parameter(0)
  %i = s32[] constant(0)
  ROOT %c = pred[] compare(%i, %i), direction=LT
}}
ENTRY %main (a: (pred[], f32[4,4])) -> (pred[], f32[4,4]) {{
  %a = (pred[], f32[4,4]) parameter(0)
  ROOT %loop = (pred[], f32[4,4]) while(%a), condition=%tick_cond, body=%tick_body
}}
"""


def test_a_loop_guarded_by_a_carried_flag_counts_as_a_branch():
    """A dot in a loop of one trip or none (its condition a carried boolean, as the
    executor's backward actions) runs only when the data says so, as in a branch; a dot in
    a counted loop (its condition a comparison) runs every tick."""
    flag = "ROOT %g = pred[] get-tuple-element(%p), index=0"
    counted = "%i = s32[] constant(0)\n  ROOT %c = pred[] compare(%i, %i), direction=LT"
    assert hlo.loop_dots_outside_branches(_program(flag)) == []
    (found,) = hlo.loop_dots_outside_branches(_program(counted))
    assert " dot(" in found


def test_operands_are_read_by_name_also_after_their_types():
    """Compilers that print each operand's type before its name (``f32[2,4]{1,0} %a``) put
    commas inside the operand list; the reader names the operands, and the tests' helper
    follows a bitcast and a concatenation to the types they were made from."""
    typed = "%cat = f32[16]{0} concatenate(f32[8]{0} %a1, f32[8]{0} %b1), dimensions={0}"
    assert reader.operands(typed) == ["a1", "b1"]
    assert reader.operands("%s = f32[4] add(%x, %y), metadata={}") == ["x", "y"]
    text = _module(
        "%a = f32[2,4]{1,0} parameter(0)",
        "%b = bf16[4,4]{1,0} parameter(1)",
        "%a1 = f32[8]{0} bitcast(f32[2,4]{1,0} %a)",
        "%b1 = f32[8]{0} convert(bf16[4,4]{1,0} %b)",
        typed,
        "ROOT %ag = f32[32]{0} all-gather(f32[16]{0} %cat), dimensions={0}",
    )
    definitions = hlo.Definitions(text)
    assert set(definitions) == {"a", "b", "a1", "b1", "cat", "ag"}
    assert reader.definitions(definitions.computations["main"]) == dict(definitions)
    assert hlo.operand_types(definitions["ag"], definitions) == ["f32[2,4]{1,0}", "f32[8]{0}"]


def _counted_loop(start: str, condition: str, step: str) -> tuple[str, dict]:
    """A ``while`` instruction and its module's computations: the counter starts at
    ``start`` (an instruction defining ``%s``), the condition's root is ``condition`` (over
    ``%i``, the counter, and ``%n = constant(10)``) and the body's new counter is ``step``
    (an instruction defining ``%next`` from ``%j``, the old counter)."""
    text = f"""
%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {{
  %p = (s32[], f32[4]) parameter(0)
  %j = s32[] get-tuple-element(%p), index=0
  %x = f32[4] get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %two = s32[] constant(2)
  %minus = s32[] constant(-1)
  {step}
  ROOT %t = (s32[], f32[4]) tuple(%next, %x)
}}
%cond (p: (s32[], f32[4])) -> pred[] {{
  %p = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(10)
  {condition}
}}
ENTRY %main (a: f32[4], b: s32[]) -> (s32[], f32[4]) {{
  %a = f32[4] parameter(0)
  %b = s32[] parameter(1)
  {start}
  %c = s32[]{{:T(128)}} copy(%s)
  %init = (s32[], f32[4]) tuple(%c, %a)
  ROOT %w = (s32[], f32[4]) while(%init), condition=%cond, body=%body
}}
"""
    comps, _ = reader.computations(text)
    (line,) = [x for x in comps["main"] if reader.opcode(x) == "while"]
    return line, comps


@pytest.mark.parametrize(
    "start, condition, step, trips",
    [
        ("%s = s32[] constant(0)", "ROOT %lt = pred[] compare(%i, %n), direction=LT",
         "%next = s32[] add(%j, %one)", 10),
        # fori_loop(3, 10): 7 trips, not 10
        ("%s = s32[] constant(3)", "ROOT %lt = pred[] compare(%i, %n), direction=LT",
         "%next = s32[] add(%one, %j)", 7),
        ("%s = s32[] constant(0)", "ROOT %gt = pred[] compare(%n, %i), direction=GT",
         "%next = s32[] add(%j, %two)", 5),
        ("%s = s32[] constant(12)", "ROOT %lt = pred[] compare(%i, %n), direction=LT",
         "%next = s32[] add(%j, %one)", 0),
        # the TPU compiler's copy of the new counter (a tick loop of fsdp_gather="ahead")
        ("%s = s32[] constant(0)", "ROOT %lt = pred[] compare(%i, %n), direction=LT",
         "%sum = s32[] add(%j, %one)\n  %next = s32[]{:T(128)} copy(%sum)", 10),
        # counting down from 15 while 10 < i: the constant is the first operand of LT
        ("%s = s32[] constant(15)", "ROOT %lt = pred[] compare(%n, %i), direction=LT",
         "%next = s32[] add(%j, %minus)", None),
        # a step that is not positive, a start that is not a constant, a step not read
        ("%s = s32[] constant(0)", "ROOT %lt = pred[] compare(%i, %n), direction=LT",
         "%next = s32[] add(%j, %minus)", None),
        ("%s = s32[] copy(%b)", "ROOT %lt = pred[] compare(%i, %n), direction=LT",
         "%next = s32[] add(%j, %one)", None),
        ("%s = s32[] constant(0)", "ROOT %lt = pred[] compare(%i, %n), direction=LT",
         "%next = s32[] multiply(%j, %two)", None),
    ],
)  # fmt: skip
def test_trip_count_reads_start_bound_and_step_or_says_it_cannot(start, condition, step, trips):
    line, comps = _counted_loop(start, condition, step)
    assert reader.trip_count(line, comps) == trips
    assert not reader.flag_loop(line, comps)
    printed = line + ', backend_config={"known_trip_count":{"n":"4"}}'
    assert reader.trip_count(printed, comps) == 4  # the compiler's own count wins
