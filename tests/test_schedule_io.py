"""CSV export and import of schedules, and the Chrome / Perfetto trace export."""

import json

import pytest

from jaxpipe import schedules
from jaxpipe.schedules import (
    BW,
    Action,
    B,
    Costs,
    F,
    Schedule,
    U,
    W,
    from_csv,
    from_csv_text,
    to_chrome_trace,
    to_csv,
)

NAMES = schedules.names()


def small(name):
    """A small schedule of ``name``: the first (S, M) its generator accepts."""
    for S, M in [(3, 6), (2, 4), (4, 8), (4, 16)]:
        try:
            return schedules.get(name, S, M)
        except ValueError:
            continue
    raise AssertionError(f"{name} accepts none of the small (S, M) tried")


@pytest.mark.parametrize("name", NAMES)
def test_csv_round_trip_for_every_schedule(name, tmp_path):
    schedule = small(name)
    assert from_csv_text(to_csv(schedule)) == schedule
    path = tmp_path / f"{name}.csv"
    text = to_csv(schedule, path)
    assert path.read_text() == text
    assert from_csv(path) == schedule
    rows = sum(1 for _ in schedule.actions(include_updates=True))
    assert len(text.strip().splitlines()) == 9 + rows


def test_csv_round_trip_keeps_options_and_versions():
    schedule = schedules.get("interleaved_1f1b", 2, 4, virtual_stages=3)
    loaded = from_csv_text(to_csv(schedule))
    assert dict(loaded.options) == {"virtual_stages": 3, "split_backward": True}
    versioned = Schedule(
        "v",
        1,
        2,
        (0,),
        (
            ((Action(F, 0, 0),),),
            ((Action(BW, 0, 0), Action(U, 0, 0, 0)),),
            ((Action(F, 0, 1, 1),),),
            ((Action(BW, 0, 1, 1), Action(U, 0, 0, 1)),),
            ((),),
        ),
    )
    text = to_csv(versioned)
    assert "3,0,U,0,0,1" in text.splitlines()
    again = from_csv_text(text)
    assert again == versioned and again.num_ticks == 5  # the trailing empty tick survives


def test_a_csv_update_row_runs_last_in_its_cell_wherever_it_stands():
    """Rows may come in any order: a U row before its cell's W row was refused ('at most
    one U, last')."""
    schedule = schedules.get("pipedream", 2, 4)
    lines = to_csv(schedule).splitlines()
    i = next(i for i, line in enumerate(lines) if ",U," in line)
    tick_device = ",".join(lines[i].split(",")[:2]) + ","
    mate = next(j for j, line in enumerate(lines) if line.startswith(tick_device) and j != i)
    lines[i], lines[mate] = lines[mate], lines[i]
    assert from_csv_text("\n".join(lines)) == schedule


def test_a_csv_header_key_given_twice_is_refused():
    """The second line used to win silently."""
    text = to_csv(schedules.get("1f1b", 2, 4)).replace(
        "# num_ticks:", "# num_microbatches: 2\n# num_ticks:"
    )
    with pytest.raises(
        ValueError, match=r"line 7: header key 'num_microbatches' given twice \(line 4: '4', line 7"
    ):
        from_csv_text(text)


def test_csv_options_keep_the_schedule_hashable():
    """A list in the options made the table unhashable: fit (Pipeline(costs=...)) failed
    with "unhashable type: 'list'"."""
    text = to_csv(schedules.get("1f1b", 2, 4)).replace(
        "# options: {", '# options: {"x": [1, [2]], '
    )
    loaded = from_csv_text(text)
    assert dict(loaded.options)["x"] == (1, (2,))
    schedules.fit(loaded, Costs())
    with pytest.raises(ValueError, match=r"line 8: options x hold a JSON object"):
        from_csv_text(text.replace("[1, [2]]", '[{"a": 1}]'))


def test_csv_versions_are_validated():
    """A version that no U explains is an error, whichever name the table has."""
    text = HAND_WRITTEN.replace(
        "tick, device, op, stage, microbatch", "tick,device,op,stage,microbatch,version"
    )
    text = "\n".join(line + (", 0" if line[:1].isdigit() else "") for line in text.splitlines())
    from_csv_text(text)
    with pytest.raises(ValueError, match=r"line 11\): .*rule 'version' violated"):
        from_csv_text(text.replace("3, 1, F, 1, 1, 0", "3, 1, F, 1, 1, 1"))


HAND_WRITTEN = """\
# A 1F1B-like schedule for 2 devices and 2 micro-batches, backward split into B and W.
# name: hand
# num_stages: 2
# num_microbatches: 2
tick, device, op, stage, microbatch
0, 0, F, 0, 0
1, 0, F, 0, 1
1, 1, F, 1, 0
2, 1, B, 1, 0
3, 0, B, 0, 0
3, 1, F, 1, 1
4, 0, W, 0, 0
4, 1, B, 1, 1
5, 0, B, 0, 1
5, 1, W, 1, 0
6, 0, W, 0, 1
6, 1, W, 1, 1
"""


