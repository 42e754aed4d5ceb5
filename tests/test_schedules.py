"""Schedules as tables: every generator validates, bubble and memory formulas, the simulator."""

import inspect
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpipe import schedules
from jaxpipe.schedules import BW, Action, B, Costs, F, Schedule, W, basic, registry, simulate

NAMES = schedules.names()
UNIT = Costs(forward=1, full_backward=1)  # F and BW take one tick each
REPEAT_OPTIONS = ("virtual_stages", "repeats")
# What a generator's refusal must name: the requirement, in the words of get()'s arguments.
REQUIREMENT = re.compile(r"num_microbatches|num_stages|virtual_stages|repeats")


def repeat_option(name):
    """The generator's stages-per-device option (``virtual_stages`` or ``repeats``), if any."""
    parameters = inspect.signature(registry._GENERATORS[name]).parameters
    return next((p for p in REPEAT_OPTIONS if p in parameters), None)


def build(name, S, M, v=None):
    """``get`` with the repeat option set to ``v`` where the generator has one."""
    option = repeat_option(name)
    return schedules.get(name, S, M, **({option: v} if option and v else {}))


def is_refusal(error):
    """A ValueError that states a requirement, not a broken table from a generator."""
    text = str(error)
    return "Invalid schedule" not in text and "deadlocks" not in text and REQUIREMENT.search(text)


def grid():
    for S in (1, 2, 3, 4, 8):
        for M in sorted({1, S, S + 1, 2 * S, 4 * S, 8 * S}):
            yield S, M


# ------------------------------------------------------------------------ every schedule


def test_known_names_are_registered():
    assert {"gpipe", "1f1b", "interleaved_1f1b", "circular"} <= set(NAMES)


def test_schedules_package_imports_neither_jax_nor_matplotlib():
    code = "import sys, jaxpipe.schedules; print(sorted({'jax', 'matplotlib'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name", NAMES)
def test_every_schedule_validates_over_the_grid(name):
    option = repeat_option(name)
    built = 0
    for S, M in grid():
        for v in (2, 3) if option else (None,):
            try:
                schedule = build(name, S, M, v)
            except ValueError as error:
                assert is_refusal(error), f"{name} S={S} M={M} v={v}: {error}"
                continue
            built += 1
            schedules.validate(schedule)
            assert (schedule.num_stages, schedule.num_microbatches) == (S, M)
            if option:
                assert schedule.stages_per_device == v
                assert dict(schedule.options)[option] == v
            ops = [(a.op, a.stage, a.microbatch) for a in schedule.actions()]
            forwards = {(s, m) for op, s, m in ops if op == F}
            assert forwards == {
                (s, m) for s in range(schedule.num_logical_stages) for m in range(M)
            }
    assert built > 0


def test_interleaved_takes_any_number_of_microbatches():
    """As PyTorch's flexible interleaving, and beyond: M need not be a multiple of S, nor of
    the number of rounds (PyTorch refuses S = 4, M = 11)."""
    for S in (2, 3, 4, 8):
        for M in range(1, 3 * S + 2):
            for name in ("interleaved_1f1b", "interleaved_zb"):
                schedule = schedules.get(name, S, M, virtual_stages=2)
                assert schedule.num_microbatches == M
    with pytest.raises(ValueError, match=r"virtual_stages must be a positive int, got 0"):
        schedules.get("interleaved_1f1b", 4, 8, virtual_stages=0)
    with pytest.raises(ValueError, match=r"repeats must be a positive int, got 0"):
        schedules.get("circular", 4, 8, repeats=0)


# ------------------------------------------------------------------------------ formulas


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_exact(name):
    """With full backwards and F = BW (one tick each) both take the classic (S-1)/(M+S-1)."""
    for S, M in grid():
        options = {"split_backward": False} if name == "1f1b" else {}
        report = schedules.bubble_fraction(schedules.get(name, S, M, **options), UNIT)
        assert report.lockstep == pytest.approx((S - 1) / (M + S - 1), abs=1e-12)
        assert report.ideal == pytest.approx((S - 1) / (M + S - 1), abs=1e-12)


def test_split_1f1b_takes_3M_plus_2S_minus_2_ticks():
    """The default 1f1b (B then W): every action one tick at Costs(), makespan 3M + 2(S-1)
    in both modes: the W's are off the critical path, the classic 3(M+S-1) is not. (With
    one device the default fuses F and BW instead: nothing waits, fewest ticks win.)"""
    for S, M in grid():
        if S == 1:
            fused = schedules.get("1f1b", S, M)
            assert dict(fused.options) == {"overlap": True, "split_backward": False}
            assert fused.num_ticks == M + 1
            continue
        schedule = schedules.get("1f1b", S, M)
        assert dict(schedule.options) == {"overlap": False, "split_backward": True}
        assert schedule.num_ticks == 3 * M + 2 * (S - 1)
        for mode in ("lockstep", "ideal"):
            assert simulate(schedule, Costs(), mode).makespan == 3 * M + 2 * (S - 1)


