"""How the coordinator paces rounds and treats stragglers (`Policy`), and the arithmetic it paces them
with: the adaptive compute and exchange windows, and the most samples a member's report may count.

Pure functions of the members' self-reported rates and times; the round state machine
(shoal.coordinator.rounds) applies them when it announces a round and takes a report.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass

from shoal.coordinator.state import Member, Round
from shoal.coordinator.validation import MAX_SAMPLES

SAMPLE_SLACK = 4.0
"""How far a report's samples, and a member's throughput, may exceed what is expected (plausible_samples)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """How the coordinator paces rounds and treats stragglers."""

    quantile: float = 0.9
    """Fraction of the members whose smallest contribution the compute window must fit."""
    min_compute_s: float = 5.0
    """Shortest compute window, seconds: the round's target length when every peer is fast."""
    max_compute_s: float = 600.0
    """Longest compute window, seconds: slower members are stragglers."""
    initial_exchange_s: float = 10.0
    """Exchange window before any exchange time has been reported, seconds."""
    min_exchange_s: float = 2.0
    max_exchange_s: float = 300.0
    headroom: float = 1.5
    """Measured times are multiplied by this before they become windows."""
    report_grace_s: float = 0.5
    """Network slack after the compute deadline during which a report still counts."""
    heartbeat_timeout_s: float = 6.0
    """Silence after which a member is dropped."""
    shrink_after: int = 2
    """Strikes from which each further strike halves a member's compute scale."""
    min_scale: float = 0.125
    evict_after: int = 4
    """Strikes at which a member is evicted."""
    eviction_s: float = 60.0
    """How long an evicted member may not join again."""
    forgive_after: int = 10
    """On-time reports in a row that take one strike back."""
    max_members: int = 10_000
    min_start_members: int = 1
    """Members the swarm's first round waits for."""
    overlap: bool = False
    """Announce round r + 1 as soon as a member reports round r, not once r's exchange is over."""
    gather: int = 0
    """Bounded fan-in: a decided round's result lists at most this many participants, chosen by
    shoal.protocol.rules, and tallies every participant's state (0: lists them all)."""

    def __post_init__(self) -> None:
        if not 0 < self.quantile <= 1:
            raise ValueError(f"quantile must be in (0, 1], got {self.quantile}")
        if not 0 < self.min_compute_s <= self.max_compute_s:
            raise ValueError(
                f"need 0 < min_compute_s <= max_compute_s, got {self.min_compute_s}, {self.max_compute_s}"
            )
        if not 0 < self.min_exchange_s <= self.max_exchange_s:
            raise ValueError(
                f"need 0 < min_exchange_s <= max_exchange_s, got {self.min_exchange_s}, {self.max_exchange_s}"
            )
        if self.headroom < 1 or self.report_grace_s < 0 or self.heartbeat_timeout_s <= 0:
            raise ValueError("headroom must be >= 1, report_grace_s >= 0, heartbeat_timeout_s > 0")
        if self.min_start_members < 1 or self.eviction_s < 0 or self.gather < 0:
            raise ValueError("min_start_members must be >= 1, eviction_s and gather >= 0")
        if not (
            1 <= self.shrink_after <= self.evict_after and self.forgive_after >= 1 and 0 < self.min_scale <= 1
        ):
            raise ValueError("need 1 <= shrink_after <= evict_after, forgive_after >= 1, 0 < min_scale <= 1")


def plausible_samples(member: Member, current: Round, members: Mapping[str, Member]) -> int | None:
    """The most samples `member` can have computed for `current`: SAMPLE_SLACK times its throughput
    (itself at most SAMPLE_SLACK times the members' lower-median throughput, as a throughput is
    self-reported too) over twice the round's compute window (with overlap a round's compute may
    start before its announcement), plus its smallest contribution. None while its throughput is
    unknown. Peers cap weights at twice the round's median anyway (shoal.peer.algorithms.robust); this bounds
    what the coordinator itself hands out, with room for an honest peer 16x faster than the median."""
    known = sorted(m.throughput for m in members.values() if m.throughput > 0)
    if member.throughput <= 0 or not known:
        return None
    throughput = min(member.throughput, SAMPLE_SLACK * known[(len(known) - 1) // 2])
    span = 2 * (current.compute_deadline - current.announced_at)
    return min(MAX_SAMPLES, math.ceil(SAMPLE_SLACK * throughput * span) + member.min_samples)


def compute_window(members: Mapping[str, Member], policy: Policy) -> float:
    """Seconds that let a fraction `quantile` of the members compute their smallest contribution."""
    times = sorted(m.min_samples / m.throughput for m in members.values() if m.throughput > 0)
    return _clamp(
        _quantile(times, policy.quantile) * policy.headroom, policy.min_compute_s, policy.max_compute_s
    )


def exchange_window(exchange_times: tuple[float, ...], policy: Policy) -> float:
    if not exchange_times:
        return policy.initial_exchange_s
    measured = _quantile(sorted(exchange_times), policy.quantile) * policy.headroom
    return _clamp(measured, policy.min_exchange_s, policy.max_exchange_s)


def _quantile(sorted_values: list[float], quantile: float) -> float:
    """The smallest value at or below which at least a fraction `quantile` of the values lie (0 if none)."""
    if not sorted_values:
        return 0.0
    return sorted_values[max(0, math.ceil(quantile * len(sorted_values)) - 1)]


def _clamp(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)
