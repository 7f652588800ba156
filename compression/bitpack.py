"""Fixed-width bit packing of non-negative integers, on any device.

Value i occupies stream bits [i*w, (i+1)*w), least significant bit first; stream bit j is bit j % 8
of byte j // 8 (the layout documented in protocol/tensor.proto). The smallest run of values that
fills whole bytes (lcm(w, 8) bits: 2 values in 3 bytes for w = 12) is assembled in one int64 word per
run, so packing costs a few vectorized ops whatever the count. Widths whose run exceeds 56 bits (9, 11,
13, 15) go through one bit per byte instead.
"""

import math

import torch

_MAX_WORD_BITS = 56


def packed_size(count: int, width: int) -> int:
    """Bytes needed for `count` values of `width` bits."""
    return (count * width + 7) // 8


def _run(width: int) -> tuple[int, int]:
    """(values, bytes) of the smallest run of values that ends on a byte boundary."""
    bits = math.lcm(width, 8)
    return bits // width, bits // 8


def pack(values: torch.Tensor, width: int) -> torch.Tensor:
    """Packs integer `values` (each in [0, 2**width)) into a flat uint8 tensor on the same device."""
    flat = values.reshape(-1)
    count, device = flat.numel(), flat.device
    if width == 0 or count == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    per_run, run_bytes = _run(width)
    if per_run * width > _MAX_WORD_BITS:
        return _pack_bits(flat, width)
    runs = -(-count // per_run)
    word_dtype = torch.uint8 if run_bytes == 1 else torch.int64  # widths 1, 2, 4, 8: stay in bytes
    padded = torch.zeros(runs * per_run, dtype=word_dtype, device=device)
    padded[:count] = flat
    lanes = padded.view(runs, per_run)
    word = lanes[:, 0].clone()
    for lane in range(1, per_run):
        word |= lanes[:, lane] << (lane * width)
    if run_bytes == 1:
        return word
    shifts = torch.arange(0, 8 * run_bytes, 8, dtype=torch.int64, device=device)
    octets = ((word.unsqueeze(1) >> shifts) & 0xFF).to(torch.uint8)  # (runs, run_bytes)
    return octets.reshape(-1)[: packed_size(count, width)]


def unpack(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """The `count` values of `width` bits in the uint8 tensor `packed`, as int64.

    The caller checks `packed.numel() == packed_size(count, width)` first (that is untrusted input).
    """
    device = packed.device
    if width == 0 or count == 0:
        return torch.zeros(count, dtype=torch.int64, device=device)
    per_run, run_bytes = _run(width)
    if per_run * width > _MAX_WORD_BITS:
        return _unpack_bits(packed, width, count)
    if run_bytes == 1:
        return unpack_bytes(packed, width, count).to(torch.int64)
    runs = -(-count // per_run)
    octets = torch.zeros(runs * run_bytes, dtype=torch.int64, device=device)
    octets[: packed.numel()] = packed
    octets = octets.view(runs, run_bytes)
    word = octets[:, 0].clone()
    for byte in range(1, run_bytes):
        word |= octets[:, byte] << (8 * byte)
    shifts = torch.arange(0, per_run * width, width, dtype=torch.int64, device=device)
    return ((word.unsqueeze(1) >> shifts) & ((1 << width) - 1)).reshape(-1)[:count]


def unpack_bytes(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """`unpack` for widths 1, 2, 4 and 8, as uint8: a quarter of the memory traffic of int64, for
    decoders that need no wider type."""
    if 8 % width:
        raise ValueError(f"unpack_bytes takes widths 1, 2, 4 or 8, got {width}")
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & ((1 << width) - 1)).reshape(-1)[:count]


def _pack_bits(flat: torch.Tensor, width: int) -> torch.Tensor:
    shifts = torch.arange(width, dtype=torch.int64, device=flat.device)
    bits = ((flat.to(torch.int64).unsqueeze(1) >> shifts) & 1).to(torch.uint8).reshape(-1)
    padded = torch.zeros(packed_size(flat.numel(), width) * 8, dtype=torch.uint8, device=flat.device)
    padded[: bits.numel()] = bits
    weights = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8, device=flat.device)
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = ((packed.unsqueeze(1) >> shifts) & 1).reshape(-1)[: count * width].view(count, width)
    weights = torch.tensor([1 << b for b in range(width)], dtype=torch.int64, device=packed.device)
    return (bits.to(torch.int64) * weights).sum(dim=1)
