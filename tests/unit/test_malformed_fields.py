"""Hostile-peer input for the tensor decoders: the header fields and the message as a whole.

Starting from the valid messages of `tests.hostile_messages`, these tests claim huge, over-dimensioned,
empty or 0-d shapes, unknown codecs, dtypes and value encodings, and bad DCT chunk shapes, top-k, index
widths and dense block sizes; check that `parse_message` applies its size limit first and maps protobuf
errors to `unparsable`; and fuzz random garbage, message prefixes, mutated bytes and hostile field edits.
Every input must either be rejected with exactly `MalformedPayloadError` or decode to a finite tensor of
the claimed shape and dtype, quickly, and without allocating what the message merely claims.
"""

import math
import random
import subprocess
import sys
import textwrap
import time
import tracemalloc

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
from shoal.protocol import parse_message
from tests.hostile_messages import (
    DECODERS,
    MAX_BYTES,
    NAMES,
    STREAMS,
    VARIANTS,
    assert_malformed,
    clone,
    decode_or_reject,
    f32,
    force_zstd,
    over_the_wire,
    raw_stream,
    with_stream,
)

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
@pytest.mark.parametrize("codec", [0, 4, 99, -1, 2**31 - 1])
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
    for encoding in (0, 8, 99, -1):
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
        message = force_zstd(message)
    for field, number in edits:
        message = _edit_field(message, field, number, rng)
    decode_or_reject(message.SerializeToString(), limits=DecodeLimits(max_numel=1 << 16))
