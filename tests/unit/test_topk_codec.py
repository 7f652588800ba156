"""TopKCodec (plain chunked top-k, Elias-Fano indices, LEVELS2 values): what it keeps, what it costs,
and what a hostile peer's message gets."""

import math

import pytest
import torch

from shoal.compression import TopKCodec, decode_tensor, elias_fano
from shoal.compression.dct_topk import unpack
from shoal.compression.values import decode as decode_values
from shoal.compression.values import encode as encode_values
from shoal.protocol import IndexCoding, ValueEncoding
from tests.hostile_messages import assert_malformed, clone, pack_bits, with_stream


def test_keeps_exactly_the_largest_values_of_every_chunk():
    torch.manual_seed(0)
    x = torch.randn(128, 192)  # chunks 64x64: 2 x 3 of them
    out = decode_tensor(TopKCodec(chunk=64, topk=100, value_bits=32).encode(x))
    for r in range(2):
        for c in range(3):
            tile, kept = (
                x[64 * r : 64 * r + 64, 64 * c : 64 * c + 64],
                out[64 * r : 64 * r + 64, 64 * c : 64 * c + 64],
            )
            threshold = tile.abs().flatten().topk(100).values[-1]
            assert torch.equal(kept, torch.where(tile.abs() >= threshold, tile, 0.0))


def test_small_chunks_keep_the_full_chunks_share_and_at_least_one():
    codec = TopKCodec(chunk=64, topk=64)
    assert unpack(codec.encode(torch.randn(128)), torch.device("cpu"), codec.limits).topk == 1
    assert unpack(codec.encode(torch.randn(640, 64)), torch.device("cpu"), codec.limits).topk == 64
    assert unpack(codec.encode(torch.randn(32, 64)), torch.device("cpu"), codec.limits).topk == 32


@pytest.mark.parametrize(("topk", "at_least"), [(64, 180), (32, 300), (128, 105)])
def test_size_of_a_2_bit_message(topk, at_least):
    """64 of 4096 at 2 bits with Elias-Fano indices: 10 bits per value and 4 bfloat16 levels per
    chunk, 186x smaller than fp32 (SparseLoCo's 146x is packed 12-bit indices, and no scale)."""
    x = torch.randn(512, 512)
    message = TopKCodec(topk=topk, value_bits=2).encode(x)
    assert message.index_coding == IndexCoding.INDEX_CODING_ELIAS_FANO
    assert x.numel() * 4 / len(message.SerializeToString()) >= at_least
    packed = TopKCodec(topk=64, value_bits=2, elias_fano=False).encode(x)
    assert 125 < x.numel() * 4 / len(packed.SerializeToString()) < 146.3


def test_levels2_keeps_signs_and_decodes_each_bin_to_its_mean():
    torch.manual_seed(1)
    v = torch.cat([torch.rand(500) + 1, -(torch.rand(500) * 3 + 1)])
    v = v[torch.randperm(1000)]
    encoded = encode_values(v, ValueEncoding.VALUE_ENCODING_LEVELS2, 300)  # groups of 300, the last 100
    assert encoded.values.numel() == 250 and encoded.scales.numel() == 4 * 4 * 2  # bfloat16 levels
    out = decode_values(encoded, ValueEncoding.VALUE_ENCODING_LEVELS2, v.numel(), 300)
    assert torch.equal(torch.sign(out), torch.sign(v))
    for start in (0, 300, 600, 900):
        part, decoded = v[start : start + 300], out[start : start + 300]
        bound = part.abs().mean()
        for mask in (
            part < -bound,
            (part < 0) & (part >= -bound),
            (part >= 0) & (part < bound),
            part >= bound,
        ):
            mean = part[mask].mean().expand(int(mask.sum()))
            assert torch.allclose(decoded[mask], mean, rtol=2**-8)  # bfloat16
    assert (out - v).norm() < 0.5 * v.norm()  # coarse, and kept by the error feedback


