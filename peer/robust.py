"""Bounding what one participant can do to a round: each contribution's norm is clipped against the
round's median.

Every participant computes the same factors from the same decoded contributions, so clipping keeps
replicas identical; honest rounds, where no norm exceeds `ratio` times the median, get exactly 1.0
everywhere and are untouched. A hostile contribution can then move the aggregate no more than an
honest one `ratio` times larger would; one that does not decode at all is dropped by the caller.
"""

from collections.abc import Sequence

import torch

DEFAULT_CLIP_RATIO = 4.0


def clip_scales(norms: Sequence[float], ratio: float | None = DEFAULT_CLIP_RATIO) -> list[float]:
    """Per contribution, the factor that brings its norm down to `ratio` times the round's lower median
    norm (1.0 when it is already below, or when `ratio` is None)."""
    if ratio is None or not norms:
        return [1.0] * len(norms)
    if not ratio >= 1:
        raise ValueError(f"clip ratio must be >= 1, got {ratio}")
    median = sorted(norms)[(len(norms) - 1) // 2]
    bound = ratio * median
    return [bound / norm if norm > bound else 1.0 for norm in norms]


def add_clipped_mean(
    into: Sequence[torch.Tensor],
    contributions: Sequence[tuple[Sequence[torch.Tensor], int]],
    ratio: float | None,
) -> tuple[float, int]:
    """Adds to `into` the sample-weighted mean of `contributions`, (tensors, samples) pairs in the
    round's order (the same sums on every participant), each clipped by `clip_scales` when there are
    several. Returns (the samples behind it, how many were scaled down)."""
    scales = [1.0] * len(contributions)
    if len(contributions) > 1 and ratio is not None:
        norms = torch.stack(
            [torch.stack([t.square().sum() for t in tensors]).sum() for tensors, _ in contributions]
        )
        scales = clip_scales(norms.sqrt().tolist(), ratio)  # one host sync per round
    total = float(sum(samples for _, samples in contributions))
    for (tensors, samples), scale in zip(contributions, scales, strict=True):
        for m, t in zip(into, tensors, strict=True):
            m.add_(t, alpha=samples / total * scale)
    return total, sum(scale < 1 for scale in scales)
