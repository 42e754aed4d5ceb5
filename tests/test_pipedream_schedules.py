"""PipeDream and PipeDream-2BW as tables: validity, weight versions, update points."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpipe.schedules import (
    BW,
    Action,
    F,
    Schedule,
    U,
    W,
    from_csv_text,
    get,
    to_csv,
    update_points,
    validate,
    weight_versions,
)
from jaxpipe.schedules.display import to_text
from jaxpipe.schedules.pipedream import validate_versions

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


def last_backward_op(schedule):
    """W for a split backward (the default), BW for full backwards."""
    return W if dict(schedule.options)["split_backward"] else BW


def expected_update_ticks(schedule, interval):
    """Per stage, the ticks of the last backward (W or BW) of the last micro-batch of each
    group, in group order."""
    when = ticks_of(schedule)
    M = schedule.num_microbatches
    op = last_backward_op(schedule)
    return [
        [when[(op, s, min(start + interval, M) - 1)][0] for start in range(0, M, interval)]
        for s in range(schedule.num_stages)
    ]


def check_versions_read(schedule, interval):
    """F reads the number of updates of its stage in earlier ticks; backwards read their F's;
    the table's U's stand exactly at the group ends."""
    updates = expected_update_ticks(schedule, interval)
    when = ticks_of(schedule)
    for s in range(schedule.num_stages):
        for m in range(schedule.num_microbatches):
            t_f, v_f = when[(F, s, m)]
            assert v_f == sum(u < t_f for u in updates[s]), (s, m)
            assert when[(last_backward_op(schedule), s, m)][1] == v_f, (s, m)
    u_ticks = [[] for _ in range(schedule.num_stages)]
    for t, d, a in schedule.timed_updates():
        assert a.op == U and d == a.stage and a.version == len(u_ticks[a.stage])
        u_ticks[a.stage].append(t)
    assert u_ticks == updates


def check_same_order_as_1f1b(schedule):
    split = dict(schedule.options)["split_backward"]
    reference = get("1f1b", schedule.num_stages, schedule.num_microbatches, split_backward=split)
    strip = [
        [tuple(a._replace(version=0) for a in cell if a.op != U) for cell in row]
        for row in schedule.ticks
    ]
    assert strip == [list(row) for row in reference.ticks]


@pytest.mark.parametrize("S,M", list(grid()))
@pytest.mark.parametrize("split", [True, False])
def test_pipedream_grid(S, M, split):
    schedule = get("pipedream", S, M, split_backward=split)
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
    if split:  # the same versions (and so the same training) as with full backwards
        full = get("pipedream", S, M, split_backward=False)
        assert sorted(ticks_of(schedule).items()) != sorted(ticks_of(full).items())
        assert {k[1:]: v[1] for k, v in ticks_of(schedule).items() if k[0] == F} == {
            k[1:]: v[1] for k, v in ticks_of(full).items() if k[0] == F
        }
        assert weight_versions(full) == versions


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
        assert not schedule.has_updates
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
    unstashed_backward = _replace_action(schedule, W, 0, 4, version + 1)
    with pytest.raises(ValueError, match="its forward read version"):
        validate_versions(unstashed_backward)
    with pytest.raises(ValueError, match="rule 'version' violated"):
        validate(unstashed_backward)  # every table's versions are checked
    synchronous = get("1f1b", 3, 6)
    with pytest.raises(ValueError, match="newest version of stage 0 at that tick is 0"):
        validate(_replace_action(synchronous, F, 0, 2, 1))


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


# ------------------------------------------------------------------- updates as data
def _cells(schedule, change):
    """``schedule`` with ``change(tick, device, cell) -> cell`` applied to every cell."""
    rows = tuple(
        tuple(change(t, d, cell) for d, cell in enumerate(row))
        for t, row in enumerate(schedule.ticks)
    )
    return dataclasses.replace(schedule, ticks=rows)


@pytest.mark.parametrize(
    "name,options", [("pipedream", {}), ("pipedream_2bw", {"update_interval": 5})]
)
def test_updates_survive_csv_under_another_name(name, options):
    """Behaviour comes from the table: a PipeDream table loaded as "custom" updates alike."""
    schedule = get(name, 4, 11, **options)
    assert schedule.has_updates
    text = to_csv(schedule).replace(f"# name: {name}", "# name: renamed")
    text = text.replace("# options:", "# nothing:")  # no options either
    text = "\n".join(line for line in text.splitlines() if not line.startswith("# nothing"))
    loaded = from_csv_text(text)
    assert loaded.name == "renamed" and loaded.options == ()
    assert update_points(loaded) == update_points(schedule)
    assert weight_versions(loaded) == weight_versions(schedule)
    assert list(loaded.actions(include_updates=True)) == list(
        schedule.actions(include_updates=True)
    )
    assert "U" in {line.split(",")[2] for line in text.splitlines()[9:]}


def test_actions_leave_out_updates_unless_asked():
    schedule = get("pipedream", 3, 5)
    compute = list(schedule.actions())
    every = list(schedule.actions(include_updates=True))
    assert U not in {a.op for a in compute}
    assert len(every) - len(compute) == 3 * 5 == len(schedule.timed_updates())
    assert schedule.splits_backward


def test_add_updates_every_step_is_synchronous_training():
    """One U per stage after its last backward: the same points as a table without U's."""
    from jaxpipe.schedules import add_updates

    for name in ("1f1b", "zb_h1", "interleaved_1f1b"):
        plain = get(name, 4, 8)
        with_u = validate(add_updates(plain, every=8))
        assert with_u.has_updates and not plain.has_updates
        assert update_points(with_u) == update_points(plain)
        assert all(a.version == 0 for a in with_u.actions())


