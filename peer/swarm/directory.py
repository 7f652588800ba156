"""RunDirectory: a peer's view of its run in the hivemind DHT (a part of SwarmExchange,
shoal.peer.swarm.exchange).

It writes this peer's signed record (shoal.peer.swarm.membership) and its announcements under its
public-key subkey, reads the others' records (keeping the compatible peers and naming what differs in
the others) and the announcements of a round, and counts the serialized bytes of every read and
write (most of a small payload's wire overhead: BENCHMARKS.md). A peer alone in its run dials its
initial peers again (`rejoin`): hivemind drops a peer that stops answering from its routing table,
and peers that knew the swarm through one bootstrap peer would never find it again once it restarted.

Everything here runs on the exchange's event loop thread.
"""

import asyncio
import dataclasses
import functools
import math
import re
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TypeAlias

import hivemind
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils.logging import get_logger
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.serializer import MSGPackSerializer

from shoal.peer.swarm.bootstrap import REPLICAS
from shoal.peer.swarm.counters import SwarmCounters
from shoal.peer.swarm.membership import (
    SHOAL_VERSION,
    PeerRecord,
    incompatibility,
    other_clock,
    winning_clock,
)
from shoal.peer.swarm.names import peers_key
from shoal.peer.swarm.records import Announcement, RoundSchedule, peer_records
from shoal.peer.swarm.relay import UNCHECKED, Reachability
from shoal.protocol import MalformedPayloadError

if TYPE_CHECKING:
    from shoal.peer.swarm.coordinator_link import CoordinatorLink

logger = get_logger(__name__)

# what this peer stores under its subkey: its record (`PeerRecord.dict()`) or an announcement's value
DHTValue: TypeAlias = dict[str, object] | list[object]

REJOIN_EVERY_S = 10.0  # a peer alone in its run dials its initial peers again at most this often ...
REJOIN_TIMEOUT_S = 5.0  # ... each for at most this long
# under a coordinator, a peer rewrites its DHT record at most this often: the coordinator tracks who is
# alive, so the record only serves `shoal status` (which shows its age), joining checks and the fallback
RECORD_REFRESH_S = 120.0
# reads and writes crawl only as far as the REPLICAS nodes nearest their key (those a write stores to;
# a read merges their entries): hivemind's default crawl is a beam of 20 nodes, each answering with
# every peer's entry under the key, O(N^2) bytes for one read or write in a swarm under 20 nodes
# (BENCHMARKS.md); a replica that withholds entries is made up for by the others (docs/ROBUSTNESS.md).
# A read of a key read from all of them less than so many rounds ago asks only the nearest (a third of
# the bytes: the nearest holds every write that found it, the first a write stores to); a newcomer to
# the peer list or a withholding nearest node is then seen that much later (docs/ROBUSTNESS.md)
BEAM = REPLICAS
RECORDS_FULLY_EVERY_ROUNDS = 8.0
ANNOUNCEMENTS_FULLY_EVERY_ROUNDS = 0.25
# the peer list (a record of every peer) is read again at most this often, and at once when an unknown
# peer announced: a newcomer shows up that way, a peer that left is dropped when its last record read
# expires (a record outlives its writer's next write by three rounds: `store_record`), and records
# change little (relays, reachability, the coordinator's address)
RECORDS_EVERY_ROUNDS = 2.0
ADDRESS = re.compile(r"[A-Za-z0-9.\-\[\]:]{1,250}:[0-9]{1,5}")  # a coordinator's HOST:PORT in a record


