"""The time of a fused attention kernel (jaxpipe.analysis.kernels): its FLOPs against XLA's
count of the same products, the causal tiles counted from the mask, and F, B, W and BW."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.analysis import kernels


def _computed_pairs(seq, tile):
    """(query, key) pairs in the tiles a causal kernel computes: a tile is computed where
    any of its pairs is unmasked (key at or before query), and then in full."""
    mask = np.tril(np.ones((seq, seq), bool))
    tiles = mask.reshape(seq // tile, tile, seq // tile, tile).any(axis=(1, 3))
    return int(tiles.sum()) * tile * tile


@pytest.mark.parametrize(
    "name, seq, tile",
    [("splash", 2048, None), ("splash", 384, None), ("cudnn", 1024, None),
     ("splash_fused", 4096, 2048)],
)  # fmt: skip
def test_causal_flops_are_the_products_over_the_tiles_the_mask_reaches(name, seq, tile):
    rows, heads, head_dim = 3, 4, 64
    tile = kernels.tile_for(name, seq, tile)
    assert seq % tile == 0
    forward, backward = kernels.attention_flops(
        name, rows=rows, seq=seq, heads=heads, head_dim=head_dim, tile=tile
    )
    product = 2 * rows * heads * _computed_pairs(seq, tile) * head_dim
    assert forward == 2 * product
    assert backward == kernels.KERNELS[name].backward_products * product


def test_full_attention_forward_is_what_xla_counts_for_its_two_products():
    """Without the causal mask the kernel's forward FLOPs are XLA's count of scores and
    probabilities times values, compiled (softmax's few FLOPs a score aside)."""
    rows, heads, seq, head_dim = 2, 4, 512, 64
    q = jax.ShapeDtypeStruct((rows, heads, seq, head_dim), jnp.float32)

    def products(q, k, v):
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, k)
        return jnp.einsum("bhqk,bhkd->bhqd", scores, v)

    counted = jax.jit(products).lower(q, q, q).compile().cost_analysis()
    counted = counted[0] if isinstance(counted, list) else counted
    forward, _ = kernels.attention_flops(
        "splash", rows=rows, seq=seq, heads=heads, head_dim=head_dim, causal=False
    )
    assert forward == pytest.approx(counted["flops"], rel=1e-6)


@pytest.mark.parametrize("recompute", [True, False])
def test_costs_put_the_forward_in_f_and_again_in_b_and_w_under_remat(recompute):
    shape = dict(rows=2, seq=1024, heads=8, head_dim=128)
    peak, efficiency = 4e14, 0.4
    forward, backward = kernels.attention_flops("cudnn", **shape)
    f, b = forward / (efficiency * peak), backward / (efficiency * peak)
    costs = kernels.attention_costs(
        "cudnn", **shape, peak_flops=peak, recompute_forward=recompute, efficiency=efficiency
    )
    again = f if recompute else 0.0
    assert costs.forward == pytest.approx(f)
    assert costs.backward_input == pytest.approx(again + b)
    assert costs.backward_weight == pytest.approx(again)
    assert costs.full_backward == pytest.approx(again + b)


def test_tiles_halve_to_divide_the_sequence_and_bad_inputs_are_refused():
    assert kernels.tile_for("splash", 4096) == 512
    assert kernels.tile_for("splash", 768) == 256
    assert kernels.tile_for("splash", 640) == 128
    assert kernels.tile_for("splash_fused", 8192, tile=2048) == 2048
    with pytest.raises(ValueError, match="multiple of 128; got 100"):
        kernels.tile_for("splash", 100)
    with pytest.raises(ValueError, match="unknown attention kernel 'flash'"):
        kernels.attention_flops("flash", rows=1, seq=128, heads=1, head_dim=8)
    with pytest.raises(ValueError, match=r"in \(0, 1\]; got 50"):
        kernels.attention_costs(
            "splash", rows=1, seq=128, heads=1, head_dim=8, peak_flops=1.0,
            recompute_forward=False, efficiency=50,
        )  # fmt: skip
