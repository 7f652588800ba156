"""PayloadServer: what a peer serves its swarm (a part of SwarmExchange, shoal.peer.swarm.exchange).

- Its payloads, and those it pulled, of its last `KEEP_STEPS` rounds (`held`): on payload channels
  (shoal.peer.swarm.channels) and on one-off streams, for hivemind's own clients. An empty answer
  means "I do not hold it". The older rounds' serve peers that catch up by replay
  (shoal.peer.swarm.replay), with the steps that led to its recent states (`steps`).
- In a butterfly round (shoal.peer.algorithms.butterfly), on request: a piece of its own payload
  (cut once per piece count, at most MAX_CUT_COUNTS counts per round), and the mean of the piece it
  owns (`reduced`), once it has it (a request waits MEAN_WAIT_S for it).
- The snapshots of its shared state of the last rounds (`states`), to peers that join or re-sync.
- Zeros for a bandwidth probe (`shoal check`), capped and rate-limited per asking peer.
- The name of its run (`shoal.run`, run-independent: `ask_runs`), for a joining peer that found none
  of its own run; a question for another run is counted (`other_run`).

It also keeps who pulled this peer's last payload (`pullers`), so that a peer leaving after its last
round can wait until every other participant has it, or a relay that keeps it for them, and until the
payloads of others it re-serves are no longer asked for (`drain`).

Everything here runs on the exchange's event loop thread. A test that plays a hostile peer subclasses
it and sets its class as the `server_type` of its SwarmExchange.
"""

import asyncio
import contextlib
import functools
import hashlib
import math
import time
from collections.abc import Mapping, Sequence

from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.utils.logging import get_logger

from shoal.peer.algorithms.butterfly import cut
from shoal.peer.swarm.channels import ChannelServer
from shoal.peer.swarm.counters import SwarmCounters
from shoal.peer.swarm.names import RUN_HANDLER, check_run_name, handler
from shoal.peer.swarm.pull import chunks
from shoal.peer.swarm.records import Announcement
from shoal.peer.swarm.replay import KEEP_STEPS, Steps, encode
from shoal.peer.swarm.state import StateSnapshot, Tally
from shoal.protocol import Payload, parse_message
from shoal.protocol.swarm_pb2 import PayloadRequest, ProbeRequest, RunReply, RunRequest, StateRequest

logger = get_logger(__name__)

PROBE_MAX_BYTES = 8 << 20  # a bandwidth probe (`shoal check`) gets at most this much ...
PROBE_INTERVAL_S = 10.0  # ... and at most once per this many seconds per asking peer
MAX_PIECES = 4096  # a butterfly round has at most this many pieces (one per participant)
MAX_CUT_COUNTS = 2  # ways a peer cuts one payload into pieces (honest peers agree on one count)
MEAN_WAIT_S = 0.25  # a request for a mean its owner has not finished waits at most this long for it
PARTS_QUIET_S = 1.0  # a leaving peer drains until this long has passed since it last served a piece
RESERVED_QUIET_S = 2.0  # ... and since it last served another's payload of its last round (re-serving)


class PayloadServer:
    """See the module docstring.

    Args:
        run: the run's name; namespaces the handlers (shoal.peer.swarm.names.handler).
        counts: the exchange's counters (bytes sent, rejected requests).
        max_payload_bytes: the largest payload this peer holds (its own is parsed again to be cut).
        keep_states: state snapshots of the last rounds kept.
        timeout_s: limit of one request on a payload channel.
    """

    def __init__(
        self, *, run: str, counts: SwarmCounters, max_payload_bytes: int, keep_states: int, timeout_s: float
    ):
        self.counts, self.max_payload_bytes = counts, max_payload_bytes
        self.keep_states, self.timeout_s = keep_states, timeout_s
        self.run = run
        self.held: dict[tuple[int, bytes], bytes] = {}
        """(round, digest): payload, this peer's and those it pulled, of its last KEEP_STEPS rounds."""
        self.steps = Steps()
        """The steps that led to its recent states, for peers that replay them."""
        self.states: dict[bytes, StateSnapshot] = {}
        self.mine: tuple[int, bytes] | None = None
        """(round, digest) of this peer's last payload."""
        self.pullers: set[str] = set()
        """The peers that pulled this peer's last payload (a butterfly round: its mean)."""
        self.expected_pullers: set[str] = set()
        """The other participants of the last round, where they are known by name ..."""
        self.expected_pulls = 0
        """... and how many there are (a coordinator's `--gather` result names only the chosen)."""
        self.relays: set[str] = set()
        """The relays this peer is reached through (shoal.peer.swarm.relay): one that pulled its payload
        keeps it for every other peer."""
        self.means: dict[tuple[int, int], bytes] = {}  # (round, piece): this peer's mean of its piece
        self._mean_ready: dict[tuple[int, int], asyncio.Event] = {}
        self._cuttable: dict[int, bytes] = {}  # round: digest of its payloads it serves in pieces
        self._cuts: dict[tuple[int, int], list[bytes]] = {}  # (round, count): the pieces, as served
        self._part_served_at = -math.inf  # monotonic time this peer last served a piece of its payload
        self._reserved_at = -math.inf  # ... and another's payload of its last round
        self._probed: dict[PeerID, float] = {}  # asking peer: monotonic time of its last probe
        self._channels: ChannelServer | None = None

    @property
    def channel_handler(self) -> str:
        """The handler its payload channels are opened on (shoal.peer.swarm.channels)."""
        return handler(self.run, "payloads")

    async def start(self, p2p: P2P) -> None:
        self._channels = ChannelServer(
            self.serve, p2p.peer_id, self.channel_handler, self.timeout_s, self.counts.rejected
        )
        await p2p.add_binary_stream_handler(self.channel_handler, self._channels.handle)
        served = (("payload", self.serve, PayloadRequest), ("state", self.serve_state, StateRequest))
        for kind, serve, request in (*served, ("probe", self.serve_probe, ProbeRequest)):
            await p2p.add_protobuf_handler(handler(self.run, kind), serve, request, stream_output=True)
        await p2p.add_protobuf_handler(RUN_HANDLER, self.serve_run, RunRequest)

    async def stop(self, p2p: P2P, *, unregister: bool = True) -> None:
        """Closes the open channels and, with `unregister`, removes the handlers from the daemon."""
        if unregister:
            await p2p.remove_binary_stream_handler(self.channel_handler)
        if self._channels is not None:
            self._channels.close()
        if unregister:
            for kind in ("payload", "state", "probe"):
                await p2p.remove_protobuf_handler(handler(self.run, kind), stream_output=True)
            await p2p.remove_protobuf_handler(RUN_HANDLER)

    # --- what is served ---

    def hold(self, round_number: int, payload: bytes, snapshot: StateSnapshot | None) -> bytes:
        """Serves this peer's payload of `round_number` (and its state snapshot) from now, and forgets
        what is older than KEEP_STEPS rounds (kept for late pullers and replays). Returns the payload's
        digest."""
        digest = hashlib.sha256(payload).digest()
        if snapshot is not None:
            self.keep_state(snapshot)
        self.held[(round_number, digest)] = payload
        self.mine, self.pullers = (round_number, digest), set()
        self.expect_pulls(set(), 0)
        for key in [k for k in self.held if k[0] < round_number - KEEP_STEPS]:
            del self.held[key]
        return digest

    def keep_state(self, snapshot: StateSnapshot) -> None:
        """Serves `snapshot` to re-syncing peers, with those of the last `keep_states` rounds."""
        self.states[snapshot.digest] = snapshot
        for old in list(self.states)[: -self.keep_states]:
            del self.states[old]

    def holds(self, round_number: int, digest: bytes) -> bool:
        return (round_number, digest) in self.held

    def cuttable_from(self, round_number: int, digest: bytes) -> None:
        """This peer's payload of `round_number` may be served in pieces from now; so may the last
        round's still (a peer averaging a late owner's piece may ask for them), no older one."""
        self._cuttable = {r: d for r, d in self._cuttable.items() if r == round_number - 1}
        self._cuttable[round_number] = digest
        self._cuts = {key: pieces for key, pieces in self._cuts.items() if key[0] in self._cuttable}

    def cut(self, round_number: int, count: int, *, limited: bool = False) -> list[bytes] | None:
        """The `count` pieces of this peer's payload of a butterfly round, cut once. `limited` (another
        peer asks): None for a count past the first MAX_CUT_COUNTS, as each costs a pass over the
        payload; the round's own count, which this peer cuts once it is decided, is never refused."""
        key = (round_number, count)
        if key not in self._cuts:
            if limited and sum(r == round_number for r, _ in self._cuts) >= MAX_CUT_COUNTS:
                return None
            own = parse_message(
                Payload,
                self.held[(round_number, self._cuttable[round_number])],
                max_bytes=self.max_payload_bytes,
            )
            self._cuts[key] = cut(own, count)
        return self._cuts[key]

    def averaging(self, round_number: int) -> None:
        """A butterfly round starts: means older than the last round's are dropped, and nobody has
        pulled this round's yet."""
        for old in [key for key in self.means if key[0] < round_number - 1]:
            del self.means[old]
        for old in [key for key in self._mean_ready if key[0] < round_number]:
            del self._mean_ready[old]
        self.pullers = set()
        self.expect_pulls(set(), 0)

    def publish_mean(self, round_number: int, piece: int, data: bytes, expected_pullers: set[str]) -> None:
        """Serves this peer's mean of the piece it owns; the other participants will pull it."""
        self.means[(round_number, piece)] = data
        self._mean_ready.setdefault((round_number, piece), asyncio.Event()).set()
        self.expect_pulls(expected_pullers, len(expected_pullers))

    # --- the handlers ---

    async def serve(self, request: PayloadRequest, context: P2PContext):
        key = (request.round, request.digest)
        if request.shards:
            data = await self.piece(request, context)
        else:
            data = self.held.get(key, b"")
            if key == self.mine and context.remote_id is not None:
                self.pullers.add(context.remote_id.to_base58())
            elif data and self.mine is not None and request.round == self.mine[0]:
                self._reserved_at = time.monotonic()
        for chunk in chunks(data):
            self.counts.sent["payload"] += len(chunk.data)
            yield chunk

    async def piece(self, request: PayloadRequest, context: P2PContext) -> bytes:
        """In a butterfly round: a piece of this peer's payload, cut on request, or (`reduced`) this
        peer's mean of the piece it owns, once it has it. Empty if it has neither."""
        if not request.shard < request.shards <= MAX_PIECES:
            self.counts.rejected["bad_request"] += 1
            return b""
        if request.reduced:
            key = (request.round, request.shard)
            if key not in self.means and self.mine is not None and request.round == self.mine[0]:
                event = self._mean_ready.setdefault(key, asyncio.Event())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), MEAN_WAIT_S)
            data = self.means.get(key, b"")
            if data and context.remote_id is not None:
                self.pullers.add(context.remote_id.to_base58())
            return data
        if self._cuttable.get(request.round) != request.digest:
            return b""
        pieces = self.cut(request.round, request.shards, limited=True)
        if pieces is None:
            self.counts.rejected["bad_request"] += 1
            return b""
        self._part_served_at = time.monotonic()
        return pieces[request.shard]

    async def serve_state(self, request: StateRequest, _context: P2PContext):
        if request.steps:
            for chunk in chunks(encode(self.steps.chain(request.state)) if request.state else b""):
                self.counts.sent["replay"] += len(chunk.data)
                yield chunk
            return
        snapshot = self.states.get(request.state)
        if snapshot is not None:
            for chunk in chunks(snapshot.manifest if request.manifest else snapshot.chunk(request.chunk)):
                self.counts.sent["state"] += len(chunk.data)
                yield chunk

    async def serve_run(self, request: RunRequest, _context: P2PContext) -> RunReply:
        """The run this peer trains; a peer that looks for another one is counted (`other_run`)."""
        if request.run[:64] != self.run:
            self.counts.rejected["other_run"] += 1
        return RunReply(run=self.run)

    async def serve_probe(self, request: ProbeRequest, context: P2PContext):
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

    async def drain(self, until: float) -> bool:
        """Serves until every other participant of the last round pulled this peer's payload (a
        butterfly round: its mean), and, where pieces of its payload were served lately, PARTS_QUIET_S
        without one: a peer averaging a lost owner's piece from the parts asks for them after the
        means, and one that found this peer gone while another got its part would end the round on
        other parameters. Likewise RESERVED_QUIET_S without a request for another's payload of the
        last round that it re-serves (peers that cannot dial that payload's author may depend on it).
        At most until the monotonic time `until`; returns whether all of them had its own."""
        while not (
            (self._missing_pulls() == 0 or self.pullers & self.relays)
            and time.monotonic() - self._part_served_at >= PARTS_QUIET_S
            and time.monotonic() - self._reserved_at >= RESERVED_QUIET_S
        ):
            if time.monotonic() >= until:
                missing = self._missing_pulls()
                if missing:
                    logger.warning(f"leaving before {missing} peer(s) pulled this peer's last payload")
                return missing == 0  # pieces may still be asked for (also by a peer that never stops)
            await asyncio.sleep(0.05)
        return True

    def expect_pulls(self, named: set[str], count: int) -> None:
        """Who will pull this peer's payload of its last round (`round_pullers`), for `drain`."""
        self.expected_pullers, self.expected_pulls = named, count

    def _missing_pulls(self) -> int:
        """How many of the last round's other participants have not pulled this peer's payload (mean)."""
        return max(len(self.expected_pullers - self.pullers), self.expected_pulls - len(self.pullers))


