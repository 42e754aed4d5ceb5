"""PipeDream and PipeDream-2BW as tables: validity, weight versions, update points."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpipe.schedules import BW, F, get
from jaxpipe.schedules.pipedream import update_points, validate_versions, weight_versions

STAGES = (1, 2, 3, 4, 8)


def grid():
    for S in STAGES:
        for M in sorted({1, S, S + 1, 2 * S, 4 * S, 8 * S}):
            yield S, M


def steady_state_size(S, d):
    """The fewest micro-batches for device ``d`` of ``pipedream`` to hold ``S-d`` versions."""
    return 2 * (S - d) - 1


def ticks_of(schedule):
    """(op, stage, micro-batch) -> (tick, version)."""
    return {(a.op, a.stage, a.microbatch): (t, a.version) for t, _, a in schedule.timed_actions()}


def expected_update_ticks(schedule, interval):
    """Per stage, the ticks of the BW of the last micro-batch of each group, in group order."""
    when = ticks_of(schedule)
    M = schedule.num_microbatches
    return [
        [when[(BW, s, min(start + interval, M) - 1)][0] for start in range(0, M, interval)]
        for s in range(schedule.num_stages)
    ]


def check_versions_read(schedule, interval):
    """F reads the number of updates of its stage in earlier ticks; BW reads its F's version."""
    updates = expected_update_ticks(schedule, interval)
    when = ticks_of(schedule)
    for s in range(schedule.num_stages):
        for m in range(schedule.num_microbatches):
            t_f, v_f = when[(F, s, m)]
            assert v_f == sum(u < t_f for u in updates[s]), (s, m)
            assert when[(BW, s, m)][1] == v_f, (s, m)


def check_same_order_as_1f1b(schedule):
    reference = get("1f1b", schedule.num_stages, schedule.num_microbatches)
    strip = [[tuple(a._replace(version=0) for a in cell) for cell in row] for row in schedule.ticks]
    assert strip == [list(row) for row in reference.ticks]


@pytest.mark.parametrize("S,M", list(grid()))
def test_pipedream_grid(S, M):
    schedule = get("pipedream", S, M)
    assert schedule is validate_versions(schedule)
    check_same_order_as_1f1b(schedule)
    check_versions_read(schedule, interval=1)
    for _, _, a in schedule.timed_actions():
        if a.op == F:  # warm-up forwards read version 0, then one newer per forward
            assert a.version == max(0, a.microbatch - (S - a.stage - 1))
    versions = weight_versions(schedule)
    for d in range(S):
        assert versions[d] <= min(S - d, M)
        if steady_state_size(S, d) <= M:
            assert versions[d] == S - d
    assert schedule.peak_activations() == tuple(min(S - d, M) for d in range(S))


@pytest.mark.parametrize("S,M", list(grid()))
@pytest.mark.parametrize("extra", [None, 0, 1, 3])
def test_pipedream_2bw_grid(S, M, extra):
    options = {} if extra is None else {"update_interval": S + extra}
    G = S if extra is None else S + extra
    schedule = get("pipedream_2bw", S, M, **options)
    assert schedule is validate_versions(schedule)
    assert dict(schedule.options)["update_interval"] == G
    check_same_order_as_1f1b(schedule)
    check_versions_read(schedule, interval=G)
    for _, _, a in schedule.timed_actions():
        if a.op == F:
            assert a.version == max(0, a.microbatch - (S - a.stage - 1)) // G
    versions = weight_versions(schedule)
    for d in range(S):
        # two versions exactly where an update happens while a micro-batch is in flight
        assert versions[d] == (2 if d < S - 1 and M > G else 1)


@pytest.mark.parametrize("name,options", [("pipedream", {}), ("pipedream_2bw", {})])
def test_update_points_are_the_group_ends(name, options):
    S, M = 4, 11
    schedule = get(name, S, M, **options)
    G = 1 if name == "pipedream" else S
    points = update_points(schedule)
    assert len(points) == S
    for s, row in enumerate(points):
        groups = [group for _, group in row]
        assert groups == [tuple(range(k, min(k + G, M))) for k in range(0, M, G)]
        assert [tick for tick, _ in row] == expected_update_ticks(schedule, G)[s]


def test_2bw_gradients_are_at_most_one_version_stale():
    for S, M in grid():
        schedule = get("pipedream_2bw", S, M)
        when = ticks_of(schedule)
        for s, row in enumerate(update_points(schedule)):
            for k, (_, group) in enumerate(row):  # the k-th update turns version k into k+1
                read = {when[(F, s, m)][1] for m in group}
                assert read <= {max(k - 1, 0), k}, (S, M, s, k, read)


def test_synchronous_schedules_have_one_version_and_one_update():
    for name in ("gpipe", "1f1b"):
        schedule = get(name, 4, 6)
        assert weight_versions(schedule) == (1, 1, 1, 1)
        assert [[group for _, group in row] for row in update_points(schedule)] == [
            [tuple(range(6))]
        ] * 4


@pytest.mark.parametrize("bad", [0, 1, 3, -4, 4.0, True, "4"])
def test_2bw_rejects_update_interval_below_num_stages(bad):
    with pytest.raises(ValueError, match=r"update_interval=.* must be an int >= num_stages \(4\)"):
        get("pipedream_2bw", 4, 8, update_interval=bad)


def _replace_action(schedule, op, stage, microbatch, version):
    rows = [
        tuple(
            tuple(
                a._replace(version=version)
                if (a.op, a.stage, a.microbatch) == (op, stage, microbatch)
                else a
                for a in cell
            )
            for cell in row
        )
        for row in schedule.ticks
    ]
    return dataclasses.replace(schedule, ticks=tuple(rows))


def test_validate_versions_rejects_wrong_versions():
    schedule = get("pipedream", 3, 6)
    version = ticks_of(schedule)[(F, 0, 4)][1]
    assert version > 0
    stale_forward = _replace_action(schedule, F, 0, 4, version - 1)
    with pytest.raises(ValueError, match="newest version of stage 0"):
        validate_versions(stale_forward)
    unstashed_backward = _replace_action(schedule, BW, 0, 4, version + 1)
    with pytest.raises(ValueError, match="its forward read version"):
        validate_versions(unstashed_backward)


@settings(max_examples=40, deadline=None)
@given(
    S=st.integers(1, 8),
    M=st.integers(1, 40),
    extra=st.integers(0, 5),
)
def test_property_random_sizes(S, M, extra):
    G = S + extra
    dream = get("pipedream", S, M)
    two = get("pipedream_2bw", S, M, update_interval=G)
    for schedule, interval in ((dream, 1), (two, G)):
        validate_versions(schedule)
        check_versions_read(schedule, interval)
        assert sum(len(group) for _, group in update_points(schedule)[0]) == M
    dream_versions, two_versions = weight_versions(dream), weight_versions(two)
    for d in range(S):
        assert dream_versions[d] <= min(S - d, M)
        if steady_state_size(S, d) <= M:
            assert dream_versions[d] == S - d
        assert 1 <= two_versions[d] <= 2
