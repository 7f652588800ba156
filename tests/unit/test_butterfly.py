"""Butterfly averaging's pure core: pieces along blocks, cuts that decode exactly, robust means, hostile
parts."""

import itertools

import pytest
import torch

from shoal.compression import DCTTopKCodec, DenseCodec
from shoal.peer.algorithms.butterfly import Part, Pieces, cut, ranges, shardable
from shoal.peer.algorithms.robust import NONE, Robustness
from shoal.protocol import EncodedTensor, MalformedPayloadError, Payload

SHAPES = [torch.Size([37, 11]), torch.Size([5]), torch.Size([0]), torch.Size([130])]

CLIP_2X = Robustness(norm_ratio=2.0, sample_ratio=None, min_agreement=None)


def tensors(seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) * scale for shape in SHAPES]


def payload(codec, values: list[torch.Tensor]) -> Payload:
    return Payload(tensors=[codec.encode(t) for t in values])


@pytest.mark.parametrize("numel,block,count", [(0, 8, 3), (5, 8, 3), (100, 8, 3), (4096, 64, 4), (7, 1, 7)])
def test_ranges_cover_the_tensor_along_blocks(numel, block, count):
    pieces = ranges(numel, block, count)
    assert len(pieces) == count
    assert pieces[0][0] == 0 and pieces[-1][1] == numel
    for (_, end), (start, _) in itertools.pairwise(pieces):
        assert end == start and (start % block == 0 or start == numel)
    sizes = [end - start for start, end in pieces]
    assert max(sizes) - min(sizes) <= block  # as even as whole blocks allow


@pytest.mark.parametrize(
    "codec,expected",
    [
        (DenseCodec(8, block=64), True),
        (DenseCodec(4, block=64), True),
        (DenseCodec(4, block=3), False),  # a block ends mid-byte
        (DenseCodec(16), True),
        (DenseCodec(32, block=1), True),
        (DenseCodec(1), False),  # one magnitude for the whole tensor
        (DCTTopKCodec(chunk=8, topk=2), False),
    ],
)
def test_shardable_codecs(codec, expected):
    assert shardable(codec) is expected


def test_an_unshardable_codec_is_refused():
    with pytest.raises(ValueError, match="cannot be cut"):
        Pieces(DenseCodec(1), SHAPES, robust=NONE)


@pytest.mark.parametrize("bits,zstd", [(8, False), (8, True), (4, True), (16, False), (32, False)])
@pytest.mark.parametrize("count", [3, 4, 7])
def test_cut_pieces_decode_to_exactly_the_whole_payloads_slices(bits, zstd, count):
    codec = DenseCodec(bits, block=8, zstd=zstd)
    values = tensors(1)
    whole = [codec.decode(m).reshape(-1) for m in payload(codec, values).tensors]
    pieces = Pieces(codec, SHAPES, robust=NONE)
    decoded = []
    for index in range(count):
        data = cut(payload(codec, values), count)[index]
        assert len(data) <= pieces.max_bytes(index, count)
        decoded.append(pieces.decode(index, count, data))
    for t, (shape, full) in enumerate(zip(SHAPES, whole, strict=True)):
        assert torch.equal(torch.cat([piece[t] for piece in decoded]), full)
        assert pieces.assemble(decoded)[t].shape == shape


def test_the_mean_of_pieces_is_the_sample_weighted_mean_within_quantization():
    codec, count = DenseCodec(8, block=8), 3
    contributions = [tensors(seed) for seed in range(count)]
    samples = [1, 2, 5]
    pieces = Pieces(codec, SHAPES, robust=NONE)
    means = []
    for index in range(count):
        parts = [
            Part(bytes([k]), samples[k], cut(payload(codec, c), count)[index])
            for k, c in enumerate(contributions)
        ]
        mean = pieces.mean(index, count, parts)
        assert mean.samples == sum(samples) and not mean.rejected
        decoded = pieces.decode(index, count, mean.data)
        assert all(torch.equal(a, b) for a, b in zip(mean.tensors, decoded, strict=True))
        means.append(mean.tensors)
    assembled = pieces.assemble(means)
    for t in range(len(SHAPES)):
        exact = sum(c[t] * s for c, s in zip(contributions, samples, strict=True)) / sum(samples)
        scale = exact.abs().max() if exact.numel() else 0
        assert torch.allclose(assembled[t], exact, atol=float(scale) * 0.02 + 1e-6)


def test_error_feedback_carries_what_the_owners_encoding_dropped_into_its_next_mean():
    codec, count, index = DenseCodec(4, block=8), 3, 1
    contributions = [tensors(seed) for seed in range(count)]
    parts = [Part(bytes([k]), 1, cut(payload(codec, c), count)[index]) for k, c in enumerate(contributions)]
    plain, fed = Pieces(codec, SHAPES, robust=NONE), Pieces(codec, SHAPES, robust=NONE)
    rounds = 8
    sum_plain = [torch.zeros(end - start) for start, end in plain.spans(index, count)]
    sum_fed = [torch.zeros_like(t) for t in sum_plain]
    for _ in range(rounds):
        a, b = plain.mean(index, count, parts), fed.mean(index, count, parts, feedback=True)
        sum_plain = [s + t for s, t in zip(sum_plain, a.tensors, strict=True)]
        sum_fed = [s + t for s, t in zip(sum_fed, b.tensors, strict=True)]
    # the same parts every round: with feedback the sum of the means tracks rounds * their exact mean
    decoded = [plain.decode(index, count, part.data) for part in parts]
    exact_mean = [sum(slices) / count for slices in zip(*decoded, strict=True)]
    error_plain = sum(((s - rounds * e) ** 2).sum() for s, e in zip(sum_plain, exact_mean, strict=True))
    error_fed = sum(((s - rounds * e) ** 2).sum() for s, e in zip(sum_fed, exact_mean, strict=True))
    assert error_fed < error_plain / 10


