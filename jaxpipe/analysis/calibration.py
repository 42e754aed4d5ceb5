"""How far the accelerator compilers' time estimates are from steps measured on chips, and
the correction jaxpipe's predicted step times take from that (`jaxpipe.target.StepTime`).

What is scaled is the compiler's estimate of the computation plus the time of any fused
attention kernel in it, which the estimate does not see (`jaxpipe.kernels`): the TPU runs
ran splash attention and are counted so, and so should a prediction the scale corrects.

The correction is fitted on published training runs with their measured step times
(``benchmarks/published_runs.py``): each run's own program is compiled here for its chips
and read by `jaxpipe.target`, and one scale of the compiler's estimate of the computation,
the same for every run of a platform, is fitted (``benchmarks/calibration.py``, which
writes ``benchmarks/results/calibration.json``; the figures below are copied from there and
a test keeps them equal). Each run is also predicted by the scale fitted without it: the
worst of those errors is how far to trust a prediction (`Calibration.held_out_error`).

Only the computation is calibrated: the published runs hid their collectives, so none of
them measures exposed communication, and on the one published program compiled here with
its own collective options the report read far more exposed time than its measured step
leaves (``benchmarks/results/calibration.json``, ``communication_check``). A calibrated
`StepTime` adds the exposed communication as read.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Calibration:
    """A correction of the compiler's estimate of a step's computation.

    Attributes:
        platform: ``"tpu"`` or ``"cuda"``.
        compute_scale: measured step over the compiler's estimate of its computation
            (TPU: the compiler's ``optimal_seconds``), fitted on ``fitted_on``.
        fitted_on: the published runs it was fitted on (``benchmarks/published_runs.py``).
        held_out_error: the worst relative error of a run's step predicted with the scale
            fitted on the other runs.
        source: what it was fitted on and how, in a line.
    """

    platform: str
    compute_scale: float
    fitted_on: tuple[str, ...]
    held_out_error: float
    source: str


CALIBRATIONS: dict[str, Calibration] = {
    "tpu": Calibration(
        platform="tpu",
        compute_scale=1.085,
        fitted_on=(
            "maxtext-llama2-70b-v5p-512",
            "maxtext-32b-v5p-64",
            "maxtext-64b-v5p-64",
        ),
        held_out_error=0.106,
        source=(
            "fitted on MaxText's published v5p runs (Llama-2-70B on 512 chips, 32B and 64B "
            "on 64), their own steps compiled here, their splash attention counted as "
            "jaxpipe.kernels counts it"
        ),
    ),
    "cuda": Calibration(
        platform="cuda",
        compute_scale=0.4215,
        fitted_on=("megatron-70b-h100-768-pp2", "megatron-119b-h100-1536-pp4"),
        held_out_error=0.036,
        source=(
            "fitted on Megatron-LM's published H100 runs with pipelines (70B pipe 2, 119B "
            "pipe 4, tensor 8), jaxpipe's closest programs compiled here"
        ),
    ),
}


def get(platform: str) -> Calibration | None:
    """The `Calibration` of a platform (``"tpu"``, ``"cuda"``), or None where none is
    fitted: predictions there stay the compiler's raw estimates."""
    return CALIBRATIONS.get(platform)
