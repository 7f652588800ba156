"""Shared material for the hostile-peer tests of the tensor decoders (not a test module).

Holds the helpers written from protocol/tensor.proto (bit packing, float bytes, stream surgery, the wire
round trip, and the `assert_malformed` / `decode_or_reject` checks) and the set of valid messages every
test corrupts: both codecs, every value encoding, raw and zstd, each produced by a real codec (or, for
the one combination no codec emits, a DCT_TOPK message with FLOAT16 values, built from the layout in
tensor.proto). The bit packing and float layouts are written here from the .proto text, independently
of `shoal.compression.bitpack`.
"""

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import zstandard

from shoal.compression import (
    DCTTopKCodec,
    DecodeLimits,
    DenseCodec,
    EncodedTensor,
    MalformedPayloadError,
    TopKCodec,
    decode_tensor,
)
from shoal.protocol import CodecId, DType, ValueEncoding, parse_message

VE = ValueEncoding
DCT = CodecId.CODEC_ID_DCT_TOPK
DENSE = CodecId.CODEC_ID_DENSE
TOPK = CodecId.CODEC_ID_TOPK
STREAMS = ("indices", "values", "scales")
MAX_BYTES = 1 << 22
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
DTYPE_OF = {
    DType.DTYPE_FLOAT32: torch.float32,
    DType.DTYPE_FLOAT16: torch.float16,
    DType.DTYPE_BFLOAT16: torch.bfloat16,
    DType.DTYPE_FLOAT64: torch.float64,
}
BITS = {
    VE.VALUE_ENCODING_FLOAT32: 32,
    VE.VALUE_ENCODING_BFLOAT16: 16,
    VE.VALUE_ENCODING_FLOAT16: 16,
    VE.VALUE_ENCODING_INT8: 8,
    VE.VALUE_ENCODING_INT4: 4,
    VE.VALUE_ENCODING_SIGN: 1,
    VE.VALUE_ENCODING_LEVELS2: 2,
}
UNSCALED = (VE.VALUE_ENCODING_FLOAT32, VE.VALUE_ENCODING_BFLOAT16)
LABEL = {
    VE.VALUE_ENCODING_FLOAT32: "f32",
    VE.VALUE_ENCODING_BFLOAT16: "bf16",
    VE.VALUE_ENCODING_FLOAT16: "fp16",
    VE.VALUE_ENCODING_INT8: "int8",
    VE.VALUE_ENCODING_INT4: "int4",
    VE.VALUE_ENCODING_SIGN: "sign",
    VE.VALUE_ENCODING_LEVELS2: "levels2",
}


# ---------------------------------------------------------------------------------------------
# Helpers written from tensor.proto: bit packing, float bytes, stream surgery, wire round trip.
# ---------------------------------------------------------------------------------------------


