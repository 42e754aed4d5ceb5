"""jaxpipe's tables against PyTorch's, family by family (fixtures: no torch needed).

`benchmarks/pytorch_tables.py` exported the compute tables of ``torch.distributed.pipelining``
(2.13) for a grid of (S, M, v) to tests/data/pytorch/ in jaxpipe's CSV format: PyTorch's own
time steps where they are a valid lock-step table, else its per-rank order packed by jaxpipe,
whichever is faster. For every fixture, jaxpipe's default table of the same family must run
no slower in lock-step at the default costs (F = B = W = 1, BW = 2) and hold no more
activations on any device.
"""

import json
import pathlib
import re

import pytest

from jaxpipe import schedules
from jaxpipe.schedules import Costs, simulate

DATA = pathlib.Path(__file__).parent / "data" / "pytorch"
FIXTURES = sorted(DATA.glob("*.csv"))
NAME = re.compile(r"(\w+?)_S(\d+)_M(\d+)_v(\d+)\.csv")
# PyTorch class -> (jaxpipe schedule, the option that sets stages per device)
FAMILY = {
    "ScheduleGPipe": ("gpipe", None),
    "Schedule1F1B": ("1f1b", None),
    "ScheduleInterleaved1F1B": ("interleaved_1f1b", "virtual_stages"),
    "ScheduleLoopedBFS": ("circular", "repeats"),
    "ScheduleInterleavedZeroBubble": ("interleaved_zb", "virtual_stages"),
    "ScheduleZBVZeroBubble": ("zbv", None),
    "ScheduleDualPipeV": ("dualpipev", None),
}


def load(path):
    table = schedules.from_csv(path)  # validates: every fixture is a valid table
    options = dict(table.options)
    S, M, v = (int(x) for x in NAME.fullmatch(path.name).groups()[1:])
    assert (table.num_stages, table.num_microbatches, table.stages_per_device) == (S, M, v)
    return table, options, S, M, v


def ours(options, S, M, v):
    name, option = FAMILY[options["pytorch_class"]]
    return schedules.get(name, S, M, **({option: v} if option else {}))


def makespan(table):
    return simulate(table, Costs(), "lockstep").makespan


def test_fixtures_cover_every_family():
    classes = {json.loads(p.read_text().split("# options: ")[1].split("\n")[0])["pytorch_class"]
               for p in FIXTURES}  # fmt: skip
    assert classes == set(FAMILY)
    assert len(FIXTURES) > 200


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_no_slower_and_no_more_memory_than_pytorch(path):
    table, options, S, M, v = load(path)
    mine = ours(options, S, M, v)
    assert mine.stage_device == table.stage_device
    assert makespan(mine) <= makespan(table), (makespan(mine), makespan(table))
    theirs = table.peak_activations()
    assert all(a <= b for a, b in zip(mine.peak_activations(), theirs, strict=True)), (
        mine.peak_activations(),
        theirs,
    )


def test_makespans_and_peaks_at_two_sizes():
    """S = 8, M = 32, v = 2: PyTorch's Interleaved1F1B takes 214 units in lock-step (its own
    time steps), jaxpipe's interleaved_1f1b 206 at 16 activations instead of 23. S = 8,
    M = 8, v = 2: PyTorch's InterleavedZeroBubble 55, jaxpipe's interleaved_zb 55, zbv 62."""
    table, options, S, M, v = load(DATA / "interleaved1f1b_S8_M32_v2.csv")
    assert options["source"] == "PyTorch's time steps"
    assert makespan(table) == 214 and max(table.peak_activations()) == 23
    mine = ours(options, S, M, v)
    assert makespan(mine) == 206 and max(mine.peak_activations()) == 16
    table, options, S, M, v = load(DATA / "interleavedzb_S8_M8_v2.csv")
    assert makespan(table) == 55 == makespan(ours(options, S, M, v))
    assert makespan(schedules.get("zbv", 8, 8)) == 62


def test_pytorch_tables_that_are_not_valid_lock_step_tables():
    """What the export found (see the options header of each fixture): PyTorch's 1F1B IR is
    off by one on the last rank; GPipe, 1F1B and DualPipeV give orders without time steps;
    the interleaved schedules' time steps break a dependency when M < S."""
    verdicts = {}
    for path in FIXTURES:
        _, options, S, M, v = load(path)
        verdicts[(options["pytorch_class"], S, M, v)] = options["raw_error"]
    assert all("expected 0.." in e for (c, *_), e in verdicts.items() if c == "Schedule1F1B")
    for cls in ("ScheduleGPipe", "ScheduleDualPipeV"):
        assert all("without time steps" in e for (c, *_), e in verdicts.items() if c == cls)
    for cls in ("ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble"):
        for (c, S, M, _), error in verdicts.items():
            if c == cls:
                assert bool(error) == (M < S), (c, S, M, error)
                assert not error or "rule 'dependency' violated" in error
    assert not any(e for (c, *_), e in verdicts.items() if c == "ScheduleZBVZeroBubble")
