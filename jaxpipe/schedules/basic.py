"""GPipe and 1F1B (PipeDream-flush): one stage per device."""

from __future__ import annotations

from jaxpipe.schedules.core import BW, Action, F, Schedule, pack
from jaxpipe.schedules.registry import register


@register("gpipe")
def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe fill-drain: every forward, then every backward (Huang et al., 2019).

    With unit F and BW costs the bubble is ``(S-1)/(M+S-1)`` and every device holds all
    ``M`` activations at the turn from forward to backward.
    """
    S, M = num_stages, num_microbatches
    orders = [
        [Action(F, d, m) for m in range(M)] + [Action(BW, d, m) for m in range(M)] for d in range(S)
    ]
    return pack("gpipe", S, M, list(range(S)), orders)


@register("1f1b")
def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B with a flush (PipeDream-flush, DeepSpeed, Megatron without interleaving).

    Device ``d`` runs ``min(S-d-1, M)`` warm-up forwards, then alternates one forward and one
    backward, then drains its backwards (Narayanan et al., "Memory-Efficient Pipeline-Parallel
    DNN Training", 2021). Bubble ``(S-1)/(M+S-1)`` with unit costs, like GPipe, but device
    ``d`` holds at most ``min(S-d, M)`` activations.
    """
    S, M = num_stages, num_microbatches
    orders = []
    for d in range(S):
        warmup = min(S - d - 1, M)
        order = [Action(F, d, m) for m in range(warmup)]
        for m in range(M - warmup):
            order += [Action(F, d, warmup + m), Action(BW, d, m)]
        order += [Action(BW, d, m) for m in range(M - warmup, M)]
        orders.append(order)
    return pack("1f1b", S, M, list(range(S)), orders)