def round_pullers(
    owner: bytes, counted: Mapping[bytes, Announcement], voters: Mapping[bytes, Announcement] | Tally | None
) -> tuple[set[str], int]:
    """Who will pull a peer's payload of a round (its drain waits for them): nobody if it does not count
    (`counted`: the owners whose payloads count); else every other peer of the round, since each pulls
    every payload that counts, not only the other counted ones (`--gather`). Named where their
    announcements are known (`voters`, or `counted` when every payload counts), counted where a
    coordinator's tally stands for them. Returns (peer ids, how many)."""
    if owner not in counted:
        return set(), 0
    everyone = voters if isinstance(voters, Mapping) else counted
    named = {a.peer for other, a in everyone.items() if other != owner}
    voted = sum(voters.votes.values()) - 1 if isinstance(voters, Tally) else 0
    return named, max(len(named), voted)


def ask_runs(dht, peers: Sequence[str], run: str, timeout_s: float = 5.0) -> dict[str, str]:
    """The run each of `peers` (multiaddresses with /p2p/) trains, for those that answered (`shoal.run`;
    a DHT node that trains nothing has no such handler), asked by a peer that looks for `run`."""
    ids = tuple(dict.fromkeys(peer.rpartition("/p2p/")[2] for peer in peers if "/p2p/" in peer))
    return dht.run_coroutine(functools.partial(_ask_runs, ids, run, timeout_s)) if ids else {}


async def _ask_runs(ids: tuple[str, ...], run: str, timeout_s: float, _dht, node) -> dict[str, str]:
    async def ask(peer: str) -> tuple[str, str]:
        reply = await node.p2p.call_protobuf_handler(
            PeerID.from_base58(peer), RUN_HANDLER, RunRequest(run=run), RunReply
        )
        return peer, check_run_name(reply.run[:64])

    outcomes = await asyncio.gather(
        *(asyncio.wait_for(ask(peer), timeout_s) for peer in ids), return_exceptions=True
    )
    return dict(outcome for outcome in outcomes if isinstance(outcome, tuple))
