"""TopKCodec: the largest-magnitude values of every chunk, untransformed. For DiLoCo's outer
pseudo-gradients, as SparseLoCo sends them (Templar, arXiv 2508.15706): chunked top-k at 1-3% density
with 2-bit values, the rest kept by the sender's error feedback (shoal.peer.algorithms.diloco).

The message is DCT_TOPK's (chunk shape, k, bit-packed chunk-local indices, values with one scale per
chunk) under its own codec id, and is validated the same way (`dct_topk.unpack`); only the
transform differs: none. Decoding scatters the values into a zero tensor, so the inverse costs one
write per value instead of a matrix product per chunk.

`topk` is per full chunk (`chunk` x `chunk` values): a smaller chunk (a 1-D tensor is cut into rows of
at most `chunk` values) keeps the same share, at least one value, so a bias of 128 values costs 2
values rather than k. Size, 64x64 chunks, 2-bit values (LEVELS2: 4 bfloat16 levels per chunk),
Elias-Fano indices: k=64 (1.56%), 64 * (8 + 2) + 64 bits per 4096 float32 values, 186x smaller;
k=32, 32 * (9 + 2) + 64, 315x. SparseLoCo's 146x is k=64 at 12 + 2 bits, no scale.
"""

import math

import torch

from shoal.compression import dct
from shoal.compression.codec import DecodeLimits, register
from shoal.compression.dct_topk import DCTTopKCodec, TopKCoefficients
from shoal.protocol import CodecId


@register
class TopKCodec(DCTTopKCodec):
    """Chunked top-k of the values themselves.

    Args:
        chunk: the largest chunk side; each dimension uses its largest divisor <= chunk.
        topk: values kept per full chunk of chunk * chunk values (module docstring).
        value_bits: 32, 16 (bf16), 8, 4 or 2 (scaled per chunk), or 1 (signs, one magnitude).
        zstd: try zstd on the value and scale streams.
        elias_fano: Elias-Fano indices (the default; False: packed at 12 bits for 64x64 chunks).
        limits: what a decoded message may claim.
    """

    codec_id = CodecId.CODEC_ID_TOPK

    def __init__(
        self,
        chunk: int = 64,
        topk: int = 32,
        value_bits: int = 2,
        *,
        zstd: bool = True,
        elias_fano: bool = True,
        limits: DecodeLimits | None = None,
    ):
        super().__init__(chunk, topk, value_bits, zstd=zstd, elias_fano=elias_fano, limits=limits)

    def kept_per_chunk(self, plan: dct.ChunkPlan) -> int:
        """k for chunks of `plan`: the full chunk's share of `topk`, at least 1, at most every value."""
        share = math.ceil(self.topk * plan.chunk_numel / (self.chunk * self.chunk))
        return min(max(share, 1), plan.chunk_numel)

    def select(self, tensor: torch.Tensor, plan: dct.ChunkPlan | None = None) -> TopKCoefficients:
        """The top-k values of every chunk of `tensor` (float32, or float64 for float64 input)."""
        plan = plan or self.plan(tuple(tensor.shape))
        compute = tensor.detach().to(torch.float64 if tensor.dtype == torch.float64 else torch.float32)
        magnitudes = self.workspace.get(0, plan.numel, compute.device, compute.dtype).view(plan.tile_layout())
        torch.abs(compute.reshape(plan.matrix_layout()).transpose(1, 2), out=magnitudes)
        indices = self._top_indices(magnitudes.view(plan.num_chunks, plan.chunk_numel), plan)
        kept = compute.reshape(-1)[dct.matrix_offsets(indices, plan)]
        return TopKCoefficients(plan, indices, kept)

    def reconstruct(self, selection: TopKCoefficients) -> torch.Tensor:
        """The tensor (float32/64) holding the selection's values at its positions, zero elsewhere."""
        plan, values = selection.plan, selection.values
        flat = torch.zeros(plan.numel, device=values.device, dtype=values.dtype)
        flat[dct.matrix_offsets(selection.indices, plan).reshape(-1)] = values.reshape(-1)
        return flat.view(plan.shape)
