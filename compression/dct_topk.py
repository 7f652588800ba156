"""DCTTopKCodec: DeMo's compression of momentum (arXiv 2411.19870, Algorithm 1 lines 6-8).

Encode: chunked DCT-II (`shoal.compression.dct`), keep the `topk` largest-magnitude coefficients of
every chunk, send their chunk-local positions bit-packed to ceil(log2(chunk elements)) bits and their
values in the chosen value encoding. The steps are also exposed separately (`select`, `pack`,
`unpack`, `reconstruct`) because DeMo needs the unquantized kept part for error feedback and
combines several peers' coefficients before a single inverse transform.

Size, 64x64 chunks: k * (12 + value_bits) bits per chunk of 4096 float32 values (+32 bits per chunk
for int8/int4/fp16 scales), e.g. k=4 with 1-bit values: 52 bits vs 131072, about 2500x smaller.
"""

import math
from dataclasses import dataclass

import torch

from shoal.compression import bitpack, dct, elias_fano, streams, values
from shoal.compression.codec import (
    WIRE_DTYPES,
    Codec,
    DecodeLimits,
    checked_output,
    checked_shape,
    decode_tensor,
    register,
    wire_dtype,
)
from shoal.compression.dense import DenseCodec
from shoal.protocol import CodecId, EncodedTensor, IndexCoding, MalformedPayloadError


@dataclass(frozen=True, slots=True)
class TopKCoefficients:
    """The kept DCT coefficients of one tensor.

    `indices` are chunk-local row-major positions, strictly increasing within each chunk;
    `values` are the coefficients there. Both are (num_chunks, k).
    """

    plan: dct.ChunkPlan
    indices: torch.Tensor
    values: torch.Tensor

    @property
    def topk(self) -> int:
        return self.indices.shape[1]


def index_bits(chunk_numel: int) -> int:
    """Bits per packed chunk-local index: ceil(log2(chunk_numel)), 12 for 64x64."""
    return math.ceil(math.log2(chunk_numel)) if chunk_numel > 1 else 0


@register
class DCTTopKCodec(Codec):
    """Chunked DCT-II + per-chunk top-k, as DeMo sends momentum.

    Args:
        chunk: the largest chunk side; each dimension uses its largest divisor <= chunk
            (DeMo reference: 64).
        topk: coefficients kept per chunk (clamped to the chunk's size; DeMo reference: 32).
        value_bits: 32, 16 (bf16), 8 or 4 (scaled per chunk), or 1 (sign only, with one mean
            magnitude for the whole tensor: DeMo's update takes a sign anyway).
        zstd: try zstd on the value and scale streams, keeping it where it is smaller (indices
            and sign bits are incompressible and always travel raw).
        elias_fano: code the indices with Elias-Fano (shoal.compression.elias_fano: 8 bits per index
            for 64 of 4096 instead of 12) rather than packed at ceil(log2(chunk numel)) bits.
        limits: what a decoded message may claim.

    0-d and one-element tensors are sent dense and exact. An instance keeps scratch buffers
    (`dct.Workspace`) and is not thread-safe: give each thread its own.
    """

    codec_id = CodecId.CODEC_ID_DCT_TOPK

    def __init__(
        self,
        chunk: int = 64,
        topk: int = 32,
        value_bits: int = 32,
        *,
        zstd: bool = True,
        elias_fano: bool = False,
        limits: DecodeLimits | None = None,
    ):
        super().__init__(limits=limits)
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        self.chunk = chunk
        self.topk = topk
        self.encoding = values.encoding_for_bits(value_bits)
        self.zstd = zstd
        self.elias_fano = elias_fano
        self.workspace = dct.Workspace()
        self._exact = DenseCodec(32)

    def plan(self, shape: tuple[int, ...]) -> dct.ChunkPlan:
        return dct.ChunkPlan.for_shape(shape, self.chunk)

    def select(self, tensor: torch.Tensor, plan: dct.ChunkPlan | None = None) -> TopKCoefficients:
        """The top-k coefficients of every chunk of `tensor` (computed in float32, or float64 for
        float64 input), with indices sorted within each chunk. `plan` overrides the chunking (it must
        describe `tensor`'s shape), e.g. `ChunkPlan.bands` for a batch of tiles."""
        plan = plan or self.plan(tuple(tensor.shape))
        compute = tensor.detach().to(torch.float64 if tensor.dtype == torch.float64 else torch.float32)
        coeffs = dct.forward(compute, plan, self.workspace)
        magnitudes = dct.tile_magnitudes(coeffs, plan, self.workspace)
        indices = self._top_indices(magnitudes, plan)
        kept = coeffs.reshape(-1)[dct.matrix_offsets(indices, plan)]
        return TopKCoefficients(plan, indices, kept)

    def select_coefficients(self, coeffs: torch.Tensor, plan: dct.ChunkPlan) -> TopKCoefficients:
        """The top-k of coefficients already in tile-major order, (plan.num_chunks, plan.chunk_numel),
        e.g. momentum kept in the DCT domain. Uses workspace slot 0 for the magnitudes."""
        magnitudes = self.workspace.get(0, plan.numel, coeffs.device, coeffs.dtype).view(coeffs.shape)
        indices = self._top_indices(torch.abs(coeffs, out=magnitudes), plan)
        return TopKCoefficients(plan, indices, torch.gather(coeffs, 1, indices))

    def kept_per_chunk(self, plan: dct.ChunkPlan) -> int:
        """k for the chunks of `plan`: `topk`, or every coefficient of a smaller chunk."""
        return min(self.topk, plan.chunk_numel)

    def _top_indices(self, magnitudes: torch.Tensor, plan: dct.ChunkPlan) -> torch.Tensor:
        k = self.kept_per_chunk(plan)
        return torch.topk(magnitudes, k, dim=1, sorted=False).indices.sort(dim=1).values

    def pack(self, selection: TopKCoefficients, dtype: torch.dtype) -> EncodedTensor:
        """The message for a selection of a tensor of `dtype`."""
        plan = selection.plan
        if self.elias_fano:
            bits, coding = (
                elias_fano.low_bits(plan.chunk_numel, selection.topk),
                IndexCoding.INDEX_CODING_ELIAS_FANO,
            )
            index_stream = elias_fano.encode(selection.indices, plan.chunk_numel)
        else:
            bits, coding = index_bits(plan.chunk_numel), IndexCoding.INDEX_CODING_PACKED
            index_stream = bitpack.pack(selection.indices, bits)
        index_bytes, _ = streams.to_wire(index_stream, try_zstd=False)
        return EncodedTensor(
            codec=self.codec_id,
            shape=plan.shape,
            dtype=WIRE_DTYPES[dtype],
            chunk_shape=(plan.chunk_rows, plan.chunk_cols),
            topk=selection.topk,
            index_bits=bits,
            index_coding=coding,
            indices=index_bytes,
            **values.message_fields(selection.values, self.encoding, selection.topk, zstd=self.zstd),
        )

    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        wire_dtype(tensor)  # reject non-float tensors before any work
        if tensor.numel() <= 1:
            return self._exact.encode(tensor)
        return self.pack(self.select(tensor), tensor.dtype)

    def reconstruct(self, selection: TopKCoefficients) -> torch.Tensor:
        """The tensor (float32/64) whose DCT coefficients are the selection and zero elsewhere."""
        plan = selection.plan
        if dct.sparse_is_cheaper(selection.topk, plan):
            return dct.inverse_sparse(selection.indices, selection.values, plan, self.workspace)
        tiles = torch.zeros(
            plan.num_chunks, plan.chunk_numel, device=selection.values.device, dtype=selection.values.dtype
        )
        tiles.scatter_(1, selection.indices, selection.values)
        return dct.inverse_dense(tiles, plan, self.workspace)

    def decode(self, message: EncodedTensor, device: torch.device | str = "cpu") -> torch.Tensor:
        if message.codec != self.codec_id:
            return decode_tensor(message, device=device, limits=self.limits)
        shape, dtype = checked_shape(message, self.limits)
        decoded = self.reconstruct(unpack(message, torch.device(device), self.limits))
        return checked_output(decoded, dtype).reshape(shape)

    @classmethod
    def decode_message(
        cls, message: EncodedTensor, *, device: torch.device, limits: DecodeLimits
    ) -> torch.Tensor:
        return cls(limits=limits).decode(message, device)


