"""Value encodings: how the transmitted numbers of a codec become bytes, and back.

Values arrive flat, in groups of consecutive values; a group is one DCT chunk or one dense block, and
the scaled encodings store one float32 scale per group (its largest magnitude). Error bounds, per value,
with `s` the group's scale:

| encoding | bits | error bound                                   |
|----------|------|-----------------------------------------------|
| FLOAT32  | 32   | exact                                         |
| BFLOAT16 | 16   | 2**-9 relative (round to nearest, 8-bit mantissa) |
| FLOAT16  | 16   | 2**-11 * s (binary16 of value / s, in [-1, 1])   |
| INT8     | 8    | s / 254 (half a step of s / 127)              |
| INT4     | 4    | s / 14 (half a step of s / 7)                 |
| SIGN     | 1    | none: magnitude replaced by the tensor's mean |value| |
| LEVELS2  | 2    | none: each value becomes the mean of the values given its code |

LEVELS2 is for top-k values (large magnitudes of both signs, none near zero), as SparseLoCo sends
them at 2 bits (Templar, arXiv 2508.15706, which bins a tensor's values by their standard deviation and
decodes each bin to its mean). Here the bins keep the sign and are per group (chunk): code 0 for
v < -m, 1 for -m <= v < 0, 2 for 0 <= v < m, 3 for v >= m, with m the group's mean |v|; the group's
4 levels, in `scales` as bfloat16 (8 bytes a group; their 2**-9 rounding is far below the 2-bit
error), are the means of its values in each bin (0 for an empty one). The mean squared error is
that of a 4-level quantizer after one Lloyd step from these bins.
"""

import sys
from dataclasses import dataclass

import torch

from shoal.compression import bitpack, streams
from shoal.protocol import MalformedPayloadError, ValueEncoding

if sys.byteorder != "little":  # tensors are viewed as bytes; the wire is little-endian
    raise ImportError("shoal.compression needs a little-endian host")

BITS: dict[int, int] = {
    ValueEncoding.VALUE_ENCODING_FLOAT32: 32,
    ValueEncoding.VALUE_ENCODING_BFLOAT16: 16,
    ValueEncoding.VALUE_ENCODING_FLOAT16: 16,
    ValueEncoding.VALUE_ENCODING_INT8: 8,
    ValueEncoding.VALUE_ENCODING_INT4: 4,
    ValueEncoding.VALUE_ENCODING_SIGN: 1,
    ValueEncoding.VALUE_ENCODING_LEVELS2: 2,
}
_LEVELS: dict[int, int] = {ValueEncoding.VALUE_ENCODING_INT8: 127, ValueEncoding.VALUE_ENCODING_INT4: 7}


def encoding_for_bits(value_bits: int, *, half: str = "bf16") -> int:
    """The wire encoding for a codec's `value_bits` setting (16 bits: `half` is "bf16" or "fp16")."""
    if value_bits == 16:
        if half not in ("bf16", "fp16"):
            raise ValueError(f"half must be 'bf16' or 'fp16', got {half!r}")
        return (
            ValueEncoding.VALUE_ENCODING_BFLOAT16 if half == "bf16" else ValueEncoding.VALUE_ENCODING_FLOAT16
        )
    by_bits = {
        32: ValueEncoding.VALUE_ENCODING_FLOAT32,
        8: ValueEncoding.VALUE_ENCODING_INT8,
        4: ValueEncoding.VALUE_ENCODING_INT4,
        2: ValueEncoding.VALUE_ENCODING_LEVELS2,
        1: ValueEncoding.VALUE_ENCODING_SIGN,
    }
    if value_bits not in by_bits:
        raise ValueError(f"value_bits must be one of 32, 16, 8, 4, 2, 1; got {value_bits}")
    return by_bits[value_bits]


def is_scaled(encoding: int) -> bool:
    return encoding not in (ValueEncoding.VALUE_ENCODING_FLOAT32, ValueEncoding.VALUE_ENCODING_BFLOAT16)


def scale_bytes(encoding: int, groups: int) -> int:
    """Bytes of the `scales` stream for `groups` groups: a float32 scale per group (one for SIGN), or
    LEVELS2's 4 bfloat16 levels per group."""
    if not is_scaled(encoding):
        return 0
    if encoding == ValueEncoding.VALUE_ENCODING_SIGN:
        return 4
    return 8 * groups if encoding == ValueEncoding.VALUE_ENCODING_LEVELS2 else 4 * groups


