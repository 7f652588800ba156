"""DeMo's canonical direction (shoal.compression.dct.inverse_signs): the sign of the inverse DCT from
products of integers held in float64, exact in whatever order a matrix product adds them, so every
device gets the same bits; and where the float inverse's sign is settled, the same sign."""

import math

import pytest
import torch

from shoal.compression import dct


def sparse_tiles(plan: dct.ChunkPlan, kept: float, generator: torch.Generator) -> torch.Tensor:
    tiles = torch.randn(plan.num_chunks, plan.chunk_numel, generator=generator)
    return tiles * (torch.rand(tiles.shape, generator=generator) < kept)


def integer_reference(tiles: torch.Tensor, plan: dct.ChunkPlan) -> torch.Tensor:
    """The same two integer stages in int64, summed in reverse order element by element: exact by
    construction, in another order than any matrix product's."""
    r, c = plan.chunk_rows, plan.chunk_cols
    x = tiles.view(plan.num_chunks, r, c).double()
    cpu = torch.device("cpu")
    if c > 1:
        x = dct._to_integers(x.clone(), 52 - dct.EXACT_BASIS_BITS - math.ceil(math.log2(c)))
        basis, values = dct.integer_basis(c, cpu).long(), x.long()
        y = torch.zeros_like(values)
        for q in reversed(range(c)):
            y += values[:, :, q : q + 1] * basis[q]
        x = y.double()
    if r > 1:
        x = dct._to_integers(x, 52 - dct.EXACT_BASIS_BITS - math.ceil(math.log2(r)))
        basis, values = dct.integer_basis(r, cpu).long(), x.long()
        y = torch.zeros_like(values)
        for i in reversed(range(r)):
            y += basis[i].view(1, r, 1) * values[:, i : i + 1, :]
        x = y.double()
    return x.sign().float().view(plan.tile_layout()).transpose(1, 2).reshape(plan.shape)


@pytest.mark.parametrize("shape", [(128, 192), (96, 48), (300,), (5, 7), (64, 3, 3)])
def test_the_signs_equal_an_integer_sum_in_another_order(shape):
    generator = torch.Generator().manual_seed(sum(shape))
    plan = dct.ChunkPlan.for_shape(shape, 64)
    workspace = dct.Workspace()
    for kept in (0.02, 1.0):
        tiles = sparse_tiles(plan, kept, generator)
        exact = dct.inverse_signs(tiles, plan, workspace)
        reference = integer_reference(tiles, plan)
        assert exact.dtype == torch.float32 and torch.equal(exact, reference)
        # away from zero, the float inverse's sign
        float_inverse = dct.inverse_dense(tiles.clone(), plan, workspace)
        settled = float_inverse.abs() > 1e-4 * float_inverse.abs().max()
        assert torch.equal(exact[settled], float_inverse.sign()[settled])


def test_values_near_zero_get_their_true_sign_and_exact_zeros_stay_zero():
    """Two coefficients at mirrored frequencies, x[a, b] = -x[b, a]: the diagonal is exactly 0 in any
    order of sums. With one of them 2^-20 smaller, the diagonal is that small against the tile (where
    a float32 inverse's rounding can give either sign) and gets the sign of the exact inverse."""
    plan = dct.ChunkPlan.for_shape((8, 8), 8)
    workspace = dct.Workspace()
    tiles = torch.zeros(1, 64)
    tiles[0, 1 * 8 + 2], tiles[0, 2 * 8 + 1] = 1.0, -1.0
    mirrored = dct.inverse_signs(tiles, plan, workspace).view(8, 8)
    assert torch.equal(mirrored, integer_reference(tiles, plan))
    assert torch.equal(mirrored.diagonal(), torch.zeros(8)) and mirrored.abs().sum() > 0
    tiles[0, 2 * 8 + 1] = -(1.0 - 2.0**-20)
    near = dct.inverse_signs(tiles, plan, workspace).view(8, 8)
    basis = dct.dct_basis(8, torch.device("cpu"), torch.float64)
    true = basis.T @ tiles.view(8, 8).double() @ basis  # float64: 2^-20 is far above its rounding
    assert torch.equal(near.diagonal(), true.diagonal().sign().float())
    assert torch.equal(near, integer_reference(tiles, plan))


def test_non_finite_and_huge_coefficients_give_signs_never_nan():
    plan = dct.ChunkPlan.for_shape((256,), 64)  # one row of four tiles
    tiles = torch.zeros(plan.num_chunks, plan.chunk_numel)
    tiles[0, 0], tiles[0, 5], tiles[1, 3] = float("nan"), float("inf"), 3e38
    tiles[2, 7], tiles[3, 1] = 1e-45, -float("inf")  # a subnormal alone in its tile still has a sign
    signs = dct.inverse_signs(tiles, plan, dct.Workspace())
    assert torch.isfinite(signs).all() and set(signs.unique().tolist()) <= {-1.0, 0.0, 1.0}
    assert signs.view(4, 64)[2].abs().sum() > 0


def test_it_writes_into_the_tensor_it_reads_when_asked():
    plan = dct.ChunkPlan.for_shape((64, 64), 64)
    tiles = sparse_tiles(plan, 0.1, torch.Generator().manual_seed(3))
    expected = dct.inverse_signs(tiles, plan, dct.Workspace())
    aliased = tiles.clone()
    assert torch.equal(dct.inverse_signs(aliased, plan, dct.Workspace(), out=aliased), expected)
