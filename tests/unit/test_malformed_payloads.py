"""Hostile-peer input for the tensor decoders.

Every test starts from a valid message that a real codec produced (or, for the one combination no
codec emits, a DCT_TOPK message with FLOAT16 values, one built from the layout in protocol/tensor.proto),
corrupts it the way a malicious or broken peer could, sends it through serialize + `parse_message`,
and checks that decoding raises exactly `MalformedPayloadError` (with its `reason` where that slug is
part of the contract), quickly, and without allocating what the message merely claims.

The bit packing and float layouts used to corrupt messages are written here from the .proto text,
independently of `shoal.compression.bitpack`.
"""

import io
import itertools
import math
import random
import struct
import subprocess
import sys
import textwrap
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.compression import (
    DCTTopKCodec,
    DecodeLimits,
    DenseCodec,
    EncodedTensor,
    MalformedPayloadError,
    decode_tensor,
)
from shoal.protocol import CodecId, DType, ValueEncoding, parse_message

VE = ValueEncoding
DCT = CodecId.CODEC_ID_DCT_TOPK
DENSE = CodecId.CODEC_ID_DENSE
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
}
UNSCALED = (VE.VALUE_ENCODING_FLOAT32, VE.VALUE_ENCODING_BFLOAT16)
LABEL = {
    VE.VALUE_ENCODING_FLOAT32: "f32",
    VE.VALUE_ENCODING_BFLOAT16: "bf16",
    VE.VALUE_ENCODING_FLOAT16: "fp16",
    VE.VALUE_ENCODING_INT8: "int8",
    VE.VALUE_ENCODING_INT4: "int4",
    VE.VALUE_ENCODING_SIGN: "sign",
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
}


# ---------------------------------------------------------------------------------------------
# Valid messages: both codecs, every value encoding, raw and zstd.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    message: EncodedTensor  # never mutate: tests work on clones
    source: torch.Tensor
    encoder_zstd: tuple[bool, bool, bool]  # (indices, values, scales) flags as the encoder set them


def _force_zstd(message: EncodedTensor) -> EncodedTensor:
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
            message = _force_zstd(message)
        name = f"{kind}-{LABEL[message.value_encoding]}-{'zstd' if zstd else 'raw'}"
        variants[name] = Variant(message, source, flags)

    for zstd in (False, True):
        for bits in (32, 16, 8, 4, 1):
            x = dct_tiled if zstd else dct_plain
            add("dct", DCTTopKCodec(chunk=64, topk=32, value_bits=bits, zstd=zstd).encode(x), x, zstd)
        add(
            "dct",
            _dct_fp16(variants[f"dct-int8-{'zstd' if zstd else 'raw'}"].message),
            dct_tiled if zstd else dct_plain,
            zstd,
        )
        for bits, half in ((32, "bf16"), (16, "bf16"), (16, "fp16"), (8, "bf16"), (4, "bf16"), (1, "bf16")):
            x = dense_tiled if zstd else dense_plain
            add("dense", DenseCodec(bits, block=64, half=half, zstd=zstd).encode(x), x, zstd)
    return variants


VARIANTS = _build_variants()
NAMES = sorted(VARIANTS)
ZSTD_NAMES = [n for n in NAMES if n.endswith("-zstd")]
RAW_NAMES = [n for n in NAMES if n.endswith("-raw")]
STREAM_CASES = [(n, s) for n in NAMES for s in STREAMS if getattr(VARIANTS[n].message, s)]


def names_with(encoding: int) -> list[str]:
    return [n for n in NAMES if VARIANTS[n].message.value_encoding == encoding]


def test_variant_set_is_complete():
    assert len(NAMES) == 24
    for codec in (DCT, DENSE):
        for encoding in BITS:
            for zstd in (False, True):
                assert any(
                    VARIANTS[n].message.codec == codec
                    and VARIANTS[n].message.value_encoding == encoding
                    and n.endswith("zstd" if zstd else "raw")
                    for n in NAMES
                ), (codec, encoding, zstd)


@pytest.mark.parametrize("name", NAMES)
def test_every_valid_variant_decodes(name):
    """The baseline: uncorrupted, each message decodes over the wire to a finite tensor of its shape."""
    variant = VARIANTS[name]
    out = decode_or_reject(variant.message.SerializeToString())
    assert out is not None, name
    assert out.shape == variant.source.shape
    if variant.message.codec == DENSE and variant.message.value_encoding == VE.VALUE_ENCODING_FLOAT32:
        assert torch.equal(out, variant.source)


@pytest.mark.parametrize("name", ZSTD_NAMES)
def test_zstd_variants_really_carry_zstd_frames(name):
    variant = VARIANTS[name]
    if variant.message.value_encoding != VE.VALUE_ENCODING_SIGN:
        # the encoder itself compressed the repetitive values (and scales) of these inputs
        assert variant.encoder_zstd[1], f"encoder did not zstd the values of {name}"
        if variant.message.value_encoding not in UNSCALED:
            assert variant.encoder_zstd[2], f"encoder did not zstd the scales of {name}"
    for stream in STREAMS:
        data = getattr(variant.message, stream)
        if data:
            assert getattr(variant.message, f"{stream}_zstd")
            assert data.startswith(ZSTD_MAGIC)


@pytest.mark.parametrize("name", RAW_NAMES)
def test_raw_variants_carry_no_zstd(name):
    message = VARIANTS[name].message
    assert not (message.indices_zstd or message.values_zstd or message.scales_zstd)


