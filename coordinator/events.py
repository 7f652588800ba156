"""What happens to the coordinator: the events that the round state machine's `transition` applies.

The gRPC layer (shoal.coordinator.server) turns each request into one of them; its ticker sends `Tick`.
"""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Join:
    peer_id: str
    throughput: float = 0.0
    min_samples: int = 1


@dataclass(frozen=True, slots=True)
class Leave:
    peer_id: str


@dataclass(frozen=True, slots=True)
class Heartbeat:
    peer_id: str
    round: int = -1
    throughput: float = 0.0
    min_samples: int = 0
    exchange_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Report:
    peer_id: str
    round: int
    digest: bytes
    size: int
    samples: int
    state: bytes = b""
    synced: bool = False


@dataclass(frozen=True, slots=True)
class Tick:
    """Only time passes."""


Event = Join | Leave | Heartbeat | Report | Tick
