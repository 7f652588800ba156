"""What a SwarmExchange counts: bytes by kind, rejections by reason, rounds by how they went. Read by
the peer's summary, its Prometheus metrics (`SwarmExchange.counters()`) and the benchmarks."""

from collections import Counter
from dataclasses import dataclass, field


@dataclass(kw_only=True, slots=True)
class SwarmCounters:
    """Running totals of one peer's exchange; touched on the exchange's event loop, copied for other
    threads by `SwarmExchange.counters()`."""

    sent: Counter[str] = field(default_factory=Counter)
    """Bytes this peer sent, by kind: payload, state and replay (its handlers served them), probe (bandwidth
    measurements it answered), dht (the serialized records and announcements it stored)."""
    received: Counter[str] = field(default_factory=Counter)
    """Bytes this peer received, by kind: payload, state, replay (steps to replay), dht (the serialized
    values of its reads)."""
    via_relay: Counter[str] = field(default_factory=Counter)
    """Of `received`, the bytes that came through a relay (shoal.peer.swarm.relay), by kind."""
    rejected: Counter[str] = field(default_factory=Counter)
    """Announcements, downloads and contributions dropped, by reason."""
    dht_stores: int = 0
    """Records and announcements this peer wrote into the DHT."""
    dht_rewrites: int = 0
    """Writes sent again: to replicas a later read found (the routing table had not known them), or with
    hivemind's crawl (a replica did not take it, or the table was too large to know them all)."""
    dht_reads: int = 0
    """Reads of records or announcements this peer made."""
    resyncs: int = 0
    """Times this peer's shared state differed from the majority's and was replaced by a download."""
    replays: int = 0
    """Times it was rebuilt instead, by replaying the steps since a state this peer held
    (shoal.peer.swarm.replay)."""
    replay_bytes: int = 0
    """Bytes pulled to replay (the steps, the payloads this peer lacked), those that failed too."""
    replayed_state_bytes: int = 0
    """The state bytes the replays did not download: what they cost the other way."""
    stragglers: int = 0
    """Peers expected in a round (by the coordinator, or compatible and seen) whose payload missed it."""
    round_stragglers: int = 0
    """... in the last round."""
    peers_seen: int = 1
    """Peers expected in the last round, this one included."""
    strikes_total: int = 0
    """Strikes given, all peers together."""
    coordinated_rounds: int = 0
    """Rounds whose participant set came from the coordinator."""
    late: int = 0
    """Rounds this peer's payload missed: left out as late by the coordinator, or computed past the
    round's deadline uncoordinated, then counted in a later round (it still applied them)."""
    butterfly_rounds: int = 0
    """Rounds averaged piece by piece (shoal.peer.algorithms.butterfly)."""
    pieces_recomputed: int = 0
    """Pieces whose owner's mean did not come in time, averaged by this peer from their parts."""
    codec_bytes_sent: int = 0
    """Payload bytes this peer was to send by the protocol, pieces and means included (what the codec
    implies, against which `sent` shows the transport's overhead)."""
    clocks_adopted: int = 0
    """Times this peer took its run's round clock from peers that started the run at once with it."""
    rejoins: int = 0
    """Times this peer, alone in its run, dialled its initial peers again."""
    left_out: int = 0
    """Rounds a bounded fan-in (`--gather`) left this peer's payload out of (its work carried on)."""

    def count_round(self, expected: int, participants: int) -> None:
        """A round ended with `participants` of the `expected` peers (this one included)."""
        self.peers_seen = expected
        self.round_stragglers = max(0, expected - participants)
        self.stragglers += self.round_stragglers

    def snapshot(self, **extra: object) -> dict:
        """A copy for another thread (the metrics endpoint), with what the exchange adds (`extra`)."""
        copied = {
            "sent": dict(self.sent),
            "received": dict(self.received),
            "via_relay": dict(self.via_relay),
            "rejected": dict(self.rejected),
        }
        totals = {
            "strikes": self.strikes_total,
            "resyncs": self.resyncs,
            "replays": self.replays,
            "replay_bytes": self.replay_bytes,
            "replayed_state_bytes": self.replayed_state_bytes,
            "stragglers": self.stragglers,
            "late": self.late,
            "coordinated_rounds": self.coordinated_rounds,
            "dht_stores": self.dht_stores,
            "dht_rewrites": self.dht_rewrites,
            "dht_reads": self.dht_reads,
            "butterfly_rounds": self.butterfly_rounds,
            "pieces_recomputed": self.pieces_recomputed,
            "rejoins": self.rejoins,
            "left_out": self.left_out,
        }
        return copied | totals | extra

    @property
    def bytes_sent(self) -> int:
        """Payload, state and probe bytes this peer's handlers served (the DHT's not included)."""
        return self.sent["payload"] + self.sent["state"] + self.sent["replay"] + self.sent["probe"]

    @property
    def bytes_received(self) -> int:
        """Payload and state bytes this peer pulled (the DHT's not included)."""
        return self.received["payload"] + self.received["state"] + self.received["replay"]