def test_hand_written_csv_loads_and_validates():
    schedule = from_csv_text(HAND_WRITTEN)
    expected = [
        [(F, 0, 0), None],
        [(F, 0, 1), (F, 1, 0)],
        [None, (B, 1, 0)],
        [(B, 0, 0), (F, 1, 1)],
        [(W, 0, 0), (B, 1, 1)],
        [(B, 0, 1), (W, 1, 0)],
        [(W, 0, 1), (W, 1, 1)],
    ]
    assert schedule.name == "hand"
    assert schedule.stage_device == (0, 1)
    assert schedule.ticks == tuple(
        tuple(() if c is None else (Action(*c),) for c in row) for row in expected
    )
    assert schedule.splits_backward
    assert schedule.peak_activations() == (2, 2)


def _broken(replace, by):
    assert replace in HAND_WRITTEN
    return HAND_WRITTEN.replace(replace, by)


@pytest.mark.parametrize(
    "text, match",
    [
        (_broken("# num_stages: 2", "# num_stages: two"), r"line 3: header num_stages must be a"),
        (_broken("# num_stages: 2\n", ""), r"missing header line '# num_stages: <positive int>'"),
        (_broken("# name: hand", "# nmae: hand"), r"line 2: unknown header key 'nmae'"),
        (_broken("4, 0, W, 0, 0", "4, 0, X, 0, 0"), r"line 12: unknown op 'X'; expected one of"),
        (_broken("4, 0, W, 0, 0", "4, 0, W, 0, zero"), r"line 12: microbatch must be a non-neg"),
        (_broken("4, 0, W, 0, 0", "4, 0, W, 0, -1"), r"line 12: microbatch must be a non-neg"),
        (_broken("4, 0, W, 0, 0", "4, 0, W, 0"), r"line 12: expected 5 fields"),
        (_broken("4, 0, W, 0, 0", "4, 2, W, 0, 0"), r"line 12: device 2 outside \[0, 2\)"),
        (_broken("tick, device, op,", "tick, op,"), r"line 5: .*missing: \['device'\]"),
        (_broken("microbatch\n", "microbatch, colour\n"), r"line 5: .*unknown: \['colour'\]"),
        (HAND_WRITTEN.split("tick,")[0], r"no column header line"),
        (_broken("# num_stages: 2", "# num_stages: 2\n# stage_device: 0 x"), r"line 4: stage_dev"),
        (_broken("# name: hand", "# options: [1]"), r"line 2: options must be a JSON object"),
        (_broken("# name: hand", "# num_ticks: 3"), r"line 2: num_ticks is 3 but a row uses"),
    ],
)
def test_broken_csv_raises_naming_the_line(text, match):
    with pytest.raises(ValueError, match=match):
        from_csv_text(text)


def test_csv_that_breaks_a_schedule_rule_is_rejected_by_the_validator():
    text = _broken("6, 0, W, 0, 1\n", "")
    with pytest.raises(ValueError, match=r"device 0: rule 'complete' violated"):
        from_csv_text(text)
    text = _broken("4, 0, W, 0, 0", "2, 0, W, 0, 0")  # W before its B
    with pytest.raises(
        ValueError,
        match=r"line 12\): Invalid schedule .hand. at tick 2, device 0: rule .dependency.",
    ):
        from_csv_text(text)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", ["lockstep", "ideal"])
def test_chrome_trace_has_one_event_per_action(name, mode, tmp_path):
    schedule = small(name)
    costs = Costs(forward=1, backward_input=1.5, backward_weight=0.5, communication=0.25)
    trace = to_chrome_trace(schedule, costs, mode, path=tmp_path / "trace.json")
    assert json.loads((tmp_path / "trace.json").read_text()) == trace
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    expected = sorted(f"{a.op}{a.microbatch} s{a.stage}" for a in schedule.actions())
    assert sorted(e["name"] for e in complete) == expected
    for device in range(schedule.num_stages):
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in complete if e["tid"] == device)
        assert spans, f"device {device} has no events"
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(spans, spans[1:], strict=False))
    for e in complete:
        assert e["dur"] == pytest.approx(1000 * costs.of(Action(e["cat"], 0, 0)))
    threads = {e["tid"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert threads == set(range(schedule.num_stages))


def test_the_trace_is_written_to_path(tmp_path):
    schedule = schedules.get("1f1b", 2, 3)
    trace = to_chrome_trace(schedule, mode="ideal", path=tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text()) == trace
    assert to_chrome_trace(schedule)["traceEvents"] != trace["traceEvents"]  # lock-step differs
