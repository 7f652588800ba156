"""Hostile-peer input for the tensor decoders: the byte streams of a message.

Starting from the valid messages of `tests.hostile_messages` (first checked to be complete and to decode),
these tests truncate, extend, drop and re-flag the indices, values and scales streams, feed in garbage,
corrupted and trailing-data zstd frames and zstd bombs, write out-of-range, duplicate and unsorted DCT
indices, and patch in NaN, infinite or out-of-range values and bad scales (including finite wire numbers
that overflow once decoded); each corrupted message must be rejected with exactly
`MalformedPayloadError` (and the expected `reason`), quickly, and without allocating what it claims.
"""

import io
import itertools
import math
import struct
import time
import tracemalloc

import pytest
import torch
import zstandard

from shoal.compression import DCTTopKCodec, DenseCodec, EncodedTensor, MalformedPayloadError, decode_tensor
from shoal.protocol import DType
from tests.hostile_messages import (
    BITS,
    DCT,
    DENSE,
    LABEL,
    NAMES,
    RAW_NAMES,
    STREAM_CASES,
    STREAMS,
    TOPK,
    UNSCALED,
    VARIANTS,
    VE,
    ZSTD_MAGIC,
    ZSTD_NAMES,
    assert_malformed,
    clone,
    decode_or_reject,
    f32,
    force_zstd,
    names_with,
    over_the_wire,
    pack_bits,
    patched,
    raw_stream,
    u16,
    unpack_bits,
    value_count,
    with_stream,
)

# ---------------------------------------------------------------------------------------------
# Valid message variants: complete, decodable, zstd where claimed.
# ---------------------------------------------------------------------------------------------


def test_variant_set_is_complete():
    assert len(NAMES) == 34
    for codec, encodings in (
        (DCT, BITS),
        (DENSE, BITS),
        (TOPK, (VE.VALUE_ENCODING_FLOAT32, VE.VALUE_ENCODING_INT8, VE.VALUE_ENCODING_LEVELS2)),
    ):
        for encoding in encodings:
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
        if variant.message.value_encoding not in (*UNSCALED, VE.VALUE_ENCODING_LEVELS2):  # 16-byte table
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
    return force_zstd(message) if zstd else message


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
    """NaN (either sign), negative (even tiny), or infinite scales; LEVELS2's are levels of either
    sign, and only the non-finite ones are refused."""
    message = VARIANTS[name].message
    levels = message.value_encoding == VE.VALUE_ENCODING_LEVELS2
    width = 2 if levels else 4  # LEVELS2: bfloat16 levels, the upper half of a float32
    groups = len(raw_stream(message, "scales")) // width
    negative = (f32(-1.0), f32(-1e-30))
    for scale in (f32(math.nan), struct.pack("<I", 0xFFC00000), f32(math.inf), f32(-math.inf), *negative):
        for group in sorted({0, groups - 1}):
            bad = patched(message, "scales", width * group, scale[4 - width :])
            if levels and scale in negative:
                assert decode_or_reject(bad.SerializeToString()) is not None
            else:
                assert_malformed(bad, "bad_scale")


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
