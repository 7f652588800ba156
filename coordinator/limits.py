"""Rate limits on what one client may ask of the coordinator (token buckets, no I/O).

A request is charged to two buckets: its peer id's (the one it names; a per-peer token binds a peer
id, so this is also per token) and its address's (the client's IP, without the port). An honest peer
heartbeats when it has been silent for a third of the heartbeat timeout and makes a report and a
heartbeat per round, so the per-peer bucket holds a burst of `peer_burst` and refills at
`peer_per_s` plus that heartbeat rate, and by `peer_per_round` with every round the coordinator
announces: peers that compute fast (a tiny model) finish rounds in a fraction of a second, and would
otherwise be refused for keeping up with the coordinator's own pace. Addresses are charged for what
makes the coordinator's state or work grow: joins (a flood of new ids from one address) and swarm
status reads (each lists every member). Calls without a peer id that only wait (`RoundResult`) are
not charged: their number is bounded by the server's stream limit.

Buckets are kept for at most `max_keys` keys, least recently used first out, so that a flood of ids
cannot grow the table without bound (a forgotten key starts again with a full bucket).
"""

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """How much each peer id and each address may ask; `Limits()` is the coordinator's default."""

    peer_per_s: float = 2.0
    """Calls per second one peer id may sustain beyond its heartbeats (three per heartbeat timeout,
    what a peer sends when it has nothing else to say; an honest one makes under one call a second)."""
    peer_burst: int = 10
    peer_per_round: float = 3.0
    """Calls one peer id may make per round announced, beyond its per-second rate (an honest peer makes
    a report and a heartbeat a round). Rounds come only as fast as the round's participants report, so
    no single client speeds this refill up."""
    address_joins_per_s: float = 20.0
    """Joins per second one address may sustain."""
    address_join_burst: int = 1024
    """Joins one address may make at once: every peer of a swarm restarting behind one gateway."""
    address_status_per_s: float = 5.0
    address_status_burst: int = 20
    max_keys: int = 100_000

    def __post_init__(self) -> None:
        rates = (self.peer_per_s, self.address_joins_per_s, self.address_status_per_s)
        bursts = (self.peer_burst, self.address_join_burst, self.address_status_burst, self.max_keys)
        if not all(r > 0 for r in rates) or not all(b >= 1 for b in bursts) or self.peer_per_round < 0:
            raise ValueError("rates must be > 0 (per round >= 0) and bursts >= 1")


class Buckets:
    """Token buckets keyed by string: `take(key, now, epoch)` spends one token if there is one. A bucket
    refills by `per_s` a second and by `per_epoch` for each epoch (a round) since it was last taken from."""

    def __init__(self, per_s: float, burst: int, max_keys: int, per_epoch: float = 0.0):
        self.per_s, self.burst, self.max_keys, self.per_epoch = per_s, burst, max_keys, per_epoch
        self._held: OrderedDict[str, tuple[float, float, int]] = OrderedDict()  # key -> (tokens, at, epoch)

    def take(self, key: str, now: float, epoch: int = 0) -> bool:
        tokens, at, then = self._held.pop(key, (float(self.burst), now, epoch))
        earned = max(0.0, now - at) * self.per_s + max(0, epoch - then) * self.per_epoch
        tokens = min(float(self.burst), tokens + earned)
        allowed = tokens >= 1.0
        self._held[key] = (tokens - 1.0 if allowed else tokens, now, max(epoch, then))
        if len(self._held) > self.max_keys:
            self._held.popitem(last=False)
        return allowed

    def __len__(self) -> int:
        return len(self._held)


class RateLimiter:
    """The coordinator's buckets: `check(method, peer_id, address, now, rounds)` names the limit a call
    is over ("peer" or "address"), or returns None; `rounds`: how many the coordinator has announced."""

    def __init__(self, limits: Limits | None = None, heartbeats_per_s: float = 0.5):
        limits = limits or Limits()
        self.limits = limits
        self.peers = Buckets(
            limits.peer_per_s + heartbeats_per_s, limits.peer_burst, limits.max_keys, limits.peer_per_round
        )
        self.joins = Buckets(limits.address_joins_per_s, limits.address_join_burst, limits.max_keys)
        self.status = Buckets(limits.address_status_per_s, limits.address_status_burst, limits.max_keys)

    def check(
        self, method: str, peer_id: str | None, address: str, now: float, rounds: int = 0
    ) -> str | None:
        if method == "Join" and not self.joins.take(address, now):
            return "address"
        if method == "SwarmStatus" and not self.status.take(address, now):
            return "address"
        if peer_id is not None and not self.peers.take(peer_id, now, rounds):
            return "peer"
        return None


def client_address(peer: str) -> str:
    """The IP of a gRPC peer string ('ipv4:1.2.3.4:5', 'ipv6:[::1]:5'), or the string if it is neither."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]")
    return peer
