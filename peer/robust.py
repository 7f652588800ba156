"""Bounding what one participant can do to a round: each contribution's norm is clipped against the
round's median.

Every participant computes the same factors from the same decoded contributions, so clipping keeps
replicas identical; honest rounds, where no norm exceeds `ratio` times the median, get exactly 1.0
everywhere and are untouched. A hostile contribution can then move the aggregate no more than an
honest one `ratio` times larger would; one that does not decode at all is dropped by the caller.
"""

from collections.abc import Sequence

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
