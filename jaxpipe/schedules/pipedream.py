"""Asynchronous schedules: PipeDream (weight stashing) and PipeDream-2BW.

Both run the 1F1B order of `jaxpipe.schedules.basic` (device ``d`` runs ``min(S-d-1, M)``
warm-up forwards, then one forward and one backward in turn, then drains its backwards), but
without a flush: each stage updates its own weights while later micro-batches are still in
the pipeline (Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN
Training", SOSP 2019; "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021).

Weight updates are data: the tables hold ``U`` actions (`jaxpipe.schedules.actions`), one at
the end of the tick of the last backward (W, or BW) of each group of micro-batches on each
stage, so a table saved to CSV and loaded under any name updates at the same points.

Weight versions. Each stage ``s`` starts the table with version 0 of its weights (the
parameters the caller passes in). Every ``U`` of stage ``s`` makes the next version
(1, 2, ...). ``Action.version`` is the version the action reads:

- ``F(s, m)`` reads the newest version of stage ``s`` at its tick, i.e. the number of U's
  of stage ``s`` in earlier ticks.
- the backward of ``(s, m)`` (``BW``, or ``B`` and ``W``) reads the version its ``F`` read
  (weight stashing), so the forward and the backward of a micro-batch see the same weights.

Update points. The micro-batches are cut, in index order, into groups of ``G`` (1 for
``pipedream``, ``update_interval`` for ``pipedream_2bw``): group ``k`` is ``kG ..
min((k+1)G, M) - 1``; the last group may be shorter. The update applies the optimizer to
the newest version of stage ``s``, with the mean of the group's per-micro-batch weight
gradients of stage ``s``, each computed at the version that micro-batch read; see
`update_points`. `validate` checks the versions of every table; the version bookkeeping
lives in `jaxpipe.schedules.versions`, re-exported here.

Both split each backward into B then W by default (``split_backward=True``), as `1f1b`
does: every action lasts one tick at the default costs, so the lock-step bubble equals the
ideal. The U follows the W; since a device runs its actions in order, each forward reads
the same version as with full backwards. ``split_backward=False`` gives full backwards.
"""

from __future__ import annotations

from jaxpipe.schedules.basic import _check_bool, one_f_one_b_orders
from jaxpipe.schedules.core import Schedule
from jaxpipe.schedules.packing import pack
from jaxpipe.schedules.registry import register
from jaxpipe.schedules.validation import validate
from jaxpipe.schedules.versions import add_updates, stamp_versions, update_points, weight_versions

__all__ = [
    "pipedream",
    "pipedream_2bw",
    "stamp_versions",
    "update_points",
    "validate_versions",
    "weight_versions",
]


@register("pipedream")
def pipedream(num_stages: int, num_microbatches: int, split_backward: bool = True) -> Schedule:
    """Asynchronous 1F1B with weight stashing (PipeDream, Narayanan et al., SOSP 2019).

    Stage ``s`` applies an optimizer update (a ``U``) right after every backward, using that
    one micro-batch's gradient (``G = 1``). ``F(s, m)`` reads version
    ``max(0, m - (S-s-1))``: the warm-up forwards read version 0, every later forward reads
    one version newer than the one before. Device ``d`` keeps ``S-d`` weight versions once
    ``M >= 2(S-d) - 1`` (the first stage the most, the last one), never more than
    ``min(S-d, M)``; see `weight_versions`. The order and the activations held are those of
    ``1f1b`` (at most ``min(S-d, M)`` on device ``d``).

    Args:
      num_stages: ``S``, the devices on the pipe axis.
      num_microbatches: ``M``.
      split_backward: run each backward as B then W (the default), or as one BW.

    Returns:
      The table with its ``U`` actions and versions (`get` validates it).

    Raises:
      ValueError: if ``split_backward`` is not a bool.
    """
    S, M = num_stages, num_microbatches
    _check_bool("pipedream", "split_backward", split_backward)
    orders = one_f_one_b_orders(S, M, split_backward)
    options = {"split_backward": split_backward}
    table = pack("pipedream", S, M, list(range(S)), orders, options=options)
    return add_updates(table, every=1)


@register("pipedream_2bw")
def pipedream_2bw(
    num_stages: int,
    num_microbatches: int,
    update_interval: int | None = None,
    split_backward: bool = True,
) -> Schedule:
    """PipeDream-2BW: 1F1B without flush, double-buffered weights (Narayanan et al., ICML 2021).

    The micro-batches are cut into groups of ``update_interval`` (``G``, default ``S``):
    group ``k`` is ``kG .. min((k+1)G, M) - 1``. Stage ``s`` applies one update (a ``U``)
    per group, at the end of the tick of the backward of the group's last micro-batch on
    stage ``s``; the update applies the optimizer to the newest version of stage ``s``
    (version ``k``) with the mean of the group's weight gradients of stage ``s``, each
    computed at the version its micro-batch read. ``F(s, m)`` reads version
    ``floor(max(0, m - (S-s-1)) / G)``: every micro-batch of group ``k`` reads version ``k``
    or ``k-1``, so the update is ``W(k+1) = W(k) - lr * mean(grad at W(k) or W(k-1))``: at
    most one version stale.

    ``G >= S`` is required: then, when stage ``s`` makes version ``k+1``, every micro-batch
    still in flight on it reads version ``k``, so version ``k-1`` is free and two weight
    buffers per stage suffice (`weight_versions` <= 2 on every device).

    Args:
      num_stages: ``S``, the devices on the pipe axis.
      num_microbatches: ``M``.
      update_interval: ``G``, the micro-batches per update (default ``S``; at least ``S``).
      split_backward: run each backward as B then W (the default), or as one BW.

    Returns:
      The table with its ``U`` actions and versions (`get` validates it).

    Raises:
      ValueError: if ``update_interval < S`` or ``split_backward`` is not a bool.
    """
    S, M = num_stages, num_microbatches
    G = S if update_interval is None else update_interval
    if not isinstance(G, int) or isinstance(G, bool) or G < S:
        raise ValueError(
            f"pipedream_2bw: update_interval={update_interval!r} with num_stages={S}; "
            f"update_interval must be an int >= num_stages ({S}), so that each stage needs "
            f"at most two weight versions. Pass update_interval >= {S}, or leave it out "
            f"(default {S})."
        )
    _check_bool("pipedream_2bw", "split_backward", split_backward)
    orders = one_f_one_b_orders(S, M, split_backward)
    options = {"update_interval": G, "split_backward": split_backward}
    table = pack("pipedream_2bw", S, M, list(range(S)), orders, options=options)
    return add_updates(table, every=G)


def validate_versions(schedule: Schedule) -> Schedule:
    """Checks a table, its ``U`` actions and its version fields: `validate` under the name
    that says what the asynchronous schedules need from it.

    Args:
      schedule: the table.

    Returns:
      ``schedule``.

    Raises:
      ValueError: as `validate`; for versions, an ``F(s, m)`` that does not read the number
        of U's of stage ``s`` in earlier ticks, or a backward of ``(s, m)`` that does not
        read the version its ``F`` read.
    """
    return validate(schedule)