def test_peak_activations_of_gpipe_and_1f1b():
    for S, M in grid():
        assert schedules.get("gpipe", S, M).peak_activations() == (M,) * S
        for split in (True, False):
            assert schedules.get("1f1b", S, M, split_backward=split).peak_activations() == tuple(
                min(S - d, M) for d in range(S)
            )


def test_interleaved_bubble_meets_megatron_formula():
    """Narayanan et al. 2021: bubble (S-1)/(v*M+S-1). The lock-step table with full backwards
    needs no rounding: every device runs its 2*v*M actions in 2*v*M + 2*(S-1) ticks."""
    for S, M in grid():
        if M % S:
            continue
        for v in (1, 2, 3, 4):
            schedule = schedules.get(
                "interleaved_1f1b", S, M, virtual_stages=v, split_backward=False
            )
            assert schedule.num_ticks == 2 * v * M + 2 * (S - 1)
            report = schedules.bubble_fraction(schedule, UNIT)
            assert report.lockstep == pytest.approx((S - 1) / (v * M + S - 1), abs=1e-12)
            assert report.ideal <= report.lockstep + 1e-12


def test_split_interleaved_takes_3vM_plus_2S_minus_2_ticks_for_any_M():
    """The default interleaved_1f1b (B then W, warm-up (v-1)g + S-d-1) fills every tick at
    Costs() after the start skew: with M >= S, 3vM + 2(S-1) ticks, lock-step equal to the
    ideal. (With M < S a micro-batch's round trip outlasts a round: idle ticks.)"""
    for S in (1, 2, 3, 4, 8):
        for M in range(1, 4 * S + 2):
            for v in (1, 2, 3):
                schedule = schedules.get("interleaved_1f1b", S, M, virtual_stages=v)
                report = schedules.bubble_fraction(schedule)
                assert report.lockstep == report.ideal
                if M < S and v > 1:
                    continue
                assert schedule.num_ticks == 3 * v * M + 2 * (S - 1), (S, M, v)
                assert report.lockstep == pytest.approx(2 * (S - 1) / (3 * v * M + 2 * (S - 1)))


def test_interleaved_peak_activations():
    """Full backwards (Megatron): device d holds its warm-up forwards plus one:
    min(2*(S-d-1) + (v-1)*S + 1, v*M) chunk activations; on device 0 that is v*S + S - 1
    chunks, i.e. S*(1 + (S-1)/(v*S)) stages' worth (Korthikanti et al. 2022). Split (the
    default): the shorter warm-up (v-1)g + S-d-1 gives min((v-1)g + S - d, v*M), no more
    than v*S on device 0 when S divides M."""
    for S, M in grid():
        g = max(basic.rounds(S, M))
        for v in (2, 3):
            split = schedules.get("interleaved_1f1b", S, M, virtual_stages=v).peak_activations()
            assert split == tuple(min((v - 1) * g + S - d, v * M) for d in range(S))
            if M % S:
                continue
            assert split[0] <= v * S
            full = schedules.get("interleaved_1f1b", S, M, virtual_stages=v, split_backward=False)
            peak = full.peak_activations()
            assert peak == tuple(min(2 * (S - d - 1) + (v - 1) * S + 1, v * M) for d in range(S))
            assert peak[0] == min(v * S + S - 1, v * M)
            assert all(a <= b for a, b in zip(split, peak, strict=True))


def test_interleaved_with_one_chunk_is_1f1b():
    for S, M in grid():
        for split in (True, False):
            one = schedules.get("interleaved_1f1b", S, M, virtual_stages=1, split_backward=split)
            assert one.ticks == schedules.get("1f1b", S, M, split_backward=split).ticks


def test_interleaved_placement_and_order():
    schedule = schedules.get("interleaved_1f1b", 4, 8, virtual_stages=2)
    assert schedule.stage_device == (0, 1, 2, 3, 0, 1, 2, 3)
    first = [a for row in schedule.ticks for a in row[0] if a.op == F][:8]
    # forwards in groups of S micro-batches, chunk by chunk within the group
    assert [(a.stage, a.microbatch) for a in first] == [(0, m) for m in range(4)] + [
        (4, m) for m in range(4)
    ]


