"""What the round state machine asks of the server: the actions that `transition` returns.

A request event yields exactly one `Reply` or `Refused`; the others report what happened to the rounds
and the members (announcements, decisions, strikes, drops), for the server to carry out and count.
"""

from collections.abc import Mapping
from dataclasses import dataclass

from shoal.coordinator.state import Round


@dataclass(frozen=True, slots=True)
class Reply:
    """The request succeeded; `fields` answer it."""

    fields: Mapping[str, object]


@dataclass(frozen=True, slots=True)
class Refused:
    """The request is refused; `code` is the name of its gRPC status code."""

    code: str
    message: str


@dataclass(frozen=True, slots=True)
class Announced:
    round: Round


@dataclass(frozen=True, slots=True)
class Decided:
    round: Round


@dataclass(frozen=True, slots=True)
class Abandoned:
    """An undecided round that members had already passed (they trained on without the coordinator)."""

    round: Round


@dataclass(frozen=True, slots=True)
class Struck:
    peer_id: str
    round: int
    strikes: int
    compute_scale: float


@dataclass(frozen=True, slots=True)
class Capped:
    """A report claimed more samples than its member can have computed: it counts `bound` instead."""

    peer_id: str
    round: int
    claimed: int
    bound: int


@dataclass(frozen=True, slots=True)
class Dropped:
    peer_id: str
    reason: str
    """`left`, `silent` or `evicted`."""


Action = Reply | Refused | Announced | Decided | Abandoned | Struck | Capped | Dropped