@pytest.mark.parametrize(
    "change, rule, match",
    [
        pytest.param(
            lambda t, d, c: c + (Action(U, d, 0),) if (t, d) == (0, 0) else c,
            "update",
            "has no weight gradient",
            id="U-before-any-gradient",
        ),
        pytest.param(
            lambda t, d, c: tuple(a for a in c if a.op != U) if t >= 24 else c,
            "update",
            "after its last U",
            id="gradient-left-after-last-U",
        ),
        pytest.param(
            lambda t, d, c: c + (Action(U, d, 0, 99),) if c and c[-1].op == U else c,
            "one slot",
            "at most one U",
            id="two-U-in-a-cell",
        ),
        pytest.param(
            lambda t, d, c: (c[-1],) + c[:-1] if c and c[-1].op == U else c,
            "one slot",
            "at most one U, last",
            id="U-not-last",
        ),
        pytest.param(
            lambda t, d, c: c[:-1] + (c[-1]._replace(microbatch=1),) if c and c[-1].op == U else c,
            "in range",
            "a U has micro-batch 0",
            id="U-with-a-microbatch",
        ),
    ],
)
def test_validator_rejects_bad_updates(change, rule, match):
    schedule = get("pipedream", 2, 8)
    assert schedule.num_ticks > 20
    with pytest.raises(ValueError, match=f"rule '{rule}' violated: .*{match}"):
        validate(_cells(schedule, change))


def test_validator_rejects_a_U_with_the_wrong_version():
    schedule = get("pipedream_2bw", 2, 8)
    (t, d, first), *_ = schedule.timed_updates()
    wrong = _cells(
        schedule,
        lambda tt, dd, c: c[:-1] + (first._replace(version=3),) if (tt, dd) == (t, d) else c,
    )
    with pytest.raises(ValueError, match="a U's version is its index"):
        validate(wrong)


def test_hand_written_update_table():
    """One stage, two micro-batches, an update after each: the second forward reads v1."""
    ticks = (
        ((Action(F, 0, 0),),),
        ((Action(BW, 0, 0), Action(U, 0, 0, 0)),),
        ((Action(F, 0, 1, 1),),),
        ((Action(BW, 0, 1, 1), Action(U, 0, 0, 1)),),
    )
    schedule = validate(Schedule("hand", 1, 2, (0,), ticks))
    assert update_points(schedule) == [[(1, (0,)), (3, (1,))]]
    assert weight_versions(schedule) == (1,)
    assert to_text(schedule).split("\n")[1].split() == ["dev", "0", "F0", "BW0+U", "F1", "BW1+U"]
