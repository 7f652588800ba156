"""Pulling what other peers serve, for SwarmExchange (shoal.peer.swarm.exchange), on its event loop.

- A payload is pulled from the peer that announced it, then through the relays its record names
  (shoal.peer.swarm.relay: `shoal bootstrap` nodes it keeps a connection to, for a peer behind NAT),
  then from any other participant of the round (every peer serves what it pulled; one that does not
  hold it yet answers with nothing), cycling
  with backoff until it is had or the round gives up on it. At most `max_concurrent` pulls run at a
  time, and beyond the first at most `max_bytes_in_flight` bytes of payloads (`InFlight`; a pull
  that takes much longer than the recent ones stops counting, so a stalled source does not hold up
  the others); every wait is bounded by `timeout_s`.
- Why a byte budget: small payloads (DeMo's, kilobytes) are pulled side by side, so that a round costs
  one round trip, not one per peer. Large ones (DiLoCo's, megabytes) one after the other: each fills
  the link alone, and several at once overfill a slow link's queue, so that TCP resends part of what
  a peer sends (`shoal bench wan`: BENCHMARKS.md).
- It is accepted only if its size and SHA-256 match the announcement; a source that sends other
  bytes is struck (the exchange's `strike`) and not asked again for it.
- A piece of a butterfly round, or an owner's mean of one, is pulled from the one peer that serves
  it, then through that peer's relays (`piece`).
- A piece of a shared state is pulled from its source, then through the source's relays, by
  shoal.peer.swarm.state's `download`, which checks it against the state's manifest.

Payloads travel over channels (shoal.peer.swarm.channels): streams kept open between two peers, as a
stream per pull cost more on the wire than a small payload. Other replies are one-off streams of
`PayloadChunk`s of at most `CHUNK_BYTES`, capped in total by what the caller expects.
"""

import asyncio
import contextlib
import hashlib
import random
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence

import torch
from hivemind.p2p import P2P, P2PDaemonError, P2PHandlerError, PeerID
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.logging import get_logger

from shoal.peer.swarm.channels import Channels
from shoal.peer.swarm.counters import SwarmCounters
from shoal.peer.swarm.names import handler
from shoal.peer.swarm.records import Announcement
from shoal.peer.swarm.replay import MAX_STEPS_BYTES, Counted
from shoal.peer.swarm.state import MAX_CHUNK_BYTES, StateUnavailable, download, restore, state_size
from shoal.protocol import MalformedPayloadError
from shoal.protocol.swarm_pb2 import PayloadChunk, PayloadRequest, RelayRequest, StateRequest

logger = get_logger(__name__)

MAX_BYTES_IN_FLIGHT = 1 << 20
CHUNK_BYTES = 1 << 20  # libp2p unary messages stop at 4 MiB; streamed chunks of 1 MiB are fastest here
TRANSIENT = (TimeoutError, P2PDaemonError, P2PHandlerError, OSError, asyncio.IncompleteReadError)
"""Failures that say nothing about the source's honesty: try another, or again later."""
CANCEL_GRACE_S = 1.0  # pulls cancelled at a round's deadline get this long to end, no longer
SLOW_ATTEMPT_S = 1.0
"""A pull attempt running this long at a round's deadline is a transfer a longer window would finish
(`Puller.transferring`), unlike a payload whose every source fails at once."""
RELAY_HANDLER = "shoal.relay"  # shoal.peer.swarm.relay's


async def abandon(tasks: Collection[asyncio.Task]) -> int:
    """Cancels the pulls still running at a round's deadline and waits at most CANCEL_GRACE_S for them
    to end. A pull inside a libp2p call that does not give way to its cancellation (seen when its
    peer left mid-dial: `wait_for` then waits for the daemon's answer) is left to end on its own rather
    than hold the round, and every peer of it, forever. Returns how many were left running."""
    for task in tasks:
        task.cancel()
        task.add_done_callback(_retrieve)
    if not tasks:
        return 0
    _, running = await asyncio.wait(tasks, timeout=CANCEL_GRACE_S)
    return len(running)


def _retrieve(task: asyncio.Task) -> None:
    """Reads a finished pull's outcome, so that an abandoned one's error is not reported as unhandled."""
    if not task.cancelled():
        task.exception()


class NotHeld(TimeoutError):
    """A source answered that it holds nothing for the request (yet): transient from a relay, a
    refusal from the author of an announcement, which holds its payload before it announces it."""


