"""A seeded permutation of [0, n) that is never materialized: position p's element, computed alone.

A corpus of 10 billion tokens holds about 80 million windows of 128: a `torch.randperm` of them is
640 MB, on every peer, each round. `permuted(positions, n, seed)` instead maps positions through a
balanced Feistel network on the smallest even number of bits that covers n (each round mixes one half
with a hash of the other, splitmix64's finalizer keyed by the seed and the round), which is a
bijection of [0, 4^k); a position whose image falls at n or past it is mapped again until it lands
inside ("cycle walking"), which keeps it a bijection of [0, n). Its cost is a few integer operations
per position, its memory that of the positions asked for. Every platform computes the same values
(uint64 arithmetic wraps the same everywhere).
"""

import numpy as np

ROUNDS = 6
GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(values: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64's finalizer of values ^ key."""
    z = values ^ key
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _keys(seed: int) -> list[np.uint64]:
    base = np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
    with np.errstate(over="ignore"):
        return [_mix(base + GOLDEN * np.uint64(r + 1), np.uint64(r))[0] for r in range(ROUNDS)]


def _feistel(values: np.ndarray, half_bits: int, keys: list[np.uint64]) -> np.ndarray:
    mask = np.uint64((1 << half_bits) - 1)
    left, right = values >> np.uint64(half_bits), values & mask
    with np.errstate(over="ignore"):
        for key in keys:
            left, right = right, left ^ (_mix(right, key) & mask)
    return (left << np.uint64(half_bits)) | right


def permuted(positions: np.ndarray, n: int, seed: int) -> np.ndarray:
    """The elements at `positions` (each in [0, n)) of the permutation of [0, n) drawn from `seed`."""
    if n < 1:
        raise ValueError(f"a permutation of {n} elements")
    wanted = np.asarray(positions, dtype=np.int64)
    if wanted.size and not 0 <= wanted.min() <= wanted.max() < n:
        raise IndexError(f"a position outside [0, {n})")
    half_bits = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
    keys = _keys(seed)
    values = _feistel(wanted.astype(np.uint64), half_bits, keys)
    outside = values >= np.uint64(n)
    while outside.any():  # at most 4^k / n < 4 steps on average
        values[outside] = _feistel(values[outside], half_bits, keys)
        outside = values >= np.uint64(n)
    return values.astype(np.int64)
