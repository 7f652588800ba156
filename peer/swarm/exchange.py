"""SwarmExchange: the Exchange of DeMo and DiLoCo over a hivemind DHT and its libp2p transport.

For round r, a participant
1. holds its serialized payload and serves it over payload channels (shoal.peer.swarm.channels:
   libp2p streams kept open between two peers, one request after another; also to one-off streams,
   for hivemind's own clients);
2. heartbeats its signed `PeerRecord` (shoal.peer.swarm.membership) and announces `(peer id, digest, size,
   samples)` under `<run>.round.<r>`, both under its public-key subkey, which only it can write
   (DHT values stay tiny: payload bytes never go through the DHT);
3. until the round's deadline, reads the announcements of compatible peers (same run configuration
   and shoal major.minor; others are refused, naming what differs) and pulls every payload it does
   not hold (shoal.peer.swarm.pull), with bounded concurrency, a timeout per call and retries with
   backoff: from the peer that announced it first, then from any other participant of the round,
   since every peer serves what it pulled (a relay that does not hold it yet answers with nothing).
   A payload is accepted only if its size and SHA-256 match the announcement; a source that sends
   other bytes is struck and not asked again for it;
4. at the deadline returns the payloads it holds, ordered by public key, so that participants
   holding the same payloads aggregate them in the same order.

Agreement: with each payload a participant announces the digest of its shared state at the start of
the round (shoal.peer.swarm.state: parameters, DiLoCo's outer momentum) and whether it was in sync last
round. At the deadline the majority state is chosen (`state.majority`); contributions computed on
another state are left out (`stale_state`), and a participant whose own state differs downloads the
majority's from the peers that hold it (several at once, 1 MiB pieces checked against a manifest,
another source taking over a lost one's pieces) and hands it to its optimizer (`adopted_state`), which
loads it before applying the round. A new peer joins the same way: its first round re-syncs it.

Hostile peers: announcements are validated and size-capped before any download; a digest already
announced in an earlier round (a replay) is refused, and one announced by several peers this round
counts once; a payload that does not match its announcement, or that the optimizer drops (`reject`),
strikes its sender, and after `strike_limit` strikes its announcements are ignored for `ban_rounds`
rounds.

Rounds are clock-synchronous: a `RoundSchedule` (start time, round length) fixes every deadline. A
participant that calls `gather` late joins the round in progress; one whose announcement comes too
late for others to pull is left out of their round.

Under a coordinator (shoal.peer.swarm.coordinator_link), step 2's announcement goes to the coordinator
instead, which decides the round's participants for everyone (shoal.peer.swarm.coordinated); the
record is then rewritten only every `RECORD_REFRESH_S`, to stay alive. Should the coordinator stop
answering, the round is announced in the DHT after all and finishes as above.

Butterfly averaging (`average`, DiLoCo's dense pseudo-gradients, shoal.peer.algorithms.butterfly): in a
coordinated round of at least `butterfly.MIN_PARTICIPANTS`, steps 3-4 become a reduce-scatter and an
all-gather. The participants that count (the agreement above, decided before any byte moves: the
coordinator's set and the states it announced) each own one piece; an owner pulls its piece of every
payload from its author (`PayloadRequest.shards`), averages it (clipped, sample-weighted) and serves the
mean (`reduced`); every participant then pulls the other means. Pieces carry no digest: the puller
validates shape and values, and a malformed one strikes its sender. A mean that is malformed or not
there by the deadline is averaged by the puller itself from the pieces of the payloads. An owner that
serves a well-formed but false mean is not caught (as in any butterfly all-reduce): if it tells every
peer the same it skews that piece for all, if not the state check of the next round finds the split
and re-syncs the minority. Runs that cannot trust their peers keep the gather (`--averaging gather`,
the default), where every peer clips every contribution itself.

The DHT is the caller's (create it before starting threads: hivemind forks a process for it). This
object runs one event loop on a thread it owns for the handler and the downloads; `close()` stops it.
"""

import asyncio
import contextlib
import functools
import hashlib
import math
import re
import struct
import threading
import time
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from datetime import timedelta

import hivemind
import torch
from google.protobuf.message import DecodeError
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2PDaemonError, P2PHandlerError, PeerID
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.logging import get_logger
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.serializer import MSGPackSerializer

from shoal.compression import DecodeLimits, DenseCodec, decode_tensor
from shoal.peer.algorithms.butterfly import Pieces, cut
from shoal.peer.algorithms.exchange import Averaged, Contribution, Exchange
from shoal.peer.swarm.channels import Channels, ChannelServer
from shoal.peer.swarm.coordinated import CoordinatedRounds
from shoal.peer.swarm.coordinator_link import CoordinatorLink
from shoal.peer.swarm.counters import SwarmCounters
from shoal.peer.swarm.membership import SHOAL_VERSION, PeerRecord, incompatibility, owner_subkey, run_hash
from shoal.peer.swarm.names import final_key, handler, peers_key, round_key
from shoal.peer.swarm.pull import Puller, abandon, chunks
from shoal.peer.swarm.records import Announcement, RoundPlan, RoundSchedule, peer_records
from shoal.peer.swarm.state import (
    StateSnapshot,
    StateUnavailable,
    download,
    majority,
    restore,
    state_size,
)
from shoal.protocol import EncodedTensor, MalformedPayloadError, Payload, parse_message
from shoal.protocol.swarm_pb2 import PayloadRequest, ProbeRequest, StateRequest

logger = get_logger(__name__)