@pytest.mark.parametrize(("n", "k"), [(4096, 64), (4096, 1), (3072, 100), (64, 64), (7, 3), (4096, 4096)])
def test_elias_fano_round_trip(n, k):
    generator = torch.Generator().manual_seed(n + k)
    indices = torch.stack([torch.randperm(n, generator=generator)[:k].sort().values for _ in range(5)])
    stream = elias_fano.encode(indices, n)
    assert stream.numel() == elias_fano.size(5, k, n)
    assert torch.equal(elias_fano.decode(stream, 5, k, n), indices)
    bits = k * elias_fano.low_bits(n, k) + elias_fano.bitmap_bits(n, k)
    assert bits <= k * (2 + math.ceil(math.log2(max(n / k, 1))))  # at most 2 bits over log2(n/k)


def _ef_message(n_chunks=3):
    torch.manual_seed(2)
    return TopKCodec(chunk=64, topk=64, value_bits=8).encode(torch.randn(64, 64 * n_chunks))


def _with_indices(message, chunks: list[list[int]], n: int = 4096):
    """`message` with its Elias-Fano stream rewritten from hand-made chunks (any order, duplicates):
    low bits packed, then each chunk's bitmap (written here from tensor.proto, not by the codec)."""
    k = len(chunks[0])
    low = elias_fano.low_bits(n, k)
    width = elias_fano.bitmap_bits(n, k)
    lows = pack_bits([i & ((1 << low) - 1) for chunk in chunks for i in chunk], low)
    bitmap = [0] * (width * len(chunks))
    for c, chunk in enumerate(chunks):
        for rank, i in enumerate(chunk):
            position = c * width + (i >> low) + rank
            if position < width * (c + 1):
                bitmap[position] = 1
    return with_stream(message, "indices", lows + pack_bits(bitmap, 1))


def test_hostile_elias_fano_streams_are_rejected():
    message = _ef_message()
    good = unpack(message, torch.device("cpu"), TopKCodec().limits).indices.tolist()
    assert torch.equal(decode_tensor(_with_indices(message, good)), decode_tensor(message))  # the layout
    duplicate = [chunk[:] for chunk in good]
    duplicate[1][5] = duplicate[1][4]
    assert_malformed(_with_indices(message, duplicate), "bad_indices")
    unsorted = [chunk[:] for chunk in good]
    unsorted[2][0], unsorted[2][1] = unsorted[2][1], unsorted[2][0]
    assert_malformed(_with_indices(message, unsorted), "bad_indices")
    # a bitmap with one set bit too many, and one too few
    k, width = 64, elias_fano.bitmap_bits(4096, 64)
    lows = elias_fano.low_bits(4096, 64) * k * 3 // 8
    raw = bytearray(elias_fano.encode(torch.tensor(good), 4096).numpy().tobytes())
    for flip in (lambda b: b | 1, lambda b: b & 0xFE if b & 1 else b & 0x7F):
        bad = bytearray(raw)
        bad[lows + width // 8] = flip(bad[lows + width // 8])
        if bad != raw:
            assert_malformed(with_stream(message, "indices", bytes(bad)), "bad_indices")
    # lengths, coding and widths are checked before decoding
    assert_malformed(with_stream(message, "indices", bytes(raw[:-1])), "length_mismatch")
    for field, value, reason in (
        ("index_coding", 2, "bad_index_coding"),
        ("index_bits", 12, "bad_index_bits"),
        ("index_coding", IndexCoding.INDEX_CODING_PACKED, "bad_index_bits"),
    ):
        bad = clone(message)
        setattr(bad, field, value)
        assert_malformed(bad, reason)


def test_an_index_past_a_chunk_that_is_not_a_multiple_of_the_low_part_is_rejected():
    """50x60 chunks (3000 values, k=47, 5 low bits): the last high part covers 2976..3007, so a
    well-formed bitmap can name 3005."""
    torch.manual_seed(3)
    message = TopKCodec(chunk=64, topk=64, value_bits=8).encode(torch.randn(50, 60))
    n, k = 3000, message.topk
    assert (k, elias_fano.low_bits(n, k)) == (47, 5)
    chunk = [*range(n - k, n - 1), n + 5]  # the last index beyond the chunk, inside the bitmap
    assert_malformed(_with_indices(message, [chunk], n=n), "bad_indices")
    assert decode_tensor(_with_indices(message, [[*range(n - k, n)]], n=n)).shape == (50, 60)
