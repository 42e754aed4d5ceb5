"""The HLO reader the memory and collective tests rely on (`tests/hlo.py`), on lines in the
forms XLA prints them: iota and listed replica groups (jax 0.10) and mesh-named groups
(jax 0.12). A reader that misses a form makes those tests pass or fail for the wrong reason."""

from __future__ import annotations

import hlo
import numpy as np
import pytest


class Mesh:  # the two attributes hlo reads of a jax Mesh
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


@pytest.mark.parametrize("form", LINES)
def test_each_form_of_replica_groups_reads_as_the_same_axes(form):
    (found,) = hlo.collectives(LINES[form], Mesh())
    assert (found.kind, found.axes, found.nbytes) == ("reduce-scatter", {"fsdp"}, 4 * 8 * 16)


def test_mesh_named_groups_over_the_leading_axis():
    line = "%ar = f32[2]{0} all-reduce(%x), replica_groups=mesh['pipe'=4,'fsdp'=2] {'pipe'}"
    assert hlo._groups("all-reduce", line.split("all-reduce(")[1], 8) == [
        [0, 2, 4, 6],
        [1, 3, 5, 7],
    ]
    (found,) = hlo.collectives(line, Mesh())
    assert found.axes == {"pipe"}


def test_groups_in_an_unknown_form_are_refused():
    with pytest.raises(ValueError, match="does not know"):
        hlo.collectives("%ar = f32[2]{0} all-reduce(%x), replica_groups=<new form>", Mesh())


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
