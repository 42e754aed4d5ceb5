"""The time of a fused attention kernel, which no compiler's estimate of a program sees.

The TPU compiler's cost analysis gives a Pallas kernel's custom call (splash attention) a
token time, and the CPU compiler, which counts a GPU program's work here, cannot build
cuDNN's. A program that runs attention in a fused kernel is therefore estimated around the
kernel, and the kernel's time is added from its shapes: its matrix products over the
(query, key) tiles it computes, at `EFFICIENCY` of the chip's peak. Both jaxpipe's own
predictions (``examples/train_llama.py``) and the calibration on published runs, whose
programs run splash attention (``benchmarks/calibration.py``), count a kernel this way, so
the calibrated scale corrects the same estimate it is applied to.

```python
import jaxpipe
costs = jaxpipe.kernels.attention_costs("splash", rows=4, seq=4096, heads=64, head_dim=128,
                                        peak_flops=459e12, recompute_forward=True)
```
"""

from __future__ import annotations

import dataclasses

from jaxpipe.schedules import Costs

# 0.5 is assumed, between the 35% of an H100's peak FlashAttention-2 reaches and the 75% of
# FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608); no measured figure of splash
# attention on a TPU was found. The calibration's scale absorbs a uniform error in it.
EFFICIENCY = 0.5


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
    """A fused attention kernel as its matrix products count it.

    Attributes:
        name: ``"splash"`` (the Pallas TPU kernel) or ``"cudnn"`` (cuDNN's flash attention).
        tile: the side of a (query, key) tile; a causal kernel skips the tiles wholly above
            the diagonal and computes those on and below it in full.
        backward_products: matrix products per tile in the backward: splash's dq kernel 3
            (scores, dP, dq) and its dk/dv kernel 4 (scores, dP, dv, dk); FlashAttention's
            single backward 5. The forward runs 2 (scores, and probabilities times values).
    """

    name: str
    tile: int
    backward_products: int


KERNELS = {
    "splash": AttentionKernel("splash", tile=512, backward_products=7),
    # splash with its backward in one kernel (MaxText's sa_use_fused_bwd_kernel)
    "splash_fused": AttentionKernel("splash_fused", tile=512, backward_products=5),
    "cudnn": AttentionKernel("cudnn", tile=128, backward_products=5),
}


def _kernel(name: str) -> AttentionKernel:
    if name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; expected one of {sorted(KERNELS)}")
    return KERNELS[name]


def tile_for(name: str, seq: int, tile: int | None = None) -> int:
    """The kernel's tile side for rows of ``seq`` tokens: ``tile`` (default its own),
    halved (down to 128) until it divides ``seq``, as splash's block sizes are chosen."""
    tile = tile or _kernel(name).tile
    while seq % tile and tile > 128:
        tile //= 2
    if seq % tile:
        raise ValueError(f"{name} attention needs a sequence that is a multiple of 128; got {seq}")
    return tile


def attention_flops(
    name: str,
    *,
    rows: int,
    seq: int,
    heads: int,
    head_dim: int,
    causal: bool = True,
    tile: int | None = None,
) -> tuple[float, float]:
    """(forward, backward) FLOPs of one call of kernel ``name`` on ``rows`` rows of ``seq``
    tokens and ``heads`` query heads of ``head_dim``: 2 x head_dim FLOPs per (query, key)
    pair and matrix product, over the tiles the kernel computes (with ``causal``, those on
    and below the diagonal; ``tile``: their side, default the kernel's, see `tile_for`)."""
    kernel, tile = _kernel(name), tile_for(name, seq, tile)
    tiles = seq // tile
    computed = tiles * (tiles + 1) // 2 if causal else tiles * tiles
    product = 2.0 * rows * heads * computed * tile * tile * head_dim
    return 2 * product, kernel.backward_products * product


def costs_of_flops(
    forward: float,
    backward: float,
    *,
    peak_flops: float,
    recompute_forward: bool,
    efficiency: float = EFFICIENCY,
) -> Costs:
    """A kernel's seconds in one block's F, B, W and BW from its ``forward`` and
    ``backward`` FLOPs at ``efficiency`` of ``peak_flops``.

    F runs its forward. With ``recompute_forward`` (remat that keeps no kernel output, as a
    policy saving only matrix products of weights does) B and W run the forward again (W for
    the output projection's weight gradient), and B and BW run its backward."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency is a share of the chip's peak in (0, 1]; got {efficiency}")
    rate = efficiency * peak_flops
    again = forward / rate if recompute_forward else 0.0
    return Costs(
        forward=forward / rate,
        backward_input=again + backward / rate,
        backward_weight=again,
        full_backward=again + backward / rate,
    )


def attention_costs(
    name: str,
    *,
    rows: int,
    seq: int,
    heads: int,
    head_dim: int,
    peak_flops: float,
    recompute_forward: bool,
    causal: bool = True,
    tile: int | None = None,
    efficiency: float = EFFICIENCY,
) -> Costs:
    """Kernel ``name``'s seconds in one block's F, B, W and BW (`costs_of_flops` of
    `attention_flops`)."""
    forward, backward = attention_flops(
        name, rows=rows, seq=seq, heads=heads, head_dim=head_dim, causal=causal, tile=tile
    )
    return costs_of_flops(
        forward,
        backward,
        peak_flops=peak_flops,
        recompute_forward=recompute_forward,
        efficiency=efficiency,
    )
