"""The swarm's round clock and what peers write into and read back from the DHT: pure values, the
untrusted ones parsed with limits (shoal.peer.swarm.exchange uses them; `shoal join` and `shoal status` too).

- `RoundSchedule`: clock-synchronous rounds (start time, round length), discovered from the run's
  peer records by a peer that joins;
- `RoundClock`: the rounds a peer takes on that clock;
- `RoundPlan`: the round a peer is about to compute for (its coordinator's, or the clock's);
- `Announcement`: one participant's payload for a round, validated from an untrusted DHT entry;
- `peer_records`: the valid peer records of a DHT read, and how many were not.
"""

import math
import threading
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import hivemind
import torch
from hivemind.p2p import PeerID
from pydantic.v1 import ValidationError

from shoal.peer.swarm.membership import PeerRecord, winning_clock
from shoal.peer.swarm.names import peers_key
from shoal.protocol import MalformedPayloadError, rules

DIGEST_BYTES = 32


def is_peer_id(text: object) -> bool:
    """Whether untrusted `text` is a libp2p peer id in base58: the shape the coordinator checks too
    (shoal.protocol.rules), and a multihash that decodes."""
    if not rules.is_peer_id(text):
        return False
    try:
        PeerID.from_base58(text)
    except (TypeError, ValueError):
        return False
    return True


def peer_records(found) -> tuple[dict[bytes, PeerRecord], int]:
    """The valid records of a DHT read of `<run>_peers` by public-key subkey, and how many were not."""
    if found is None or not isinstance(found.value, dict):
        return {}, 0
    records, malformed = {}, 0
    for owner, entry in found.value.items():
        try:
            records[owner] = PeerRecord.parse_obj(getattr(entry, "value", None))
        except ValidationError:
            malformed += 1
    return records, malformed


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundSchedule:
    """Clock-synchronous rounds: round r ends at `start_time + (r + 1) * round_seconds`."""

    start_time: float
    """Unix time at which round 0 starts."""
    round_seconds: float
    """Length of a round (compute and exchange), seconds."""

    def __post_init__(self) -> None:
        if not self.round_seconds > 0:
            raise ValueError(f"round_seconds must be > 0, got {self.round_seconds}")

    def round_at(self, now: float) -> int:
        """The round in progress at `now` (0 before the start)."""
        return max(0, math.floor((now - self.start_time) / self.round_seconds))

    def deadline(self, round_number: int) -> float:
        return self.start_time + (round_number + 1) * self.round_seconds

    @staticmethod
    def discover(dht: hivemind.DHT, run: str, timeout: timedelta = timedelta(seconds=30)) -> "RoundSchedule":
        """The clock the run's live peers follow (the one most of their records name), for a peer that
        joins a running swarm; raises TimeoutError if no peer record shows up in time."""
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            records, _ = peer_records(dht.get(peers_key(run), latest=True))
            clocks = Counter(
                (record.start_time, record.round_seconds)
                for record in records.values()
                if record.start_time > 0
            )
            if clocks:
                start_time, round_seconds = winning_clock(clocks)
                return RoundSchedule(start_time=start_time, round_seconds=round_seconds)
            if time.monotonic() > deadline:
                raise TimeoutError(f"no live peer of run {run!r} found in the DHT within {timeout}")
            time.sleep(0.5)


