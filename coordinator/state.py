"""What the coordinator knows of the swarm: its members, its rounds and their reports.

Immutable records: the round state machine (shoal.coordinator.rounds) returns a new `SwarmState` for
each transition, and shoal.coordinator.store keeps it in SQLite.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, kw_only=True)
class Member:
    peer_id: str
    joined_at: float
    last_seen: float
    throughput: float = 0.0
    """Samples per second, as last reported (0: unknown)."""
    min_samples: int = 1
    """Samples of its smallest contribution in a round."""
    round: int = -1
    """The last round it finished."""
    strikes: int = 0
    on_time: int = 0
    """On-time reports since its last strike or forgiveness."""
    compute_scale: float = 1.0
    heard: bool = True
    """Whether it has been heard from since the coordinator (re)started."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PayloadReport:
    """A member's payload for a round, ready to be pulled from it."""

    peer_id: str
    digest: bytes
    size: int
    samples: int
    state: bytes = b""
    synced: bool = False
    at: float = 0.0
    """When it arrived."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Round:
    number: int
    announced_at: float
    compute_deadline: float
    exchange_deadline: float
    data_seed: int
    expected: tuple[str, ...]
    """Members at the announcement, sorted: a peer's index is its data slot."""
    reports: Mapping[str, PayloadReport] = field(default_factory=dict)
    """On-time reports (never mutated: a new round value carries a new mapping)."""
    decided_at: float | None = None
    stragglers: tuple[str, ...] = ()
    earned: tuple[str, ...] = ()
    """Participants whose state vote weighed at the decision: counted in enough recent rounds
    (shoal.protocol.work), the rest a headcount of identities that cost nothing."""

    @property
    def participants(self) -> tuple[str, ...]:
        """The payloads to aggregate, by peer id (final once decided)."""
        return tuple(sorted(self.reports))


@dataclass(frozen=True, slots=True, kw_only=True)
class SwarmState:
    seed: int
    """Mixed with each round number into its data seed."""
    members: Mapping[str, Member] = field(default_factory=dict)
    evicted: Mapping[str, float] = field(default_factory=dict)
    """Evicted peers and when they may join again."""
    round: Round | None = None
    """The round in progress, or the last one (decided, exchanging)."""
    previous: Round | None = None
    """With `overlap`: the round before `round` while it is still undecided (it takes reports)."""
    next_round: int = 0
    """The number the next announcement takes."""
    history: tuple[Round, ...] = ()
    """The last decided rounds before `round`, oldest first."""
    exchange_times: tuple[float, ...] = ()
    """Recently reported exchange times, seconds."""
    stragglers_total: int = 0
    evictions_total: int = 0
    resumed_at: float | None = None
    """When the coordinator last restarted from this state."""
    counted: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """The rounds of the last `WORK_WINDOW` in which each peer's contribution counted (on the round's
    agreed state, and chosen under a bounded fan-in): what its state vote weighs (shoal.protocol.work)."""
    seen_floor: float = 0.0
    """No member was last seen before this (a lower bound, not durable): members cannot have fallen
    silent while `now - seen_floor` is within the heartbeat timeout, so no scan of them is needed."""
