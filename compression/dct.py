"""Chunked orthonormal DCT-II over whole tensors, as DeMo (arXiv 2411.19870, section 3) uses it.

A tensor is viewed as a matrix (a 1-D tensor is one row; more dimensions fold their leading dims
into rows) and cut into tiles of `chunk_rows x chunk_cols`, where each side is the largest divisor of
its dimension that is at most the requested chunk. Every tile gets the separable 2-D transform
`T = C_r @ X @ C_c^T` with the orthonormal DCT-II matrices `C_n[k, i] = s_k cos(pi (2i + 1) k / 2n)`.

All tiles are transformed together by two large matrix products (no loop over tiles):
the row transform is a batched product over row bands, the column transform one GEMM over all rows.
The result stays in the matrix layout `(tile_row, r, tile_col, c)`; only the magnitudes are copied
into tile-major order, fused with `abs`, for top-k. Large intermediates live in a `Workspace` that is
reused across calls, because on CPU every fresh large temporary costs page faults, several times the
operation itself.
"""

import math
from dataclasses import dataclass
from functools import lru_cache

import torch


@lru_cache(maxsize=64)
def dct_basis(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The orthonormal DCT-II matrix (n, n): row k is frequency k, so `coeffs = basis @ signal`."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    basis = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    basis[0] /= math.sqrt(2.0)
    return basis.to(device=device, dtype=dtype)


def largest_divisor_at_most(size: int, limit: int) -> int:
    """The largest divisor of `size` that is <= `limit` (1 for a prime larger than `limit`)."""
    for candidate in range(min(size, limit), 0, -1):
        if size % candidate == 0:
            return candidate
    return 1


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """How a tensor of `shape` is cut into DCT tiles.

    The tensor is viewed as a `rows x cols` matrix and cut into `chunk_rows x chunk_cols` tiles,
    numbered row-major: tile `t` covers tile-row `t // tiles_per_row` and tile-column
    `t % tiles_per_row`.
    """

    shape: tuple[int, ...]
    rows: int
    cols: int
    chunk_rows: int
    chunk_cols: int

    @staticmethod
    def for_shape(shape: tuple[int, ...], chunk: int) -> "ChunkPlan":
        """The plan DeMo's reference uses: per dimension, the largest divisor <= `chunk`."""
        if len(shape) == 0 or math.prod(shape) == 0:
            raise ValueError(f"a DCT plan needs a non-empty tensor of >= 1 dims, got shape {shape}")
        cols = shape[-1]
        last_rows = shape[-2] if len(shape) >= 2 else 1
        rows = math.prod(shape[:-1])
        return ChunkPlan(
            shape=tuple(shape),
            rows=rows,
            cols=cols,
            chunk_rows=largest_divisor_at_most(last_rows, chunk),
            chunk_cols=largest_divisor_at_most(cols, chunk),
        )

    @staticmethod
    def bands(num_chunks: int, chunk_rows: int, chunk_cols: int) -> "ChunkPlan":
        """A batch of tiles stacked as row bands: the `(num_chunks * r, c)` matrix whose tile t is
        rows `[t r, (t + 1) r)`. How DeMo transforms every tensor of one chunk shape at once."""
        rows = num_chunks * chunk_rows
        return ChunkPlan((rows, chunk_cols), rows, chunk_cols, chunk_rows, chunk_cols)

    @property
    def chunk_numel(self) -> int:
        return self.chunk_rows * self.chunk_cols

    @property
    def tiles_per_row(self) -> int:
        return self.cols // self.chunk_cols

    @property
    def num_chunks(self) -> int:
        return (self.rows // self.chunk_rows) * self.tiles_per_row

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    def matrix_layout(self) -> tuple[int, int, int, int]:
        """(tile_row, r, tile_col, c): the matrix view with tiles made explicit."""
        return (self.rows // self.chunk_rows, self.chunk_rows, self.tiles_per_row, self.chunk_cols)

    def tile_layout(self) -> tuple[int, int, int, int]:
        """(tile_row, tile_col, r, c): tile-major order, each tile contiguous."""
        return (self.rows // self.chunk_rows, self.tiles_per_row, self.chunk_rows, self.chunk_cols)


class Workspace:
    """Scratch buffers reused across transforms; not thread-safe (one per codec per thread).

    Holds at most two buffers the size of the largest tensor transformed so far.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}

    def get(self, slot: int, numel: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (slot, device, dtype)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            self._buffers.pop(key, None)  # free the old one before allocating the larger one
            buffer = torch.empty(numel, device=device, dtype=dtype)
            self._buffers[key] = buffer
        return buffer[:numel]


def forward(x: torch.Tensor, plan: ChunkPlan, workspace: Workspace) -> torch.Tensor:
    """DCT coefficients of every tile of `x`, in matrix layout `plan.matrix_layout()`.

    `x` must be a floating tensor of `plan.shape`; the result is a view into `workspace` slot 0 or 1,
    valid until the next call that uses the workspace.
    """
    tile_rows, r, tiles_per_row, c = plan.matrix_layout()
    device, dtype = x.device, x.dtype
    coeffs = x.reshape(plan.rows, plan.cols)
    if r > 1:  # row transform, one (r x r) @ (r x cols) product per band of r rows
        out = workspace.get(0, plan.numel, device, dtype).view(tile_rows, r, plan.cols)
        coeffs = torch.matmul(dct_basis(r, device, dtype), coeffs.view(tile_rows, r, plan.cols), out=out)
    if c > 1:  # column transform, one GEMM over all (rows * tiles_per_row) segments of c values
        out = workspace.get(1, plan.numel, device, dtype).view(plan.rows * tiles_per_row, c)
        coeffs = torch.matmul(coeffs.reshape(-1, c), dct_basis(c, device, dtype).T, out=out)
    return coeffs.reshape(tile_rows, r, tiles_per_row, c)


def tile_magnitudes(coeffs: torch.Tensor, plan: ChunkPlan, workspace: Workspace) -> torch.Tensor:
    """|coeffs| reordered tile-major, (num_chunks, chunk_numel), in one pass.

    `coeffs` comes from `forward`, which leaves them in slot 1 after a column transform and in slot 0
    after a row transform alone; the magnitudes take the other slot.
    """
    slot = 0 if plan.chunk_cols > 1 else 1
    magnitudes = workspace.get(slot, plan.numel, coeffs.device, coeffs.dtype).view(plan.tile_layout())
    torch.abs(coeffs.view(plan.matrix_layout()).transpose(1, 2), out=magnitudes)
    return magnitudes.view(plan.num_chunks, plan.chunk_numel)


def matrix_offsets(indices: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """Flat offsets into the matrix layout of the chunk-local `indices` (num_chunks, k)."""
    tile = torch.arange(plan.num_chunks, device=indices.device)[:, None]
    row = (tile // plan.tiles_per_row) * plan.chunk_rows + indices // plan.chunk_cols
    col = (tile % plan.tiles_per_row) * plan.chunk_cols + indices % plan.chunk_cols
    return row * plan.cols + col


def inverse_dense(
    tiles: torch.Tensor, plan: ChunkPlan, workspace: Workspace, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The tensor whose tile coefficients are `tiles` (num_chunks, chunk_numel), of plan.shape: a new
    tensor, or `out` (plan.numel elements, not aliasing workspace slots 0 and 1) if given."""
    r, c = plan.chunk_rows, plan.chunk_cols
    device, dtype = tiles.device, tiles.dtype
    x = tiles.view(plan.num_chunks, r, c)
    if c > 1:
        scratch = workspace.get(0, plan.numel, device, dtype).view(-1, c)
        x = torch.matmul(x.reshape(-1, c), dct_basis(c, device, dtype), out=scratch).view(
            plan.num_chunks, r, c
        )
    if r > 1:
        x = torch.matmul(
            dct_basis(r, device, dtype).T,
            x,
            out=workspace.get(1, plan.numel, device, dtype).view(plan.num_chunks, r, c),
        )
    return _tiles_to_tensor(x, plan, out)


def inverse_sparse(
    indices: torch.Tensor,
    values: torch.Tensor,
    plan: ChunkPlan,
    workspace: Workspace,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The tensor whose only non-zero tile coefficients are `values` at chunk-local `indices`: a new
    tensor, or `out` (plan.numel elements, not aliasing workspace slot 0) if given.

    Each tile is `sum_j v_j outer(C_r[row_j], C_c[col_j])`: one batched product with inner size k,
    2 k r c multiply-adds per tile instead of the dense inverse's 2 r c (r + c). Duplicate indices
    within a tile add up. `indices` and `values` are (num_chunks, k).
    """
    device, dtype = values.device, values.dtype
    r, c = plan.chunk_rows, plan.chunk_cols
    row_basis = dct_basis(r, device, dtype)[indices // c] * values.unsqueeze(-1)  # (chunks, k, r)
    col_basis = dct_basis(c, device, dtype)[indices % c]  # (chunks, k, c)
    scratch = workspace.get(0, plan.numel, device, dtype).view(plan.num_chunks, r, c)
    tiles = torch.bmm(row_basis.transpose(1, 2), col_basis, out=scratch)
    return _tiles_to_tensor(tiles, plan, out)


def sparse_is_cheaper(k: int, plan: ChunkPlan) -> bool:
    """Whether `inverse_sparse` beats `inverse_dense` for k values per tile.

    By multiply-adds the sparse inverse wins while k < r + c, but its batched product of inner size
    k runs far below GEMM speed: measured on 64x64 chunks (2 CPU cores), sparse is 3-20x faster for
    k <= 16, even at k = 32, and slower at k = 64. So the cut is at (r + c) / 4.
    """
    return 4 * k <= plan.chunk_rows + plan.chunk_cols


def _tiles_to_tensor(tiles: torch.Tensor, plan: ChunkPlan, out: torch.Tensor | None = None) -> torch.Tensor:
    if out is None:
        out = torch.empty(plan.numel, device=tiles.device, dtype=tiles.dtype)
    tensor = out.view(plan.matrix_layout())
    tensor.copy_(tiles.view(plan.tile_layout()).transpose(1, 2))
    return tensor.view(plan.shape)


EXACT_BASIS_BITS = 22
"""The integer DCT basis of `inverse_signs`: round(C * 2^22), |entries| <= 2^22."""
_EXACT_LIMIT_BITS = 52
"""float64 holds every integer up to 2^53: products and sums of integers that stay at or below 2^52
are exact, whatever order or fused multiply-adds a matrix product uses."""


@lru_cache(maxsize=64)
def integer_basis(n: int, device: torch.device) -> torch.Tensor:
    """round(C_n * 2^EXACT_BASIS_BITS) as float64 integers, from Python's own cos and rounding on the
    host (one table whatever the device or its vector kernels), moved to `device`."""
    scale = 2.0**EXACT_BASIS_BITS
    rows = [
        [float(round(math.cos(math.pi * (2 * i + 1) * k / (2 * n)) * _norm(k, n) * scale)) for i in range(n)]
        for k in range(n)
    ]
    return torch.tensor(rows, dtype=torch.float64).to(device)


def _norm(k: int, n: int) -> float:
    """The orthonormal DCT-II's scale of frequency `k` of `n`."""
    return math.sqrt((1.0 if k else 0.5) * 2.0 / n)


def _to_integers(x: torch.Tensor, bits: int) -> torch.Tensor:
    """`x` (num_chunks, ...; float64, finite) scaled per tile by a power of two so that its largest
    magnitude lies in [2^(bits-1), 2^bits), then rounded to integers (half to even), in place. A power
    of two scales exactly and keeps every sign; each tile's scale is its own."""
    peak = x.abs().amax(dim=tuple(range(1, x.dim())), keepdim=True)
    _, exponent = torch.frexp(peak)  # peak < 2^exponent (0 for an all-zero tile)
    # 2^(bits - exponent) built from its bits (exponent field, zero mantissa): exact on every device
    scale = ((bits - exponent).to(torch.int64) + 1023).bitwise_left_shift_(52).view(torch.float64)
    return x.mul_(scale).round_()


def inverse_signs(
    tiles: torch.Tensor, plan: ChunkPlan, workspace: Workspace, out: torch.Tensor | None = None
) -> torch.Tensor:
    """sign(inverse DCT of `tiles`) (num_chunks, chunk_numel), of plan.shape: the same bits on every
    device (shoal.peer.algorithms.canonical). The float inverse's matrix products round in an order
    and with fused multiply-adds that differ between CPUs and GPUs, which can flip the sign of a
    value near zero. Here each stage is a product of integers held in float64, small enough that
    every partial sum is exact: the coefficients scaled per tile to 2^(52 - 22 - log2 c) and rounded,
    times the basis rounded to 22 bits (`integer_basis`); the row stage's input is scaled per tile
    the same way again. Scaling a tile by a positive factor keeps its signs, so no scale is undone.
    Non-finite coefficients count as 0 (NaN) or the largest float (infinities). The result is a new
    tensor of `tiles`' dtype, or `out` (plan.numel elements; it may alias `tiles`)."""
    r, c = plan.chunk_rows, plan.chunk_cols
    device = tiles.device
    x = workspace.get(0, plan.numel, device, torch.float64).view(plan.num_chunks, r, c)
    x.copy_(tiles.view(plan.num_chunks, r, c)).nan_to_num_(nan=0.0, posinf=3.4e38, neginf=-3.4e38)
    if c > 1:
        _to_integers(x, _EXACT_LIMIT_BITS - EXACT_BASIS_BITS - math.ceil(math.log2(c)))
        x = torch.matmul(
            x.view(-1, c),
            integer_basis(c, device),
            out=workspace.get(1, plan.numel, device, torch.float64).view(-1, c),
        ).view(plan.num_chunks, r, c)
    if r > 1:
        _to_integers(x, _EXACT_LIMIT_BITS - EXACT_BASIS_BITS - math.ceil(math.log2(r)))
        slot = 0 if c > 1 else 1
        x = torch.matmul(
            integer_basis(r, device).T,
            x,
            out=workspace.get(slot, plan.numel, device, torch.float64).view(plan.num_chunks, r, c),
        )
    if out is None:
        out = torch.empty(plan.numel, device=device, dtype=tiles.dtype)
    return _tiles_to_tensor(x.sign_(), plan, out.view(-1))