class RoundClock:
    """The rounds a peer takes on its run's `schedule`. The training thread plans while an overlapped
    optimizer gathers on its own thread: a lock keeps either from undoing the other's step, which
    would plan one round twice."""

    def __init__(self, schedule: RoundSchedule):
        self.schedule = schedule
        """The clock the rounds follow: the run's, or a coordinator's last pace."""
        self.untaken = 0
        """Rounds before this one are taken by a plan or a gather."""
        self._lock = threading.Lock()

    @property
    def next_round(self) -> int:
        """The round a plan, or a gather without one, would take if called now."""
        return max(self.untaken, self.schedule.round_at(time.time()))

    def take(self, planned: int | None, *, coordinated: bool = False) -> int:
        """Takes a round for a computation: the coordinator's `planned` one; uncoordinated, `planned`
        (None: the next round not taken) or, if the clock is past it, the round in progress (a late
        peer joins it). No later plan or gather takes it or an earlier one."""
        with self._lock:
            number = self.untaken if planned is None else planned
            if not coordinated:
                number = max(number, self.schedule.round_at(time.time()))
            self.untaken = max(self.untaken, number + 1)
            return number

    def pace(self, schedule: RoundSchedule) -> None:
        """Rounds at a coordinator's pace from now (used if it goes away), the rounds taken kept."""
        with self._lock:
            self.schedule = schedule

    def follow(self, schedule: RoundSchedule) -> None:
        """From now, the rounds of `schedule`, joining the round in progress."""
        with self._lock:
            self.schedule = schedule
            self.untaken = schedule.round_at(time.time())


class Claim(Protocol):
    """A peer's lane of the token ledger in one round (shoal.peer.data.ledger.Lane): its claim goes with
    its payload."""

    def claim_bytes(self) -> bytes: ...


class SharedLedger(Protocol):
    """A record the swarm keeps with its shared state and settles from its rounds' payloads: the token
    ledger (shoal.peer.data.ledger.TokenLedger). The exchange appends its view to each round's state,
    hands it the payloads that counted and those the optimizer rejected, and gives it an adopted
    state's view; a round's plan carries the peer's lane, whose claim goes with its payload."""

    def view_tensor(self, round_number: int) -> torch.Tensor: ...

    def record_payloads(self, round_number: int, payloads: dict[bytes, bytes]) -> None: ...

    def name(self, peer_ids: dict[bytes, str]) -> None: ...

    def reject(self, round_number: int, sender: bytes) -> None: ...

    def adopt_tensor(self, tensor: torch.Tensor, round_number: int) -> None: ...

    def twin(self, view: torch.Tensor) -> "SharedLedger":
        """A ledger of the same run holding `view`, to replay rounds on apart from this one."""
        ...

    seq_len: int
    """Tokens of one window, less the target's."""

    def lane(self, round_number: int, slot: int, slots: int) -> Claim:
        """The lane of `slot` of `slots` in the round."""
        ...

    def progress(self) -> tuple[int, float, int]:
        """(epoch, share of it settled, windows settled in all)."""
        ...


