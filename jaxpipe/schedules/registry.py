"""Name -> generator registry behind `jaxpipe.schedules.get` and `jaxpipe.schedules.names`."""

from __future__ import annotations

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
    schedule = _GENERATORS[name](num_stages, num_microbatches, **options)
    return schedule.validate()
