"""Name -> generator registry behind `jaxpipe.schedules.get` and `jaxpipe.schedules.names`."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from jaxpipe.schedules.core import Schedule

_GENERATORS: dict[str, Callable[..., Schedule]] = {}


def register(name: str):
    """Decorator: registers ``fn(num_stages, num_microbatches, **options) -> Schedule``."""

    def wrap(fn):
        _GENERATORS[name] = fn
        return fn

    return wrap


def names() -> list[str]:
    """Every schedule name `get` accepts."""
    return sorted(_GENERATORS)


def get(name: str, num_stages: int, num_microbatches: int, **options) -> Schedule:
    """Builds and validates the schedule ``name`` for ``S`` devices and ``M`` micro-batches.

    Raises ``ValueError`` for an unknown name, or for (S, M, options) the schedule cannot
    meet, saying what is required.
    """
    if name not in _GENERATORS:
        raise ValueError(f"unknown schedule {name!r}; known schedules: {', '.join(names())}")
    for key, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key} must be a positive int, got {value!r}")
    generator = _GENERATORS[name]
    accepted = list(inspect.signature(generator).parameters)[2:]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"schedule {name!r} takes no option {', '.join(map(repr, unknown))}; its options: "
            + (", ".join(accepted) if accepted else "none")
        )
    schedule = generator(num_stages, num_microbatches, **options)
    return schedule.validate()
