"""Relaying for peers behind a home NAT, as `shoal bootstrap` offers it (shoal-level, over libp2p).

A peer behind a NAT cannot be dialed: another peer behind another NAT that asks for its payload gets
"routing: not found" at once. It can dial out, though, and it keeps a connection to the bootstrap node
it joined through. The relay uses that connection the other way:

- `RelayRequest` (handler `shoal.relay`): a peer asks the relay for what another peer serves (a
  round's payload, a piece of a butterfly round, a piece of a shared state); the relay opens a stream
  to that peer over the connection it keeps, and streams the answer back. A whole payload whose bytes
  match the digest asked for is kept (`cache_bytes` in all, oldest dropped first) and served to the
  next peers that ask, so that the peer behind the NAT uploads it once, not once per peer.
- `ReachRequest` (handler `shoal.reach`): the relay tells a peer whether it can be dialed, by trying a
  TCP connection to the ports it names at the address its connection comes from, and no other address
  (the relay cannot be used to knock on anyone else's ports).

Why not libp2p's circuit relay: circuit relay v2, the one hivemind's p2pd speaks, limits a relayed
connection to 2 minutes and 128 KiB by default (a limited, "transient" connection, meant for hole
punching), and peers behind two NATs did not reach each other through it in the namespace test
(docs/ARCHITECTURE.md, "Peers behind NAT").

Untrusted input: every request is bounded (run name, peer id, sizes), each asking peer may have at
most MAX_STREAMS_PER_PEER requests open and RATE_PER_S a second, all at most MAX_STREAMS; the relay
forwards only to peers connected to it (it dials nobody), never more than `max_payload_bytes`; each
refusal is counted by reason (`counts`).
"""

import asyncio
import contextlib
import functools
import hashlib
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import hivemind
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.multiaddr import Multiaddr

from shoal.peer.swarm.names import RUN_NAME, handler
from shoal.peer.swarm.pull import CHUNK_BYTES, RELAY_HANDLER, TRANSIENT, chunks
from shoal.peer.swarm.state import MAX_CHUNK_BYTES
from shoal.protocol.swarm_pb2 import PayloadChunk, ReachReply, ReachRequest, RelayRequest

REACH_HANDLER = "shoal.reach"
MAX_STREAMS = 64  # requests forwarded at once, from everyone
MAX_STREAMS_PER_PEER = 8  # ... and from one asking peer
RATE_PER_S = 20.0  # requests a second one asking peer may make, on average ...
BURST = 40  # ... and at once
REACH_INTERVAL_S = 10.0  # a peer's reachability is checked at most this often
REACH_TIMEOUT_S = 2.0  # for one TCP connection of the check
MAX_REACH_PORTS = 8
CONNECTED_TTL_S = 1.0  # the relay's list of connected peers is read again after this long
MAX_PEER_ID = 128


class RelayServer:
    """See the module docstring. Runs on one event loop; `counts` counts what it did and refused.

    Args:
        max_payload_bytes: the largest answer forwarded (a payload, a piece, a state chunk).
        cache_bytes: payloads kept for the next asking peers, in all.
        timeout_s: limit on each wait for the peer behind the relay.
    """

    def __init__(self, *, max_payload_bytes: int, cache_bytes: int, timeout_s: float = 30.0):
        if max_payload_bytes < 1 or cache_bytes < 0 or not timeout_s > 0:
            raise ValueError("max_payload_bytes must be >= 1, cache_bytes >= 0 and timeout_s > 0")
        self.max_payload_bytes, self.cache_bytes, self.timeout_s = max_payload_bytes, cache_bytes, timeout_s
        self.sent: Counter[str] = Counter()
        """Bytes sent to asking peers, by kind (payload, state, piece)."""
        self.fetched: Counter[str] = Counter()
        """Bytes fetched from the peers behind the relay, by kind."""
        self.streams: Counter[str] = Counter()
        """Requests answered, by kind (payload, state, piece, cached, reach)."""
        self.rejected: Counter[str] = Counter()
        """Requests refused or failed, by reason."""
        self.cache: OrderedDict[tuple[str, int, bytes], bytes] = OrderedDict()
        self.cached_bytes = 0
        self._open: Counter[PeerID] = Counter()
        self._buckets: dict[PeerID, tuple[float, float]] = {}  # peer: (tokens, monotonic time)
        self._reached: dict[PeerID, float] = {}
        self._fetching: dict[tuple[str, int, bytes], asyncio.Future] = {}
        self._connected: tuple[float, dict[PeerID, list[Multiaddr]]] = (-math.inf, {})
        self._p2p: P2P | None = None

    async def start(self, p2p: P2P) -> None:
        self._p2p = p2p
        await p2p.add_protobuf_handler(RELAY_HANDLER, self.relay, RelayRequest, stream_output=True)
        await p2p.add_protobuf_handler(REACH_HANDLER, self.reach, ReachRequest)

    async def stop(self) -> None:
        if self._p2p is not None:
            await self._p2p.remove_protobuf_handler(RELAY_HANDLER, stream_output=True)
            await self._p2p.remove_protobuf_handler(REACH_HANDLER)

    # --- relaying ---

    async def relay(self, request: RelayRequest, context: P2PContext):
        reason = self._admit(context.remote_id)
        if reason is None:
            reason = _check(request)
        if reason is not None:
            self.rejected[reason] += 1
            return
        self._open[context.remote_id] += 1
        try:
            data = await self._answer(request)
        finally:
            self._open[context.remote_id] -= 1
            if not self._open[context.remote_id]:
                del self._open[context.remote_id]
        kind = _kind(request)
        for chunk in chunks(data):
            self.sent[kind] += len(chunk.data)
            yield chunk

    async def _answer(self, request: RelayRequest) -> bytes:
        kind = _kind(request)
        if kind != "payload":
            return await self._forward(request)
        key = (request.run, request.payload.round, request.payload.digest)
        if key in self.cache:
            self.streams["cached"] += 1
            self.cache.move_to_end(key)
            return self.cache[key]
        if key in self._fetching:  # another asking peer's fetch of the same payload: shared
            return await asyncio.shield(self._fetching[key])
        future = asyncio.get_running_loop().create_future()
        self._fetching[key] = future
        try:
            data = await self._forward(request)
            if data and hashlib.sha256(data).digest() != request.payload.digest:
                self.rejected["digest_mismatch"] += 1
                data = b""
            if data:
                self._keep(key, data)
            future.set_result(data)
            return data
        except BaseException:
            future.set_result(b"")
            raise
        finally:
            del self._fetching[key]

    async def _forward(self, request: RelayRequest) -> bytes:
        """The answer of the peer behind the relay, if it is connected here; empty otherwise."""
        target = PeerID.from_base58(request.peer)
        if target not in await self._connected_peers():
            self.rejected["not_connected"] += 1
            return b""
        kind = _kind(request)
        if kind == "state":
            name, inner, limit = handler(request.run, "state"), request.state, MAX_CHUNK_BYTES + CHUNK_BYTES
        else:
            name, inner, limit = handler(request.run, "payload"), request.payload, self.max_payload_bytes
        parts, size = [], 0
        assert self._p2p is not None  # a request to a handler `start` added
        try:
            stream = await asyncio.wait_for(
                self._p2p.iterate_protobuf_handler(target, name, inner, PayloadChunk), self.timeout_s
            )
            async for chunk in aiter_with_timeout(stream, self.timeout_s):
                size += len(chunk.data)
                if size > limit:
                    self.rejected["too_large"] += 1
                    return b""
                parts.append(chunk.data)
        except TRANSIENT:
            self.rejected["unreachable"] += 1
            return b""
        self.fetched[kind] += size
        self.streams[kind] += 1
        return b"".join(parts)

    def _keep(self, key: tuple[str, int, bytes], data: bytes) -> None:
        if len(data) > self.cache_bytes:
            return
        self.cache[key] = data
        self.cached_bytes += len(data)
        while self.cached_bytes > self.cache_bytes:
            _, dropped = self.cache.popitem(last=False)
            self.cached_bytes -= len(dropped)

    def _admit(self, peer: PeerID | None) -> str | None:
        """Why a request from `peer` is refused now (None: admitted)."""
        if peer is None:
            return "bad_request"
        if sum(self._open.values()) >= MAX_STREAMS:
            return "busy"
        if self._open[peer] >= MAX_STREAMS_PER_PEER:
            return "too_many_streams"
        now = time.monotonic()
        tokens, then = self._buckets.get(peer, (BURST, now))
        tokens = min(BURST, tokens + (now - then) * RATE_PER_S)
        if tokens < 1:
            self._buckets[peer] = (tokens, now)
            return "rate"
        if len(self._buckets) > 4096:  # forget the peers whose buckets are full again
            self._buckets = {p: b for p, b in self._buckets.items() if now - b[1] < BURST / RATE_PER_S}
        self._buckets[peer] = (tokens - 1, now)
        return None

    async def _connected_peers(self) -> dict[PeerID, list[Multiaddr]]:
        read_at, peers = self._connected
        if time.monotonic() - read_at > CONNECTED_TTL_S:
            assert self._p2p is not None  # for a request to a handler `start` added
            peers = {info.peer_id: info.addrs for info in await self._p2p.list_peers()}
            self._connected = (time.monotonic(), peers)
        return peers

    # --- reachability ---

    async def reach(self, request: ReachRequest, context: P2PContext) -> ReachReply:
        """Whether the asking peer accepts TCP connections at the address it connects from."""
        peer, now = context.remote_id, time.monotonic()
        if len(request.ports) > MAX_REACH_PORTS or not all(0 < port < 65536 for port in request.ports):
            self.rejected["bad_request"] += 1
            return ReachReply(checked=False)
        if now - self._reached.get(peer, -math.inf) < REACH_INTERVAL_S:
            self.rejected["reach_rate"] += 1
            return ReachReply(checked=False)
        if len(self._reached) > 4096:
            self._reached = {p: t for p, t in self._reached.items() if now - t < REACH_INTERVAL_S}
        self._reached[peer] = now
        self._connected = (-math.inf, {})  # the asking peer has just connected: read the list again
        host = observed_host((await self._connected_peers()).get(peer, []))
        if host is None:
            return ReachReply(checked=False)
        self.streams["reach"] += 1
        outcomes = await asyncio.gather(*(_accepts(host, port) for port in request.ports))
        return ReachReply(observed=f"/ip4/{host}", reachable=any(outcomes), checked=True)


MAX_RELAYS = 4


@dataclass(frozen=True, slots=True)
class Reachability:
    """What a peer learned of its reachability from the relays among its initial peers."""

    reachable: bool | None = None
    """Whether a relay could dial it; None: no relay checked (none among the initial peers)."""
    relays: tuple[str, ...] = ()
    """Peer ids of the relays it is connected to (that answered), at most MAX_RELAYS."""
    observed: str = ""
    """The address a relay saw its connection come from."""
    relaying: bool = True
    """Whether this peer goes through relays at all (`shoal join --relay off`: it names none in its
    record and pulls only from the peers themselves)."""

    def describe(self) -> str:
        """One line for a volunteer: which case this peer is in."""
        if not self.relaying and self.reachable is not True:
            return (
                "relays off (--relay off): this peer trains only with peers it can dial and that can dial "
                "it; behind NAT, that is peers on its own network"
            )
        if self.reachable:
            return f"reachable: a relay dialled this peer back at {self.observed}"
        if self.reachable is False:
            return (
                f"behind NAT: a relay sees this peer at {self.observed} and cannot dial it there; it "
                f"trains through {len(self.relays)} relay(s) (peers that cannot dial it pull through them)"
            )
        return (
            "not checked (no initial peer is a shoal bootstrap node, which checks and relays); behind NAT, "
            "this peer trains only with peers that can dial it"
        )


UNCHECKED = Reachability()


def check_reachability(
    dht: hivemind.DHT, initial_peers: Sequence[str], timeout_s: float = 3 * REACH_TIMEOUT_S
) -> Reachability:
    """Asks each initial peer that is a relay whether this peer can be dialed (in the DHT's process,
    whose libp2p daemon holds the connections). Reachable if any relay dialed it back."""
    peers = tuple(
        dict.fromkeys(address.rpartition("/p2p/")[2] for address in initial_peers if "/p2p/" in address)
    )
    if not peers:
        return Reachability()
    answers = dht.run_coroutine(functools.partial(_ask_relays, peers[: 2 * MAX_RELAYS], timeout_s))
    relays = tuple(peer for peer, _, _ in answers)[:MAX_RELAYS]
    checked = [(observed, reachable) for _, observed, reachable in answers if observed]
    if not checked:
        return Reachability(relays=relays)
    reachable = any(reached for _, reached in checked)
    observed = next((seen for seen, reached in checked if reached == reachable), "")
    return Reachability(reachable=reachable, relays=relays, observed=observed)


async def _ask_relays(
    peers: tuple[str, ...], timeout_s: float, _dht: hivemind.DHT, node: DHTNode
) -> list[tuple[str, str, bool]]:
    """(relay, observed address or "" if it did not check, reachable) of each peer that answered."""
    ports = sorted(tcp_ports(await node.p2p.get_visible_maddrs()))

    async def ask(peer: str) -> tuple[str, str, bool]:
        reply = await node.p2p.call_protobuf_handler(
            PeerID.from_base58(peer), REACH_HANDLER, ReachRequest(ports=ports[:MAX_REACH_PORTS]), ReachReply
        )
        return peer, reply.observed[:64] if reply.checked else "", reply.reachable

    outcomes = await asyncio.gather(
        *(asyncio.wait_for(ask(peer), timeout_s) for peer in peers), return_exceptions=True
    )
    return [outcome for outcome in outcomes if isinstance(outcome, tuple)]


def tcp_ports(addresses: Sequence[Multiaddr]) -> set[int]:
    ports = set()
    for address in addresses:
        with contextlib.suppress(KeyError, ValueError):
            ports.add(int(address["tcp"]))
    return ports


def observed_host(addresses: Sequence[Multiaddr]) -> str | None:
    """The IPv4 address a connection came from (None if none is IPv4)."""
    for address in addresses:
        with contextlib.suppress(KeyError, ValueError):
            return address["ip4"]
    return None


async def _accepts(host: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), REACH_TIMEOUT_S)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


def _kind(request: RelayRequest) -> str:
    if request.WhichOneof("request") == "state":
        return "state"
    return "piece" if request.payload.shards else "payload"


def _check(request: RelayRequest) -> str | None:
    """Why a relay request is malformed (None: it is not)."""
    if not RUN_NAME.match(request.run) or not 0 < len(request.peer) <= MAX_PEER_ID:
        return "bad_request"
    try:
        PeerID.from_base58(request.peer)
    except Exception:  # any failure to parse another peer's text is its fault, never the relay's
        return "bad_request"
    if request.WhichOneof("request") is None:
        return "bad_request"
    if request.WhichOneof("request") == "payload" and len(request.payload.digest) != 32:
        return "bad_request"
    return None