def test_a_huge_part_is_clipped_to_the_median_norm_of_the_piece():
    codec, count, index = DenseCodec(8, block=8), 3, 0
    contributions = [tensors(0), tensors(1), tensors(2, scale=1e4)]
    parts = [Part(bytes([k]), 1, cut(payload(codec, c), count)[index]) for k, c in enumerate(contributions)]
    clipped = Pieces(codec, SHAPES, robust=CLIP_2X).mean(index, count, parts)
    unclipped = Pieces(codec, SHAPES, robust=NONE).mean(index, count, parts)
    assert clipped.clipped == 1 and unclipped.clipped == 0
    norm = sum(t.square().sum() for t in clipped.tensors).sqrt()
    assert norm < 3 * max(sum(t.square().sum() for t in c).sqrt() for c in contributions[:2])
    assert sum(t.square().sum() for t in unclipped.tensors).sqrt() > 100 * norm


def hostile_parts(codec, good: bytes, index: int, count: int) -> dict[str, bytes]:
    """Ways an untrusted author could answer for piece `index` of `count`."""
    other = cut(payload(codec, tensors(9)), count)[(index + 1) % count]
    whole = payload(codec, tensors(9)).SerializeToString()
    parsed = Payload.FromString(good)
    short = Payload(tensors=list(parsed.tensors)[:-1])
    wrong_shape = Payload.FromString(good)
    wrong_shape.tensors[0].shape[0] += 8
    topk = Payload.FromString(good)
    topk.tensors[0].codec = DCTTopKCodec(chunk=8, topk=2).codec_id
    huge = Payload.FromString(good)
    huge.tensors[0].shape[0] = 1 << 40
    return {
        "garbage": b"\xff" * 50,
        "empty_tensor_list": Payload().SerializeToString(),
        "fewer_tensors": short.SerializeToString(),
        "another_piece": other,
        "the_whole_payload": whole,
        "wrong_shape": wrong_shape.SerializeToString(),
        "not_dense": topk.SerializeToString(),
        "huge_shape": huge.SerializeToString(),
        "oversized": good + b"\x00" * 100_000,
        "nan_scales": nan_scales(good),
    }


def nan_scales(good: bytes) -> bytes:
    message = Payload.FromString(good)
    tensor: EncodedTensor = message.tensors[0]
    tensor.scales = b"\x00\x00\xc0\x7f" * (len(tensor.scales) // 4)
    return message.SerializeToString()


HOSTILE = [
    "garbage",
    "empty_tensor_list",
    "fewer_tensors",
    "another_piece",
    "the_whole_payload",
    "wrong_shape",
    "not_dense",
    "huge_shape",
    "oversized",
    "nan_scales",
]


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_part_is_left_out_with_its_reason_and_the_rest_averaged(name):
    codec, count, index = DenseCodec(8, block=8, zstd=False), 3, 1
    pieces = Pieces(codec, SHAPES, robust=CLIP_2X)
    honest = [cut(payload(codec, tensors(k)), count)[index] for k in range(2)]
    bad = hostile_parts(codec, honest[0], index, count)[name]
    with pytest.raises(MalformedPayloadError):
        pieces.decode(index, count, bad)
    mean = pieces.mean(index, count, [Part(b"a", 1, honest[0]), Part(b"b", 1, honest[1]), Part(b"x", 1, bad)])
    assert [sender for sender, _ in mean.rejected] == [b"x"]
    assert mean.samples == 2
    expected = pieces.mean(index, count, [Part(b"a", 1, honest[0]), Part(b"b", 1, honest[1])])
    assert all(torch.equal(a, b) for a, b in zip(mean.tensors, expected.tensors, strict=True))
    assert all(torch.isfinite(t).all() for t in mean.tensors)


@pytest.mark.parametrize("samples", [0, -3])
def test_a_part_claiming_no_samples_is_left_out(samples):
    codec, count = DenseCodec(8, block=8), 3
    pieces = Pieces(codec, SHAPES, robust=NONE)
    good = cut(payload(codec, tensors(0)), count)[0]
    mean = pieces.mean(0, count, [Part(b"a", 1, good), Part(b"x", samples, good)])
    assert mean.rejected == [(b"x", "bad_samples")] and mean.samples == 1


def test_a_piece_of_no_parts_is_zero():
    pieces = Pieces(
        DenseCodec(8, block=8),
        SHAPES,
        robust=CLIP_2X,
    )
    mean = pieces.mean(2, 3, [])
    assert mean.samples == 0 and all(not t.any() for t in mean.tensors)