def pack_bits(values: list[int], width: int) -> bytes:
    """Value i in bits [i*w, (i+1)*w), LSB first, bit j of the stream = bit j % 8 of byte j // 8."""
    word = 0
    for i, value in enumerate(values):
        assert 0 <= value < 1 << width
        word |= value << (i * width)
    return word.to_bytes((len(values) * width + 7) // 8, "little")


def unpack_bits(data: bytes, width: int, count: int) -> list[int]:
    word, mask = int.from_bytes(data, "little"), (1 << width) - 1
    return [(word >> (i * width)) & mask for i in range(count)]


def f32(x: float) -> bytes:
    return struct.pack("<f", x)


def u16(bits: int) -> bytes:
    return struct.pack("<H", bits)


def clone(message: EncodedTensor) -> EncodedTensor:
    out = EncodedTensor()
    out.CopyFrom(message)
    return out


def raw_stream(message: EncodedTensor, name: str) -> bytes:
    """The content of a stream, unwrapping our own (trusted) zstd frames."""
    data = getattr(message, name)
    if getattr(message, f"{name}_zstd"):
        return zstandard.ZstdDecompressor().decompress(data)
    return data


def with_stream(
    message: EncodedTensor, name: str, content: bytes, *, zstd: bool | None = None
) -> EncodedTensor:
    """A copy whose stream `name` holds `content`, as a zstd frame if the original was one (or `zstd`)."""
    out = clone(message)
    zstd = getattr(message, f"{name}_zstd") if zstd is None else zstd
    setattr(out, name, zstandard.ZstdCompressor().compress(content) if zstd else content)
    setattr(out, f"{name}_zstd", zstd)
    return out


def patched(message: EncodedTensor, name: str, offset: int, patch: bytes) -> EncodedTensor:
    """A copy with `patch` written at `offset` of the stream's content (re-framed if it was zstd)."""
    content = bytearray(raw_stream(message, name))
    assert offset + len(patch) <= len(content)
    content[offset : offset + len(patch)] = patch
    return with_stream(message, name, bytes(content))


def value_count(message: EncodedTensor) -> int:
    """How many values the (valid) message transmits."""
    if message.codec == DENSE:
        return math.prod(message.shape)
    rows, cols = math.prod(message.shape[:-1]), message.shape[-1]
    chunk_rows, chunk_cols = message.chunk_shape
    return (rows // chunk_rows) * (cols // chunk_cols) * message.topk


def over_the_wire(message: EncodedTensor) -> EncodedTensor:
    """What a receiver holds: the message serialized and parsed back under a size limit."""
    return parse_message(EncodedTensor, message.SerializeToString(), max_bytes=MAX_BYTES)


def assert_malformed(
    message: EncodedTensor,
    *reasons: str,
    limits: DecodeLimits | None = None,
    decode: Callable[..., torch.Tensor] | None = None,
) -> MalformedPayloadError:
    """Decoding the received message raises exactly MalformedPayloadError, with one of `reasons`."""
    received = over_the_wire(message)
    decode = decode or (lambda m: decode_tensor(m, device="cpu", limits=limits))
    with pytest.raises(MalformedPayloadError) as info:
        decode(received)
    assert type(info.value) is MalformedPayloadError
    assert isinstance(info.value, ValueError)
    if reasons:
        assert info.value.reason in reasons, str(info.value)
    return info.value


def decode_or_reject(data: bytes, limits: DecodeLimits | None = None) -> torch.Tensor | None:
    """Untrusted bytes either fail with MalformedPayloadError or decode to a finite tensor of exactly
    the claimed shape and dtype; anything else (another exception, a crash) fails the test."""
    try:
        message = parse_message(EncodedTensor, data, max_bytes=MAX_BYTES)
    except MalformedPayloadError as error:
        assert type(error) is MalformedPayloadError and error.reason in ("too_large", "unparsable")
        return None
    try:
        out = decode_tensor(message, device="cpu", limits=limits)
    except MalformedPayloadError as error:
        assert type(error) is MalformedPayloadError and error.reason
        return None
    assert tuple(out.shape) == tuple(message.shape)
    assert out.dtype == DTYPE_OF[message.dtype]
    assert bool(torch.isfinite(out).all()), f"decoded a non-finite tensor from {message}"
    return out


DECODERS: dict[str, Callable[..., torch.Tensor]] = {
    "decode_tensor": lambda m, limits=None: decode_tensor(m, device="cpu", limits=limits),
    "DCTTopKCodec.decode": lambda m, limits=None: DCTTopKCodec(limits=limits).decode(m),
    "DenseCodec.decode": lambda m, limits=None: DenseCodec(limits=limits).decode(m),
    "TopKCodec.decode": lambda m, limits=None: TopKCodec(limits=limits).decode(m),
}


# ---------------------------------------------------------------------------------------------
# Valid messages: both codecs, every value encoding, raw and zstd.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    message: EncodedTensor  # never mutate: tests work on clones
    source: torch.Tensor
    encoder_zstd: tuple[bool, bool, bool]  # (indices, values, scales) flags as the encoder set them


def force_zstd(message: EncodedTensor) -> EncodedTensor:
    """Wraps every non-empty raw stream in a zstd frame, as a peer is free to (the decoder accepts zstd
    on any stream; the encoder just never tries it on indices and sign bits)."""
    for name in STREAMS:
        data = getattr(message, name)
        if data and not getattr(message, f"{name}_zstd"):
            message = with_stream(message, name, data, zstd=True)
    return message


def _dct_fp16(int8_message: EncodedTensor) -> EncodedTensor:
    """A DCT_TOPK message with FLOAT16 values (value / chunk scale, in [-1, 1]) built from an INT8 one."""
    levels = torch.frombuffer(bytearray(raw_stream(int8_message, "values")), dtype=torch.int8)
    unit = (levels.float() / 127).half()
    out = with_stream(int8_message, "values", unit.view(torch.uint8).numpy().tobytes())
    out.value_encoding = VE.VALUE_ENCODING_FLOAT16
    return out


def _build_variants() -> dict[str, Variant]:
    gen = torch.Generator().manual_seed(20240611)
    dct_plain = torch.randn(96, 128, generator=gen)  # chunk 48x64: 4 chunks of 3072, 12-bit indices
    dct_tiled = torch.randn(64, 64, generator=gen).repeat(4, 4)  # 16 identical chunks: compressible
    dense_plain = torch.randn(999, generator=gen)  # 16 blocks of 64, the last shorter; odd count
    dense_tiled = torch.randn(64, generator=gen).repeat(64)  # 64 identical blocks: compressible
    variants: dict[str, Variant] = {}

    def add(kind: str, message: EncodedTensor, source: torch.Tensor, zstd: bool) -> None:
        flags = (message.indices_zstd, message.values_zstd, message.scales_zstd)
        if zstd:
            message = force_zstd(message)
        name = f"{kind}-{LABEL[message.value_encoding]}-{'zstd' if zstd else 'raw'}"
        variants[name] = Variant(message, source, flags)

    for zstd in (False, True):
        for bits in (32, 16, 8, 4, 2, 1):
            x = dct_tiled if zstd else dct_plain
            add("dct", DCTTopKCodec(chunk=64, topk=32, value_bits=bits, zstd=zstd).encode(x), x, zstd)
        add(
            "dct",
            _dct_fp16(variants[f"dct-int8-{'zstd' if zstd else 'raw'}"].message),
            dct_tiled if zstd else dct_plain,
            zstd,
        )
        for bits, half in (
            (32, "bf16"),
            (16, "bf16"),
            (16, "fp16"),
            (8, "bf16"),
            (4, "bf16"),
            (2, "bf16"),
            (1, "bf16"),
        ):
            x = dense_tiled if zstd else dense_plain
            add("dense", DenseCodec(bits, block=64, half=half, zstd=zstd).encode(x), x, zstd)
        # plain top-k, Elias-Fano indices: k=256 of each 64x64 chunk (4096, 4 low bits) and 48x64 (3072)
        for bits in (32, 8, 2):
            x = dct_tiled if zstd else dct_plain
            add("topk", TopKCodec(chunk=64, topk=256, value_bits=bits, zstd=zstd).encode(x), x, zstd)
    return variants


VARIANTS = _build_variants()
NAMES = sorted(VARIANTS)
ZSTD_NAMES = [n for n in NAMES if n.endswith("-zstd")]
RAW_NAMES = [n for n in NAMES if n.endswith("-raw")]
STREAM_CASES = [(n, s) for n in NAMES for s in STREAMS if getattr(VARIANTS[n].message, s)]


def names_with(encoding: int) -> list[str]:
    return [n for n in NAMES if VARIANTS[n].message.value_encoding == encoding]
