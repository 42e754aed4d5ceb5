"""Lock-step against ideal, for every registered schedule: its default table runs in
lock-step (as the executor runs it) within 2 percentage points of its own ideal bubble, at
the default costs (F = B = W = 1, BW = 2), for S in {2, 4, 8} and M in {S, 2S, 4S, 8S}
wherever the schedule takes that M; and holds at most one activation per device more than
the schedule's published table (the paper's or upstream's), whose peak (`published_peak`)
comes from its published formula, not from a table. Where the default table differs from
the published one, the options in `PUBLISHED` build the published table, and its peak is
checked against the formula.
"""

import pytest

from jaxpipe import schedules
from jaxpipe.schedules import Costs, F, W, basic

BOUND = 0.02
GRID = [(S, k * S) for S in (2, 4, 8) for k in (1, 2, 4, 8)]
# The options that build the published table where the default differs from it.
PUBLISHED = {
    "1f1b": {"split_backward": False},
    "interleaved_1f1b": {"split_backward": False},
    "pipedream": {"split_backward": False},
    "pipedream_2bw": {"split_backward": False},
    "dualpipev": {"overlap": True},
}


def default_or_none(name, S, M, **options):
    try:
        return schedules.get(name, S, M, **options)
    except ValueError:
        return None


@pytest.mark.parametrize("name", schedules.names())
def test_lockstep_within_two_points_of_ideal(name):
    built = 0
    for S, M in GRID:
        table = default_or_none(name, S, M)
        if table is None:
            continue
        built += 1
        report = schedules.bubble_fraction(table, Costs())
        assert report.lockstep - report.ideal <= BOUND, (name, S, M, report)
    assert built >= 9


def published_peak(name, S, M):
    """Per device, the activations the published table of ``name`` holds at its peak (or,
    where the paper gives only the largest, that bound on every device), from the published
    formulas at the default options, for ``M`` a multiple of ``S``: computed here, not read
    off a table."""
    v = 2  # virtual_stages, repeats: the defaults
    per_device = {
        "gpipe": lambda d: M,  # every forward before the first backward
        "circular": lambda d: v * M,
        # 1F1B with full backwards (Narayanan et al., 2021): S-d in flight on device d
        "1f1b": lambda d: min(S - d, M),
        "pipedream": lambda d: min(S - d, M),
        "pipedream_2bw": lambda d: min(S - d, M),
        # Megatron's interleaved table: a warm-up of (v-1)S + 2(S-d-1) forwards, plus one
        "interleaved_1f1b": lambda d: min((v - 1) * S + 2 * (S - d - 1) + 1, v * M),
        "zb_h1": lambda d: min(S, M),
        "zb_h2": lambda d: min(2 * S - 1, M),
        "zbv": lambda d: 2 * S,
        "interleaved_zb": lambda d: min(v * S, v * M),
        "dualpipev": lambda d: 2 * S + 1,
    }[name]
    return [per_device(d) for d in range(S)]


def memory_overruns(name, table):
    """``(device, peak, bound)`` for every device of ``table`` that holds more than one
    activation over the published table's peak (`published_peak`)."""
    bound = published_peak(name, table.num_stages, table.num_microbatches)
    peaks = table.peak_activations()
    return [(d, peaks[d], bound[d] + 1) for d in range(table.num_stages) if peaks[d] > bound[d] + 1]


def test_every_schedule_has_a_published_peak():
    assert {name for name in schedules.names() if published_peak(name, 2, 4)} == set(
        schedules.names()
    )


@pytest.mark.parametrize("name", schedules.names())
def test_memory_at_most_one_more_than_the_published_table(name):
    for S, M in GRID:
        table = default_or_none(name, S, M)
        if table is None:
            continue
        assert not memory_overruns(name, table), (name, S, M, memory_overruns(name, table))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_published_tables_hold_what_the_formulas_say(name):
    """The options build the published tables: their peaks are the formulas'."""
    for S, M in GRID:
        published = default_or_none(name, S, M, **PUBLISHED[name])
        if published is not None:
            peaks, formula = list(published.peak_activations()), published_peak(name, S, M)
            assert all(p <= f for p, f in zip(peaks, formula, strict=True)), (name, S, M)
            if name != "dualpipev":  # its formula is a bound; the others are exact
                assert peaks == formula, (name, S, M)


def one_f_one_b_with(S, M, *, extra_warmup=0, late_weights=0):
    """The default `1f1b` table of ``S`` and ``M``, with device 0 changed for the worse:
    ``extra_warmup`` more forwards before its first backward, and its first
    ``late_weights`` W's run last (each keeps its micro-batch's activation alive)."""
    orders = basic.one_f_one_b_orders(S, M, split_backward=True)
    warmup = [a for a in orders[0] if a.op == F][: S + extra_warmup]
    late = [a for a in orders[0] if a.op == W][:late_weights]
    orders[0] = warmup + [a for a in orders[0] if a not in warmup + late] + late
    return schedules.validate(schedules.pack("1f1b", S, M, list(range(S)), orders))


def test_the_memory_check_rejects_tables_that_hold_more():
    assert one_f_one_b_with(4, 16).ticks == schedules.get("1f1b", 4, 16).ticks
    assert not memory_overruns("1f1b", one_f_one_b_with(4, 16))
    assert not memory_overruns("1f1b", one_f_one_b_with(4, 16, extra_warmup=1))  # one more
    assert memory_overruns("1f1b", one_f_one_b_with(4, 16, extra_warmup=2)) == [(0, 6, 5)]
    assert memory_overruns("1f1b", one_f_one_b_with(4, 16, late_weights=2)) == [(0, 6, 5)]
    gpipe = schedules.get("gpipe", 4, 16)  # every device holds all 16
    assert [d for d, _, _ in memory_overruns("zb_h1", gpipe)] == [0, 1, 2, 3]


def test_the_published_tables_miss_the_bound():
    """The published tables the options build run in lock-step more than 5 points above
    their ideal bubble, which the default tables stay within 2 points of."""
    for name, options in PUBLISHED.items():
        report = schedules.bubble_fraction(schedules.get(name, 4, 16, **options))
        assert report.lockstep - report.ideal > 0.05, (name, report)
    report = schedules.bubble_fraction(schedules.get("1f1b", 8, 32, split_backward=False))
    assert (round(report.lockstep, 3), round(report.ideal, 3)) == (0.351, 0.179)


def test_unequal_costs_are_reported_not_bounded():
    """At F:B:W = 1:1.2:0.8 a tick lasts as long as its slowest action, so tables whose ticks
    mix F, B and W pay in lock-step; fused F+BW ticks (1f1b overlap=True) do not. The
    benchmark (benchmarks/bubble.py) prints these figures; here only their direction."""
    costs = Costs(forward=1, backward_input=1.2, backward_weight=0.8)
    split = schedules.bubble_fraction(schedules.get("1f1b", 4, 32), costs)
    fused = schedules.bubble_fraction(schedules.get("1f1b", 4, 32, overlap=True), costs)
    assert split.lockstep > split.ideal + 0.1
    assert fused.lockstep == pytest.approx(fused.ideal)