def unpack(message: EncodedTensor, device: torch.device, limits: DecodeLimits) -> TopKCoefficients:
    """Validates a DCT_TOPK message and returns its coefficients; raises MalformedPayloadError."""
    shape, _ = checked_shape(message, limits)
    if len(shape) == 0 or math.prod(shape) == 0:
        raise MalformedPayloadError("bad_shape", f"DCT top-k needs >= 1 dims and elements, got {list(shape)}")
    if len(message.chunk_shape) != 2:
        raise MalformedPayloadError(
            "bad_chunk", f"chunk_shape needs 2 entries, got {len(message.chunk_shape)}"
        )
    chunk_rows, chunk_cols = message.chunk_shape
    last_rows = shape[-2] if len(shape) >= 2 else 1
    for side, size in ((chunk_rows, last_rows), (chunk_cols, shape[-1])):
        if not 1 <= side <= limits.max_chunk or size % side:
            raise MalformedPayloadError(
                "bad_chunk", f"chunk side {side} must divide {size} and be in [1, {limits.max_chunk}]"
            )
    plan = dct.ChunkPlan(shape, math.prod(shape[:-1]), shape[-1], chunk_rows, chunk_cols)
    if not 1 <= message.topk <= plan.chunk_numel:
        raise MalformedPayloadError("bad_topk", f"topk {message.topk} outside [1, {plan.chunk_numel}]")
    k, count = message.topk, plan.num_chunks * message.topk
    if message.index_coding == IndexCoding.INDEX_CODING_ELIAS_FANO:
        bits, expected = (
            elias_fano.low_bits(plan.chunk_numel, k),
            elias_fano.size(plan.num_chunks, k, plan.chunk_numel),
        )
    elif message.index_coding == IndexCoding.INDEX_CODING_PACKED:
        bits = index_bits(plan.chunk_numel)
        expected = bitpack.packed_size(count, bits)
    else:
        raise MalformedPayloadError("bad_index_coding", f"index coding {message.index_coding} is not known")
    if message.index_bits != bits:
        raise MalformedPayloadError("bad_index_bits", f"index_bits {message.index_bits}, expected {bits}")
    index_stream = streams.from_wire(message.indices, message.indices_zstd, expected, "indices", device)
    if message.index_coding == IndexCoding.INDEX_CODING_ELIAS_FANO:
        indices = elias_fano.decode(index_stream, plan.num_chunks, k, plan.chunk_numel)
    else:
        indices = bitpack.unpack(index_stream, bits, count).view(plan.num_chunks, k)
    in_range = bool((indices[:, -1] < plan.chunk_numel).all())
    increasing = k == 1 or bool((indices[:, 1:] > indices[:, :-1]).all())
    if not (in_range and increasing):
        raise MalformedPayloadError(
            "bad_indices", "indices must be < chunk size and strictly increasing within each chunk"
        )
    kept = values.from_message(message, count, k, device).view(plan.num_chunks, k)
    return TopKCoefficients(plan, indices, kept)