def test_circular_bubble_and_memory():
    """Fill and drain are paid once for r passes: with M >= S the bubble is (S-1)/(r*M+S-1).

    With M < S a micro-batch comes back to device d after S ticks, so each pass costs S ticks:
    makespan 2*(r*max(M, S) + min(M, S) - 1) ticks for 2*r*M busy ones.
    """
    for S, M in grid():
        for r in (1, 2, 3):
            schedule = schedules.get("circular", S, M, repeats=r)
            assert schedule.stage_device == tuple(s % S for s in range(S * r))
            assert schedule.num_ticks == 2 * (r * max(M, S) + min(M, S) - 1)
            bubble = schedules.bubble_fraction(schedule, UNIT).lockstep
            if M >= S:
                assert bubble == pytest.approx((S - 1) / (r * M + S - 1), abs=1e-12)
            else:
                assert bubble == pytest.approx(1 - r * M / (r * S + M - 1), abs=1e-12)
            assert schedule.peak_activations() == (r * M,) * S


def test_circular_with_one_repeat_is_gpipe():
    for S, M in grid():
        assert (
            schedules.get("circular", S, M, repeats=1).ticks == schedules.get("gpipe", S, M).ticks
        )


# ----------------------------------------------------------------------------- simulator


def test_simulated_gpipe_makespans_with_communication():
    """GPipe by hand: lock-step ticks are (M+S-1) forward + (M+S-1) backward, all but the last
    of each phase send across devices; ideal: the last micro-batch leaves device 0 at M*f, then
    S-1 hops of f+c, then M backwards, then S-1 hops of b+c."""
    for S, M in [(2, 1), (2, 3), (4, 4), (4, 9), (8, 3)]:
        schedule = schedules.get("gpipe", S, M)
        for f, b, c in [(1.0, 2.0, 0.0), (1.5, 2.5, 0.25), (2.0, 1.0, 1.0)]:
            costs = Costs(forward=f, full_backward=b, communication=c)
            lockstep = simulate(schedule, costs, "lockstep")
            ideal = simulate(schedule, costs, "ideal")
            assert lockstep.makespan == pytest.approx((M + S - 1) * (f + b) + 2 * (M + S - 2) * c)
            assert ideal.makespan == pytest.approx(M * (f + b) + (S - 1) * (f + b + 2 * c))


def test_1f1b_ideal_makespan_and_price_of_lockstep():
    """With F != BW the ideal keeps 1F1B's (S-1)*(f+b) bubble (Narayanan et al. 2021), while a
    lock-step tick that mixes F and BW lasts as long as BW."""
    for S, M in grid():
        schedule = schedules.get("1f1b", S, M, split_backward=False)
        costs = Costs(forward=1.0, full_backward=2.0)
        ideal = simulate(schedule, costs, "ideal")
        assert ideal.makespan == pytest.approx((M + S - 1) * 3.0)
        report = schedules.bubble_fraction(schedule, costs)
        assert report.ideal == pytest.approx((S - 1) / (M + S - 1))
        if S > 1 and M > 1:
            assert report.lockstep > report.ideal


def test_split_backward_costs():
    costs = Costs(forward=1, backward_input=2, backward_weight=3)
    assert costs.of(Action(BW, 0, 0)) == 5
    assert Costs(full_backward=1.5).of(Action(BW, 0, 0)) == 1.5
    assert (costs.of(Action(B, 0, 0)), costs.of(Action(W, 0, 0))) == (2, 3)


def test_simulator_rejects_bad_input():
    with pytest.raises(ValueError, match=r"mode must be one of .*got 'fast'"):
        simulate(schedules.get("gpipe", 2, 2), mode="fast")
    with pytest.raises(ValueError, match=r"Costs.forward must be finite and >= 0, got -1"):
        Costs(forward=-1)


def test_lockstep_two_action_cell_costs_the_sum():
    """A cell with F and BW (DualPipeV-style pair) lasts F + BW; the other device idles."""
    ticks = (
        ((Action(F, 0, 0),), ()),
        ((Action(F, 0, 1),), (Action(F, 1, 0),)),
        ((), (Action(F, 1, 1), Action(BW, 1, 0))),
        ((Action(BW, 0, 0),), (Action(BW, 1, 1),)),
        ((Action(BW, 0, 1),), ()),
    )
    schedule = schedules.validate(Schedule("pairs", 2, 2, (0, 1), ticks, max_actions_per_tick=2))
    timeline = simulate(schedule, Costs(forward=1, full_backward=2), "lockstep")
    assert timeline.makespan == 1 + 1 + (1 + 2) + 2 + 2
    pair = [e for e in timeline.events if e.tick == 2]
    assert [(e.start, e.end) for e in pair] == [(2, 3), (3, 5)]


