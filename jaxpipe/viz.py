"""Pictures of schedules: a timeline per device, drawn with matplotlib's Agg backend.

``draw(schedule)`` simulates the table (`jaxpipe.schedules.simulate`) and draws one row per
device: one box per action, coloured by micro-batch; forwards solid, full backwards (BW)
darker with ``//`` hatching, input backwards (B) lighter with ``\\\\`` hatching, weight
backwards (W) lighter with ``xx`` hatching. Idle time stays blank. The title gives the name,
S, M, v, the bubble fraction (lock-step and ideal) and the peak live activations per device.
``draw(schedule, show_versions=True)`` also writes the weight version each action reads
(``Action.version``, e.g. ``F3 v1``) and adds the weight versions per device
(`jaxpipe.schedules.weight_versions`) to the title. Weight updates (``U``
actions) are drawn as short red ticks at the end of their tick. The bubble in the title is
the lock-step figure at the costs on the x axis, as jaxpipe reports it everywhere, with the
ideal next to it.
"""

from __future__ import annotations

import os

from jaxpipe.schedules import (
    BW,
    Action,
    B,
    Costs,
    F,
    Schedule,
    W,
    bubble_fraction,
    simulate,
    weight_versions,
)

# op -> (blend towards white (+) or black (-), hatch)
_STYLE = {F: (0.0, ""), BW: (-0.35, "//"), B: (0.45, "\\\\"), W: (0.7, "xx")}
_NAMES = {F: "F forward", BW: "BW full backward", B: "B input backward", W: "W weight backward"}


def _colour(microbatch: int, num_microbatches: int, shade: float):
    from matplotlib import colormaps

    if num_microbatches <= 10:
        base = colormaps["tab10"](microbatch)
    else:
        base = colormaps["turbo"](0.05 + 0.9 * microbatch / max(1, num_microbatches - 1))
    target = 1.0 if shade > 0 else 0.0
    return tuple(c + abs(shade) * (target - c) for c in base[:3])


def draw(
    schedule: Schedule,
    path: str | os.PathLike | None = None,
    costs: Costs | None = None,
    mode: str = "lockstep",
    show_versions: bool = False,
):
    """Draws ``schedule``'s simulated timeline.

    Args:
      schedule: the table.
      path: a file to save the figure to (PNG unless the suffix names another format), or
        None.
      costs: the costs to simulate at (default `jaxpipe.schedules.Costs()`).
      mode: ``"lockstep"`` (as the executor runs it), ``"neighbour"`` or ``"ideal"`` (see
        `jaxpipe.schedules.simulate`).
      show_versions: also name in each box the weight version its action reads (``F3 v1``,
        or ``F3`` over ``v1`` where the box is narrow), and give the weight versions held
        per device in the title; synchronous schedules read version 0 throughout.

    Returns:
      The matplotlib ``Figure``.

    Raises:
      ImportError: if matplotlib is not installed, naming the extra to install.
      TypeError: ``costs`` is not a `jaxpipe.schedules.Costs`.
      ValueError: for an unknown ``mode``.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError as error:
        hint = "pip install 'jaxpipe[viz]'"
        raise ImportError(
            f"jaxpipe.viz.draw needs matplotlib, which is not installed: {hint}"
        ) from error

    costs = costs or Costs()
    timeline = simulate(schedule, costs, mode)
    report = bubble_fraction(schedule, costs)
    S, M, v = schedule.num_stages, schedule.num_microbatches, schedule.stages_per_device
    makespan = max(timeline.makespan, 1e-9)

    per_device = max(sum(e.device == d for e in timeline.events) for d in range(S))
    width = min(40.0, max(8.0, 0.45 * per_device + 3))
    fig = Figure(figsize=(width, 1.4 + 0.55 * S), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    points_per_unit = 0.8 * width * 72 / makespan
    for e in timeline.events:
        a = e.action
        shade, hatch = _STYLE[a.op]
        ax.barh(
            e.device,
            e.end - e.start,
            left=e.start,
            height=0.8,
            color=_colour(a.microbatch, M, shade),
            hatch=hatch,
            edgecolor="black",
            linewidth=0.4,
        )
        text = f"{a.op}{a.microbatch}" + (f":{schedule.chunk_of(a.stage)}" if v > 1 else "")
        if show_versions:
            one_line = f"{text} v{a.version}"
            fits = (e.end - e.start) * points_per_unit >= 3.5 * len(one_line)
            text = one_line if fits else f"{text}\nv{a.version}"
        longest = max(len(line) for line in text.split("\n"))
        if (e.end - e.start) * points_per_unit >= 3.5 * longest:
            ink = "white" if shade < 0 else "black"
            ax.text((e.start + e.end) / 2, e.device, text, ha="center", va="center", fontsize=5.5,
                    color=ink)  # fmt: skip
    for e in timeline.updates:
        ax.plot([e.start, e.start], [e.device - 0.45, e.device + 0.45], color="red", lw=1.5)
    ax.set_xlim(0, makespan)
    ax.set_ylim(S - 0.5, -0.5)
    ax.set_yticks(range(S), [f"device {d}" for d in range(S)])
    full_backward = costs.computation_of(Action(BW, 0, 0))
    exchanges = {
        "F": costs.all_to_all_forward,
        "B": costs.all_to_all_backward,
        "W": costs.all_to_all_weight,
    }
    all_to_alls = ", ".join(f"{op}={value:g}" for op, value in exchanges.items() if value)
    ax.set_xlabel(
        f"time, {mode} (costs: F={costs.forward:g}, B={costs.backward_input:g}, "
        f"W={costs.backward_weight:g}, BW={full_backward:g}, comm={costs.communication:g}"
        + (f"; all-to-alls: {all_to_alls})" if all_to_alls else ")")
    )
    ops = [op for op in (F, BW, B, W) if any(a.op == op for a in schedule.actions())]
    handles = [
        Patch(facecolor=_colour(0, 1, _STYLE[op][0]), hatch=_STYLE[op][1], label=_NAMES[op])
        for op in ops
    ]
    if timeline.updates:
        handles.append(Line2D([], [], color="red", lw=1.5, label="U weight update"))
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=7,
    )
    title = (
        f"{schedule.name}: S={S}, M={M}, v={v} | bubble {report.lockstep:.1%} (lock-step; "
        f"ideal {report.ideal:.1%}) | peak activations {list(schedule.peak_activations())}"
    )
    if show_versions:
        title += f" | weight versions {list(weight_versions(schedule))}"
    ax.set_title(title, fontsize=9)
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig
