"""Zero-bubble schedules: ZB-H1, ZB-H2, ZB-V, interleaved ZB and DualPipeV (split backward).

The backward of a stage splits into B (gradient with respect to the stage input, which the
previous stage waits for) and W (gradient with respect to the weights, which nothing waits
for). Moving W into the idle slots of a schedule is what shrinks its bubble (Qi et al.,
"Zero Bubble Pipeline Parallelism", ICLR 2024). Each generator lists, per device, the order
of its actions and lets `pack` place them in lock-step ticks.

With F, B and W of equal cost every action fills one tick, so a table's lock-step and ideal
timelines coincide (unit costs) and the bubble counts can be read off the table.
"""

from __future__ import annotations

from collections import deque

from jaxpipe.schedules.actions import BW, Action, B, F, W
from jaxpipe.schedules.basic import interleaved_orders, rounds
from jaxpipe.schedules.core import Schedule
from jaxpipe.schedules.packing import pack
from jaxpipe.schedules.registry import register


def _split_backward_order(stage: int, M: int, warmup: int, weight_lag: int) -> list[Action]:
    """One stage's order: ``warmup`` forwards, then per micro-batch B, W, F, W held back.

    The W of a micro-batch runs once ``weight_lag`` later micro-batches have had their B;
    the held-back W's run at the end, in the cool-down, where they fill idle ticks.
    """
    warmup = min(warmup, M)
    order = [Action(F, stage, m) for m in range(warmup)]
    pending: deque[int] = deque()
    for m in range(M):
        order.append(Action(B, stage, m))
        pending.append(m)
        if len(pending) > weight_lag:
            order.append(Action(W, stage, pending.popleft()))
        if warmup + m < M:
            order.append(Action(F, stage, warmup + m))
    order += [Action(W, stage, m) for m in pending]
    return order


@register("zb_h1")
def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1, the memory-efficient handcrafted zero-bubble schedule (Qi et al., ICLR 2024, §3.1).

    One stage per device. Device ``d`` runs ``S-d`` warm-up forwards, then B, W, F per
    micro-batch with each W held back by ``d`` micro-batches; the ``d`` held W's fill the
    cool-down. Every device then holds at most ``min(S, M)`` activations: the peak of 1F1B
    (its device 0), while devices ``d > 0`` hold more than under 1F1B (``min(S-d, M)``).
    With F = B = W the idle time per device is ``S-1`` ticks against 1F1B's ``3(S-1)``: a
    third (for ``M >= S``); bubble ``(S-1)/(3M+S-1)``.

    Args:
      num_stages: ``S``, the devices on the pipe axis.
      num_microbatches: ``M``.

    Returns:
      The table (`get` validates it).
    """
    S, M = num_stages, num_microbatches
    orders = [_split_backward_order(d, M, warmup=S - d, weight_lag=d) for d in range(S)]
    return pack("zb_h1", S, M, list(range(S)), orders)


@register("zb_h2")
def zb_h2(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H2, the handcrafted zero-bubble schedule (Qi et al., ICLR 2024, §3.2).

    One stage per device. Device ``d`` runs ``2(S-d)-1`` warm-up forwards, which fill the
    wait for the first backward, then B, W, F per micro-batch with each W held back by ``2d``
    micro-batches. With F = B = W each device is busy without a gap from its first tick
    (``d``) to its last (``3M+d-1`` when ``M >= 2S-1``): the table is a parallelogram, and
    its only idle time is the ``S-1`` ticks of start and end skew. Every device holds at
    most ``min(2S-1, M)`` activations, about twice 1F1B's ``S``.

    Args:
      num_stages: ``S``, the devices on the pipe axis.
      num_microbatches: ``M``.

    Returns:
      The table (`get` validates it).
    """
    S, M = num_stages, num_microbatches
    orders = [
        _split_backward_order(d, M, warmup=2 * (S - d) - 1, weight_lag=2 * d) for d in range(S)
    ]
    return pack("zb_h2", S, M, list(range(S)), orders)


def v_placement(num_stages: int) -> list[int]:
    """V placement of ``2S`` stages: device ``d`` holds stages ``d`` and ``2S-1-d``.

    Args:
      num_stages: ``S``.

    Returns:
      The device of each of the ``2S`` logical stages.
    """
    S = num_stages
    return [s if s < S else 2 * S - 1 - s for s in range(2 * S)]


class _Counter:
    """Hands out the next micro-batch for each (op, stage); B and BW share one count."""

    def __init__(self):
        self.next: dict[tuple[str, int], int] = {}

    def take(self, op: str, stage: int) -> Action:
        key = (B if op == BW else op, stage)
        m = self.next.get(key, 0)
        self.next[key] = m + 1
        return Action(op, stage, m)

    def count(self, op: str, stage: int) -> int:
        return self.next.get((op, stage), 0)


