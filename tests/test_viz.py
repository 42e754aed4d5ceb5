"""`jaxpipe.viz.draw` writes a timeline picture for every schedule."""

import pytest
from matplotlib.figure import Figure

from jaxpipe import schedules, viz
from jaxpipe.schedules import Costs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def small(name):
    """A small schedule of ``name``: the first (S, M) its generator accepts."""
    for S, M in [(2, 4), (3, 6), (4, 8)]:
        try:
            return schedules.get(name, S, M)
        except ValueError:
            continue
    raise AssertionError(f"{name} accepts none of the small (S, M) tried")


@pytest.mark.parametrize("name", schedules.names())
def test_draw_writes_a_png_for_every_schedule(name, tmp_path):
    schedule = small(name)
    path = tmp_path / f"{name}.png"
    figure = viz.draw(schedule, path)
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 5_000  # a picture with boxes in it, not an empty canvas
    assert isinstance(figure, Figure)
    title = figure.axes[0].get_title()
    report = schedules.bubble_fraction(schedule)
    assert f"{name}: S={schedule.num_stages}, M={schedule.num_microbatches}" in title
    assert f"{report.lockstep:.1%}" in title and f"{report.ideal:.1%}" in title
    assert str(list(schedule.peak_activations())) in title
    boxes = figure.axes[0].patches
    assert len(boxes) == sum(1 for _ in schedule.actions())


def test_draw_ideal_mode_with_costs_and_no_path():
    schedule = schedules.get("interleaved_1f1b", 2, 4, virtual_stages=2)
    costs = Costs(forward=1, full_backward=2, communication=0.5)
    figure = viz.draw(schedule, costs=costs, mode="ideal")
    ideal = schedules.simulate(schedule, costs, "ideal")
    assert figure.axes[0].get_xlim() == pytest.approx((0, ideal.makespan))
    with pytest.raises(ValueError, match="mode must be one of"):
        viz.draw(schedule, mode="fast")


@pytest.mark.parametrize("name", ["pipedream", "pipedream_2bw", "1f1b"])
def test_draw_show_versions_writes_each_actions_version(name, tmp_path):
    from jaxpipe.schedules import weight_versions

    schedule = schedules.get(name, 4, 8)
    path = tmp_path / f"{name}.png"
    figure = viz.draw(schedule, path, show_versions=True)
    assert path.read_bytes()[:8] == PNG_MAGIC
    axes = figure.axes[0]
    assert f"weight versions {list(weight_versions(schedule))}" in axes.get_title()
    labels = sorted(text.get_text().replace("\n", " ") for text in axes.texts)
    want = sorted(f"{a.op}{a.microbatch} v{a.version}" for a in schedule.actions())
    assert labels == want  # every box is labelled, with the version its action reads
    if name != "1f1b":
        assert any(a.version > 0 for a in schedule.actions())  # versions are really shown
    plain = viz.draw(schedule)  # the default is unchanged: no versions
    assert all(" v" not in t.get_text() and "\n" not in t.get_text() for t in plain.axes[0].texts)
    assert "weight versions" not in plain.axes[0].get_title()


def test_draw_labels_the_costs_with_the_all_to_alls_that_take_time():
    schedule = schedules.get("1f1b", 2, 4, overlap=True)
    plain = viz.draw(schedule, costs=Costs(forward=1, backward_input=2, backward_weight=0.5))
    label = plain.axes[0].get_xlabel()
    assert label.endswith("(costs: F=1, B=2, W=0.5, BW=2.5, comm=0)") and "all-to-all" not in label
    costs = Costs(all_to_all_forward=0.25, all_to_all_backward=0.5)
    label = viz.draw(schedule, costs=costs).axes[0].get_xlabel()
    assert label.endswith("BW=2, comm=0; all-to-alls: F=0.25, B=0.5)"), label


def test_draw_and_the_chrome_trace_refuse_costs_that_are_not_costs():
    # A tuple of costs failed with "'tuple' object has no attribute 'of'".
    schedule = schedules.get("1f1b", 2, 2)
    message = r"costs must be a jaxpipe.schedules.Costs\(forward=.*got tuple \(1, 2, 3\)"
    with pytest.raises(TypeError, match=message):
        viz.draw(schedule, costs=(1, 2, 3))
    with pytest.raises(TypeError, match=message):
        schedules.to_chrome_trace(schedule, costs=(1, 2, 3))
