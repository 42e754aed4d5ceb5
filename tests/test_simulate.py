"""The neighbour mode of the simulator: a tick waits for the devices its ppermutes pair.

Checked by hand on small tables, and against the other two modes (ideal <= neighbour <=
lock-step) on every default table at random costs.
"""

import random

import pytest

from jaxpipe import schedules
from jaxpipe.schedules import Action, B, Costs, F, Schedule, W, simulate
from jaxpipe.schedules.simulate import channel_offsets, partners

MODES = ("ideal", "neighbour", "lockstep")


def table(cells, stage_device):
    """A validated one-micro-batch `Schedule` from ``cells[t][d]`` (an Action or None)."""
    rows = tuple(tuple(() if c is None else (c,) for c in row) for row in cells)
    S = len(stage_device)
    return schedules.validate(Schedule("hand", S, 1, tuple(stage_device), rows))


def one_microbatch(S, weights):
    """Forwards down ``S`` stages (ticks ``0 .. S-1``), then B's back up (ticks ``S .. 2S-1``);
    ``weights[t]`` lists the stages whose W runs in tick ``S + 1 + t``."""
    cells = [[None] * S for _ in range(max(2 * S, S + 1 + len(weights)))]
    for s in range(S):
        cells[s][s] = Action(F, s, 0)
        cells[2 * S - 1 - s][s] = Action(B, s, 0)
    for t, stages in enumerate(weights):
        for s in stages:
            cells[S + 1 + t][s] = Action(W, s, 0)
    return table(cells, list(range(S)))


def makespans(schedule, costs):
    return {mode: simulate(schedule, costs, mode).makespan for mode in MODES}


def test_three_devices_by_hand():
    """S = 3, one micro-batch; F = 1, B = 2, W = 3, a transfer 0.5. Ticks: F0, F1, F2, B2,
    (B1, W2), (B0, W1), W0. On a ring of three every device pairs with both others, so a tick
    waits for everyone: neighbour = lock-step = 1.5 + 1.5 + 1 + 2.5 + 3.5 + 3 + 3 = 16 (F2
    and B0 send nothing). The ideal: F's end at 1, 2.5, 4; B2 6, B1 8.5, B0 11, W0 14."""
    schedule = one_microbatch(3, [{2}, {1}, {0}])
    assert [[a.op for cell in row for a in cell] for row in schedule.ticks][4:] == [
        ["B", "W"],
        ["B", "W"],
        ["W"],
    ]
    assert partners(schedule) == ((1, 2), (0, 2), (0, 1))
    costs = Costs(forward=1, backward_input=2, backward_weight=3, communication=0.5)
    assert makespans(schedule, costs) == {"ideal": 14, "neighbour": 16, "lockstep": 16}


def test_four_devices_by_hand():
    """S = 4, one micro-batch; F = B = 1, W = 3. Ticks 0-4: F0..F3, B3; tick 5: B2, W3;
    tick 6: B1; tick 7: B0, W2; tick 8: W0, W1. Device d pairs with d +- 1 (mod 4), so
    devices 0 and 2 never wait for each other.

    Neighbour, tick starts per device: after tick 4 (5, 4, 5, 5); tick 5 cells end
    (5, 4, 6, 8), every device but 1 waits for 3: (8, 6, 8, 8); tick 6 ends 8 everywhere;
    tick 7 cells end (9, 8, 11, 8): device 0 waits only for 1 and 3, starts tick 8 at 9,
    the others at 11; tick 8: W1 ends at 14, W0 at 12, device 0 waits for device 1: 14.
    Lock-step: 5 + 3 + 1 + 3 + 3 = 15. Ideal: B0 ends at 8, W0 at 11."""
    schedule = one_microbatch(4, [{3}, set(), {2}, {0, 1}])
    assert partners(schedule) == ((1, 3), (0, 2), (1, 3), (0, 2))
    costs = Costs(forward=1, backward_input=1, backward_weight=3)
    assert makespans(schedule, costs) == {"ideal": 11, "neighbour": 14, "lockstep": 15}
    timeline = simulate(schedule, costs, "neighbour")
    last = {e.action: e for e in timeline.events if e.tick == 8}
    assert (last[Action(W, 0, 0)].start, last[Action(W, 1, 0)].start) == (9, 11)


def test_channels_come_from_the_placement():
    """Offsets are those over which a stage's result crosses, both ways, mod S."""
    line = Schedule("p", 4, 1, (0, 1, 2, 3), ())
    assert channel_offsets(line) == (1, 3)
    shuffled = Schedule("p", 4, 1, (0, 2, 1, 3), ())
    assert channel_offsets(shuffled) == (1, 2, 3)
    assert partners(shuffled) == ((1, 2, 3), (0, 2, 3), (0, 1, 3), (0, 1, 2))
    alone = Schedule("p", 2, 1, (0, 0, 1, 1), ())
    assert partners(alone) == ((1,), (0,))
    one = Schedule("p", 1, 1, (0, 0), ())
    assert partners(one) == ((),)
    v_shape = schedules.get("zbv", 8, 16)
    assert channel_offsets(v_shape) == (1, 7)
    assert partners(v_shape)[0] == (1, 7)


def default_tables():
    for name in schedules.names():
        for S, M in ((2, 4), (3, 6), (4, 8), (4, 16), (8, 16)):
            try:
                yield name, schedules.get(name, S, M)
            except ValueError:
                continue


