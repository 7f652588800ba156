"""DenseCodec: every element, quantized blockwise. For DiLoCo's outer pseudo-gradients.

The tensor is flattened and cut into blocks of `block` values; scaled encodings (int8, int4, fp16)
store one float32 scale (the block's largest magnitude) per block, so one outlier only coarsens its
own block. Error bounds per element are those of `shoal.compression.values`; `value_bits=32` is exact
and is also how the DCT codec sends 0-d and one-element tensors.
"""

import math

import torch

from shoal.compression import streams, values
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
        dtype = wire_dtype(tensor)
        encoded = values.encode(tensor.detach().reshape(-1), self.encoding, self.block)
        value_bytes, values_zstd = streams.to_wire(
            encoded.values, try_zstd=self.zstd and values.BITS[self.encoding] > 1
        )
        scale_bytes, scales_zstd = streams.to_wire(encoded.scales, try_zstd=self.zstd)
        return EncodedTensor(
            codec=self.codec_id,
            shape=tensor.shape,
            dtype=dtype,
            value_encoding=self.encoding,
            values=value_bytes,
            values_zstd=values_zstd,
            block_size=self.block,
            scales=scale_bytes,
            scales_zstd=scales_zstd,
        )

    @classmethod
    def decode_message(
        cls, message: EncodedTensor, *, device: torch.device, limits: DecodeLimits
    ) -> torch.Tensor:
        shape, dtype = checked_shape(message, limits)
        encoding = message.value_encoding
        if encoding not in values.BITS:
            raise MalformedPayloadError("unknown_value_encoding", f"value encoding {encoding} is not known")
        if message.block_size < 1:
            raise MalformedPayloadError("bad_block", "block_size must be >= 1")
        count = math.prod(shape)
        blocks = -(-count // message.block_size)
        encoded = values.EncodedValues(
            streams.from_wire(
                message.values, message.values_zstd, values.values_size(encoding, count), "values", device
            ),
            streams.from_wire(
                message.scales,
                message.scales_zstd,
                4 * values.scale_count(encoding, blocks),
                "scales",
                device,
            ),
        )
        decoded = values.decode(encoded, encoding, count, message.block_size)
        return checked_output(decoded, dtype).reshape(shape)
