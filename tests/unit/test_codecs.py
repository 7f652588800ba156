"""Codec round trips, error bounds per value encoding, property tests over shapes, the registry."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shoal.compression import (
    CODECS,
    DCTTopKCodec,
    DecodeLimits,
    DenseCodec,
    EncodedTensor,
    TopKCodec,
    decode_tensor,
)
from shoal.compression.codec import check_registry
from shoal.protocol import CodecId, DType, ValueEncoding, parse_message

shapes = st.one_of(
    st.lists(st.integers(1, 300), min_size=1, max_size=1),
    st.lists(st.integers(1, 130), min_size=2, max_size=2),
    st.lists(st.integers(1, 24), min_size=3, max_size=3),
    st.sampled_from([[1], [1, 1], [2], [131], [127, 1], [1, 97], [251, 67], [3, 1, 5]]),
).map(tuple)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def roundtrip(codec, x: torch.Tensor) -> torch.Tensor:
    """Encode, serialize, parse, decode: exactly what crosses the wire."""
    data = codec.encode(x).SerializeToString()
    message = parse_message(EncodedTensor, data, max_bytes=len(data))
    return codec.decode(message)


@given(shape=shapes, seed=st.integers(0, 2**16))
def test_dct_topk_with_all_coefficients_is_exact(shape, seed):
    torch.manual_seed(seed)
    x = torch.randn(shape)
    y = roundtrip(DCTTopKCodec(chunk=64, topk=64 * 64, value_bits=32), x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert relative_error(y, x) <= 1e-5


@given(
    shape=shapes,
    topk=st.integers(1, 40),
    bits=st.sampled_from([32, 16, 8, 4, 1]),
    chunk=st.sampled_from([8, 64]),
)
def test_dct_topk_decodes_any_shape_to_its_shape(shape, topk, bits, chunk):
    x = torch.randn(shape)
    y = roundtrip(DCTTopKCodec(chunk=chunk, topk=topk, value_bits=bits), x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    if math.prod(shape) > 1 and bits == 32:  # a top-k projection never adds energy
        assert y.square().sum() <= x.square().sum() * (1 + 1e-5)


@pytest.mark.parametrize("x", [torch.tensor(3.5), torch.tensor([-2.0]), torch.zeros(1, 1, 1)])
def test_scalars_and_single_elements_travel_dense_and_exact(x):
    codec = DCTTopKCodec(topk=4, value_bits=1)
    message = codec.encode(x)
    assert message.codec == CodecId.CODEC_ID_DENSE
    assert torch.equal(roundtrip(codec, x), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_original_dtype_is_restored(dtype):
    x = torch.randn(64, 64).to(dtype)
    for codec in (DCTTopKCodec(topk=4096), DenseCodec(32)):
        y = roundtrip(codec, x)
        assert y.dtype == dtype
        assert relative_error(y.float(), x.float()) < (
            1e-5 if dtype in (torch.float32, torch.float64) else 1e-2
        )


def test_integer_tensors_are_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="can only encode float"):
        DCTTopKCodec().encode(torch.arange(10))


@pytest.mark.parametrize(
    ("bits", "half", "bound"),
    [
        (8, "bf16", lambda x, s: s / 254),
        (4, "bf16", lambda x, s: s / 14),
        (16, "fp16", lambda x, s: s * 2.0**-11),
        (16, "bf16", lambda x, s: x.abs() * 2.0**-8),
        (32, "bf16", lambda x, s: torch.zeros_like(x)),
    ],
)
@pytest.mark.parametrize("block", [1, 7, 64])
def test_dense_error_within_bound_of_its_encoding(bits, half, bound, block):
    torch.manual_seed(3)
    x = torch.randn(1000) * torch.logspace(-6, 2, 1000)  # values spanning 8 decades
    y = roundtrip(DenseCodec(value_bits=bits, block=block, half=half), x)
    padded = torch.zeros(math.ceil(1000 / block) * block)
    padded[:1000] = x
    scale = padded.view(-1, block).abs().amax(dim=1).repeat_interleave(block)[:1000]
    limit = bound(x, scale) * (1 + 1e-6) + 1e-30
    assert ((y - x).abs() <= limit).all(), ((y - x).abs() / limit).max()


def test_dense_int8_is_about_four_times_smaller():
    x = torch.randn(4096)
    size = DenseCodec(8, block=64, zstd=False).encode(x).ByteSize()
    assert 4096 + 64 * 4 <= size <= 4096 + 64 * 4 + 32  # values + one float32 scale per block + header


def test_sign_values_keep_signs_and_mean_magnitude():
    torch.manual_seed(4)
    x = torch.randn(5, 64)
    codec = DCTTopKCodec(chunk=64, topk=8, value_bits=1)
    selection = codec.select(x)
    unpacked = DCTTopKCodec().decode(codec.encode(x))
    expected = torch.sign(selection.values) * selection.values.abs().mean()
    torch.testing.assert_close(
        unpacked, codec.reconstruct(type(selection)(selection.plan, selection.indices, expected))
    )


@pytest.mark.parametrize("bits", [8, 4, 16])
def test_topk_quantized_values_within_bound(bits):
    torch.manual_seed(5)
    x = torch.randn(256, 192)
    exact = DCTTopKCodec(topk=16, value_bits=32)
    quantized = DCTTopKCodec(topk=16, value_bits=bits)
    selection = exact.select(x)
    scale = selection.values.abs().amax(dim=1, keepdim=True)
    from shoal.compression.dct_topk import unpack

    received = unpack(quantized.encode(x), torch.device("cpu"), DecodeLimits())
    assert torch.equal(received.indices, selection.indices)
    bound = {8: scale / 254, 4: scale / 14, 16: selection.values.abs() * 2.0**-8}[bits]
    assert ((received.values - selection.values).abs() <= bound * (1 + 1e-6)).all()


def test_compact_setting_is_over_2000x_smaller_on_a_64x64_tiled_matrix():
    x = torch.randn(768, 3072)
    message = DCTTopKCodec(chunk=64, topk=4, value_bits=1).encode(x)
    assert message.index_bits == 12
    assert x.numel() * 4 / message.ByteSize() > 2000


def test_indices_are_sorted_within_each_chunk_so_equal_input_gives_equal_bytes():
    x = torch.randn(128, 128)
    codec = DCTTopKCodec(topk=32)
    selection = codec.select(x)
    assert (selection.indices[:, 1:] > selection.indices[:, :-1]).all()
    assert codec.encode(x).SerializeToString() == DCTTopKCodec(topk=32).encode(x.clone()).SerializeToString()


def test_zstd_is_kept_only_where_it_shrinks_a_stream():
    uniform = DenseCodec(8, zstd=True).encode(torch.rand(10_000) * 2 - 1)
    assert not uniform.values_zstd  # uniformly spread int8 levels carry a full 8 bits: incompressible
    repetitive = torch.ones(10_000)
    message = DenseCodec(8, zstd=True).encode(repetitive)
    assert message.values_zstd and message.scales_zstd
    assert len(message.values) < 10_000 // 10
    assert torch.equal(DenseCodec().decode(message), repetitive)


def test_any_codec_instance_decodes_any_message():
    x = torch.randn(64, 64)
    dense_message = DenseCodec(32).encode(x)
    assert torch.equal(DCTTopKCodec().decode(dense_message), x)
    assert torch.equal(decode_tensor(dense_message), x)


def test_registry_covers_the_wire_enum_both_ways():
    check_registry()
    assert {
        CodecId.CODEC_ID_DENSE: DenseCodec,
        CodecId.CODEC_ID_DCT_TOPK: DCTTopKCodec,
        CodecId.CODEC_ID_TOPK: TopKCodec,
    } == CODECS


def test_registry_check_fails_when_a_codec_is_missing(monkeypatch):
    monkeypatch.delitem(CODECS, CodecId.CODEC_ID_DENSE)
    with pytest.raises(RuntimeError, match="out of sync"):
        check_registry()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"chunk": 0}, "chunk"),
        ({"topk": 0}, "topk"),
        ({"value_bits": 3}, "value_bits"),
    ],
)
def test_bad_codec_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DCTTopKCodec(**kwargs)


def test_bad_dense_settings_are_named():
    with pytest.raises(ValueError, match="block"):
        DenseCodec(8, block=0)
    with pytest.raises(ValueError, match="half"):
        DenseCodec(16, half="fp8")
    with pytest.raises(ValueError, match="max_numel"):
        DecodeLimits(max_numel=0)


def test_wire_enums_match_the_names_used_in_docs():
    assert DType.Name(DType.DTYPE_BFLOAT16) == "DTYPE_BFLOAT16"
    assert ValueEncoding.Value("VALUE_ENCODING_SIGN") == 6