# ---------------------------------------------------------------- hand-made invalid tables


def table(cells, S=2, M=1, stage_device=(0, 1), max_actions=1):
    """A `Schedule` from ``cells[t][d]``: an Action, a tuple of Actions, or None."""
    rows = tuple(
        tuple(() if c is None else (c,) if isinstance(c, Action) else tuple(c) for c in row)
        for row in cells
    )
    return Schedule("hand", S, M, tuple(stage_device), rows, max_actions)


GOOD = [
    [Action(F, 0, 0), None],
    [None, Action(F, 1, 0)],
    [None, Action(BW, 1, 0)],
    [Action(BW, 0, 0), None],
]


def test_hand_made_valid_table_passes():
    schedules.validate(table(GOOD))


@pytest.mark.parametrize(
    "cells, kwargs, tick, device, rule",
    [
        pytest.param(GOOD[:3], {}, 2, 0, "complete", id="missing-backward"),
        pytest.param(
            [GOOD[0], [None, Action(BW, 1, 0)], [None, Action(F, 1, 0)], GOOD[3]],
            {},
            1,
            1,
            "dependency",
            id="backward-before-forward",
        ),
        pytest.param(
            [[(Action(F, 0, 0), Action(F, 0, 1)), None]] + GOOD[1:],
            {"M": 2},
            0,
            0,
            "one slot",
            id="two-actions-one-slot",
        ),
        pytest.param(
            [[(Action(F, 0, 0), Action(F, 0, 1)), None]] + GOOD[1:],
            {"M": 2, "max_actions": 2},
            0,
            0,
            "one slot",
            id="two-forwards-in-a-pair-slot",
        ),
        pytest.param(
            [GOOD[0], [Action(F, 1, 0), None]] + GOOD[2:], {}, 1, 0, "placement", id="wrong-device"
        ),
        pytest.param(
            GOOD[:2] + [[None, Action(W, 1, 0)], [None, Action(B, 1, 0)], [Action(BW, 0, 0), None]],
            {},
            2,
            1,
            "dependency",
            id="W-before-B",
        ),
        pytest.param(GOOD + [[Action(BW, 0, 0), None]], {}, 4, 0, "exactly once", id="twice"),
    ],
)
def test_hand_made_invalid_tables_are_rejected(cells, kwargs, tick, device, rule):
    with pytest.raises(ValueError) as caught:
        schedules.validate(table(cells, **kwargs))
    message = str(caught.value)
    assert f"at tick {tick}, device {device}: rule '{rule}' violated" in message
    assert "dev 0" in message and "dev 1" in message and "tick " in message  # the grid
    grid_rows = message.splitlines()
    marked = [line for line in grid_rows if line.startswith(f"dev {device}")]
    assert ">" in marked[0], message


def test_more_than_two_actions_per_cell_are_refused():
    # The executor runs one forward and one backward per cell: with max_actions_per_tick=3,
    # a cell of two forwards and a backward passed and lost a forward (wrong loss).
    cells = [
        [Action(F, 0, 0), None],
        [Action(F, 0, 1), Action(F, 1, 0)],
        [Action(F, 0, 2), None],
        [None, (Action(F, 1, 1), Action(F, 1, 2), Action(BW, 1, 0))],
        [Action(BW, 0, 0), Action(BW, 1, 1)],
        [Action(BW, 0, 1), Action(BW, 1, 2)],
        [Action(BW, 0, 2), None],
    ]
    with pytest.raises(ValueError, match=r"max_actions_per_tick=3, but a cell runs one action"):
        schedules.validate(table(cells, M=3, max_actions=3))
    text = schedules.to_csv(schedules.get("1f1b", 2, 2)).replace(
        "# max_actions_per_tick: 1", "# max_actions_per_tick: 3"
    )
    with pytest.raises(ValueError, match=r"line 6: max_actions_per_tick must be 1 or 2"):
        schedules.from_csv_text(text)


