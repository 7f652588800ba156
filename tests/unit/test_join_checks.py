"""What `shoal join` checks before it trains next to a swarm: the coordinator most peers follow must be
passed, one peer's record cannot keep newcomers out, and a coordinator address from a record is shown
only if it looks like one (it is another peer's text)."""

from dataclasses import dataclass, field

import pytest

from shoal.peer.job.node import JoinError, _check_compatible
from shoal.peer.swarm.directory import ADDRESS


@dataclass
class Seen:
    """The part of a SwarmExchange that `_check_compatible` reads."""

    others: int
    coordinators: dict[bytes, str]
    coordinator: object = None
    refused: dict[str, str] = field(default_factory=dict)

    def compatible_peers(self, *, fully: bool = False) -> set[bytes]:
        assert fully  # the join decision reads every replica: one nearest node could hide the others
        return {b"me", *(bytes([i]) for i in range(self.others))}

    @property
    def coordinators_seen(self) -> dict[bytes, str]:
        return self.coordinators


def test_most_peers_following_a_coordinator_refuse_a_peer_without_one():
    seen = Seen(others=3, coordinators={bytes([0]): "coord.example.org:7733", bytes([1]): "10.0.0.5:7733"})
    with pytest.raises(JoinError, match=r"they reach it as 10\.0\.0\.5:7733, coord\.example\.org:7733\)"):
        _check_compatible(seen)


def test_a_minority_naming_a_coordinator_does_not():
    _check_compatible(Seen(others=2, coordinators={bytes([0]): "evil.example:1"}))
    _check_compatible(Seen(others=0, coordinators={}))


def test_a_peer_that_passes_a_coordinator_is_not_refused():
    _check_compatible(
        Seen(others=2, coordinators={bytes([0]): "c:1", bytes([1]): "c:1"}, coordinator=object())
    )


@pytest.mark.parametrize("address", ["coord.example.org:7733", "10.0.0.5:7733", "[::1]:7733", "localhost:1"])
def test_addresses_are_shown(address):
    assert ADDRESS.fullmatch(address)


@pytest.mark.parametrize(
    "address", ["", "host", "host:", ":7733", "\x1b[2Jhost:7733", "host:7733\nroot", "a b:1", "h:123456"]
)
def test_anything_else_is_dropped(address):
    assert not ADDRESS.fullmatch(address)