class Puller:
    """See the module docstring. Create on the loop it will run on."""

    def __init__(
        self,
        p2p: P2P,
        *,
        run: str,
        channels: Channels,
        owner: bytes,
        timeout_s: float,
        max_concurrent: int,
        strike: Callable[[bytes, str, int], None],
        counts: SwarmCounters,
        relays_of: Callable[[str], Collection[str]] = lambda _peer: (),
        claims_reachable: Callable[[str], bool] = lambda _peer: False,
        max_bytes_in_flight: int = MAX_BYTES_IN_FLIGHT,
    ):
        self.p2p, self.run, self.owner, self.timeout_s = p2p, run, owner, timeout_s
        self.channels, self.state_handler = channels, handler(run, "state")
        self.strike, self.relays_of = strike, relays_of
        """`relays_of(peer id)`: the relays a peer names in its record."""
        self.claims_reachable = claims_reachable
        """`claims_reachable(peer id)`: whether its record says it can be dialed."""
        self.false_claims: set[str] = set()
        """Peers that say they can be dialed, could not be, and were reached through a relay."""
        self.received, self.rejected, self.via_relay = counts.received, counts.rejected, counts.via_relay
        self.relayed = 0
        """Payloads pulled from a peer other than their author."""
        self.refused_by_author: set[tuple[int, bytes]] = set()
        """(round, digest) of payloads whose author answered that it holds nothing: announced but not
        served (the exchange strikes the author if nobody got the payload by the deadline)."""
        self._in_flight = InFlight(max_concurrent, max_bytes_in_flight)
        self._attempts: dict[bytes, float] = {}  # digest: when the running attempt to pull it started

    def transferring(self, digests: Collection[bytes], now: float | None = None) -> bool:
        """Whether one of these payloads has a pull attempt running for SLOW_ATTEMPT_S or more: its bytes
        are on their way (or a source keeps it waiting), so the round's exchange was slow, not broken."""
        now = time.monotonic() if now is None else now
        return any(now - self._attempts.get(digest, now) >= SLOW_ATTEMPT_S for digest in digests)

    async def payload(
        self, round_number: int, announcement: Announcement, holders: Mapping[bytes, Announcement]
    ) -> bytes:
        """The announced payload, from its author or the other participants in `holders` (read live:
        it grows during the round)."""
        request = PayloadRequest(round=round_number, digest=announcement.digest)
        refused: set[str] = set()  # sources (or relays) that sent bad bytes for this payload
        undialled = False  # a pull from the author itself failed in transit
        cycle = 0
        while True:
            others = [h for h in holders.values() if h.owner not in (announcement.owner, self.owner)]
            random.shuffle(others)  # spreads the load of re-serving over the relays
            relays = [(announcement, relay) for relay in self.relays_of(announcement.peer)]
            for source, relay in [(announcement, None), *relays, *((other, None) for other in others)]:
                if (relay or source.peer) in refused:
                    continue
                try:
                    async with self._in_flight.hold(announcement.size):
                        started = self._attempts[announcement.digest] = time.monotonic()
                        data = await self._checked(source.peer, announcement, request, relay)
                        self._in_flight.observe(len(data), time.monotonic() - started)
                except MalformedPayloadError as error:
                    self.rejected[error.reason] += 1
                    if relay is None:  # a relay checks the digest: bad bytes from one are its own
                        self.strike(source.owner, error.reason, round_number)
                    refused.add(relay or source.peer)
                    continue
                except NotHeld:
                    if source is announcement and relay is None:
                        self.refused_by_author.add((round_number, announcement.digest))
                    continue
                except TRANSIENT:
                    undialled |= source is announcement and relay is None
                    continue
                finally:
                    self._attempts.pop(announcement.digest, None)
                self.received["payload"] += len(data)
                if relay is not None:
                    self.via_relay["payload"] += len(data)
                    if undialled:
                        self._check_claim(announcement.peer)
                self.relayed += source.owner != announcement.owner or relay is not None
                return data
            await asyncio.sleep(min(1.0, 0.1 * 2**cycle))
            cycle += 1

    def _check_claim(self, peer: str) -> None:
        """A peer whose record says it can be dialed, that could not be and was reached through a relay,
        is counted (`false_reachable`) and named, once: the others then ask its relays after a failed
        dial, every round, where an honest record would have them ask the relays first."""
        if peer not in self.false_claims and self.claims_reachable(peer):
            self.false_claims.add(peer)
            self.rejected["false_reachable"] += 1
            logger.warning(f"peer {peer} says it can be dialed, but it could not be: reached through a relay")

    async def piece(
        self, peer: str, request: PayloadRequest, max_bytes: int, *, observe: bool = True
    ) -> bytes:
        """A piece of a butterfly round (shoal.peer.algorithms.butterfly) from the one peer that serves it,
        or through its relays when it cannot be dialed (the relay forwards pieces, and keeps none), paced
        like payloads; tried again with backoff while it answers with nothing or fails in transit, until
        the caller cancels. Raises MalformedPayloadError (too_large). `observe`: whether the pull's time
        tells the link's rate (not when the peer may wait before it answers)."""
        cycle = 0
        while True:
            data = b""
            for relay in (None, *self.relays_of(peer)):
                try:
                    async with self._in_flight.hold(max_bytes):
                        started = time.monotonic()
                        if relay is None:
                            data = await self.channels.pull(peer, request, max_bytes)
                        else:
                            asked = RelayRequest(run=self.run, peer=peer, payload=request)
                            data = await self.pull(relay, RELAY_HANDLER, asked, max_bytes)
                        if data and observe:
                            self._in_flight.observe(len(data), time.monotonic() - started)
                except TRANSIENT:
                    continue
                if data:
                    self.received["payload"] += len(data)
                    if relay is not None:
                        self.via_relay["payload"] += len(data)
                    return data
                if relay is None:  # it answered: not ready yet, most likely (an owner still averaging)
                    break
            # asked again soon, without holding the byte budget meanwhile, so that the means that are
            # ready come in first
            await asyncio.sleep(min(0.5, 0.05 * 2**cycle))
            cycle += 1

    def new_round(self, round_number: int) -> None:
        """Forgets the refusals of rounds before the last."""
        self.refused_by_author = {key for key in self.refused_by_author if key[0] >= round_number - 1}

    async def state(
        self, digest: bytes, sources: list[str], like: list[torch.Tensor]
    ) -> list[torch.Tensor] | None:
        """The shared state `digest` (shoal.peer.swarm.state), pulled from `sources` in pieces and restored
        in tensors like `like`; None, counted as `resync_failed`, if it could not be had."""
        started = time.perf_counter()
        try:
            _, data = await download(
                digest,
                sources,
                self.state_piece,
                expected_size=state_size(like),
                transient=(P2PDaemonError, P2PHandlerError),
                rejected=self.rejected,
            )
            state = restore(data, like)
        except (StateUnavailable, MalformedPayloadError) as error:
            self.rejected["resync_failed"] += 1
            logger.warning(f"could not re-sync with the swarm's state: {error}")
            return None
        self.received["state"] += len(data)
        elapsed = time.perf_counter() - started
        logger.info(f"re-synced {len(data)} bytes of state from {len(sources)} peers in {elapsed:.1f} s")
        return state

    async def steps(self, digest: bytes, source: str) -> bytes:
        """The steps `source` took to the state `digest` (shoal.peer.swarm.replay), unparsed; empty if it
        keeps none, or cannot be reached."""
        try:
            return await self.state_piece(source, StateRequest(state=digest, steps=True), MAX_STEPS_BYTES)
        except ConnectionError:
            return b""

    async def kept(self, round_number: int, counted: Counted, sources: Sequence[str]) -> bytes | None:
        """A payload that counted in an earlier round (a replay's), from the first of `sources` (or
        their relays) that still holds it, checked against its digest; None if none does."""
        request = PayloadRequest(round=round_number, digest=counted.digest)
        for source in sources:
            announcement = Announcement(counted.owner, source, counted.digest, counted.size, counted.samples)
            for relay in (None, *self.relays_of(source)):
                try:
                    data = await self._checked(source, announcement, request, relay)
                except MalformedPayloadError as error:
                    self.rejected[error.reason] += 1
                    break
                except (NotHeld, *TRANSIENT):
                    continue
                self.received["payload"] += len(data)
                return data
        return None

    async def state_piece(
        self, source: str, request: StateRequest, limit: int = MAX_CHUNK_BYTES + CHUNK_BYTES
    ) -> bytes:
        """A piece of a state from `source`, or through the relays it names (it may be behind NAT)."""
        try:
            data = await self.pull(source, self.state_handler, request, limit)
        except TRANSIENT:
            data = b""
        for relay in self.relays_of(source) if not data else ():
            with contextlib.suppress(*TRANSIENT):
                data = await self.pull(
                    relay, RELAY_HANDLER, RelayRequest(run=self.run, peer=source, state=request), limit
                )
            if data:
                self.via_relay["state"] += len(data)
                break
        if not data:
            raise ConnectionError(f"{source} does not hold the state, or cannot be reached")
        return data

    async def pull(self, peer: str, handler: str, request, max_bytes: int) -> bytes:
        """The chunks a peer's stream handler sends back, joined; empty if it holds nothing.
        Each wait is bounded by the timeout, the total by `max_bytes`."""
        stream = await asyncio.wait_for(
            self.p2p.iterate_protobuf_handler(PeerID.from_base58(peer), handler, request, PayloadChunk),
            self.timeout_s,
        )
        parts, size = [], 0
        async for chunk in aiter_with_timeout(stream, self.timeout_s):
            size += len(chunk.data)
            if size > max_bytes:
                raise MalformedPayloadError("too_large", f"{peer} sent more than {max_bytes} bytes")
            parts.append(chunk.data)
        return b"".join(parts)

    async def _checked(
        self, source: str, announcement: Announcement, request: PayloadRequest, relay: str | None
    ) -> bytes:
        if relay is None:
            data = await self.channels.pull(source, request, announcement.size)
        else:
            asked = RelayRequest(run=self.run, peer=source, payload=request)
            data = await self.pull(relay, RELAY_HANDLER, asked, announcement.size)
        if not data:
            raise NotHeld(f"{source} does not hold the payload (yet)")
        if len(data) != announcement.size or hashlib.sha256(data).digest() != announcement.digest:
            raise MalformedPayloadError(
                "digest_mismatch", f"{source}: payload does not match its announcement"
            )
        return data


