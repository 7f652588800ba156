"""The chunked DCT against an independent float64 computation, and its plan against DeMo's rules."""

import math

import pytest
import torch

from shoal.compression import DCTTopKCodec, dct


def cos_basis_f64(n: int) -> torch.Tensor:
    """DCT-II written element by element from its definition (not the library's vectorized one)."""
    basis = torch.empty(n, n, dtype=torch.float64)
    for k in range(n):
        scale = math.sqrt(1 / n) if k == 0 else math.sqrt(2 / n)
        for i in range(n):
            basis[k, i] = scale * math.cos(math.pi * (2 * i + 1) * k / (2 * n))
    return basis


def tile_coefficients_f64(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """(num_chunks, rows*cols) coefficients, tiles in row-major order, by an explicit loop."""
    m = x.double().reshape(-1, x.shape[-1])
    cr, cc = cos_basis_f64(rows), cos_basis_f64(cols)
    out = []
    for r0 in range(0, m.shape[0], rows):
        for c0 in range(0, m.shape[1], cols):
            out.append((cr @ m[r0 : r0 + rows, c0 : c0 + cols] @ cc.T).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 48, 64, 256])
def test_basis_is_orthonormal_and_matches_definition(n):
    basis = dct.dct_basis(n, torch.device("cpu"), torch.float64)
    torch.testing.assert_close(basis @ basis.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(basis, cos_basis_f64(n), atol=1e-12, rtol=0)


def test_basis_is_cached_per_size_device_dtype():
    cpu = torch.device("cpu")
    assert dct.dct_basis(64, cpu, torch.float32) is dct.dct_basis(64, cpu, torch.float32)
    assert dct.dct_basis(64, cpu, torch.float32) is not dct.dct_basis(64, cpu, torch.float64)


@pytest.mark.parametrize(
    ("shape", "chunk", "tile"),
    [
        ((768, 3072), 64, (64, 64)),
        ((50304, 768), 64, (64, 64)),
        ((50257, 768), 64, (29, 64)),
        ((768,), 64, (1, 64)),
        ((131,), 64, (1, 1)),
        ((10, 6, 40), 16, (6, 10)),
        ((1, 768), 64, (1, 64)),
        ((97, 89), 64, (1, 1)),
    ],
)
def test_chunk_plan_takes_largest_divisor_per_dimension(shape, chunk, tile):
    plan = dct.ChunkPlan.for_shape(shape, chunk)
    assert (plan.chunk_rows, plan.chunk_cols) == tile
    assert plan.num_chunks * plan.chunk_numel == math.prod(shape)


@pytest.mark.parametrize("shape", [(128, 192), (96,), (4, 12, 20), (7, 5), (3, 131)])
def test_forward_matches_float64_definition(shape):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64)
    plan = dct.ChunkPlan.for_shape(shape, 64)
    workspace = dct.Workspace()
    coeffs = dct.forward(x, plan, workspace)
    tiles = coeffs.reshape(plan.matrix_layout()).transpose(1, 2).reshape(plan.num_chunks, plan.chunk_numel)
    torch.testing.assert_close(tiles, tile_coefficients_f64(x, plan.chunk_rows, plan.chunk_cols))


def test_inverse_dense_and_sparse_agree_with_definition():
    torch.manual_seed(1)
    plan = dct.ChunkPlan.for_shape((128, 64), 64)
    indices = torch.stack(
        [torch.randperm(plan.chunk_numel)[:5].sort().values for _ in range(plan.num_chunks)]
    )
    values = torch.randn(plan.num_chunks, 5, dtype=torch.float64)
    tiles = torch.zeros(plan.num_chunks, plan.chunk_numel, dtype=torch.float64).scatter_(1, indices, values)
    expected = torch.cat([cos_basis_f64(64).T @ t.view(64, 64) @ cos_basis_f64(64) for t in tiles])
    workspace = dct.Workspace()
    torch.testing.assert_close(dct.inverse_dense(tiles, plan, workspace), expected)
    torch.testing.assert_close(dct.inverse_sparse(indices, values, plan, workspace), expected)


@pytest.mark.parametrize("topk", [1, 4, 32, 200])
def test_kept_energy_is_sum_of_k_largest_squared_coefficients(topk):
    torch.manual_seed(2)
    x = torch.randn(192, 128, dtype=torch.float64)
    codec = DCTTopKCodec(chunk=64, topk=topk, value_bits=32)
    reconstruction = codec.decode(codec.encode(x)).double()
    coefficients = tile_coefficients_f64(x, 64, 64)
    expected = coefficients.square().topk(topk, dim=1).values.sum()
    # Parseval: the orthonormal inverse keeps energy, so ||x_hat||^2 = sum of kept squares
    torch.testing.assert_close(reconstruction.square().sum(), expected, rtol=1e-5, atol=0)
    # and what is left out is exactly the rest of the energy
    torch.testing.assert_close(
        (x - reconstruction).square().sum(), x.square().sum() - expected, rtol=1e-4, atol=1e-6
    )


def test_workspace_grows_and_reuses():
    workspace = dct.Workspace()
    small = workspace.get(0, 10, torch.device("cpu"), torch.float32)
    large = workspace.get(0, 1000, torch.device("cpu"), torch.float32)
    again = workspace.get(0, 500, torch.device("cpu"), torch.float32)
    assert small.numel() == 10 and large.numel() == 1000 and again.numel() == 500
    assert again.data_ptr() == large.data_ptr()