@dataclass(frozen=True, slots=True)
class LedgerProgress:
    """How far the run's token ledger has walked its corpus, as this peer holds it."""

    epoch: int
    share: float
    """Of the current epoch, settled."""
    windows: int
    """Windows settled, every epoch together."""
    seq_len: int

    @property
    def epochs(self) -> float:
        return self.epoch + self.share

    @property
    def tokens(self) -> int:
        return self.windows * self.seq_len


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundStatus:
    """What the peer job reads of its exchange after a round (`SwarmExchange.status`): one frozen value,
    so that the job reaches into none of the exchange's parts (its stages, counters, isolation, ledger).
    """

    round: int | None
    """The round of the last `gather` (None: none yet)."""
    needed: tuple[float, float] | None
    """What the last round's exchange needed, for the compute window (shoal.peer.job.window): seconds
    to announce and be read, and of the longest pull; None: a pull was still on at the deadline."""
    shared: bool
    """Whether this peer's payload counted together with another peer's."""
    late: int
    """Rounds this peer's payload missed so far."""
    isolated: bool
    """Whether this peer reaches none of the others (shoal.peer.swarm.isolation)."""
    peers_seen: int
    """Peers expected in the last round, this one included."""
    stragglers: int
    """Of them, those whose payload missed the last round."""
    clocks_adopted: int
    """Times this peer took the run's round clock from peers that started with it."""
    resyncs: int
    """Times its shared state was replaced by the majority's."""
    resync_bytes: int
    """State bytes pulled for those re-syncs, so far."""
    replays: int = 0
    """Times its state was rebuilt by replaying the steps since a state it held, instead."""
    replay_bytes: int = 0
    """Bytes pulled to replay, so far."""
    payload_bytes: int
    """This peer's payload in the last round."""
    bytes_sent: int
    """Payload, state and probe bytes served so far."""
    bytes_received: int
    """Payload and state bytes pulled so far."""
    round_seconds: float
    ledger: LedgerProgress | None
    """The token ledger's progress (None: the run keeps none)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundPlan:
    """The round a peer is about to compute for (`SwarmExchange.plan_round`)."""

    round: int
    coordinated: bool
    """Whether the coordinator announced it (then it decides the participant set)."""
    compute_seconds: float | None
    """Seconds of computation that fit before the payload is due (None: the peer's own window)."""
    data_seed: int | None
    """The round's data seed from the coordinator (None: the run's seed)."""
    slot: tuple[int, int]
    """(this peer's place, count) among the round's peers: its data slice."""
    exchange_deadline: float = 0.0
    """Coordinated: when the round ends at the latest (this machine's clock)."""
    expected: int = 0
    """Coordinated: how many peers the coordinator expects in the round."""
    lane: Claim | None = None
    """This peer's lane of the token ledger in the round (shoal.peer.data.ledger.Lane; None: no
    ledger): its batches draw from it, and the exchange sends its claim."""


@dataclass(frozen=True, slots=True)
class Announcement:
    """A validated DHT announcement of one participant's payload for a round."""

    owner: bytes
    """The announcing peer's public-key subkey: who it is, unforgeably."""
    peer: str
    """Its libp2p peer id, where the payload is pulled from."""
    digest: bytes
    size: int
    samples: int
    state: bytes = b""
    """Digest of its shared state at the start of the round (shoal.peer.swarm.state); empty if none."""
    synced: bool = False
    """Whether it held the majority's state last round (only those vote while any exist)."""

    @staticmethod
    def parse(owner: object, value: object, max_bytes: int, peer: str) -> "Announcement":
        """From an untrusted DHT subkey and value (`value()`'s form) and the peer id the owner's record
        names (or the coordinator's list); raises MalformedPayloadError."""
        if not isinstance(owner, bytes) or not isinstance(value, list | tuple) or len(value) not in (3, 5):
            raise MalformedPayloadError(
                "bad_announcement",
                "announcement is not {public key: [digest, size, samples(, state, synced)]}",
            )
        digest, size, samples, state, synced = (*value, b"", False)[:5]
        if not is_peer_id(peer):
            raise MalformedPayloadError("bad_announcement", f"{peer!r} is not a peer id")
        if not isinstance(digest, bytes) or len(digest) != DIGEST_BYTES:
            raise MalformedPayloadError("bad_announcement", f"{peer}: digest is not {DIGEST_BYTES} bytes")
        if type(size) is not int or not 0 < size <= max_bytes:
            raise MalformedPayloadError("too_large", f"{peer}: size {size!r} outside (0, {max_bytes}]")
        if type(samples) is not int or samples < 0:
            raise MalformedPayloadError("bad_announcement", f"{peer}: samples {samples!r}")
        if not isinstance(state, bytes) or len(state) not in (0, DIGEST_BYTES) or type(synced) is not bool:
            raise MalformedPayloadError("bad_announcement", f"{peer}: state {state!r}, synced {synced!r}")
        return Announcement(owner, peer, digest, size, samples, state, synced)

    def value(self) -> list:
        """What `parse` reads back: the DHT value, a list without names (the owner is the subkey, the
        peer id is in its record, which every reader holds): every read answers with every peer's, and
        the names and the peer id were 90 of an entry's 235 bytes."""
        value = [self.digest, self.size, self.samples]
        return value + ([self.state, self.synced] if self.state else [])