class InFlight:
    """Admits a pull when fewer than `max_pulls` run and its bytes fit in `max_bytes` with the bytes
    counted in flight, or when none are counted (so one larger than the budget runs alone). Waiters
    are admitted in the order they came, so pulls start in the order the caller asked for them.

    A pull that runs longer than its patience stops counting against the bytes (it still counts as a
    pull), so that a source that stalls, or serves slowly, holds up the others for no longer than
    that: twice the time its bytes should take at the rate recent large pulls achieved (`observe`),
    and at least `min_patience_s`."""

    OBSERVED_BYTES = 64 * 1024
    """Pulls smaller than this say more about latency than about the rate: not observed."""

    def __init__(self, max_pulls: int, max_bytes: int, min_patience_s: float = 3.0):
        if max_pulls < 1 or max_bytes < 0 or not min_patience_s > 0:
            raise ValueError(
                f"max_pulls must be >= 1, max_bytes >= 0 and min_patience_s > 0; got {max_pulls}, "
                f"{max_bytes}, {min_patience_s}"
            )
        self.max_pulls, self.max_bytes, self.min_patience_s = max_pulls, max_bytes, min_patience_s
        self.pulls = self.bytes = 0
        self.rate: float | None = None
        """Bytes per second of recent large pulls (a moving average); None before the first."""
        self._waiting: deque[tuple[int, asyncio.Future]] = deque()

    def observe(self, size: int, seconds: float) -> None:
        """A pull of `size` bytes took `seconds`."""
        if size >= self.OBSERVED_BYTES and seconds > 0:
            rate = size / seconds
            self.rate = rate if self.rate is None else 0.5 * (self.rate + rate)

    def patience(self, size: int) -> float:
        if self.rate is None:
            return self.min_patience_s
        return max(self.min_patience_s, 2 * size / self.rate)

    @contextlib.asynccontextmanager
    async def hold(self, size: int):
        if self._waiting or not self._fits(size):
            admitted = asyncio.get_running_loop().create_future()
            self._waiting.append((size, admitted))
            try:
                await admitted
            except asyncio.CancelledError:
                if admitted.done() and not admitted.cancelled():  # admitted just before the cancel
                    self._release(size, counted=True)
                else:
                    self._waiting.remove((size, admitted))
                    self._admit()
                raise
        else:
            self._take(size)
        counted = True

        def stop_counting() -> None:
            nonlocal counted
            counted = False
            self.bytes -= size
            self._admit()

        timer = asyncio.get_running_loop().call_later(self.patience(size), stop_counting)
        try:
            yield
        finally:
            timer.cancel()
            self._release(size, counted=counted)

    def _fits(self, size: int) -> bool:
        return self.pulls < self.max_pulls and (self.bytes == 0 or self.bytes + size <= self.max_bytes)

    def _take(self, size: int) -> None:
        self.pulls += 1
        self.bytes += size

    def _release(self, size: int, *, counted: bool) -> None:
        self.pulls -= 1
        if counted:
            self.bytes -= size
        self._admit()

    def _admit(self) -> None:
        while self._waiting and self._fits(self._waiting[0][0]):
            size, admitted = self._waiting.popleft()
            self._take(size)
            admitted.set_result(None)


def chunks(data: bytes) -> list[PayloadChunk]:
    """`data` as stream replies of at most CHUNK_BYTES each (none if it is empty)."""
    return [
        PayloadChunk(data=data[start : start + CHUNK_BYTES]) for start in range(0, len(data), CHUNK_BYTES)
    ]