@pytest.mark.parametrize("seed", range(3))
def test_neighbour_lies_between_ideal_and_lockstep(seed):
    """ideal <= neighbour <= lock-step on every default table at random costs."""
    rng = random.Random(seed)
    for name, schedule in default_tables():
        costs = Costs(
            forward=rng.uniform(0.5, 2),
            backward_input=rng.uniform(0.5, 2.5),
            backward_weight=rng.uniform(0.1, 2),
            communication=rng.choice([0.0, 0.3]),
        )
        runs = makespans(schedule, costs)
        assert runs["ideal"] <= runs["neighbour"] + 1e-9, name
        assert runs["neighbour"] <= runs["lockstep"] + 1e-9, name
        report = schedules.bubble_fraction(schedule, costs)
        assert report.ideal <= report.neighbour + 1e-12 <= report.lockstep + 2e-12, name


def test_all_three_agree_where_lockstep_is_ideal():
    """Where a default table's lock-step equals its ideal at unit costs, so does neighbour."""
    agreeing = 0
    for name, schedule in default_tables():
        report = schedules.bubble_fraction(schedule, Costs())
        if report.lockstep == pytest.approx(report.ideal):
            agreeing += 1
            assert report.neighbour == pytest.approx(report.lockstep), name
    assert agreeing >= 20


def test_neighbour_is_strictly_between_on_a_zero_bubble_table():
    """zbv at S = 4 with F:B:W = 1:1.6:0.6: devices 0 and 2 do not wait for each other."""
    report = schedules.bubble_fraction(schedules.get("zbv", 4, 16), Costs(1, 1.6, 0.6))
    assert report.ideal < report.neighbour < report.lockstep


def test_a_paired_tick_runs_each_actions_all_to_alls_behind_the_other():
    """One device, 1f1b at M = 4: F0 | F1+BW0 | F2+BW1 | F3+BW2 | BW3 with overlap=True, each
    action in its own tick without. F = 1, BW = 2, an F's all-to-alls 0.5, a BW's 1: alone an
    action takes both; a pair takes the larger of its computations (3) and its all-to-alls
    (1.5), and where the all-to-alls are the larger (2 + 3 > 3), they set the pair's time.
    A pair never takes less than either action alone: an action's all-to-alls wait for its
    own computation (F = 2 with all-to-alls of 2 takes 4 beside a BW of 1 + 1)."""
    paired = schedules.get("1f1b", 1, 4, overlap=True)
    apart = schedules.get("1f1b", 1, 4, overlap=False)
    hidden = Costs(1, 1, 1, all_to_all_forward=0.5, all_to_all_backward=1)
    exposed = Costs(1, 1, 1, all_to_all_forward=2, all_to_all_backward=3)
    for mode in ("lockstep", "neighbour", "ideal"):
        assert simulate(paired, hidden, mode).makespan == pytest.approx(1.5 + 3 * 3 + 3)
        assert simulate(apart, hidden, mode).makespan == pytest.approx(4 * 1.5 + 4 * 3)
        assert simulate(paired, exposed, mode).makespan == pytest.approx(3 + 3 * 5 + 5)
        assert simulate(apart, exposed, mode).makespan == pytest.approx(4 * 3 + 4 * 5)
    assert hidden.of(Action("BW", 0, 0)) == 3
    assert hidden.of_cell([Action(F, 0, 1), Action("BW", 0, 0)]) == 3
    assert exposed.of_cell([Action(F, 0, 1), Action("BW", 0, 0)]) == 5
    assert Costs(all_to_all_weight=0.5).of(Action(W, 0, 0)) == 1.5
    long_forward = Costs(2, 0.5, 0.5, all_to_all_forward=2, all_to_all_backward=1)
    assert long_forward.of_cell([Action(F, 0, 1), Action("BW", 0, 0)]) == 4


@pytest.mark.parametrize("seed", range(2))
def test_all_to_alls_keep_ideal_below_neighbour_below_lockstep(seed):
    """ideal <= neighbour <= lock-step with all-to-alls, on the default tables and the ones
    that pair a forward with a backward in a tick; the paired dualpipev is faster than the
    unpaired one once its all-to-alls weigh."""
    rng = random.Random(seed)
    paired = [("dualpipev", schedules.get("dualpipev", 4, 8, overlap=True))]
    paired += [("1f1b", schedules.get("1f1b", S, 8, overlap=True)) for S in (1, 4)]
    for name, schedule in [*default_tables(), *paired]:
        costs = Costs(
            forward=rng.uniform(0.5, 2),
            backward_input=rng.uniform(0.5, 2.5),
            backward_weight=rng.uniform(0.1, 2),
            communication=rng.choice([0.0, 0.3]),
            all_to_all_forward=rng.uniform(0, 1),
            all_to_all_backward=rng.uniform(0, 2),
            all_to_all_weight=rng.uniform(0, 1),
        )
        runs = makespans(schedule, costs)
        assert runs["ideal"] <= runs["neighbour"] + 1e-9, name
        assert runs["neighbour"] <= runs["lockstep"] + 1e-9, name
    costs = Costs(1, 1, 1, all_to_all_forward=0.5, all_to_all_backward=1, all_to_all_weight=0.5)
    apart = simulate(schedules.get("dualpipev", 4, 8), costs).makespan
    assert simulate(paired[0][1], costs).makespan < apart