# ---------------------------------------------------------------------------------------------
# Stream lengths: truncated, extended, missing, flags flipped.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "stream"), STREAM_CASES)
def test_truncated_stream_is_rejected(name, stream):
    message = VARIANTS[name].message
    data = getattr(message, stream)
    zstd = getattr(message, f"{stream}_zstd")
    reasons = ("length_mismatch", "bad_zstd") if zstd else ("length_mismatch",)
    for keep in sorted({0, 1, len(data) // 2, len(data) - 1}):
        bad = clone(message)
        setattr(bad, stream, data[:keep])
        assert_malformed(bad, *reasons)


@pytest.mark.parametrize(("name", "stream"), STREAM_CASES)
def test_stream_content_of_wrong_length_is_rejected(name, stream):
    """One byte short, one byte long, doubled: raw, or as a well-formed zstd frame of the wrong content."""
    message = VARIANTS[name].message
    content = raw_stream(message, stream)
    for wrong in (content[:-1], content + b"\0", content + b"\xff" * 4, content + content):
        assert_malformed(with_stream(message, stream, wrong), "length_mismatch")


@pytest.mark.parametrize("name", [n for n in NAMES if VARIANTS[n].message.value_encoding in UNSCALED])
def test_scales_on_an_unscaled_encoding_are_rejected(name):
    assert_malformed(with_stream(VARIANTS[name].message, "scales", f32(1.0)), "length_mismatch")


@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith("dct-")])
def test_missing_dct_indices_are_rejected(name):
    assert_malformed(with_stream(VARIANTS[name].message, "indices", b"", zstd=False), "length_mismatch")


@pytest.mark.parametrize(("name", "stream"), STREAM_CASES)
def test_flipped_zstd_flag_is_rejected(name, stream):
    """Raw bytes flagged as zstd, or a zstd frame read as raw bytes."""
    bad = clone(VARIANTS[name].message)
    was_zstd = getattr(bad, f"{stream}_zstd")
    setattr(bad, f"{stream}_zstd", not was_zstd)
    assert_malformed(bad, "length_mismatch", *(() if was_zstd else ("bad_zstd",)))


@pytest.mark.parametrize(("name", "stream"), STREAM_CASES)
def test_zstd_flag_on_garbage_is_rejected(name, stream):
    for garbage in (b"not a zstd frame at all", ZSTD_MAGIC + b"\xff" * 20, ZSTD_MAGIC, b"\0"):
        bad = clone(VARIANTS[name].message)
        setattr(bad, stream, garbage)
        setattr(bad, f"{stream}_zstd", True)
        assert_malformed(bad, "bad_zstd", "length_mismatch")