PROBE_MAX_BYTES = 8 << 20  # a bandwidth probe (`shoal check`) gets at most this much ...
PROBE_INTERVAL_S = 10.0  # ... and at most once per this many seconds per asking peer
REJOIN_EVERY_S = 10.0  # a peer alone in its run dials its initial peers again at most this often ...
REJOIN_TIMEOUT_S = 5.0  # ... each for at most this long
# under a coordinator, a peer rewrites its DHT record at most this often: the coordinator tracks who is
# alive, so the record only serves `shoal status` (which shows its age), joining checks and the fallback;
# a write costs about 18 KB on the wire in a small swarm (BENCHMARKS.md)
RECORD_REFRESH_S = 120.0
MAX_PIECES = 4096  # a butterfly round has at most this many pieces (one per participant)
MAX_CUT_COUNTS = 2  # ways a peer cuts one payload into pieces (honest peers agree on one count)
MEAN_WAIT_S = 0.25  # a request for a mean its owner has not finished waits at most this long for it
PARTS_QUIET_S = 1.0  # a leaving peer drains until this long has passed since it last served a piece
FINAL_WAIT_ROUNDS = 2  # at a run's end, peers wait this many round lengths for the others' final states
ADDRESS = re.compile(r"[A-Za-z0-9.\-\[\]:]{1,250}:[0-9]{1,5}")  # a coordinator's HOST:PORT in a record