def test_a_table_of_the_wrong_shape_is_refused_by_name():
    # stage_device=() passed (v=0) and the Pipeline failed with an IndexError; a bare Action
    # as a cell was iterated field by field and failed with an AttributeError.
    with pytest.raises(ValueError, match=r"stage_device=\(\), no logical stages; .*\(0, 1\)"):
        schedules.validate(Schedule("empty", 2, 1, (), ((), ())))
    ticks = tuple(tuple(c if isinstance(c, Action) else () for c in row) for row in GOOD)
    with pytest.raises(
        ValueError, match=r"the cell of tick 0, device 0 is Action\(op='F'.*not a tuple of Actions"
    ):
        schedules.validate(Schedule("bare", 2, 1, (0, 1), ticks))


def test_an_activation_limit_of_another_length_is_refused():
    # A shorter list failed with an IndexError; a longer one was cut short silently.
    for limit in ([4], (4, 4, 4)):
        with pytest.raises(ValueError, match=r"has \d entries, but schedule '1f1b' has 2 devices"):
            schedules.validate(schedules.get("1f1b", 2, 2), limit)


# --------------------------------------------------------------------- property test


def _cost_per_microbatch(costs):
    return costs.forward + costs.backward_input + costs.backward_weight


def _check_timeline(schedule, timeline, costs):
    """Independent checks: no overlap on a device, every input ready before use."""
    where = {}
    for e in timeline.events:
        where[(e.action.op, e.action.stage, e.action.microbatch)] = e
    for d in range(schedule.num_stages):
        spans = sorted((e.start, e.end) for e in timeline.events if e.device == d)
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:], strict=False))
    last = schedule.num_logical_stages - 1
    for e in timeline.events:
        op, stage, m = e.action.op, e.action.stage, e.action.microbatch
        if op == F:
            inputs = [where[(F, stage - 1, m)]] if stage > 0 else []
        elif op == W:
            inputs = [where[(B, stage, m)]]
        else:
            inputs = [where[(F, stage, m)]]
            if stage < last:
                inputs.append(where.get((B, stage + 1, m)) or where[(BW, stage + 1, m)])
        for dep in inputs:
            delay = costs.communication if dep.device != e.device else 0.0
            assert dep.end + delay <= e.start + 1e-9, (dep, e)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=15, deadline=None)
@given(
    S=st.integers(1, 6),
    M=st.integers(1, 16),
    v=st.integers(1, 3),
    f=st.integers(1, 4),
    b=st.integers(1, 4),
    w=st.integers(1, 4),
    c=st.sampled_from([0.0, 0.5, 2.0]),
)
def test_property_every_generator(name, S, M, v, f, b, w, c):
    try:
        schedule = build(name, S, M, v)
    except ValueError as error:
        assert is_refusal(error), f"{name} S={S} M={M} v={v}: {error}"
        return
    schedules.validate(schedule)
    costs = Costs(forward=f, backward_input=b, backward_weight=w, communication=c)
    runs = {mode: simulate(schedule, costs, mode) for mode in ("lockstep", "neighbour", "ideal")}
    for timeline in runs.values():
        for d in range(S):
            expected = M * len(schedule.device_stages(d)) * _cost_per_microbatch(costs)
            assert timeline.busy[d] == pytest.approx(expected)
        _check_timeline(schedule, timeline, costs)
        assert 0 <= timeline.bubble < 1
    assert runs["ideal"].makespan <= runs["lockstep"].makespan + 1e-9
    assert runs["ideal"].makespan <= runs["neighbour"].makespan + 1e-9
    assert runs["neighbour"].makespan <= runs["lockstep"].makespan + 1e-9
    report = schedules.bubble_fraction(schedule, costs)
    assert report == (runs["lockstep"].bubble, runs["ideal"].bubble, runs["neighbour"].bubble)


@pytest.mark.parametrize("S", [1, 2, 3, 4, 8])
def test_overlapped_1f1b_has_no_lockstep_penalty(S):
    """1f1b(overlap=True): F and BW share a tick, so lock-step equals the ideal timeline and
    the closed form (S-1)/(M+S-1) for any F:BW, at up to 2(S-d) activations on device d."""
    for M in sorted({1, S, S + 1, 2 * S, 4 * S, 8 * S}):
        overlapped = schedules.get("1f1b", S, M, overlap=True)
        plain = schedules.get("1f1b", S, M, split_backward=False)
        assert overlapped.max_actions_per_tick == 2
        assert overlapped.peak_activations() == tuple(min(2 * (S - d), M) for d in range(S))
        for costs in (Costs(forward=1, full_backward=1), Costs(forward=1, full_backward=2)):
            expected = (S - 1) / (M + S - 1)
            report = schedules.bubble_fraction(overlapped, costs)
            assert report.lockstep == pytest.approx(expected) == report.ideal
            assert schedules.bubble_fraction(plain, costs).lockstep >= report.lockstep - 1e-12