class RunDirectory:
    """See the module docstring.

    Args:
        dht: the run's hivemind.DHT.
        run: the run's name.
        owner: this peer's public-key subkey.
        record: this peer's first record (`first_record`).
        counts: the exchange's counters (DHT bytes and writes, rejected records, rejoins).
        rejoin: the initial peers' multiaddresses.
        relaying: whether this peer pulls through relays (`relays_of`).
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        *,
        run: str,
        owner: bytes,
        record: PeerRecord,
        counts: SwarmCounters,
        rejoin: Sequence[str] = (),
        relaying: bool = True,
    ):
        self.dht, self.run, self.owner, self.counts = dht, run, owner, counts
        self.record, self.relaying = record, relaying
        self.refused: dict[str, str] = {}
        """Incompatible peers seen (peer id: which settings differ)."""
        self.coordinators: dict[bytes, str] = {}
        """Compatible peers that follow a coordinator: the address their record names (HOST:PORT,
        printable; anything else is dropped: it is another peer's text, shown to a user)."""
        self.run_clock: tuple[float, float] | None = None
        """The round clock (start time, round length) this run converges on, when it is not this
        peer's: another peer started the run at once (`membership.winning_clock`)."""
        self._relays: dict[str, tuple[str, ...]] = {}  # peer id: the relays its record names
        self._peer_ids = {owner: record.peer_id}  # compatible owner: the peer id its last record read names
        self._reachable: set[str] = set()  # peer ids whose record says they can be dialed
        self._rejoin = tuple(rejoin)
        self._rejoined_at = -math.inf  # monotonic time of the last attempt
        self._read_fully_at: dict[str, float] = {}  # key: monotonic time of its last read from every replica
        self._compatible: dict[bytes, float] = {}  # the last peer list read: compatible owner: its expiry
        self._records_read_at = -math.inf  # monotonic time of that read
        self._record_expires = -math.inf  # the expiry of this peer's last record written
        self._read_fully = False  # whether the last read asked every replica
        # key: this peer's last write there and the replicas it went to, until a read from every replica
        self._unconfirmed: dict[str, tuple[DHTValue, float, frozenset[bytes]]] = {}

    @property
    def peer_ids(self) -> dict[bytes, str]:
        """The peer id each compatible peer's last record read names (a copy: it is replaced by reads)."""
        return dict(self._peer_ids)

    @property
    def coordinated(self) -> bool:
        """Whether this peer follows a coordinator (its record names it): the record is then only kept
        alive."""
        return bool(self.record.coordinator)

    async def store_record(
        self, round_number: int, schedule: RoundSchedule, *, refresh_s: float = 0.0
    ) -> None:
        """Writes this peer's record, unless the last write is less than `refresh_s` old. It outlives
        the next write by three rounds: under a coordinator, that may be `RECORD_REFRESH_S` away."""
        now = time.time()
        if now - self.record.updated < refresh_s:
            return
        next_write = now + (RECORD_REFRESH_S if self.coordinated else 0.0)
        expires = max(schedule.deadline(round_number), next_write) + 3 * schedule.round_seconds
        # a second write in a round (the first round's, after the one at start; a new clock's) must
        # expire later than the last: a replica refuses an entry that expires no later than the one it
        # holds, and a refused write crawls the DHT (`_store_near`), every node asked answering with
        # every record (at 16 peers, a sixth of a 6-round run's bytes)
        expires = self._record_expires = max(expires, self._record_expires + 0.001)
        self.record = self.record.copy(update={"round": round_number, "updated": now})
        await self.store(peers_key(self.run), self.record.dict(), expires)

    def update_record(self, **fields) -> None:
        """What the next record write says (progress: throughput, samples)."""
        self.record = self.record.copy(update=fields)

    async def store(self, key: str, value: DHTValue, expiration: float) -> None:
        """Stores `value` under this peer's subkey, counting its serialized bytes: on the replicas its
        routing table knows, and on any nearer one the next read from every replica finds (`get`)."""
        self.counts.sent["dht"] += len(key) + len(self.owner) + len(MSGPackSerializer.dumps(value))
        self.counts.dht_stores += 1
        written = await self._store_near(key, value, expiration, skip=frozenset())
        # until a read from every replica (which a round's key may never get: `get`), or its expiry
        self._unconfirmed = {k: entry for k, entry in self._unconfirmed.items() if entry[1] > time.time()}
        if written is not None:
            self._unconfirmed[key] = (value, expiration, written)

    async def _store_near(
        self, key: str, value: DHTValue, expiration: float, *, skip: frozenset[bytes]
    ) -> frozenset[bytes] | None:
        """Stores on the nearest replicas the routing table knows, except those in `skip`; hivemind's
        crawling store instead if one did not take it or the table may have dropped nodes. Returns the
        replicas that hold it (None: crawled)."""
        write = functools.partial(_store_near, key, self.owner, value, expiration, skip)
        outcome = await self.dht.run_coroutine(write, return_future=True)
        if outcome is None or not outcome[1]:
            self.counts.dht_rewrites += 1
            await self.dht.store(
                key,
                value,
                expiration,
                subkey=self.owner,
                return_future=True,
                beam_size=BEAM,
                num_workers=BEAM,
            )
            return None
        self.counts.dht_rewrites += bool(skip and outcome[0])
        return skip | frozenset(outcome[0])

    async def get(self, key: str, *, every_rounds: float, fully: bool = False, nearest: bool = False):
        """The latest value under `key` on the BEAM nodes nearest it (the nearest only, if read from
        all less than `every_rounds` rounds ago, and at least a second, unless `fully`; or if `nearest`:
        a first read with `nearest` then counts as one from all), counting the bytes of what came back."""
        self.counts.dht_reads += 1
        now, beam = time.monotonic(), 1
        every_s = max(1.0, every_rounds * self.record.round_seconds)
        if nearest:
            self._read_fully_at.setdefault(key, now)
        elif fully or now - self._read_fully_at.get(key, -math.inf) >= every_s:
            self._read_fully_at[key], beam = now, BEAM
        kept_s = max(1.0, RECORDS_FULLY_EVERY_ROUNDS * self.record.round_seconds)
        self._read_fully_at = {k: t for k, t in self._read_fully_at.items() if now - t < kept_s or k == key}
        self._read_fully = beam == BEAM
        found = await self.dht.get(key, latest=True, return_future=True, beam_size=beam, num_workers=beam)
        if beam == BEAM and key in self._unconfirmed:
            # the read put the replicas in the routing table: this peer's last write goes to any it missed
            value, expiration, written = self._unconfirmed.pop(key)
            await self._store_near(key, value, expiration, skip=written)
        if found is not None and isinstance(found.value, dict):
            self.counts.received["dht"] += sum(
                len(MSGPackSerializer.dumps(getattr(entry, "value", None))) + len(subkey)
                for subkey, entry in found.value.items()
                if isinstance(subkey, bytes)
            )
        return found

    async def compatible_peers(self, *, fully: bool = False) -> set[bytes]:
        """Public-key subkeys of the peers whose current record is compatible with this one's: as last
        read, less the expired records, if that was less than RECORDS_EVERY_ROUNDS rounds ago; read
        from every replica if `fully` (an unknown peer announced)."""
        now = time.monotonic()
        if not fully and now - self._records_read_at < RECORDS_EVERY_ROUNDS * self.record.round_seconds:
            return {owner for owner, expires in self._compatible.items() if expires > time.time()}
        # the first read asks the nearest replica only (at 16 peers, most of a first round's bytes): a
        # record it lacks shows up when its peer announces, as an unknown announcer (`fully`); what a
        # hiding node could sway is decided on a read from every replica (a clock, below; joining:
        # shoal.peer.job.node._check_compatible)
        first = self._records_read_at == -math.inf and not fully
        found = await self.get(
            peers_key(self.run), every_rounds=RECORDS_FULLY_EVERY_ROUNDS, fully=fully, nearest=first
        )
        self._records_read_at = now
        records, malformed = peer_records(found)
        if malformed:
            self.counts.rejected["bad_record"] += malformed
        compatible = {self.owner}
        peer_ids = {self.owner: self.record.peer_id}
        relays: dict[str, tuple[str, ...]] = {}
        self._reachable = set()
        self.coordinators = {}
        clocks: Counter[tuple[float, float]] = Counter()
        for owner, record in records.items():
            reason = incompatibility(self.record, record)
            if reason is None:
                compatible.add(owner)
                peer_ids[owner] = record.peer_id
                relays[record.peer_id] = tuple(record.relays)
                if record.reachable:
                    self._reachable.add(record.peer_id)
                if owner != self.owner and ADDRESS.fullmatch(record.coordinator):
                    self.coordinators[owner] = record.coordinator
            elif other_clock(self.record, record):
                clocks[(record.start_time, record.round_seconds)] += 1
            elif record.peer_id not in self.refused:
                self.refused[record.peer_id] = reason
                logger.warning(f"refusing peer {record.peer_id}: {reason}")
        mine = (self.record.start_time, self.record.round_seconds)
        clocks[mine] = len(compatible)
        winner = winning_clock(clocks)
        if winner != mine and not self._read_fully:
            # another clock is followed only on a read from every replica: a nearest node that hides
            # the others' records would otherwise move this peer onto the clock of a few of its own
            return await self.compatible_peers(fully=True)
        self.run_clock = None if winner == mine else winner
        self._relays, self._peer_ids = relays, peer_ids
        self._compatible = {owner: _expiry(found, owner) for owner in compatible - {self.owner}}
        self._compatible[self.owner] = math.inf
        return compatible

    def relays_of(self, peer_id: str) -> tuple[str, ...]:
        """The relays a compatible peer's record names (it may be behind NAT: pull through them); for a
        peer whose record this one has not read (under a coordinator), this peer's own relays: a swarm
        usually shares its bootstrap nodes. None for a peer that does not relay (`shoal join --relay off`)."""
        if not self.relaying:
            return ()
        return self._relays.get(peer_id) or tuple(self.record.relays)

    def claims_reachable(self, peer_id: str) -> bool:
        """Whether a compatible peer's record says that it can be dialed."""
        return peer_id in self._reachable

    async def announcements(
        self, key: str, max_payload_bytes: int, *, nearest: bool = False
    ) -> list[tuple[object, Announcement | MalformedPayloadError]]:
        """(subkey, its announcement or why it is malformed) for every entry under `key` (see `get`)."""
        found = await self.get(key, every_rounds=ANNOUNCEMENTS_FULLY_EVERY_ROUNDS, nearest=nearest)
        if found is None or not isinstance(found.value, dict):
            return []
        announcements: list[tuple[object, Announcement | MalformedPayloadError]] = []
        for owner, entry in found.value.items():
            try:
                peer = self._peer_ids.get(owner) if isinstance(owner, bytes) else None
                if peer is None:
                    raise MalformedPayloadError(
                        "bad_announcement", "no compatible record read for its author"
                    )
                parsed = Announcement.parse(owner, getattr(entry, "value", None), max_payload_bytes, peer)
                announcements.append((owner, parsed))
            except MalformedPayloadError as error:
                announcements.append((owner, error))
        return announcements

    async def everyone(
        self,
        key: str,
        mine: Announcement,
        *,
        wait_s: float,
        poll_s: float,
        ignored: set[bytes],
        max_payload_bytes: int,
    ) -> dict[bytes, Announcement]:
        """Announces `mine` under `key`, then reads the compatible peers' announcements there until
        every compatible peer has one or `wait_s` has passed; those of `ignored` owners are left out."""
        await self.store(key, mine.value(), time.time() + wait_s + 60)
        deadline = time.time() + wait_s
        announced = {self.owner: mine}
        while True:
            compatible = await self.compatible_peers()
            for owner, announcement in await self.announcements(key, max_payload_bytes):
                if owner in compatible and owner not in ignored and isinstance(announcement, Announcement):
                    announced[owner] = announcement
            if compatible <= announced.keys() or time.time() >= deadline:
                return announced
            await asyncio.sleep(min(poll_s, max(0.0, deadline - time.time())))

    def take_run_clock(self) -> RoundSchedule | None:
        """The run's round clock, if this peer is to follow it instead of its own (`run_clock`); this
        peer's record names it from now."""
        if self.run_clock is None:
            return None
        start_time, round_seconds = self.run_clock
        logger.warning(
            f"another peer started this run at the same time: following the run's round clock "
            f"({round_seconds:g} s rounds from {start_time:.3f}) instead of this peer's"
        )
        self.update_record(start_time=start_time, round_seconds=round_seconds)
        self.run_clock = None
        self._records_read_at = -math.inf  # judged compatible on the old clock: read them again
        self.counts.clocks_adopted += 1
        return RoundSchedule(start_time=start_time, round_seconds=round_seconds)

    def rejoin_if_alone(self, peers_seen: int) -> None:
        """Dials the initial peers again (in the DHT's process, not waited for) if this peer saw no
        other in its last round (an isolated peer passes 1: shoal.peer.swarm.isolation), at most every
        REJOIN_EVERY_S."""
        if self._rejoin and peers_seen <= 1 and time.monotonic() - self._rejoined_at >= REJOIN_EVERY_S:
            self._rejoined_at = time.monotonic()
            self.counts.rejoins += 1
            self.dht.run_coroutine(functools.partial(_ping_again, self._rejoin), return_future=True)


def first_record(
    peer_id: str,
    config: Mapping[str, str],
    device: str,
    schedule: RoundSchedule,
    coordinator: "CoordinatorLink | None",
    reachability: Reachability = UNCHECKED,
) -> PeerRecord:
    """This peer's record before its first round: who it is, what it runs, on what clock, whether it
    can be dialed and through which relays it can be reached."""
    return PeerRecord(
        peer_id=peer_id,
        version=SHOAL_VERSION,
        config=dict(config),
        device=device,
        throughput=0.0,
        round=0,
        start_time=float(schedule.start_time),
        round_seconds=float(schedule.round_seconds),
        coordinator=(coordinator.address if coordinator else "")[:256],
        reachable=reachability.reachable,
        relays=list(reachability.relays),
    )


def _expiry(found, owner: bytes) -> float:
    """When the entry of `owner` in a DHT read expires (unix time; hivemind checked it is a float)."""
    return getattr(found.value.get(owner), "expiration_time", math.inf)


async def _ping_again(maddrs: tuple[str, ...], _dht: hivemind.DHT, node: DHTNode) -> int:
    """In the DHT's process: dials each multiaddress and pings its DHT node, which puts the two back in
    each other's routing tables. Returns how many answered."""

    async def ping(maddr: str) -> bool:
        address = Multiaddr(maddr)
        peer = PeerID.from_base58(address["p2p"])
        await node.p2p._client.connect(peer, [address.decapsulate(Multiaddr(f"/p2p/{address['p2p']}"))])
        return await node.protocol.call_ping(peer) is not None

    # bounded, so that none is still dialling when the peer leaves; unreachable for now: the next
    # lonely round tries again
    outcomes = await asyncio.gather(
        *(asyncio.wait_for(ping(maddr), REJOIN_TIMEOUT_S) for maddr in maddrs), return_exceptions=True
    )
    return sum(outcome is True for outcome in outcomes)


async def _store_near(
    key: str, subkey: bytes, value: DHTValue, expiration: float, skip: frozenset[bytes], _dht, node: DHTNode
) -> tuple[list[bytes], bool] | None:
    """In the DHT's process: signs (key, subkey, value) with the node's record validators and stores it
    on the REPLICAS nodes nearest `key` that its routing table knows (itself among them, unless a
    client), those in `skip` (node ids) excepted. No crawl: each node a crawl asks answers with every
    entry it holds under the key, most of a write's bytes (BENCHMARKS.md).

    Returns (the node ids stored to, whether each took it); None if the table holds a bucket's worth of
    nodes: it may then have turned away nearer ones for room, and only a crawl finds the replicas."""
    protocol, key_id = node.protocol, DHTID.generate(source=key)
    if len(protocol.routing_table.uid_to_peer_id) >= protocol.routing_table.bucket_size:
        return None
    candidates = protocol.routing_table.get_nearest_neighbors(key_id, REPLICAS, exclude=node.node_id)
    if not protocol.client_mode:
        candidates.append((node.node_id, None))
    nearest = sorted(candidates, key=lambda candidate: key_id.xor_distance(candidate[0]))[:REPLICAS]
    targets = [(node_id, peer) for node_id, peer in nearest if node_id.to_bytes() not in skip]
    if not targets:
        return [], True
    serialized = protocol.serializer.dumps(subkey), protocol.serializer.dumps(value)
    record = DHTRecord(key_id.to_bytes(), *serialized, expiration)
    if protocol.record_validator is not None:
        record = dataclasses.replace(record, value=protocol.record_validator.sign_value(record))
    remote = [peer for _, peer in targets if peer is not None]
    taken = []
    if len(remote) < len(targets):
        valid = protocol.record_validator is None or protocol.record_validator.validate(record)
        taken.append(valid and protocol.storage.store(key_id, record.value, expiration, subkey=subkey))
    outcomes = await asyncio.gather(
        *(protocol.call_store(peer, [key_id], [record.value], [expiration], [subkey]) for peer in remote)
    )
    taken += [bool(outcome and outcome[0]) for outcome in outcomes]
    return [node_id.to_bytes() for node_id, _ in targets], all(taken)