class SwarmExchange(Exchange):
    """Exchange over a hivemind swarm; see the module docstring.

    Args:
        dht: a running hivemind.DHT of this swarm, started with `membership.record_validators(run,
            identity)`.
        run: the run's name, shared by its participants; namespaces DHT keys and the handler.
        schedule: the rounds' clock.
        identity: this peer's RSA key; its records sit under its public-key subkey.
        config: the run's configuration (model, algorithm, hyperparameters); peers whose
            configuration or shoal version differ are refused, with the differing settings named.
        device: reported in this peer's record.
        max_payload_bytes: announcements of larger payloads are rejected unread.
        fetch_timeout: limit of one download attempt.
        max_concurrent_fetches: downloads in flight at once.
        poll_interval: how often announcements are re-read during a round.
        strike_limit: strikes (payloads that fail their announcement or that the optimizer drops)
            after which a peer's announcements are ignored ...
        ban_rounds: ... for this many rounds.
        keep_states: state snapshots of the last rounds served to joining and re-syncing peers.
        coordinator: the link to the swarm's coordinator, if it has one (see `plan_round`).
        rejoin: multiaddresses (the initial peers) dialled and pinged again whenever this peer
            starts a round seeing no other peer of its run. hivemind drops a peer that stops
            answering from its routing table: without this, peers that knew the swarm through one
            bootstrap peer would never find it again once it restarted.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        *,
        run: str,
        schedule: RoundSchedule,
        identity: RSAPrivateKey,
        config: Mapping[str, str],
        device: str = "cpu",
        max_payload_bytes: int = 1 << 30,
        fetch_timeout: timedelta = timedelta(seconds=30),
        max_concurrent_fetches: int = 4,
        poll_interval: timedelta = timedelta(milliseconds=200),
        strike_limit: int = 3,
        ban_rounds: int = 10,
        keep_states: int = 2,
        coordinator: CoordinatorLink | None = None,
        rejoin: Sequence[str] = (),
    ):
        self.dht = dht
        self.run = run
        self.schedule = schedule
        self.max_payload_bytes = max_payload_bytes
        self.fetch_timeout_s = fetch_timeout.total_seconds()
        self.poll_interval_s = poll_interval.total_seconds()
        self.records_interval_s = max(1.0, self.poll_interval_s)
        self.peer_id = dht.peer_id.to_base58()
        self.owner = owner_subkey(identity)
        self.record = _first_record(self.peer_id, config, device, schedule, coordinator)
        self.strike_limit, self.ban_rounds, self.keep_states = strike_limit, ban_rounds, keep_states
        self.counts = SwarmCounters()
        self.strikes: Counter[bytes] = Counter()
        """Strikes per peer (public-key subkey) since its last ban."""
        self.banned: dict[bytes, int] = {}
        """Banned peers and the first round they are heard again."""
        self.synced = False
        """Whether this peer held (or adopted) the majority's state in its last round."""
        self.refused: dict[str, str] = {}
        """Incompatible peers seen (peer id: which settings differ)."""
        self.coordinators: dict[bytes, str] = {}
        """Compatible peers that follow a coordinator: the address their record names (HOST:PORT,
        printable; anything else is dropped: it is another peer's text, shown to a user)."""
        self.last_payload_bytes = 0
        """Size of this peer's payload in its last round."""
        self.last_round: int | None = None
        """The round of the last `gather`."""
        self.coordinator = coordinator
        self._plans: deque[RoundPlan] = deque()  # planned, not yet gathered (DiLoCo: in the background)
        self._handler = handler(run, "payload")
        self._channel_handler = handler(run, "payloads")
        self._state_handler = handler(run, "state")
        self._probe_handler = handler(run, "probe")
        self._probed: dict[PeerID, float] = {}  # asking peer: monotonic time of its last probe
        # touched only on the loop thread:
        self._held: dict[tuple[int, bytes], bytes] = {}
        self._states: dict[bytes, StateSnapshot] = {}
        self._seen: dict[bytes, int] = {}  # payload digest: the round it was first announced in
        self._seen_content: dict[bytes, int] = {}  # content_digest of a payload: the round it came in
        self._adopted: list[torch.Tensor] | None = None
        self._mine: tuple[int, bytes] | None = None  # (round, digest) of this peer's last payload
        self._cuttable: dict[int, bytes] = {}  # round: digest of its payloads it serves in pieces
        self._cuts: dict[tuple[int, int], list[bytes]] = {}  # (round, count): the pieces, as served
        self._means: dict[tuple[int, int], bytes] = {}  # (round, piece): this peer's mean of its piece
        self._mean_ready: dict[tuple[int, int], asyncio.Event] = {}
        self._pullers: set[str] = set()  # the peers that pulled this peer's last payload
        self._expected_pullers: set[str] = set()  # the other participants of the last round
        self._part_served_at = -math.inf  # monotonic time this peer last served a piece of its payload
        self._next_round = 0  # rounds before it are taken by a plan or a gather (`_take_round`)
        self._rounds_lock = threading.Lock()
        self.rounds = CoordinatedRounds(self)
        """The rounds under a coordinator (shoal.peer.swarm.coordinated)."""
        self._participants = [self.owner]
        self._me = self.owner  # this peer's key among the participants (its peer id under a coordinator)
        self._members: list[bytes] = []  # compatible peers seen in the last round, by public key
        self._rejoin = tuple(rejoin)
        self._rejoined_at = -math.inf  # monotonic time of the last attempt
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="shoal-swarm", daemon=True)
        self._thread.start()
        self._p2p = self._call(self._start(max_concurrent_fetches))

    def counters(self) -> dict:
        """A consistent copy of the counters, for another thread (the metrics endpoint)."""
        return {
            "sent": dict(self.counts.sent),
            "received": dict(self.counts.received),
            "rejected": dict(self.counts.rejected),
            "strikes": self.counts.strikes_total,
            "banned": len(self.banned),
            "refused": len(self.refused),
            "resyncs": self.counts.resyncs,
            "synced": self.synced,
            "stragglers": self.counts.stragglers,
            "late": self.counts.late,
            "coordinated_rounds": self.counts.coordinated_rounds,
            "dht_stores": self.counts.dht_stores,
            "relayed": self.relayed,
            "butterfly_rounds": self.counts.butterfly_rounds,
            "pieces_recomputed": self.counts.pieces_recomputed,
        }

    @property
    def relayed(self) -> int:
        """Payloads pulled from a peer other than their author."""
        return self._puller.relayed

    @property
    def rank(self) -> int:
        return self._participants.index(self._me) if self._me in self._participants else 0

    @property
    def world_size(self) -> int:
        return len(self._participants)

    @property
    def next_round(self) -> int:
        """The round the next plan, or a `gather` without one, would take if called now."""
        return max(self._next_round, self.schedule.round_at(time.time()))

    def _take_round(self, planned: int | None, *, coordinated: bool = False) -> int:
        """Takes a round for a computation: the coordinator's `planned` one; uncoordinated, `planned` (None:
        the next round not taken) or, if the clock is past it, the round in progress (a late peer joins
        it). No later plan or gather takes it or an earlier one. The training thread plans while an
        overlapped optimizer gathers on its own thread: the lock keeps either from undoing the other's
        step, which would plan one round twice."""
        with self._rounds_lock:
            round_number = self._next_round if planned is None else planned
            if not coordinated:
                round_number = max(round_number, self.schedule.round_at(time.time()))
            self._next_round = max(self._next_round, round_number + 1)
            return round_number

    def plan_round(self, last_round: int | None = None) -> RoundPlan | None:
        """The round the next computation is for. With a reachable coordinator: the next round it
        announces (waiting for it), with its compute budget, data seed and this peer's slot; the next
        `gather` then aggregates exactly the participant set the coordinator decides. Otherwise: the
        round in progress on the clock, uncoordinated, or the next one while an overlapped optimizer still
        gathers that one; the next `gather` joins it (or, late, the round in progress then).

        `last_round`: the run ends after it (`--until-round`). None once the clock, at the coordinator's
        last pace, is a round past it and no plan came: the coordinator announces no more rounds (the
        others have left), and a peer it keeps out, evicted, would otherwise wait for one forever."""
        while True:  # in slices, so that a stop (Ctrl-C) is noticed by the caller's signal handler
            plan = self._call(self.rounds.plan(wait=1.0))
            if plan is not None:
                self._plans.append(plan)
                return plan
            if last_round is not None and self.schedule.round_at(time.time()) > last_round + 1:
                return None

    def gather(
        self, payload: bytes, samples: int, state: Sequence[torch.Tensor] | None = None
    ) -> list[Contribution]:
        return self._gather(payload, samples, state, None)

    def average(
        self, payload: bytes, samples: int, state: Sequence[torch.Tensor] | None, pieces: Pieces
    ) -> Averaged:
        """A coordinated round of at least `butterfly.MIN_PARTICIPANTS` is averaged piece by piece
        (shoal.peer.algorithms.butterfly); any other round is gathered."""
        result = self._gather(payload, samples, state, pieces)
        return result if isinstance(result, Averaged) else Averaged(contributions=result)

    def _gather(
        self,
        payload: bytes,
        samples: int,
        state: Sequence[torch.Tensor] | None,
        pieces: Pieces | None,
    ) -> list[Contribution] | Averaged:
        plan = self._plans.popleft() if self._plans else None
        coordinated = plan is not None and plan.coordinated
        round_number = self._take_round(None if plan is None else plan.round, coordinated=coordinated)
        self.last_round = round_number
        self.last_payload_bytes = len(payload)
        self._adopted = None
        snapshot = None if state is None else (StateSnapshot.capture(state, round_number), list(state))
        if coordinated:
            return self._call(self.rounds.round(plan, bytes(payload), samples, snapshot, pieces))
        contributions = self._call(self._round(round_number, bytes(payload), samples, snapshot))
        if self.coordinator is not None:  # once it is back, the coordinator continues after this round
            self.coordinator.progress.round = max(self.coordinator.progress.round, round_number)
        return contributions

    def compatible_peers(self) -> set[bytes]:
        """Public-key subkeys of the peers whose record is compatible with this one's (itself included);
        the others are in `refused`, with what differs."""
        return self._call(self._compatible_peers())

    def set_progress(
        self, *, throughput: float, samples: int, compute_throughput: float = 0.0, min_samples: int = 0
    ) -> None:
        """What the next record says about this peer: samples per second, samples contributed; and
        what the heartbeats tell a coordinator: samples per second of computation, and the samples of
        this peer's smallest contribution to a round."""
        update = {"throughput": float(max(throughput, 0.0)), "samples": int(max(samples, 0))}
        self._loop.call_soon_threadsafe(lambda: setattr(self, "record", self.record.copy(update=update)))
        if self.coordinator is not None:
            progress = self.coordinator.progress
            progress.throughput, progress.min_samples = max(compute_throughput, 0.0), max(min_samples, 0)

    def agree_final(self, last_round: int, state: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """The last step of a run that ends after `last_round` (`shoal join --until-round`): the peers
        ending it compare the states they ended on, and one that is not on the majority's takes it.

        Every round's state digests heal a split in the round after it, except in a run's last round:
        decisions each peer takes alone (a payload pulled or not by the deadline, a sender's suspicion
        history) can leave the peers on two models with no round left to repair it. Here each peer
        announces its state under `final_key`, waits until every compatible peer has (at most
        FINAL_WAIT_ROUNDS round lengths), and the majority rule of every round (`state.majority`,
        banned peers left out) picks the state; a peer of the majority that saw another state serves
        its snapshot one round length more, for the re-sync. Returns the majority's state, if this
        peer's differs and could be pulled; else None."""
        snapshot = StateSnapshot.capture(state, last_round + 1)
        return self._call(self._final(last_round, snapshot, list(state)))

    async def _final(
        self, last_round: int, snapshot: StateSnapshot, like: list[torch.Tensor]
    ) -> list[torch.Tensor] | None:
        self._states[snapshot.digest] = snapshot  # served to a peer that re-syncs
        # what is announced is the state's manifest: its digest and size, and no samples
        manifest = len(snapshot.manifest)
        mine = Announcement(
            self.owner, self.peer_id, snapshot.digest, manifest, 0, snapshot.digest, self.synced
        )
        key = final_key(self.run, last_round)
        wait_s = FINAL_WAIT_ROUNDS * self.schedule.round_seconds
        await self._store(key, mine.value(), time.time() + wait_s + 60)
        deadline = time.time() + wait_s
        announced = {self.owner: mine}
        while True:
            compatible = await self._compatible_peers()
            for owner, announcement in await self._announcements(key):
                if (
                    owner in compatible
                    and owner not in self.banned
                    and isinstance(announcement, Announcement)
                ):
                    announced[owner] = announcement
            if compatible <= announced.keys() or time.time() >= deadline:
                break
            await asyncio.sleep(min(self.poll_interval_s, max(0.0, deadline - time.time())))
        agreed = majority({owner: (a.state, a.synced) for owner, a in announced.items()})
        if agreed == mine.state:
            if any(a.state != agreed for a in announced.values()):
                logger.info("a peer ended the run on another state: serving ours for its re-sync")
                await asyncio.sleep(self.schedule.round_seconds)
            return None
        sources = [a.peer for owner, a in announced.items() if a.state == agreed and owner != self.owner]
        logger.warning(f"ended the run on another state than {len(sources)} peer(s): re-syncing to theirs")
        return await self._resync(agreed, sources, like)

    def adopted_state(self) -> list[torch.Tensor] | None:
        adopted, self._adopted = self._adopted, None
        return adopted

    def reject(self, contribution: Contribution, reason: str) -> None:
        """Counts and strikes what the optimizer left out: malformed, `config_mismatch`, or screened
        (`opposed`, `outlier`: shoal.peer.algorithms.robust)."""
        number = contribution.round if contribution.round >= 0 else self.last_round
        self._loop.call_soon_threadsafe(self._count_and_strike, contribution.sender, reason, number)

    def _count_and_strike(self, owner: bytes, reason: str, round_number: int | None) -> None:
        self.counts.rejected[reason] += 1
        self._strike(owner, reason, round_number)

    def mean(self, tensor: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
        message = DenseCodec(32, zstd=False).encode(tensor.detach().float().cpu()).SerializeToString()
        contributions = self.gather(struct.pack("<d", weight) + message, samples=0)
        limits = DecodeLimits(max_numel=max(tensor.numel(), 1))
        total, result = 0.0, torch.zeros_like(tensor, dtype=torch.float32)
        for contribution in contributions:  # peer-id order: the same float sums everywhere
            try:
                other_weight, other = self._decode_mean_part(contribution.payload, tensor.shape, limits)
            except MalformedPayloadError as error:
                self.counts.rejected[error.reason] += 1
                continue
            result.add_(other.to(result.device), alpha=other_weight)
            total += other_weight
        return (result / max(total, 1e-30)).to(tensor.dtype)

    @staticmethod
    def _decode_mean_part(data: bytes, shape: torch.Size, limits: DecodeLimits) -> tuple[float, torch.Tensor]:
        if len(data) < 8:
            raise MalformedPayloadError("unparsable", "mean contribution shorter than its weight")
        (weight,) = struct.unpack("<d", data[:8])
        if not (math.isfinite(weight) and weight >= 0):
            raise MalformedPayloadError("bad_samples", f"weight {weight}")
        message = parse_message(EncodedTensor, data[8:], max_bytes=len(data))
        tensor = decode_tensor(message, limits=limits)
        if tensor.shape != shape:
            raise MalformedPayloadError(
                "wrong_structure", f"shape {list(tensor.shape)}, expected {list(shape)}"
            )
        return weight, tensor

    def close(self, drain: timedelta = timedelta(0)) -> bool:
        """Removes the handlers, closes this process's P2P replica and stops the loop thread.

        With `drain`, first goes on serving, for at most that long, until every other participant of
        the last round has pulled this peer's payload of it (a butterfly round: its mean, and pieces
        until none was asked for in PARTS_QUIET_S): a peer that leaves right after its last round
        would otherwise leave a slower one without it (that one's round would miss a payload and its
        parameters would differ). Returns whether all of them had it (True without drain)."""
        if not self._thread.is_alive():
            return True
        drained = drain <= timedelta(0) or self._call(self._drain(time.monotonic() + drain.total_seconds()))
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        return drained

    def __enter__(self) -> "SwarmExchange":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- on the loop thread ---

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _start(self, max_concurrent_fetches: int):
        p2p = await self.dht.replicate_p2p()
        self._channel_server = ChannelServer(
            self._serve, p2p.peer_id, self._channel_handler, self.fetch_timeout_s, self.counts.rejected
        )
        self._puller = Puller(
            p2p,
            channels=Channels(p2p, self._channel_handler, self.fetch_timeout_s),
            state_handler=self._state_handler,
            owner=self.owner,
            timeout_s=self.fetch_timeout_s,
            max_concurrent=max_concurrent_fetches,
            strike=self._strike,
            received=self.counts.received,
            rejected=self.counts.rejected,
        )
        await p2p.add_binary_stream_handler(self._channel_handler, self._channel_server.handle)
        # a payload also goes to a one-off stream (hivemind's own clients can ask for it so)
        await p2p.add_protobuf_handler(self._handler, self._serve, PayloadRequest, stream_output=True)
        await p2p.add_protobuf_handler(
            self._state_handler, self._serve_state, StateRequest, stream_output=True
        )
        await p2p.add_protobuf_handler(
            self._probe_handler, self._serve_probe, ProbeRequest, stream_output=True
        )
        # the record goes out before the first round, so that the others count this peer in their
        # data slots (and `shoal status` lists it) while it computes
        await self._store_record(self.schedule.round_at(time.time()))
        return p2p

    async def _store_record(self, round_number: int, *, refresh_s: float = 0.0) -> None:
        """Writes this peer's record, unless the last write is less than `refresh_s` old. It outlives
        the next write by three rounds: under a coordinator, that may be `RECORD_REFRESH_S` away."""
        now = time.time()
        if now - self.record.updated < refresh_s:
            return
        self.record = self.record.copy(update={"round": round_number, "updated": now})
        next_write = now + (RECORD_REFRESH_S if self.coordinator is not None else 0.0)
        expires = max(self.schedule.deadline(round_number), next_write) + 3 * self.schedule.round_seconds
        await self._store(peers_key(self.run), self.record.dict(), expires)

    async def _store(self, key: str, value: dict, expiration: float) -> None:
        """Stores `value` under this peer's subkey, counting its serialized bytes."""
        self.counts.sent["dht"] += len(key) + len(self.owner) + len(MSGPackSerializer.dumps(value))
        self.counts.dht_stores += 1
        await self.dht.store(key, value, expiration, subkey=self.owner, return_future=True)

    async def _get(self, key: str):
        """The latest value under `key`, counting the serialized bytes of what came back."""
        found = await self.dht.get(key, latest=True, return_future=True)
        if found is not None and isinstance(found.value, dict):
            self.counts.received["dht"] += sum(
                len(MSGPackSerializer.dumps(getattr(entry, "value", None))) + len(subkey)
                for subkey, entry in found.value.items()
                if isinstance(subkey, bytes)
            )
        return found

    async def _drain(self, until: float) -> bool:
        """Until every other participant of the last round pulled this peer's payload (a butterfly
        round: its mean), and, where pieces of its payload were served lately, PARTS_QUIET_S without
        one: a peer averaging a lost owner's piece from the parts (`_recompute`) asks for them after
        the means, and one that found this peer gone while another got its part would end the round
        on other parameters."""
        while not (
            self._expected_pullers <= self._pullers
            and time.monotonic() - self._part_served_at >= PARTS_QUIET_S
        ):
            if time.monotonic() >= until:
                missing = len(self._expected_pullers - self._pullers)
                if missing:
                    logger.warning(f"leaving before {missing} peer(s) pulled this peer's last payload")
                return missing == 0  # pieces may still be asked for (also by a peer that never stops)
            await asyncio.sleep(0.05)
        return True

    async def _stop(self) -> None:
        if self.coordinator is not None and self.coordinator.started:
            await self.coordinator.stop()
        await self._p2p.remove_binary_stream_handler(self._channel_handler)
        self._channel_server.close()
        self._puller.channels.close()
        await self._p2p.remove_protobuf_handler(self._handler, stream_output=True)
        await self._p2p.remove_protobuf_handler(self._state_handler, stream_output=True)
        await self._p2p.remove_protobuf_handler(self._probe_handler, stream_output=True)
        await self._p2p.shutdown()

    async def _serve_state(self, request: StateRequest, _context):
        snapshot = self._states.get(request.state)
        if snapshot is not None:
            for chunk in chunks(snapshot.manifest if request.manifest else snapshot.chunk(request.chunk)):
                self.counts.sent["state"] += len(chunk.data)
                yield chunk

    async def _serve_probe(self, request: ProbeRequest, context):
        """Zeros for a bandwidth measurement, rate-limited per asking peer (not an amplifier)."""
        now = time.monotonic()
        if now - self._probed.get(context.remote_id, -math.inf) < PROBE_INTERVAL_S:
            self.counts.rejected["probe_rate"] += 1
            return
        if len(self._probed) > 1024:
            self._probed = {p: t for p, t in self._probed.items() if now - t < PROBE_INTERVAL_S}
        self._probed[context.remote_id] = now
        for chunk in chunks(bytes(min(request.size, PROBE_MAX_BYTES))):
            self.counts.sent["probe"] += len(chunk.data)
            yield chunk

    def _strike(self, owner: bytes, reason: str, round_number: int | None) -> None:
        """A strike for what `owner` sent in `round_number`; the ban that the last strike brings lasts
        `ban_rounds` from that round, not from wherever this peer is now, so that peers that struck
        for the same rounds lift the ban in the same round (a peer that lifted it a round earlier would
        take a payload the others ignore, and end a run on another model)."""
        if not owner or owner == self.owner:
            return
        self.strikes[owner] += 1
        self.counts.strikes_total += 1
        if self.strikes[owner] >= self.strike_limit:
            until = (round_number if round_number is not None else self.last_round or 0) + 1 + self.ban_rounds
            logger.warning(
                f"ignoring a peer for {self.ban_rounds} rounds after {self.strikes[owner]} strikes"
            )
            self.banned[owner] = until
            del self.strikes[owner]

    async def _serve(self, request: PayloadRequest, context):
        key = (request.round, request.digest)
        if request.shards:
            data = await self._piece(request, context)
        else:
            data = self._held.get(key, b"")
            if key == self._mine and context.remote_id is not None:
                self._pullers.add(context.remote_id.to_base58())
        for chunk in chunks(data):
            self.counts.sent["payload"] += len(chunk.data)
            yield chunk

    async def _round(
        self,
        round_number: int,
        payload: bytes,
        samples: int,
        snapshot: tuple[StateSnapshot, list[torch.Tensor]] | None,
    ) -> list[Contribution]:
        mine = await self._hold(round_number, payload, samples, snapshot)
        announced, compatible = await self._collect(round_number, mine, self.schedule.deadline(round_number))
        self._members = sorted(compatible)
        held = sum((round_number, a.digest) in self._held for a in announced.values())
        self._count_stragglers(len(compatible | {self.owner}), held)
        return await self._settle(round_number, announced, mine, snapshot)

    async def _piece(self, request: PayloadRequest, context) -> bytes:
        """In a butterfly round (shoal.peer.algorithms.butterfly): a piece of this peer's payload, cut on
        request, or (`reduced`) this peer's mean of the piece it owns, once it has it. Empty if it has
        neither."""
        if not request.shard < request.shards <= MAX_PIECES:
            self.counts.rejected["bad_request"] += 1
            return b""
        if request.reduced:
            key = (request.round, request.shard)
            if key not in self._means and self._mine is not None and request.round == self._mine[0]:
                event = self._mean_ready.setdefault(key, asyncio.Event())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), MEAN_WAIT_S)
            data = self._means.get(key, b"")
            if data and context.remote_id is not None:
                self._pullers.add(context.remote_id.to_base58())
            return data
        if self._cuttable.get(request.round) != request.digest:
            return b""
        pieces = self._cut(request.round, request.shards, limited=True)
        if pieces is None:
            self.counts.rejected["bad_request"] += 1
            return b""
        self._part_served_at = time.monotonic()
        return pieces[request.shard]

    def _cut(self, round_number: int, count: int, *, limited: bool = False) -> list[bytes] | None:
        """The `count` pieces of this peer's payload of a butterfly round, cut once. `limited` (another
        peer asks): None for a count past the first MAX_CUT_COUNTS, as each costs a pass over the
        payload; the round's own count, which this peer cuts once it is decided, is never refused."""
        key = (round_number, count)
        if key not in self._cuts:
            if limited and sum(r == round_number for r, _ in self._cuts) >= MAX_CUT_COUNTS:
                return None
            own = parse_message(
                Payload,
                self._held[(round_number, self._cuttable[round_number])],
                max_bytes=self.max_payload_bytes,
            )
            self._cuts[key] = cut(own, count)
        return self._cuts[key]

    def _cuttable_from(self, round_number: int, digest: bytes) -> None:
        """This peer's payload of `round_number` may be served in pieces from now; so may the last
        round's still (a peer averaging a late owner's piece may ask for them), no older one."""
        self._cuttable = {r: d for r, d in self._cuttable.items() if r == round_number - 1}
        self._cuttable[round_number] = digest
        self._cuts = {key: pieces for key, pieces in self._cuts.items() if key[0] in self._cuttable}

    def _count_stragglers(self, expected: int, participants: int) -> None:
        self.counts.peers_seen = expected
        self.counts.round_stragglers = max(0, expected - participants)
        self.counts.stragglers += self.counts.round_stragglers

    async def _hold(
        self,
        round_number: int,
        payload: bytes,
        samples: int,
        snapshot: tuple[StateSnapshot, list[torch.Tensor]] | None,
        *,
        coordinated: bool = False,
    ) -> Announcement:
        """Serves this peer's payload (and state snapshot) for the round and, uncoordinated, announces
        it in the DHT. A coordinator is told of it instead (`CoordinatedRounds.round`), and the record is
        then only kept alive: it serves `shoal status` and the fallback's data slots, and rewriting it
        and an announcement every round was most of a small payload's wire traffic (BENCHMARKS.md)."""
        digest = hashlib.sha256(payload).digest()
        state = b""
        if snapshot is not None:
            state = snapshot[0].digest
            self._states[state] = snapshot[0]
            for old in list(self._states)[: -self.keep_states]:
                del self._states[old]
        self._held[(round_number, digest)] = payload
        self._mine, self._pullers, self._expected_pullers = (round_number, digest), set(), set()
        for key in [k for k in self._held if k[0] < round_number - 1]:  # keep the last round for late pullers
            del self._held[key]
        for seen in (self._seen, self._seen_content):
            for key in [k for k, first_round in seen.items() if first_round < round_number - 16]:
                del seen[key]
        self._puller.refused_by_author = {
            k for k in self._puller.refused_by_author if k[0] >= round_number - 1
        }
        self.banned = {owner: until for owner, until in self.banned.items() if until > round_number}
        await self._store_record(round_number, refresh_s=RECORD_REFRESH_S if coordinated else 0.0)
        if (
            self._rejoin
            and self.counts.peers_seen <= 1
            and time.monotonic() - self._rejoined_at >= REJOIN_EVERY_S
        ):
            self._rejoined_at = time.monotonic()
            self.counts.rejoins += 1
            self.dht.run_coroutine(functools.partial(_ping_again, self._rejoin), return_future=True)
        mine = Announcement(self.owner, self.peer_id, digest, len(payload), samples, state, self.synced)
        if not coordinated:
            await self._announce(round_number, mine)
        self._seen.setdefault(digest, round_number)
        return mine

    async def _announce(self, round_number: int, mine: Announcement) -> None:
        key = round_key(self.run, round_number)
        await self._store(key, mine.value(), self.schedule.deadline(round_number) + 60)

    async def _collect(
        self, round_number: int, mine: Announcement, deadline: float
    ) -> tuple[dict[bytes, Announcement], set[bytes]]:
        """Uncoordinated: until `deadline`, the announcements of compatible peers in the DHT and their
        payloads. Returns (the announcements taken, the compatible peers)."""
        key = round_key(self.run, round_number)
        announced = {self.owner: mine}
        announced_at: dict[bytes, float] = {}
        ignored: set[bytes] = set()
        fetches: dict[bytes, asyncio.Task] = {}
        compatible: set[bytes] = set()
        while True:
            # DHT reads are most of the wire overhead (BENCHMARKS.md): once every compatible peer's payload
            # is in, only the peer list is re-read (once per `records_interval`), to notice a newcomer
            waiting = not compatible <= announced.keys() | ignored
            if waiting or not all(task.done() for task in fetches.values()) or not compatible:
                compatible = await self._compatible_peers()
            else:
                await asyncio.sleep(min(self.records_interval_s, max(0.0, deadline - time.time())))
                if time.time() >= deadline:
                    break
                compatible = await self._compatible_peers()
                if compatible <= announced.keys() | ignored:
                    continue
            for owner, announcement in await self._announcements(key):
                # compatible owners come from schema-checked records: signed public-key subkeys
                if owner not in compatible or owner in announced or owner in ignored:
                    continue
                if isinstance(announcement, MalformedPayloadError):
                    reason = "banned" if owner in self.banned else announcement.reason
                else:
                    reason = self._refusal(round_number, announcement)
                if reason is not None:
                    ignored.add(owner)
                    self.counts.rejected[reason] += 1
                    if reason != "banned":
                        self._strike(owner, reason, round_number)
                    continue
                announced[owner] = announcement
                announced_at[owner] = time.time()
                if (round_number, announcement.digest) not in self._held:
                    fetches[owner] = asyncio.create_task(self._fetch(round_number, announcement, announced))
            remaining = deadline - time.time()
            if remaining <= 0:
                break
            await asyncio.sleep(min(self.poll_interval_s, remaining))
        for owner, task in fetches.items():
            if not task.done():
                self._unserved(round_number, announced[owner], since=announced_at[owner], deadline=deadline)
        await abandon(list(fetches.values()))
        return announced, compatible

    def _unserved(
        self, round_number: int, announcement: Announcement, *, since: float, deadline: float
    ) -> None:
        """A payload nobody could pull by the deadline strikes its author if the author said it held
        nothing, or if it was announced a whole `fetch_timeout` before the deadline: announcing without
        serving would otherwise cost nothing, and every peer would wait on it, round after round."""
        refused = (round_number, announcement.digest) in self._puller.refused_by_author
        if refused or deadline - since >= self.fetch_timeout_s:
            self.counts.rejected["unserved"] += 1
            self._strike(announcement.owner, "unserved", round_number)

    async def _settle(
        self,
        round_number: int,
        announced: dict[bytes, Announcement],
        mine: Announcement,
        snapshot: tuple[StateSnapshot, list[torch.Tensor]] | None,
    ) -> list[Contribution]:
        """The round's contributions from the payloads held, in key order: one per distinct payload, only
        those computed on the majority's state (this peer re-syncs to it if its own differs)."""
        held = [owner for owner, a in announced.items() if (round_number, a.digest) in self._held]
        held = await self._agree({owner: announced[owner] for owner in held}, mine, snapshot)
        self._expected_pullers = {a.peer for owner, a in announced.items() if owner != mine.owner}
        return [
            Contribution(
                rank,
                self._held[(round_number, announced[owner].digest)],
                announced[owner].samples,
                sender=owner,
                round=round_number,
            )
            for rank, owner in enumerate(held)
        ]

    async def _agree(
        self,
        announced: dict[bytes, Announcement],
        mine: Announcement,
        snapshot: tuple[StateSnapshot, list[torch.Tensor]] | None,
    ) -> list[bytes]:
        """The owners of `announced` whose contributions count, in key order: one per distinct payload,
        only those computed on the majority's state (this peer re-syncs to it if its own differs)."""
        held = sorted(announced)
        # a payload announced by several peers counts once, for the smallest key (no strike: copying an
        # announcement is free, so the copier cannot be told from the author)
        first_owner = {}
        for owner in held:
            first_owner.setdefault(announced[owner].digest, owner)
        copies = [owner for owner in held if first_owner[announced[owner].digest] != owner]
        if copies:
            self.counts.rejected["duplicate"] += len(copies)
            held = [owner for owner in held if owner not in copies]
        if snapshot is not None and held:  # (a coordinated round may have no participant at all)
            agreed = majority({owner: (announced[owner].state, announced[owner].synced) for owner in held})
            stale = [owner for owner in held if announced[owner].state != agreed and owner != mine.owner]
            if stale:
                self.counts.rejected["stale_state"] += len(stale)
            if agreed != mine.state:
                stale.append(mine.owner)
                sources = [
                    announced[o].peer for o in held if announced[o].state == agreed and o != mine.owner
                ]
                self._adopted = await self._resync(agreed, sources, snapshot[1])
            self.synced = agreed == mine.state or self._adopted is not None
            held = [owner for owner in held if owner not in stale]
        self._participants, self._me = held, mine.owner
        return held

    async def _slot(self) -> tuple[int, int]:
        """(this peer's place, count) among the compatible peers, ordered by public key, as last seen:
        its data slice in an uncoordinated round (shoal.peer.data.RoundSlices)."""
        members = self._members or sorted(await self._compatible_peers())
        members = sorted(set(members) | {self.owner})
        return members.index(self.owner), len(members)

    def _refusal(self, round_number: int, announcement: Announcement) -> str | None:
        """Why an announcement of a compatible peer is not taken (None: it is)."""
        if announcement.owner in self.banned:
            return "banned"
        return "replayed" if self._seen.setdefault(announcement.digest, round_number) < round_number else None

    async def _resync(self, digest: bytes, sources: list[str], like: list[torch.Tensor]) -> list | None:
        """The majority's state, pulled from `sources`; None (counted) if it could not be had."""
        started = time.perf_counter()
        try:
            _, data = await download(
                digest,
                sources,
                self._puller.state_piece,
                expected_size=state_size(like),
                transient=(P2PDaemonError, P2PHandlerError),
                rejected=self.counts.rejected,
            )
            adopted = restore(data, like)
        except (StateUnavailable, MalformedPayloadError) as error:
            self.counts.rejected["resync_failed"] += 1
            logger.warning(f"could not re-sync with the swarm's state: {error}")
            return None
        self.counts.resyncs += 1
        self.counts.received["state"] += len(data)
        elapsed = time.perf_counter() - started
        logger.info(f"re-synced {len(data)} bytes of state from {len(sources)} peers in {elapsed:.1f} s")
        return adopted

    async def _compatible_peers(self) -> set[bytes]:
        """Public-key subkeys of the peers whose current record is compatible with this one's."""
        records, malformed = peer_records(await self._get(peers_key(self.run)))
        if malformed:
            self.counts.rejected["bad_record"] += malformed
        compatible = {self.owner}
        self.coordinators = {}
        for owner, record in records.items():
            reason = incompatibility(self.record, record)
            if reason is None:
                compatible.add(owner)
                if owner != self.owner and ADDRESS.fullmatch(record.coordinator):
                    self.coordinators[owner] = record.coordinator
            elif record.peer_id not in self.refused:
                self.refused[record.peer_id] = reason
                logger.warning(f"refusing peer {record.peer_id}: {reason}")
        return compatible

    async def _announcements(self, key: str) -> list[tuple[object, Announcement | MalformedPayloadError]]:
        """(subkey, its announcement or why it is malformed) for every entry under `key`."""
        found = await self._get(key)
        if found is None or not isinstance(found.value, dict):
            return []
        announcements = []
        for owner, entry in found.value.items():
            try:
                announcements.append(
                    (owner, Announcement.parse(owner, getattr(entry, "value", None), self.max_payload_bytes))
                )
            except MalformedPayloadError as error:
                announcements.append((owner, error))
        return announcements

    async def _fetch(
        self, round_number: int, announcement: Announcement, holders: Mapping[bytes, Announcement]
    ) -> None:
        """Pulls one payload into `_held` (shoal.peer.swarm.pull), until it is had or the round's task
        is cancelled."""
        data = await self._puller.payload(round_number, announcement, holders)
        content = content_digest(data)
        if content is not None and self._seen_content.setdefault(content, round_number) < round_number:
            # an earlier round's payload, re-encoded (an unknown field appended, fields reordered):
            # its digest is new, its content is not
            self.counts.rejected["replayed"] += 1
            self._strike(announcement.owner, "replayed", round_number)
            return
        self._held[(round_number, announcement.digest)] = data


def _first_record(
    peer_id: str,
    config: Mapping[str, str],
    device: str,
    schedule: RoundSchedule,
    coordinator: CoordinatorLink | None,
) -> PeerRecord:
    """This peer's record before its first round: who it is, what it runs, on what clock."""
    return PeerRecord(
        peer_id=peer_id,
        version=SHOAL_VERSION,
        run_hash=run_hash(config),
        config=dict(config),
        device=device,
        throughput=0.0,
        round=0,
        start_time=float(schedule.start_time),
        round_seconds=float(schedule.round_seconds),
        coordinator=coordinator.address[:256] if coordinator is not None else "",
    )


def content_digest(data: bytes) -> bytes | None:
    """SHA-256 of a payload's canonical form (unknown fields dropped, deterministic serialization):
    the same for every encoding of the same tensors. None when `data` is no Payload of tensors (a
    `mean`'s part): nothing to compare."""
    message = Payload()
    try:
        message.ParseFromString(data)
    except DecodeError:
        return None
    message.DiscardUnknownFields()
    if not message.tensors:
        return None
    return hashlib.sha256(message.SerializeToString(deterministic=True)).digest()


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
