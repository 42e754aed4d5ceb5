"""Name -> generator registry behind `jaxpipe.schedules.get` and `jaxpipe.schedules.names`."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable

from jaxpipe.schedules.core import Schedule
from jaxpipe.schedules.fitting import fit
from jaxpipe.schedules.simulate import Costs
from jaxpipe.schedules.validation import validate

_GENERATORS: dict[str, Callable[..., Schedule]] = {}


def register(name: str):
    """Decorator: registers ``fn(num_stages, num_microbatches, **options) -> Schedule``.

    Args:
      name: the name `get` knows the generator by.

    Returns:
      A decorator that records ``fn`` and returns it unchanged.
    """

    def wrap(fn):
        _GENERATORS[name] = fn
        return fn

    return wrap


def names() -> list[str]:
    """Every schedule name `get` accepts.

    Returns:
      The registered names, sorted.
    """
    return sorted(_GENERATORS)


def get(
    name: str, num_stages: int, num_microbatches: int, *, costs: Costs | None = None, **options
) -> Schedule:
    """Builds and validates the schedule ``name`` for ``S`` devices and ``M`` micro-batches.

    Args:
      name: a name from `names`.
      num_stages: ``S``, the devices on the pipe axis.
      num_microbatches: ``M``.
      costs: the stage's per-action costs (`Costs`): the table is packed for them
        (`jaxpipe.schedules.fit`), so that its lock-step ticks last about as long as each
        other at those costs, with no more live activations per device. None: the table
        packed for equal costs (every action one tick).
      **options: the generator's options.

    Returns:
      The validated table.

    Raises:
      ValueError: for an unknown name or option (with the closest spelling), for ``S`` or
        ``M`` that is not a positive int, or for (S, M, options) the schedule cannot meet.
    """
    if name not in _GENERATORS:
        raise ValueError(
            f"unknown schedule {name!r}{_suggest_schedule(name)}; known schedules: "
            f"{', '.join(names())}"
        )
    for key, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(
                f"{key} must be a positive int, got {value!r}"
                + (
                    "; a common choice is a multiple of the number of stages (4 * S or more "
                    "keeps the bubble small)"
                    if key == "num_microbatches"
                    else ""
                )
            )
    generator = _GENERATORS[name]
    accepted = list(inspect.signature(generator).parameters)[2:]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        hints = "".join(_did_you_mean(key, accepted) for key in unknown)
        raise ValueError(
            f"schedule {name!r} takes no option {', '.join(map(repr, unknown))}{hints}; its "
            "options: "
            + (", ".join(accepted) if accepted else "none")
            + _taken_by(unknown, accepted)
        )
    schedule = validate(generator(num_stages, num_microbatches, **options))
    return schedule if costs is None else fit(schedule, costs)


def _suggest_schedule(name) -> str:
    """A hint for a mistyped schedule name: case ignored; a name starting with what was
    typed first (the first such in `names()` order), else the closest spelling."""
    typed = str(name).lower()
    starting = [known for known in names() if known.startswith(typed)]
    if starting:
        return f" (did you mean {starting[0]!r}?)"
    return _did_you_mean(typed, names())


def _did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(str(word), list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _taken_by(options, accepted) -> str:
    """Which other schedules take ``options`` (or a close spelling of them), as a hint."""
    takes = {n: list(inspect.signature(fn).parameters)[2:] for n, fn in sorted(_GENERATORS.items())}
    every = sorted({o for opts in takes.values() for o in opts})
    hints = []
    for option in options:
        close = difflib.get_close_matches(str(option), every, n=1)
        if close and close[0] not in accepted:
            takers = [n for n, opts in takes.items() if close[0] in opts]
            hints.append(f"{close[0]!r} is an option of {', '.join(takers)}")
    return f" ({'; '.join(hints)})" if hints else ""