@register("zbv")
def zbv(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-V: zero bubble with two stages per device in V placement (Qi et al., ICLR 2024, §6).

    Device ``d`` holds stages ``d`` (chunk 0) and ``2S-1-d`` (chunk 1); a micro-batch goes
    down the devices in chunk 0 and back up in chunk 1, so device 0 computes the loss.
    Per device: ``2(S-d)-1`` chunk-0 forwards, ``d`` pairs of chunk-1 and chunk-0 forwards,
    ``S-d`` rounds of chunk-1 F, B, W; then the steady phase, F, B, W on chunk 0 then on
    chunk 1; then the cool-down, ``d`` pairs of chunk-0 and chunk-1 B, ``S-d`` rounds of
    chunk-0 B and W, and the W's still owed (the phases of PyTorch's
    ``ScheduleZBVZeroBubble``). The order is built for ``max(M, 2S-1)`` micro-batches and
    those beyond ``M`` are dropped, so any ``M >= 1`` works. A device holds at most ``2S``
    chunk activations whatever ``M``; the bubble shrinks towards 0 as ``M`` grows.

    Args:
      num_stages: ``S``, the devices on the pipe axis.
      num_microbatches: ``M``.

    Returns:
      The table (`get` validates it).
    """
    S, M = num_stages, num_microbatches
    n = max(M, 2 * S - 1)
    orders = []
    for d in range(S):
        c0, c1 = d, 2 * S - 1 - d
        k = _Counter()
        order = [k.take(F, c0) for _ in range(2 * (S - d) - 1)]
        for _ in range(d):
            order += [k.take(F, c1), k.take(F, c0)]
        for _ in range(S - d):
            order += [k.take(F, c1), k.take(B, c1), k.take(W, c1)]
        while k.count(F, c0) < n or k.count(F, c1) < n:
            if k.count(F, c0) < n:
                order.append(k.take(F, c0))
            order += [k.take(B, c0), k.take(W, c0)]
            order += [k.take(F, c1), k.take(B, c1), k.take(W, c1)]
        for _ in range(d):
            order += [k.take(B, c0), k.take(B, c1)]
        for _ in range(S - d):
            order += [k.take(B, c0), k.take(W, c0)]
        order += [k.take(W, c1) for _ in range(n - k.count(W, c1))]
        order += [k.take(W, c0) for _ in range(n - k.count(W, c0))]
        orders.append([a for a in order if a.microbatch < M])
    return pack("zbv", S, M, v_placement(S), orders)


@register("interleaved_zb")
def interleaved_zb(num_stages: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Looped zero bubble: interleaved 1F1B whose W's fill the bubbles (Qi et al., ICLR 2024;
    the order of PyTorch's ``ScheduleInterleavedZeroBubble``, its ZB1P schedule).

    Placement and forward/backward order of `interleaved_1f1b` (chunk ``c`` of device ``d``
    is stage ``c*S + d``; ``max(1, M // S)`` rounds of ``g`` or ``g-1`` micro-batches, so any
    ``M >= 1`` works). Device ``d`` runs ``(v-1)*g + S-d-1`` warm-up forwards, then per step
    a forward, a B, and the W of the B ``d`` steps back (W's held back by ``d``, as in
    `zb_h1`); the held W's fill the cool-down. At the default costs every action lasts one
    tick: with ``M`` a multiple of ``S`` the table takes ``3vM + S - 1`` ticks, the least
    possible (device ``S-1`` cannot start before tick ``S-1``), so lock-step bubble
    ``(S-1)/(3vM+S-1)``, equal to the ideal. Every device holds at most
    ``min((v-1)*g + S, v*M)`` chunk activations: ``v*S`` when ``M`` is a multiple of ``S``,
    the peak of `zbv` for ``v = 2`` (whose early devices hold less, and which never holds more
    than ``2S`` whatever ``M``).

    Args:
      num_stages: ``S``, the devices on the pipe axis.
      num_microbatches: ``M``.
      virtual_stages: ``v``, the chunks per device.

    Returns:
      The table (`get` validates it).

    Raises:
      ValueError: if ``virtual_stages`` is not a positive int.
    """
    S, M, v = num_stages, num_microbatches, virtual_stages
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"interleaved_zb: virtual_stages must be a positive int, got {v!r}")
    forwards, backwards = interleaved_orders(S, M, v)
    g = max(rounds(S, M))
    total = v * M
    orders = []
    for d in range(S):
        warmup = min((v - 1) * g + S - d - 1, total)
        order = [Action(F, forwards[k][0] * S + d, forwards[k][1]) for k in range(warmup)]
        held: deque[Action] = deque()
        for k in range(total):
            if warmup + k < total:
                chunk, m = forwards[warmup + k]
                order.append(Action(F, chunk * S + d, m))
            chunk, m = backwards[k]
            order.append(Action(B, chunk * S + d, m))
            held.append(Action(W, chunk * S + d, m))
            if len(held) > d:
                order.append(held.popleft())
        order += held
        orders.append(order)
    stage_device = [s % S for s in range(S * v)]
    return pack("interleaved_zb", S, M, stage_device, orders, options={"virtual_stages": v})


