"""GPipe and 1F1B (PipeDream-flush): one stage per device."""

from __future__ import annotations

from jaxpipe.schedules.actions import BW, Action, B, F, W
from jaxpipe.schedules.core import Schedule
from jaxpipe.schedules.packing import pack
from jaxpipe.schedules.registry import register


@register("gpipe")
def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe fill-drain: every forward, then every backward (Huang et al., 2019).

    With unit F and BW costs the bubble is ``(S-1)/(M+S-1)`` and every device holds all
    ``M`` activations at the turn from forward to backward.

    Args:
      num_stages: ``S``, the devices on the pipe axis.
      num_microbatches: ``M``.

    Returns:
      The table (`get` validates it).
    """
    S, M = num_stages, num_microbatches
    orders = [
        [Action(F, d, m) for m in range(M)] + [Action(BW, d, m) for m in range(M)] for d in range(S)
    ]
    return pack("gpipe", S, M, list(range(S)), orders)


@register("1f1b")
def one_f_one_b(
    num_stages: int,
    num_microbatches: int,
    overlap: bool | None = None,
    split_backward: bool | None = None,
) -> Schedule:
    """1F1B with a flush (PipeDream-flush, DeepSpeed, Megatron without interleaving).

    Device ``d`` runs ``min(S-d-1, M)`` warm-up forwards, then alternates one forward and one
    backward, then drains its backwards (Narayanan et al., "Memory-Efficient Pipeline-Parallel
    DNN Training", 2021). Device ``d`` holds at most ``min(S-d, M)`` activations.

    By default (``S > 1``: ``split_backward=True``) each backward runs as B then W in the
    next tick.
    Every action then lasts one unit at the default costs (F = B = W = 1), so every lock-step
    tick is full: the table takes ``3M + 2(S-1)`` ticks, lock-step bubble
    ``2(S-1)/(3M+2(S-1))`` equal to the ideal. It pays in lock-step when F, B and W differ
    (a tick lasts as long as its slowest action).

    ``split_backward=False`` gives the classic table (one BW per backward): with BW = 2F
    its ticks mix F on one device with BW on the next, so lock-step pays ``BW`` for nearly
    every tick; ideal bubble ``(S-1)/(M+S-1)``.

    With one device (``S = 1``) the default is ``overlap=True``: nothing waits, so the
    fewest ticks win.

    ``overlap=True`` (full backwards) runs the steady state's forward and backward in the
    *same* tick (a two-action cell) after ``2(S-d)-1`` warm-up forwards: every tick costs
    F + BW on every device, so lock-step equals the ideal ``(S-1)/(M+S-1)`` for any cost
    ratio, for up to ``2(S-d)`` activations on device ``d`` instead of ``S-d``. No
    full-backward 1F1B can do both (docs/schedules.md, "Why 1f1b splits its backward").

    Args:
      num_stages: ``S``, the devices on the pipe axis.
      num_microbatches: ``M``.
      overlap: fuse each steady-state forward with a full backward in one tick.
      split_backward: run each backward as B, then W in the next tick.

    Returns:
      The table (`get` validates it).

    Raises:
      ValueError: if an option is not a bool, or both are True.
    """
    S, M = num_stages, num_microbatches
    if overlap is None:  # one device has no bubble to fill: fewest ticks, F and BW together
        overlap = S == 1 and split_backward is None
    if not isinstance(overlap, bool):
        raise ValueError(f"1f1b: overlap must be True or False, got {overlap!r}")
    if split_backward is None:
        split_backward = not overlap
    if not isinstance(split_backward, bool):
        raise ValueError(f"1f1b: split_backward must be True or False, got {split_backward!r}")
    if overlap and split_backward:
        raise ValueError(
            "1f1b: overlap=True fuses a forward with a full backward (BW) in one tick, so it "
            "cannot split the backward; pass overlap=True alone, or split_backward=True alone"
        )
    options = {"overlap": overlap, "split_backward": split_backward}
    if not overlap:
        orders = one_f_one_b_orders(S, M, split_backward)
        return pack("1f1b", S, M, list(range(S)), orders, options=options)
    orders = []
    for d in range(S):
        warmup = min(2 * (S - d) - 1, M)
        order: list = [Action(F, d, m) for m in range(warmup)]
        order += [(Action(F, d, warmup + m), Action(BW, d, m)) for m in range(M - warmup)]
        order += [Action(BW, d, m) for m in range(M - warmup, M)]
        orders.append(order)
    return pack("1f1b", S, M, list(range(S)), orders, max_actions_per_tick=2, options=options)


def backward(stage: int, microbatch: int, split: bool) -> list[Action]:
    """One backward: ``[B, W]`` if ``split`` (W right after B), else ``[BW]``.

    Args:
      stage: the logical stage.
      microbatch: the micro-batch.
      split: whether the backward is split into B and W.

    Returns:
      The actions of the backward, in order.
    """
    if split:
        return [Action(B, stage, microbatch), Action(W, stage, microbatch)]
    return [Action(BW, stage, microbatch)]


def one_f_one_b_orders(
    num_stages: int, num_microbatches: int, split_backward: bool = False
) -> list[list[Action]]:
    """Per-device 1F1B orders: warm-up forwards, one forward one backward, drain.

    With ``split_backward`` each backward is B followed by W.

    Args:
      num_stages: ``S``, the devices on the pipe axis.
      num_microbatches: ``M``.
      split_backward: run each backward as B then W.

    Returns:
      One order per device, for `pack`.
    """
    S, M = num_stages, num_microbatches
    orders = []
    for d in range(S):
        warmup = min(S - d - 1, M)
        order = [Action(F, d, m) for m in range(warmup)]
        for m in range(M - warmup):
            order += [Action(F, d, warmup + m), *backward(d, m, split_backward)]
        for m in range(M - warmup, M):
            order += backward(d, m, split_backward)
        orders.append(order)
    return orders


def _check_positive(name: str, option: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: {option} must be a positive int, got {value!r}")


def _check_bool(name: str, option: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: {option} must be True or False, got {value!r}")


def rounds(num_stages: int, num_microbatches: int) -> list[int]:
    """Sizes of the rounds of an interleaved order: ``max(1, M // S)`` rounds, as equal as
    possible, larger first, each at least ``S`` micro-batches when ``M >= S`` (PyTorch's
    flexible interleaving, which needs them equal).

    Args:
      num_stages: ``S``, the devices on the pipe axis.
      num_microbatches: ``M``.

    Returns:
      The round sizes, in order.
    """
    S, M = num_stages, num_microbatches
    count = max(1, M // S)
    size, larger = divmod(M, count)
    return [size + 1] * larger + [size] * (count - larger)


def interleaved_orders(
    num_stages: int, num_microbatches: int, virtual_stages: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(forwards, backwards)``: one device's ``(chunk, micro-batch)`` sequences.

    The micro-batches are cut into `rounds`; each round runs chunk by chunk (every
    micro-batch of the round on chunk 0, then on chunk 1, ...) for the forwards, and with
    the chunks reversed for the backwards.

    Args:
      num_stages: ``S``, the devices on the pipe axis.
      num_microbatches: ``M``.
      virtual_stages: ``v``, the chunks per device.

    Returns:
      ``(forwards, backwards)``, each a list of ``(chunk, micro-batch)``.
    """
    v = virtual_stages
    forwards, backwards, start = [], [], 0
    for size in rounds(num_stages, num_microbatches):
        group = range(start, start + size)
        forwards += [(c, m) for c in range(v) for m in group]
        backwards += [(c, m) for c in reversed(range(v)) for m in group]
        start += size
    return forwards, backwards


@register("interleaved_1f1b")
def interleaved_1f1b(
    num_stages: int,
    num_microbatches: int,
    virtual_stages: int = 2,
    split_backward: bool = True,
) -> Schedule:
    """Interleaved 1F1B: Megatron's virtual pipeline (Narayanan et al., SC 2021, sec. 2.2).

    Each device holds ``v = virtual_stages`` chunks; chunk ``c`` of device ``d`` is logical
    stage ``c*S + d``. The micro-batches are cut into ``max(1, M // S)`` rounds of ``g`` or
    ``g - 1`` micro-batches (`rounds`; ``g = S`` when ``M`` is a multiple of ``S``), so any
    ``M >= 1`` works; forwards run round by round, chunk by chunk within a round, and
    backwards mirror them with the chunks reversed. Device ``d`` runs a warm-up of forwards,
    then alternates one forward and one backward, then drains.

    By default (``split_backward=True``) each backward is B then W, and the warm-up is
    ``(v-1)*g + S-d-1`` forwards (PyTorch's interleaved zero-bubble warm-up): at the default
    costs every action lasts one tick and the table takes exactly ``3vM + 2(S-1)`` ticks,
    lock-step bubble ``2(S-1)/(3vM+2(S-1))`` (for ``M >= S``) equal to the ideal. Device
    ``d`` holds at most its warm-up plus one chunk activations, ``min((v-1)*g + S - d, v*M)``:
    ``v*S`` on device 0 when ``M`` is a multiple of ``S``, fewer than Megatron's table.

    ``split_backward=False`` gives Megatron's table: full backwards (BW) and a warm-up of
    ``(v-1)*g + 2(S-d-1)`` forwards; with unit F and BW costs its bubble is
    ``(S-1)/(v*M+S-1)`` (ibid.) in ``2vM + 2(S-1)`` ticks, and device 0 holds
    ``min(v*S + 2(S-1) + 1, v*M)`` chunk activations when ``g = S`` (Korthikanti et al.,
    2022, sec. 4.2.3). ``virtual_stages=1`` gives the `1f1b` table either way.

    Args:
      num_stages: ``S``, the devices on the pipe axis.
      num_microbatches: ``M``.
      virtual_stages: ``v``, the chunks per device.
      split_backward: run each backward as B then W (the default), or as one BW.

    Returns:
      The table (`get` validates it).

    Raises:
      ValueError: if ``virtual_stages`` is not a positive int or ``split_backward`` not a
        bool.
    """
    S, M, v = num_stages, num_microbatches, virtual_stages
    _check_positive("interleaved_1f1b", "virtual_stages", v)
    _check_bool("interleaved_1f1b", "split_backward", split_backward)
    forwards, backwards = interleaved_orders(S, M, v)
    g = max(rounds(S, M))
    total = v * M
    orders = []
    for d in range(S):
        hops = S - d - 1 if split_backward or v == 1 else 2 * (S - d - 1)
        warmup = min((v - 1) * g + hops, total)

        def forward(k: int, d=d) -> Action:
            chunk, m = forwards[k]
            return Action(F, chunk * S + d, m)

        def backward_of(k: int, d=d) -> list[Action]:
            chunk, m = backwards[k]
            return backward(chunk * S + d, m, split_backward)

        seq = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            seq += [forward(warmup + k), *backward_of(k)]
        for k in range(total - warmup, total):
            seq += backward_of(k)
        orders.append(seq)
    stage_device = [s % S for s in range(S * v)]
    options = {"virtual_stages": v, "split_backward": split_backward}
    return pack("interleaved_1f1b", S, M, stage_device, orders, options=options)


@register("circular")
def circular(num_stages: int, num_microbatches: int, repeats: int = 2) -> Schedule:
    """Circular GPipe (MaxText / praxis): micro-batches go round the ring ``repeats`` times.

    There are ``S*r`` logical stages (``r = repeats``); stage ``s`` lives on device ``s % S``.
    Each device runs every forward (repeat by repeat, micro-batches in order), then every
    backward in reverse repeat order. With unit F and BW costs and ``M >= S`` the bubble is
    ``(S-1)/(r*M+S-1)``: the fill and drain of GPipe (Huang et al., 2019) are paid once for
    ``r`` passes. Every device holds all ``r*M`` chunk activations at the turn.

    Args:
      num_stages: ``S``, the devices on the pipe axis.
      num_microbatches: ``M``.
      repeats: ``r``, the passes round the ring.

    Returns:
      The table (`get` validates it).

    Raises:
      ValueError: if ``repeats`` is not a positive int.
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
