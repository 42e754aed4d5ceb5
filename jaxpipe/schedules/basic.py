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
def one_f_one_b(num_stages: int, num_microbatches: int, overlap: bool = False) -> Schedule:
    """1F1B with a flush (PipeDream-flush, DeepSpeed, Megatron without interleaving).

    Device ``d`` runs ``min(S-d-1, M)`` warm-up forwards, then alternates one forward and one
    backward, then drains its backwards (Narayanan et al., "Memory-Efficient Pipeline-Parallel
    DNN Training", 2021). Bubble ``(S-1)/(M+S-1)`` with unit costs, like GPipe, but device
    ``d`` holds at most ``min(S-d, M)`` activations.

    ``overlap=True`` runs the steady state's forward and backward in the *same* tick (a
    two-action cell, as DualPipeV's pairs) after ``2(S-d)-1`` warm-up forwards. Lock-step
    ticks then cost F + BW on every device, so the lock-step bubble equals the ideal
    ``(S-1)/(M+S-1)`` for any F:BW ratio, where plain 1F1B pays for mixing F and BW ticks;
    the price is up to ``2(S-d)`` activations on device ``d`` instead of ``S-d``.
    """
    S, M = num_stages, num_microbatches
    if not isinstance(overlap, bool):
        raise ValueError(f"1f1b: overlap must be True or False, got {overlap!r}")
    if not overlap:
        return pack("1f1b", S, M, list(range(S)), one_f_one_b_orders(S, M))
    orders = []
    for d in range(S):
        warmup = min(2 * (S - d) - 1, M)
        order: list = [Action(F, d, m) for m in range(warmup)]
        order += [(Action(F, d, warmup + m), Action(BW, d, m)) for m in range(M - warmup)]
        order += [Action(BW, d, m) for m in range(M - warmup, M)]
        orders.append(order)
    return pack(
        "1f1b", S, M, list(range(S)), orders, max_actions_per_tick=2, options={"overlap": True}
    )


def one_f_one_b_orders(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """Per-device 1F1B orders: warm-up forwards, one forward one backward, drain."""
    S, M = num_stages, num_microbatches
    orders = []
    for d in range(S):
        warmup = min(S - d - 1, M)
        order = [Action(F, d, m) for m in range(warmup)]
        for m in range(M - warmup):
            order += [Action(F, d, warmup + m), Action(BW, d, m)]
        order += [Action(BW, d, m) for m in range(M - warmup, M)]
        orders.append(order)
    return orders


def _check_positive(name: str, option: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: {option} must be a positive int, got {value!r}")


@register("interleaved_1f1b")
def interleaved_1f1b(num_stages: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Interleaved 1F1B: Megatron's virtual pipeline (Narayanan et al., SC 2021, sec. 2.2).

    Each device holds ``v = virtual_stages`` chunks; chunk ``c`` of device ``d`` is logical
    stage ``c*S + d``. Forwards go in groups of ``S`` micro-batches, chunk by chunk within a
    group; backwards mirror them with the chunks reversed. Device ``d`` runs
    ``min(2*(S-d-1) + (v-1)*S, v*M)`` warm-up forwards, then alternates one forward and one
    backward, then drains. Needs ``M % S == 0`` when ``v > 1``; ``v = 1`` gives the `1f1b`
    table (warm-up ``S-d-1``).

    With unit F and BW costs the bubble is ``(S-1)/(v*M+S-1)`` (ibid.); the lock-step table
    meets it exactly: ``2*v*M + 2*(S-1)`` ticks. Device ``d`` holds at most its warm-up plus
    one chunk activations; on device 0 that is ``min(v*S + S - 1, v*M)``, i.e.
    ``S * (1 + (S-1)/(v*S))`` stages' worth (Korthikanti et al., "Reducing Activation
    Recomputation in Large Transformer Models", 2022, sec. 4.2.3).
    """
    S, M, v = num_stages, num_microbatches, virtual_stages
    _check_positive("interleaved_1f1b", "virtual_stages", v)
    if v > 1 and M % S:
        raise ValueError(
            "interleaved_1f1b needs num_microbatches to be a multiple of num_stages "
            f"(S={S}, got M={M}); use M={S * max(1, round(M / S))}, or virtual_stages=1"
        )

    def order(d: int, k: int, forward: bool) -> Action:
        group, within = divmod(k, S * v)
        chunk = within // S if forward else v - 1 - within // S
        return Action(F if forward else BW, chunk * S + d, group * S + within % S)

    orders = []
    for d in range(S):
        total = v * M
        warmup = min(2 * (S - d - 1) + (v - 1) * S if v > 1 else S - d - 1, total)
        seq = [order(d, k, True) for k in range(warmup)]
        for k in range(total - warmup):
            seq += [order(d, warmup + k, True), order(d, k, False)]
        seq += [order(d, k, False) for k in range(total - warmup, total)]
        orders.append(seq)
    stage_device = [s % S for s in range(S * v)]
    return pack("interleaved_1f1b", S, M, stage_device, orders, options={"virtual_stages": v})


@register("circular")
def circular(num_stages: int, num_microbatches: int, repeats: int = 2) -> Schedule:
    """Circular GPipe (MaxText / praxis): micro-batches go round the ring ``repeats`` times.

    There are ``S*r`` logical stages (``r = repeats``); stage ``s`` lives on device ``s % S``.
    Each device runs every forward (repeat by repeat, micro-batches in order), then every
    backward in reverse repeat order. With unit F and BW costs and ``M >= S`` the bubble is
    ``(S-1)/(r*M+S-1)``: the fill and drain of GPipe (Huang et al., 2019) are paid once for
    ``r`` passes. Every device holds all ``r*M`` chunk activations at the turn.
    """
    S, M, r = num_stages, num_microbatches, repeats
    _check_positive("circular", "repeats", r)
    orders = [
        [Action(F, c * S + d, m) for c in range(r) for m in range(M)]
        + [Action(BW, c * S + d, m) for c in reversed(range(r)) for m in range(M)]
        for d in range(S)
    ]
    stage_device = [s % S for s in range(S * r)]
    return pack("circular", S, M, stage_device, orders, options={"repeats": r})
