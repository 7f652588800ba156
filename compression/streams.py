"""Byte streams of an EncodedTensor: optional zstd per stream, and bounded reads of untrusted ones.

zstd is tried only on streams where it was measured to help (`shoal bench codec`, BENCHMARKS.md):
float and integer values and scales (4-15% smaller); never on packed indices or sign bits, which are
incompressible (0% or worse). A stream keeps the zstd frame only when it is smaller. Decoding
never trusts a frame's own size header: the expected length follows from the already-validated
shape, a frame must declare exactly that size, and nothing may follow the frame.
"""

import torch
import zstandard

from shoal.protocol import MalformedPayloadError

ZSTD_LEVEL = 3
MIN_ZSTD_BYTES = 64  # below this a frame header eats any gain


def to_wire(stream: torch.Tensor, *, try_zstd: bool) -> tuple[bytes, bool]:
    """The bytes of a uint8 tensor, zstd-compressed if asked and smaller; and whether it is."""
    raw = stream.cpu().numpy().tobytes()
    if try_zstd and len(raw) >= MIN_ZSTD_BYTES:
        packed = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)
        if len(packed) < len(raw):
            return packed, True
    return raw, False


def from_wire(data: bytes, compressed: bool, expected: int, name: str, device: torch.device) -> torch.Tensor:
    """The uint8 tensor of a received stream that must hold exactly `expected` bytes.

    A zstd stream must be one frame whose header declares exactly `expected` bytes of content (our
    encoder always writes it), with nothing after it; only then is it decompressed, into `expected`
    bytes. A frame that declares another size, none, or lies about it is rejected.
    """
    if compressed:
        try:
            declared = zstandard.frame_content_size(data)
        except zstandard.ZstdError as error:
            raise MalformedPayloadError("bad_zstd", f"{name}: {error}") from None
        if declared != expected:
            raise MalformedPayloadError(
                "length_mismatch", f"{name}: zstd frame declares {declared} bytes, expected {expected}"
            )
        try:
            data = zstandard.ZstdDecompressor().decompress(data, allow_extra_data=False)
        except zstandard.ZstdError as error:
            raise MalformedPayloadError("bad_zstd", f"{name}: {error}") from None
    if len(data) != expected:
        raise MalformedPayloadError("length_mismatch", f"{name}: {len(data)} bytes, expected {expected}")
    if expected == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
