"""DenseCodec: every element, quantized blockwise. For DiLoCo's outer pseudo-gradients.

The tensor is flattened and cut into blocks of `block` values; scaled encodings (int8, int4, fp16)
store one float32 scale (the block's largest magnitude) per block, so one outlier only coarsens its
own block. Error bounds per element are those of `shoal.compression.values`; `value_bits=32` is exact
and is also how the DCT codec sends 0-d and one-element tensors.
"""

import math

import torch

from shoal.compression import values
from shoal.compression.codec import Codec, DecodeLimits, checked_output, checked_shape, register, wire_dtype
from shoal.protocol import CodecId, EncodedTensor, MalformedPayloadError


@register
class DenseCodec(Codec):
    """Blockwise-quantized dense tensors.

    Args:
        value_bits: 32 (exact), 16 (`half`: "bf16", unscaled, or "fp16", scaled per block),
            8 or 4 (symmetric integers, scaled per block), or 1 (signs and one mean magnitude).
        block: values per scale group; smaller blocks bound the error tighter and cost
            32 / block extra bits per value.
        half: the 16-bit format.
        zstd: try zstd on the value and scale streams, keeping it where it is smaller (sign bits
            are incompressible and always travel raw).
        limits: what a decoded message may claim.
    """

    codec_id = CodecId.CODEC_ID_DENSE

    def __init__(
        self,
        value_bits: int = 8,
        block: int = 64,
        *,
        half: str = "bf16",
        zstd: bool = True,
        limits: DecodeLimits | None = None,
    ):
        super().__init__(limits=limits)
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.encoding = values.encoding_for_bits(value_bits, half=half)
        self.block = block
        self.zstd = zstd

    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        return EncodedTensor(
            codec=self.codec_id,
            shape=tensor.shape,
            dtype=wire_dtype(tensor),
            block_size=self.block,
            **values.message_fields(tensor.detach().reshape(-1), self.encoding, self.block, zstd=self.zstd),
        )

    @classmethod
    def decode_message(
        cls, message: EncodedTensor, *, device: torch.device, limits: DecodeLimits
    ) -> torch.Tensor:
        shape, dtype = checked_shape(message, limits)
        if message.block_size < 1:
            raise MalformedPayloadError("bad_block", "block_size must be >= 1")
        decoded = values.from_message(message, math.prod(shape), message.block_size, device)
        return checked_output(decoded, dtype).reshape(shape)