def test_corrupted_zstd_frame_body_is_rejected():
    message = VARIANTS["dense-f32-zstd"].message
    frame = bytearray(message.values)
    for position in range(len(ZSTD_MAGIC), len(frame), max(1, len(frame) // 23)):
        for flip in (0x01, 0x80, 0xFF):
            bad = clone(message)
            corrupted = bytearray(frame)
            corrupted[position] ^= flip
            bad.values = bytes(corrupted)
            out = decode_or_reject(bad.SerializeToString())
            # a flipped literal can still be a valid frame of the right size; it must then decode sanely
            assert out is None or out.shape == VARIANTS["dense-f32-zstd"].source.shape


@pytest.mark.parametrize(
    ("name", "stream"), [(n, s) for n, s in STREAM_CASES if n in ("dct-int8-zstd", "dense-int8-zstd")]
)
def test_bytes_after_the_zstd_frame_are_rejected(name, stream):
    """tensor.proto: the stream "is a zstd frame of the bytes described above"; anything after that
    frame (a byte, or a whole second frame) makes the stream longer than its content and must be
    rejected, like an extended raw stream is."""
    message = VARIANTS[name].message
    for extra in (b"\0", b"garbage", zstandard.ZstdCompressor().compress(b"\1" * 64)):
        bad = clone(message)
        setattr(bad, stream, getattr(message, stream) + extra)
        assert_malformed(bad, "length_mismatch", "bad_zstd")


# ---------------------------------------------------------------------------------------------
# zstd bombs: small frames that decompress to far more than the stream may hold.
# ---------------------------------------------------------------------------------------------

BOMB_CONTENT = 50_000_000


@pytest.fixture(scope="module")
def bombs() -> dict[str, bytes]:
    with_size = zstandard.ZstdCompressor().compress(bytes(BOMB_CONTENT))  # content size in the header
    streaming = io.BytesIO()  # no content size in the header: only decompressing tells how big it is
    with zstandard.ZstdCompressor().stream_writer(streaming, closefd=False) as writer:
        chunk = bytes(1 << 20)
        for _ in range(BOMB_CONTENT // len(chunk)):
            writer.write(chunk)
    return {"sized": with_size, "streaming": streaming.getvalue()}


@pytest.mark.parametrize("kind", ["sized", "streaming"])
def test_zstd_bomb_within_the_frame_size_allowance_is_cut_off(bombs, kind):
    """Expected stream: 4096 bytes (1024 float32). The bomb is small enough to pass the frame-size
    precheck, so the decoder really decompresses; it must stop after the expected length."""
    bomb = bombs[kind]
    message = DenseCodec(32, zstd=True).encode(torch.zeros(1024))
    assert message.values_zstd
    assert len(bomb) < 4096, "the bomb must be smaller than the stream it replaces"
    message.values = bomb
    received = over_the_wire(message)
    tracemalloc.start()
    try:
        start = time.perf_counter()
        with pytest.raises(MalformedPayloadError) as info:
            decode_tensor(received)
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.reason == "length_mismatch"
    assert elapsed < 1.0
    assert peak < 4 << 20, f"{peak} bytes traced while rejecting a {BOMB_CONTENT}-byte bomb"


@pytest.mark.parametrize("kind", ["sized", "streaming"])
@pytest.mark.parametrize(("name", "stream"), [(n, s) for n, s in STREAM_CASES if n.startswith("dct-int8")])
def test_zstd_bomb_in_a_small_stream_is_rejected_fast(bombs, kind, name, stream):
    bad = clone(VARIANTS[name].message)
    setattr(bad, stream, bombs[kind])
    setattr(bad, f"{stream}_zstd", True)
    start = time.perf_counter()
    assert_malformed(bad, "length_mismatch", "bad_zstd")
    assert time.perf_counter() - start < 1.0


# ---------------------------------------------------------------------------------------------
# Indices: out of range, duplicate, decreasing.
# ---------------------------------------------------------------------------------------------

INDEX_LAYOUTS = [  # (tensor shape, codec chunk, chunk_shape on the wire, index_bits)
    ((96, 128), 64, (48, 64), 12),  # 3072 elements per chunk: codes 3072..4095 fit 12 bits
    ((3, 200), 100, (3, 100), 9),  # 300: 9-bit indices take the bit-by-bit unpacking path
    ((2, 5, 6), 64, (5, 6), 5),  # 3-D folds into rows; 30 elements per chunk, codes 30, 31 fit
]


def _index_message(shape, chunk, topk, zstd):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    message = DCTTopKCodec(chunk=chunk, topk=topk, value_bits=8, zstd=False).encode(x)
    return _force_zstd(message) if zstd else message


def _chunks_of_indices(message) -> list[list[int]]:
    k, bits = message.topk, message.index_bits
    flat = unpack_bits(raw_stream(message, "indices"), bits, value_count(message))
    return [flat[i : i + k] for i in range(0, len(flat), k)]


def _with_indices(message, chunks: list[list[int]]) -> EncodedTensor:
    flat = [i for chunk in chunks for i in chunk]
    return with_stream(message, "indices", pack_bits(flat, message.index_bits))


def _corrupt(chunks: list[list[int]], how: str, chunk_numel: int, bits: int) -> list[list[int]]:
    chunks = [list(c) for c in chunks]
    if how == "last_index_is_chunk_numel":
        chunks[-1][-1] = chunk_numel
    elif how == "last_index_is_max_code":
        chunks[-1][-1] = (1 << bits) - 1
    elif how == "first_chunk_out_of_range":
        chunks[0][-1] = (1 << bits) - 1
    elif how == "duplicate":
        chunks[-1][2] = chunks[-1][1]
    elif how == "decreasing":
        chunks[1][0], chunks[1][1] = chunks[1][1], chunks[1][0]
    elif how == "all_zero":
        chunks[0] = [0] * len(chunks[0])
    elif how == "reversed":
        chunks[-1] = chunks[-1][::-1]
    else:
        raise AssertionError(how)
    return chunks


@pytest.mark.parametrize("zstd", [False, True], ids=["raw", "zstd"])
@pytest.mark.parametrize(("shape", "chunk", "chunk_shape", "bits"), INDEX_LAYOUTS)
@pytest.mark.parametrize(
    "how",
    [
        "last_index_is_chunk_numel",
        "last_index_is_max_code",
        "first_chunk_out_of_range",
        "duplicate",
        "decreasing",
        "all_zero",
        "reversed",
    ],
)
def test_bad_indices_are_rejected(shape, chunk, chunk_shape, bits, zstd, how):
    message = _index_message(shape, chunk, 8, zstd)
    assert tuple(message.chunk_shape) == chunk_shape and message.index_bits == bits
    chunks = _chunks_of_indices(message)
    assert len(chunks) >= 2 and all(a < b for c in chunks for a, b in itertools.pairwise(c))
    numel = chunk_shape[0] * chunk_shape[1]
    assert numel < 1 << bits  # an out-of-range index is representable in the packed width
    assert_malformed(_with_indices(message, _corrupt(chunks, how, numel, bits)), "bad_indices")


@pytest.mark.parametrize(("shape", "chunk", "chunk_shape", "bits"), INDEX_LAYOUTS)
def test_largest_in_range_index_is_accepted(shape, chunk, chunk_shape, bits):
    """Control for the above: the helpers re-pack indices correctly, and chunk_numel - 1 is fine."""
    message = _index_message(shape, chunk, 8, False)
    chunks = _chunks_of_indices(message)
    assert _with_indices(message, chunks).indices == message.indices
    chunks[-1][-1] = chunk_shape[0] * chunk_shape[1] - 1
    assert decode_or_reject(_with_indices(message, chunks).SerializeToString()) is not None


@pytest.mark.parametrize("index", [3072, 4095])
def test_out_of_range_index_with_topk_one_is_rejected(index):
    message = _index_message((96, 128), 64, 1, False)
    assert message.topk == 1 and message.index_bits == 12
    chunks = _chunks_of_indices(message)
    chunks[2] = [index]
    assert_malformed(_with_indices(message, chunks), "bad_indices")


# ---------------------------------------------------------------------------------------------
# Values and scales: NaN, infinities, out-of-range codes, bad scales, overflow.
# ---------------------------------------------------------------------------------------------

FLOAT_PATCHES = [  # (encoding, bytes per value, patch, reason)
    (VE.VALUE_ENCODING_FLOAT32, 4, f32(math.nan), "non_finite"),
    (VE.VALUE_ENCODING_FLOAT32, 4, struct.pack("<I", 0xFFC00001), "non_finite"),  # negative NaN
    (VE.VALUE_ENCODING_FLOAT32, 4, f32(math.inf), "non_finite"),
    (VE.VALUE_ENCODING_FLOAT32, 4, f32(-math.inf), "non_finite"),
    (VE.VALUE_ENCODING_BFLOAT16, 2, u16(0x7FC0), "non_finite"),
    (VE.VALUE_ENCODING_BFLOAT16, 2, u16(0xFF81), "non_finite"),
    (VE.VALUE_ENCODING_BFLOAT16, 2, u16(0x7F80), "non_finite"),
    (VE.VALUE_ENCODING_BFLOAT16, 2, u16(0xFF80), "non_finite"),
    (VE.VALUE_ENCODING_FLOAT16, 2, u16(0x7E00), "value_out_of_range"),  # NaN
    (VE.VALUE_ENCODING_FLOAT16, 2, u16(0x7C00), "value_out_of_range"),  # +inf
    (VE.VALUE_ENCODING_FLOAT16, 2, u16(0xFC00), "value_out_of_range"),  # -inf
    (VE.VALUE_ENCODING_FLOAT16, 2, u16(0x3C01), "value_out_of_range"),  # 1.000977 > 1
    (VE.VALUE_ENCODING_FLOAT16, 2, u16(0x7BFF), "value_out_of_range"),  # 65504
    (VE.VALUE_ENCODING_INT8, 1, b"\x80", "value_out_of_range"),  # -128
]


@pytest.mark.parametrize(
    ("encoding", "width", "patch", "reason"),
    FLOAT_PATCHES,
    ids=[f"{LABEL[e]}-{p.hex()}" for e, _, p, _ in FLOAT_PATCHES],
)
def test_bad_value_is_rejected(encoding, width, patch, reason):
    for name in names_with(encoding):
        message = VARIANTS[name].message
        count = value_count(message)
        for index in (0, count // 2, count - 1):
            assert_malformed(patched(message, "values", index * width, patch), reason)


@pytest.mark.parametrize("name", names_with(VE.VALUE_ENCODING_INT4))
@pytest.mark.parametrize("code", [0])
def test_int4_code_zero_is_rejected(name, code):
    """INT4 codes are round(7 * v / s) + 8 in [1, 15]; code 0 would be -8."""
    message = VARIANTS[name].message
    content = raw_stream(message, "values")
    count = value_count(message)
    for index in (0, 1, count - 1):
        corrupted = bytearray(content)
        shift = 4 * (index % 2)
        corrupted[index // 2] = (corrupted[index // 2] & ~(0xF << shift) & 0xFF) | (code << shift)
        assert unpack_bits(bytes(corrupted), 4, count)[index] == code
        assert_malformed(with_stream(message, "values", bytes(corrupted)), "value_out_of_range")


SCALED_NAMES = [n for n in NAMES if VARIANTS[n].message.value_encoding not in UNSCALED]


@pytest.mark.parametrize("name", SCALED_NAMES)
def test_bad_scale_is_rejected(name):
    """NaN (either sign), negative (even tiny), or infinite scales."""
    message = VARIANTS[name].message
    groups = len(raw_stream(message, "scales")) // 4
    for scale in (
        f32(math.nan),
        struct.pack("<I", 0xFFC00000),
        f32(-1.0),
        f32(-1e-30),
        f32(math.inf),
        f32(-math.inf),
    ):
        for group in sorted({0, groups - 1}):
            assert_malformed(patched(message, "scales", 4 * group, scale), "bad_scale")


def _overflowing_messages() -> dict[str, EncodedTensor]:
    """Finite wire numbers whose decoded tensor is not finite: in the output dtype, or after the
    inverse DCT sums several near-float32-max coefficients."""
    cases = {}
    m = DenseCodec(8, zstd=False).encode(torch.tensor([1.0, -2.0, 3.0]))
    m.dtype, m.scales = DType.DTYPE_FLOAT16, f32(1e6)
    cases["dense-int8-scale-1e6-as-float16"] = m
    m = DenseCodec(1, zstd=False).encode(torch.tensor([1.0, -2.0, 3.0]))
    m.dtype, m.scales = DType.DTYPE_FLOAT16, f32(1e6)
    cases["dense-sign-scale-1e6-as-float16"] = m
    m = DenseCodec(32, zstd=False).encode(torch.tensor([1.0, -2.0]))
    m.dtype, m.values = DType.DTYPE_FLOAT16, f32(1e6) + f32(1.0)
    cases["dense-f32-1e6-as-float16"] = m
    m = DenseCodec(32, zstd=False).encode(torch.tensor([1.0, -2.0]))
    m.dtype, m.values = DType.DTYPE_BFLOAT16, f32(3.4028235e38) + f32(1.0)
    cases["dense-f32-max-as-bfloat16"] = m
    m = DCTTopKCodec(chunk=64, topk=2, value_bits=32, zstd=False).encode(torch.tensor([1.0, 2.0]))
    m.values = f32(3.4e38) * 2
    cases["dct-f32-inverse-overflows"] = m
    m = DCTTopKCodec(chunk=64, topk=2, value_bits=8, zstd=False).encode(torch.tensor([1.0, 2.0]))
    m.values, m.scales = b"\x7f\x7f", f32(3.4e38)
    cases["dct-int8-huge-scale-inverse-overflows"] = m
    m = DCTTopKCodec(chunk=64, topk=2, value_bits=1, zstd=False).encode(torch.tensor([1.0, 2.0]))
    m.values, m.scales = b"\x00", f32(3.4e38)
    cases["dct-sign-huge-scale-inverse-overflows"] = m
    m = DCTTopKCodec(chunk=64, topk=2, value_bits=32, zstd=False).encode(torch.tensor([1.0, 2.0]))
    m.dtype, m.values = DType.DTYPE_FLOAT16, f32(1e6) * 2
    cases["dct-f32-1e6-as-float16"] = m
    return cases


OVERFLOWING = _overflowing_messages()


@pytest.mark.parametrize("case", sorted(OVERFLOWING))
def test_finite_wire_values_that_decode_to_infinity_are_rejected(case):
    """The decoded tensor must be finite: a peer can't smuggle inf in through a huge finite scale or
    value, whether it overflows in the inverse DCT or in the cast to the message's dtype.

    No honest DENSE encoder produces these (its values never exceed the source's range), so they must
    be rejected. A top-k DCT reconstruction can overshoot the source's range a little, so for DCT_TOPK a
    decoder that saturates to the dtype's finite range instead of rejecting is also acceptable."""
    message = OVERFLOWING[case]
    if message.codec == DENSE:
        assert_malformed(message)
    else:
        decode_or_reject(message.SerializeToString())


# ---------------------------------------------------------------------------------------------
# Shapes: too many elements, too many dims, degenerate; all rejected before any allocation.
# ---------------------------------------------------------------------------------------------

BASES = ["dct-int8-raw", "dense-int8-raw"]
HUGE_SHAPES = [
    [2**40, 2**40],
    [2**64 - 1, 2**64 - 1],
    [2**64 - 1] * 8,
    [2**14, 2**14 + 1],
    [2**28 + 1],
    [2, 3, 2**40, 0],  # the product passes the limit before the zero is reached
]


@pytest.mark.parametrize("decoder", sorted(DECODERS))
@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("shape", HUGE_SHAPES, ids=str)
def test_huge_claimed_shape_is_rejected_fast_without_allocating(decoder, base, shape):
    bad = clone(VARIANTS[base].message)
    bad.shape[:] = shape
    assert len(bad.SerializeToString()) < 4096 + 200  # the streams of a tiny message travel with it
    tracemalloc.start()
    try:
        start = time.perf_counter()
        assert_malformed(bad, "too_large", decode=DECODERS[decoder])
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert elapsed < 1.0
    assert peak < 4 << 20


@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_shape_at_the_element_limit_with_tiny_streams_is_rejected_fast(decoder):
    """2**28 elements is allowed, but the streams are those of a small tensor: the length check
    must come before the 1 GiB output (or DCT workspace) is allocated."""
    dct = clone(VARIANTS["dct-int8-raw"].message)
    dct.shape[:] = [2**14, 2**14]
    dct.chunk_shape[:] = [64, 64]
    dense = clone(VARIANTS["dense-int8-raw"].message)
    dense.shape[:] = [2**28]
    for bad in (dct, dense):
        start = time.perf_counter()
        assert_malformed(bad, "length_mismatch", decode=DECODERS[decoder])
        assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("decoder", sorted(DECODERS))
@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("shape", [[1] * 9, [2] * 9, [1] * 100], ids=["nine-1s", "nine-2s", "hundred-1s"])
def test_too_many_dims_is_rejected(decoder, base, shape):
    bad = clone(VARIANTS[base].message)
    bad.shape[:] = shape
    assert_malformed(bad, "bad_shape", decode=DECODERS[decoder])


@pytest.mark.parametrize("base", BASES)
def test_decode_limits_are_applied(base):
    message = VARIANTS[base].message
    numel = math.prod(message.shape)
    assert_malformed(message, "too_large", limits=DecodeLimits(max_numel=numel - 1))
    if len(message.shape) > 1:
        assert_malformed(message, "bad_shape", limits=DecodeLimits(max_dims=len(message.shape) - 1))
    for decoder in DECODERS.values():
        with pytest.raises(MalformedPayloadError) as info:
            decoder(over_the_wire(message), limits=DecodeLimits(max_numel=numel - 1))
        assert info.value.reason == "too_large"
    assert decode_tensor(message, limits=DecodeLimits(max_numel=numel)).numel() == numel


def test_decode_limits_bound_the_dct_chunk():
    message = VARIANTS["dct-int8-raw"].message
    assert tuple(message.chunk_shape) == (48, 64)
    assert_malformed(message, "bad_chunk", limits=DecodeLimits(max_chunk=63))
    assert_malformed(message, "bad_chunk", limits=DecodeLimits(max_chunk=47))
    assert decode_tensor(message, limits=DecodeLimits(max_chunk=64)).shape == (96, 128)


@pytest.mark.parametrize("decoder", sorted(DECODERS))
@pytest.mark.parametrize("shape", [[], [0], [0, 5], [5, 0], [0, 2**63], [2**64 - 1, 0]], ids=str)
def test_dct_message_claiming_a_0d_or_empty_shape_is_rejected(decoder, shape):
    """0-d and empty tensors travel dense; a DCT_TOPK message claiming one is malformed.
    ([2**64 - 1, 0] may be refused as too large before the zero is seen.)"""
    bad = clone(VARIANTS["dct-int8-raw"].message)
    bad.shape[:] = shape
    assert_malformed(bad, "bad_shape", "too_large", decode=DECODERS[decoder])


@pytest.mark.parametrize("decoder", sorted(DECODERS))
@pytest.mark.parametrize("shape", [[1], [1, 1], [1, 1, 1]], ids=str)
def test_dct_message_claiming_one_element_is_rejected_or_coherent(decoder, shape):
    """One-element tensors travel dense. A DCT_TOPK message claiming one with the chunk and streams of
    a (96, 128) tensor is malformed; a fully coherent one (chunk 1x1, topk 1, index_bits 0, one value)
    may be rejected or decoded, but only to a finite tensor of that shape."""
    bad = clone(VARIANTS["dct-int8-raw"].message)
    bad.shape[:] = shape
    assert_malformed(bad, "bad_shape", "bad_chunk", decode=DECODERS[decoder])
    coherent = clone(VARIANTS["dct-f32-raw"].message)
    coherent.shape[:] = shape
    coherent.chunk_shape[:] = [1, 1]
    coherent.topk, coherent.index_bits, coherent.indices, coherent.values = 1, 0, b"", f32(2.5)
    try:
        out = DECODERS[decoder](over_the_wire(coherent))
    except MalformedPayloadError as error:
        assert type(error) is MalformedPayloadError
    else:
        assert list(out.shape) == shape and torch.equal(out.reshape(-1), torch.tensor([2.5]))


@pytest.mark.parametrize("decoder", sorted(DECODERS))
@pytest.mark.parametrize(
    "shape", [[0, 2**40], [0, 2**62, 2**62], [0, 2**63], [2**63, 0], [0, 2**64 - 1]], ids=str
)
def test_dense_empty_tensor_with_absurd_dims_fails_cleanly(decoder, shape):
    """Zero elements, but a dimension beyond anything real (beyond int64 for 2**63 and up). The
    decoder may reject it or return an empty tensor of that shape, but nothing else."""
    message = DenseCodec(8, zstd=False).encode(torch.zeros(0))
    message.shape[:] = shape
    try:
        out = DECODERS[decoder](over_the_wire(message))
    except MalformedPayloadError as error:
        assert type(error) is MalformedPayloadError
        return
    assert out.numel() == 0 and list(out.shape) == shape


# ---------------------------------------------------------------------------------------------
# Header fields: unknown enums, DCT chunk/topk/index_bits, dense block size.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("codec", [0, 3, 99, -1, 2**31 - 1])
def test_unknown_codec_is_rejected(base, codec):
    bad = clone(VARIANTS[base].message)
    bad.codec = codec
    assert over_the_wire(bad).codec == codec  # proto3 enums are open: the value survives the wire
    assert_malformed(bad, "unknown_codec")


@pytest.mark.parametrize("decoder", sorted(DECODERS))
@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("dtype", [0, 5, 99, -1])
def test_unknown_dtype_is_rejected(decoder, base, dtype):
    bad = clone(VARIANTS[base].message)
    bad.dtype = dtype
    assert_malformed(bad, "bad_dtype", decode=DECODERS[decoder])


@pytest.mark.parametrize("decoder", sorted(DECODERS))
@pytest.mark.parametrize("name", ["dct-int8-raw", "dct-f32-zstd", "dense-int8-raw", "dense-sign-zstd"])
def test_unknown_value_encoding_is_rejected(decoder, name):
    for encoding in (0, 7, 99, -1):
        bad = clone(VARIANTS[name].message)
        bad.value_encoding = encoding
        assert_malformed(bad, "unknown_value_encoding", decode=DECODERS[decoder])


@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith("dense-")])
def test_dense_block_size_zero_is_rejected(name):
    bad = clone(VARIANTS[name].message)
    bad.block_size = 0
    assert_malformed(bad, "bad_block")


@pytest.mark.parametrize("block", [1, 32, 50, 128, 999, 2**20])
def test_dense_block_size_that_changes_the_scale_count_is_rejected(block):
    bad = clone(VARIANTS["dense-int8-raw"].message)
    assert bad.block_size == 64 and -(-999 // block) != -(-999 // 64)
    bad.block_size = block
    assert_malformed(bad, "length_mismatch")


@pytest.mark.parametrize(
    "chunk_shape",
    [
        [],
        [48],
        [48, 64, 1],
        [48, 64, 64],
        [48, 60],
        [40, 64],
        [0, 64],
        [48, 0],
        [0, 0],
        [96, 256],
        [2**32 - 1, 64],
        [48, 2**32 - 1],
        [1, 128 * 3],
    ],
    ids=str,
)
def test_bad_chunk_shape_is_rejected(chunk_shape):
    """DCT_TOPK message of a (96, 128) tensor, valid chunk (48, 64)."""
    bad = clone(VARIANTS["dct-int8-raw"].message)
    bad.chunk_shape[:] = chunk_shape
    assert_malformed(bad, "bad_chunk")


def test_chunk_side_over_the_limit_is_rejected_even_when_it_divides():
    bad = clone(VARIANTS["dct-int8-raw"].message)
    bad.shape[:] = [96, 512]
    bad.chunk_shape[:] = [48, 512]  # divides, but 512 > DecodeLimits().max_chunk = 256
    assert_malformed(bad, "bad_chunk")
    bad.shape[:] = [512, 2]
    bad.chunk_shape[:] = [512, 2]
    assert_malformed(bad, "bad_chunk")


def test_chunk_rows_must_divide_the_second_to_last_dim_not_the_folded_rows():
    """A (2, 48, 128) tensor is a 96 x 128 matrix, but chunk rows must divide 48 (tensor.proto)."""
    bad = clone(VARIANTS["dct-int8-raw"].message)
    bad.shape[:] = [2, 48, 128]
    bad.chunk_shape[:] = [96, 64]
    assert_malformed(bad, "bad_chunk")
    bad.chunk_shape[:] = [48, 64]  # valid again: same number of chunks, same streams
    assert decode_or_reject(bad.SerializeToString()) is not None


@pytest.mark.parametrize("topk", [0, 48 * 64 + 1, 2**31, 2**32 - 1])
def test_topk_outside_the_chunk_is_rejected(topk):
    bad = clone(VARIANTS["dct-int8-raw"].message)
    bad.topk = topk
    assert_malformed(bad, "bad_topk")


@pytest.mark.parametrize("topk", [1, 31, 33, 48 * 64])
def test_topk_that_does_not_match_the_streams_is_rejected(topk):
    bad = clone(VARIANTS["dct-int8-raw"].message)
    assert bad.topk == 32
    bad.topk = topk
    assert_malformed(bad, "length_mismatch")


@pytest.mark.parametrize("bits", [0, 1, 11, 13, 16, 32, 2**32 - 1])
def test_wrong_index_bits_is_rejected(bits):
    bad = clone(VARIANTS["dct-int8-raw"].message)
    assert bad.index_bits == 12
    bad.index_bits = bits
    assert_malformed(bad, "bad_index_bits")


def test_huge_dense_block_size_does_not_allocate_per_block_size():
    """A 3-element INT8 message with block_size = 2**32 - 1 is one short block. Decoding it must not
    allocate anything proportional to block_size (a scale per *claimed* block slot would be 16 GiB).
    Run in a child process under an address-space limit so a regression fails instead of thrashing."""
    if not sys.platform.startswith("linux"):
        pytest.skip("needs /proc and RLIMIT_AS")
    script = textwrap.dedent(
        """
        import resource, sys, torch
        from shoal.compression import DenseCodec, MalformedPayloadError, decode_tensor
        message = DenseCodec(8, block=64, zstd=False).encode(torch.tensor([1.0, -2.0, 3.0]))
        expected = decode_tensor(message)
        message.block_size = 2**32 - 1
        vm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status")
                  if line.startswith("VmSize:"))
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = vm + (1 << 30)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
        try:
            out = decode_tensor(message)
        except MalformedPayloadError as error:
            print("rejected", error.reason)
        else:
            assert torch.equal(out, expected), (out, expected)
            print("decoded", out.tolist())
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"decoding crashed:\n{result.stdout}\n{result.stderr[-3000:]}"


# ---------------------------------------------------------------------------------------------
# parse_message: size limit first, protobuf errors mapped, garbage handled.
# ---------------------------------------------------------------------------------------------


def test_parse_rejects_oversized_input_before_parsing():
    data = VARIANTS["dct-f32-raw"].message.SerializeToString()
    with pytest.raises(MalformedPayloadError) as info:
        parse_message(EncodedTensor, data, max_bytes=len(data) - 1)
    assert type(info.value) is MalformedPayloadError and info.value.reason == "too_large"
    assert parse_message(EncodedTensor, data, max_bytes=len(data)) == VARIANTS["dct-f32-raw"].message
    huge = b"\xff" * (64 << 20)  # unparsable, but the size check comes first, and fast
    start = time.perf_counter()
    with pytest.raises(MalformedPayloadError) as info:
        parse_message(EncodedTensor, huge, max_bytes=1 << 20)
    assert info.value.reason == "too_large"
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize(
    "data",
    [
        b"\xff",
        b"\xff\xff\xff\xff",
        b"\x0a\xff\xff\xff",
        b"\x52\x05ab",
        b"\x12\x03\x80\x80",
        b"\x08\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",
        b"\x52\xff\xff\xff\xff\x0f",
        b"\x0f",
        b"\x07",
    ],
    ids=lambda d: d.hex(),
)
def test_parse_maps_protobuf_errors_to_unparsable(data):
    with pytest.raises(MalformedPayloadError) as info:
        parse_message(EncodedTensor, data, max_bytes=1 << 20)
    assert type(info.value) is MalformedPayloadError and info.value.reason == "unparsable"


def test_random_garbage_is_rejected_or_decodes_sanely():
    rng = random.Random(99)
    outcomes = {"unparsable": 0, "rejected": 0, "decoded": 0}
    for _ in range(600):
        data = rng.randbytes(rng.randint(0, 300))
        try:
            message = parse_message(EncodedTensor, data, max_bytes=MAX_BYTES)
        except MalformedPayloadError as error:
            assert error.reason == "unparsable"
            outcomes["unparsable"] += 1
            continue
        out = decode_or_reject(data)
        outcomes["decoded" if out is not None else "rejected"] += 1
        assert out is None or tuple(out.shape) == tuple(message.shape)
    assert outcomes["unparsable"] > 0 and outcomes["rejected"] > 0  # both paths were exercised


@pytest.mark.parametrize("name", ["dct-int4-raw", "dct-sign-zstd", "dense-fp16-zstd", "dense-int8-raw"])
def test_every_prefix_of_a_message_is_rejected_or_decodes_sanely(name):
    data = VARIANTS[name].message.SerializeToString()
    full = decode_tensor(VARIANTS[name].message)
    for cut in range(0, len(data), max(1, len(data) // 150)):
        out = decode_or_reject(data[:cut])
        # a prefix that drops only default-valued trailing fields is the same message
        assert out is None or torch.equal(out, full)


# ---------------------------------------------------------------------------------------------
# Fuzzing.
# ---------------------------------------------------------------------------------------------

WIRE = {name: VARIANTS[name].message.SerializeToString() for name in NAMES}
EDITS = st.lists(
    st.tuples(
        st.sampled_from(("set", "set", "set", "flip", "flip", "flip", "insert", "delete")),
        st.integers(0, 1 << 16),
        st.integers(0, 255),
    ),
    min_size=1,
    max_size=4,
)
FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@FUZZ
@given(name=st.sampled_from(NAMES), edits=EDITS)
def test_fuzz_mutated_bytes_are_rejected_or_decode_sanely(name, edits):
    data = bytearray(WIRE[name])
    for op, position, byte in edits:
        if op == "insert":
            data.insert(position % (len(data) + 1), byte)
        elif not data:
            continue
        elif op == "set":
            data[position % len(data)] = byte
        elif op == "flip":
            data[position % len(data)] ^= 1 << (byte % 8)
        else:
            del data[position % len(data) :][: 1 + byte % 8]
    decode_or_reject(bytes(data))


FIELD_EDITS = (
    "shape",
    "add_dim",
    "drop_dim",
    "dtype",
    "codec",
    "encoding",
    "chunk_shape",
    "topk",
    "index_bits",
    "block_size",
    "flag",
    "stream_random",
    "stream_byte",
)
NUMBERS = st.one_of(st.integers(0, 70), st.sampled_from([2**31 - 1, 2**32 - 1, 2**63, 2**64 - 1]))


def _edit_field(message: EncodedTensor, field: str, number: int, rng: random.Random) -> EncodedTensor:
    """One hostile change to one field of a valid message."""
    stream = STREAMS[number % 3]
    if field == "shape" and message.shape:
        message.shape[rng.randrange(len(message.shape))] = number
    elif field == "add_dim":
        message.shape.insert(rng.randrange(len(message.shape) + 1), number)
    elif field == "drop_dim" and message.shape:
        del message.shape[rng.randrange(len(message.shape))]
    elif field == "dtype":
        message.dtype = number % 7
    elif field == "codec":
        message.codec = number % 4
    elif field == "encoding":
        message.value_encoding = number % 9
    elif field == "chunk_shape":
        if message.chunk_shape and number % 5:
            message.chunk_shape[rng.randrange(len(message.chunk_shape))] = number % 2**32
        else:
            message.chunk_shape.append(number % 2**32)
    elif field == "topk":
        message.topk = number % 2**32
    elif field == "index_bits":
        message.index_bits = number % 2**32
    elif field == "block_size":  # bounded: test_huge_dense_block_size_... covers huge ones
        message.block_size = number % 301
    elif field == "flag":
        setattr(message, f"{stream}_zstd", not getattr(message, f"{stream}_zstd"))
    elif field in ("stream_random", "stream_byte") and getattr(message, stream):
        try:  # edit the content, re-framed as it was
            content, zstd = bytearray(raw_stream(message, stream)), None
        except zstandard.ZstdError:  # a flag flipped by an earlier edit: edit the bytes as they are
            content, zstd = bytearray(getattr(message, stream)), False
        if field == "stream_random":
            content = bytearray(rng.randbytes(len(content)))
        elif content:
            content[rng.randrange(len(content))] = number % 256
        flag = getattr(message, f"{stream}_zstd")
        message = with_stream(message, stream, bytes(content), zstd=zstd)
        setattr(message, f"{stream}_zstd", flag)
    return message


@FUZZ
@given(
    codec=st.sampled_from(["dct", "dense"]),
    shape=st.lists(st.integers(1, 24), min_size=1, max_size=3),
    bits=st.sampled_from([32, 16, 8, 4, 1]),
    half=st.sampled_from(["bf16", "fp16"]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
    zstd=st.booleans(),
    edits=st.lists(st.tuples(st.sampled_from(FIELD_EDITS), NUMBERS), min_size=1, max_size=3),
    seed=st.integers(0, 2**32 - 1),
)
def test_fuzz_header_fields_are_rejected_or_decode_sanely(codec, shape, bits, half, dtype, zstd, edits, seed):
    """A valid message of a random small tensor, then one to three hostile field edits."""
    rng = random.Random(seed)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    if codec == "dct":
        encoder = DCTTopKCodec(
            chunk=rng.choice([4, 8, 64]), topk=rng.randint(1, 12), value_bits=bits, zstd=zstd
        )
    else:
        encoder = DenseCodec(bits, block=rng.randint(1, 70), half=half, zstd=zstd)
    message = encoder.encode(x)
    if zstd and rng.random() < 0.5:
        message = _force_zstd(message)
    for field, number in edits:
        message = _edit_field(message, field, number, rng)
    decode_or_reject(message.SerializeToString(), limits=DecodeLimits(max_numel=1 << 16))