@register("dualpipev")
def dualpipev(num_stages: int, num_microbatches: int, overlap: bool = False) -> Schedule:
    """DualPipeV, the V-shaped half of DeepSeek's DualPipe (deepseek-ai/DualPipe, dualpipev.py).

    V placement as in `zbv`: chunk 0 is stage ``d``, chunk 1 is stage ``2S-1-d``. Device ``d``
    runs eight phases (what each round holds; how many rounds):

    1. chunk-0 F, ``2(S-d-1)``;
    2. chunk-0 F, chunk-1 F, ``d+1``;
    3. chunk-1 B, the oldest W, chunk-1 F, ``S-d-1``;
    4. (chunk-0 F + chunk-1 BW), (chunk-1 F + chunk-0 BW), ``M-2S+d+1``: the main phase, each
       pair one two-action cell, a forward overlapped with the backward of another
       micro-batch (on device ``S-1`` the very first pair runs as two cells, as upstream);
    5. chunk-1 BW, (chunk-1 F + chunk-0 BW), ``S-d-1``;
    6. chunk-1 and chunk-0 backwards, ``d+1``, as BW in the first half, split B (W queued)
       from the middle on;
    7. the oldest W, chunk-0 B, ``S-d-1``;
    8. the oldest W, ``d+1``.

    W's run oldest first. Requires ``M >= 2S`` (upstream asserts ``num_chunks >= 2 *
    num_ranks``). A device holds at most ``2S+1`` chunk activations whatever ``M``.

    ``overlap=True`` keeps the pairs as two-action cells, as upstream runs them. A pair cell
    lasts as long as both its actions, and devices enter and leave phase 4 at different
    ticks, so lock-step pays for ticks where one device runs a pair (F + BW) and another a
    single action: its lock-step bubble is several times its ideal one. By default
    (``overlap=False``) every pair runs as its forward, then its backward, and every full
    backward as B then W: the same order, every action one tick at the default costs, so
    the lock-step bubble equals the ideal (that of `zbv`), at the same peak activations.

    Args:
      num_stages: ``S``, the devices on the pipe axis.
      num_microbatches: ``M``.
      overlap: keep each pair as one two-action cell.

    Returns:
      The table (`get` validates it).

    Raises:
      ValueError: if ``M < 2S`` or ``overlap`` is not a bool.
    """
    S, M = num_stages, num_microbatches
    if not isinstance(overlap, bool):
        raise ValueError(f"dualpipev: overlap must be True or False, got {overlap!r}")
    if M < 2 * S:
        raise ValueError(
            f"dualpipev needs num_microbatches >= 2 * num_stages = {2 * S}, got "
            f"num_microbatches={M} with num_stages={S} (device 0 runs M - 2S + 1 rounds of "
            f"overlapped pairs, and DeepSeek's DualPipeV asserts the same); use at least "
            f"{2 * S} micro-batches, or 'zbv', which takes any number"
        )
    orders = [_dualpipev_order(S, M, d) for d in range(S)]
    if overlap:
        return pack(
            "dualpipev", S, M, v_placement(S), orders, max_actions_per_tick=2,
            options={"overlap": True},
        )  # fmt: skip
    orders = [_unfold(order) for order in orders]
    return pack("dualpipev", S, M, v_placement(S), orders, options={"overlap": False})


def _unfold(order: list) -> list[Action]:
    """A device order with each two-action item run as two items (forward first) and each
    full backward as B then W."""
    out: list[Action] = []
    for item in order:
        for a in (item,) if isinstance(item, Action) else sorted(item, key=lambda a: a.op != F):
            if a.op == BW:
                out += [Action(B, a.stage, a.microbatch), Action(W, a.stage, a.microbatch)]
            else:
                out.append(a)
    return out


def _dualpipev_order(S: int, M: int, d: int) -> list:
    """Device ``d``'s order in `dualpipev`, phase by phase; a tuple is a two-action cell."""
    c0, c1 = d, 2 * S - 1 - d
    k = _Counter()
    queued: deque[Action] = deque()  # W's owed by split backwards, oldest first

    def split(stage: int) -> Action:
        b = k.take(B, stage)
        queued.append(Action(W, stage, b.microbatch))
        return b

    def weight() -> list[Action]:
        return [queued.popleft()] if queued else []

    order: list = [k.take(F, c0) for _ in range(2 * (S - d - 1))]  # 1
    for _ in range(d + 1):  # 2
        order += [k.take(F, c0), k.take(F, c1)]
    for _ in range(S - d - 1):  # 3
        order += [split(c1), *weight(), k.take(F, c1)]
    for i in range(M - 2 * S + d + 1):  # 4
        if i == 0 and d == S - 1:
            order += [k.take(F, c0), k.take(BW, c1)]
        else:
            order.append((k.take(F, c0), k.take(BW, c1)))
        order.append((k.take(F, c1), k.take(BW, c0)))
    for _ in range(S - d - 1):  # 5
        order += [k.take(BW, c1), (k.take(F, c1), k.take(BW, c0))]
    half, odd = (d + 1) // 2, d % 2 == 1
    for i in range(d + 1):  # 6
        order.append(split(c1) if i > half or (i == half and odd) else k.take(BW, c1))
        order.append(split(c0) if i >= half else k.take(BW, c0))
    for _ in range(S - d - 1):  # 7
        order += [*weight(), split(c0)]
    for _ in range(d + 1):  # 8
        order += weight()
    return order