@dataclass(frozen=True, slots=True)
class EncodedValues:
    """The two byte streams of a value encoding, as uint8 tensors on the values' device."""

    values: torch.Tensor
    scales: torch.Tensor


def values_size(encoding: int, count: int) -> int:
    """Bytes of the `values` stream for `count` values."""
    return bitpack.packed_size(count, BITS[encoding])


def encode(values: torch.Tensor, encoding: int, group: int) -> EncodedValues:
    """Encodes the flat float `values`, `group` consecutive values sharing a scale (the last group
    may be shorter)."""
    values = values.reshape(-1).float()
    empty = torch.empty(0, dtype=torch.uint8, device=values.device)
    if encoding == ValueEncoding.VALUE_ENCODING_FLOAT32:
        return EncodedValues(_as_bytes(values), empty)
    if encoding == ValueEncoding.VALUE_ENCODING_BFLOAT16:
        return EncodedValues(_as_bytes(values.bfloat16()), empty)
    if encoding == ValueEncoding.VALUE_ENCODING_SIGN:
        scale = values.abs().mean().reshape(1) if values.numel() else torch.zeros(1, device=values.device)
        return EncodedValues(bitpack.pack(values < 0, 1), _as_bytes(scale))
    if encoding == ValueEncoding.VALUE_ENCODING_LEVELS2:
        return _levels2(values, group)
    count = values.numel()
    groups = -(-count // group)
    padded = torch.zeros(groups * group, device=values.device)  # zeros leave every group's absmax as is
    padded[:count] = values
    scales = padded.view(groups, group).abs().amax(dim=1, keepdim=True)
    unit = (padded.view(groups, group) / torch.where(scales > 0, scales, 1.0)).reshape(-1)[:count]
    if encoding == ValueEncoding.VALUE_ENCODING_FLOAT16:
        stream = _as_bytes(unit.half())
    elif encoding == ValueEncoding.VALUE_ENCODING_INT8:
        stream = _as_bytes(torch.round(unit * 127).to(torch.int8))
    elif encoding == ValueEncoding.VALUE_ENCODING_INT4:
        stream = bitpack.pack(torch.round(unit * 7).to(torch.int64) + 8, 4)
    else:
        raise ValueError(f"unknown value encoding {encoding}")
    return EncodedValues(stream, _as_bytes(scales))


def decode(encoded: EncodedValues, encoding: int, count: int, group: int) -> torch.Tensor:
    """The `count` float32 values; raises MalformedPayloadError for untrusted garbage.

    The stream lengths must already match `values_size` and `scale_bytes` (checked by the caller
    against the message's claimed shape before any allocation).
    """
    stream = encoded.values
    if encoding == ValueEncoding.VALUE_ENCODING_FLOAT32:
        decoded = stream.view(torch.float32).clone()
    elif encoding == ValueEncoding.VALUE_ENCODING_BFLOAT16:
        decoded = stream.view(torch.bfloat16).float()
    elif encoding == ValueEncoding.VALUE_ENCODING_LEVELS2:  # any code is valid; levels of either sign
        levels = encoded.scales.view(torch.bfloat16).float()
        if not bool(torch.isfinite(levels).all()):
            raise MalformedPayloadError("bad_scale", "a level is NaN or infinite")
        group_of = torch.arange(count, device=stream.device) // group
        return levels[group_of * 4 + bitpack.unpack(stream, 2, count)]
    else:
        scales = encoded.scales.view(torch.float32)
        if not bool((torch.isfinite(scales) & (scales >= 0)).all()):
            raise MalformedPayloadError("bad_scale", "a scale is negative, NaN or infinite")
        if encoding == ValueEncoding.VALUE_ENCODING_SIGN:
            return (1 - 2 * bitpack.unpack(stream, 1, count)).float() * scales
        # the unit values of a group, in [-1, 1], times its finite scale: finite, no check needed
        decoded = torch.empty(count, dtype=torch.float32, device=stream.device)
        _decode_unit(stream, encoding, decoded)
        full = count // group  # whole groups, then a shorter last one (nothing sized by `group`)
        decoded[: full * group].view(full, group).mul_(scales[:full].view(full, 1))
        if full * group < count:
            decoded[full * group :].mul_(scales[full])
        return decoded
    if not bool(torch.isfinite(decoded).all()):
        raise MalformedPayloadError("non_finite", "decoded values contain NaN or infinity")
    return decoded


def message_fields(values: torch.Tensor, encoding: int, group: int, *, zstd: bool) -> dict:
    """The EncodedTensor fields that carry `values` (flat, `group` per scale): encoding, the value
    and scale streams, and their zstd flags. zstd is tried on scales and on values of more than one
    bit (sign bits do not compress)."""
    encoded = encode(values, encoding, group)
    value_bytes, values_zstd = streams.to_wire(encoded.values, try_zstd=zstd and BITS[encoding] > 1)
    scale_bytes, scales_zstd = streams.to_wire(encoded.scales, try_zstd=zstd)
    return {
        "value_encoding": encoding,
        "values": value_bytes,
        "values_zstd": values_zstd,
        "scales": scale_bytes,
        "scales_zstd": scales_zstd,
    }


def from_message(message, count: int, group: int, device: torch.device) -> torch.Tensor:
    """The `count` float32 values an untrusted EncodedTensor carries, `group` per scale."""
    encoding = message.value_encoding
    if encoding not in BITS:
        raise MalformedPayloadError("unknown_value_encoding", f"value encoding {encoding} is not known")
    groups = -(-count // group)
    encoded = EncodedValues(
        streams.from_wire(
            message.values, message.values_zstd, values_size(encoding, count), "values", device
        ),
        streams.from_wire(
            message.scales, message.scales_zstd, scale_bytes(encoding, groups), "scales", device
        ),
    )
    return decode(encoded, encoding, count, group)


def _decode_unit(stream: torch.Tensor, encoding: int, out: torch.Tensor) -> None:
    """Scaled encodings: writes the values divided by their group's scale, in [-1, 1], into the
    float32 tensor `out` (one per value); raises MalformedPayloadError for any outside that range."""
    if encoding == ValueEncoding.VALUE_ENCODING_FLOAT16:
        out.copy_(stream.view(torch.float16))
        if not bool((out.abs() <= 1).all()):  # also false for NaN
            raise MalformedPayloadError("value_out_of_range", "a float16 value is outside [-1, 1]")
        return
    if encoding == ValueEncoding.VALUE_ENCODING_INT8:
        levels, offset, lowest = stream.view(torch.int8), 0, -128
    elif encoding == ValueEncoding.VALUE_ENCODING_INT4:
        levels, offset, lowest = bitpack.unpack_bytes(stream, 4, out.numel()), 8, 0
    else:
        raise MalformedPayloadError("unknown_value_encoding", f"value encoding {encoding} is not known")
    limit = _LEVELS[encoding]
    if bool((levels == lowest).any()):  # the one level of the type beyond -limit
        raise MalformedPayloadError("value_out_of_range", f"a quantized value is outside [-{limit}, {limit}]")
    out.copy_(levels)
    if offset:
        out.sub_(offset)
    out.div_(limit)


def _levels2(values: torch.Tensor, group: int) -> EncodedValues:
    """LEVELS2 (module docstring): the 2-bit codes and each group's 4 levels."""
    count = values.numel()
    groups = -(-count // group)
    group_of = torch.arange(count, device=values.device) // group
    magnitudes = values.abs()
    sizes = torch.zeros(groups, device=values.device).index_add_(0, group_of, torch.ones_like(values))
    bounds = torch.zeros(groups, device=values.device).index_add_(0, group_of, magnitudes) / sizes
    large = (magnitudes >= bounds[group_of]).long()
    slots = group_of * 4 + torch.where(values < 0, 1 - large, 2 + large)
    totals = values.new_zeros(4 * groups).index_add_(0, slots, values)
    counts = values.new_zeros(4 * groups).index_add_(0, slots, torch.ones_like(values))
    levels = (totals / counts.clamp(min=1)).bfloat16()
    return EncodedValues(bitpack.pack(slots % 4, 2), _as_bytes(levels))


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)
