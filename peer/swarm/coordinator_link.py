"""A peer's link to the swarm's coordinator (`shoal join --coordinator HOST:PORT`).

The link lives on the SwarmExchange's event loop. One task owned by the link keeps it a member:
join, the stream of round announcements, and a heartbeat whenever the coordinator has not heard
from this peer for `heartbeat_interval` (by default a third of the timeout its join reply states;
a report counts as heard). A heartbeat carries the last round this peer finished, its compute
throughput and its exchange time, which the coordinator's deadlines follow. When a call fails
because the coordinator is unreachable, `connected` turns False and the task retries with backoff
(capped at `MAX_BACKOFF_S`) until it answers again; the peer meanwhile trains uncoordinated. An
eviction (the coordinator refuses the member) is waited out the same way: the link joins again
once it is allowed to. A refused token (UNAUTHENTICATED) is not waited out: the link stops, and
the next round's plan raises `CoordinatorError` naming `--coordinator-token-file`; `check_access`
asks the same question before the peer starts.

Every call has a timeout. Times from the coordinator are converted to this machine's clock with the
offset measured on each reply (`now` fields), so a peer with a skewed clock still meets deadlines.
"""

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import grpc
from hivemind.utils.logging import get_logger

from shoal.protocol import coordinator_pb2 as pb
from shoal.protocol import coordinator_pb2_grpc

logger = get_logger(__name__)

MAX_BACKOFF_S = 2.0
# gRPC's own reconnection backoff grows to 120 s, and calls fail at once while it waits: after a long
# outage, peers would reach a restarted coordinator only after its grace for them (one heartbeat
# timeout) has passed, and be dropped as silent
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", int(MAX_BACKOFF_S * 1000)),
    # no bandwidth-estimation pings: a round's few small calls need no flow-control tuning, and the
    # pings and their acknowledgements were a fifth of a peer's packets to the coordinator
    ("grpc.http2.bdp_probe", 0),
)
DEFAULT_HEARTBEAT_S = 1.0  # when the coordinator states no usable heartbeat timeout
CALL_TIMEOUT_S = 5.0
# codes that mean "not reachable right now", as opposed to a refusal of this request
UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
# what the coordinator's status codes mean for a peer (shoal.coordinator.rounds, .validation and .auth
# send them)
IN_WORDS = {
    grpc.StatusCode.UNAVAILABLE: "the coordinator cannot be reached",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the coordinator did not answer in time",
    grpc.StatusCode.CANCELLED: "the call to the coordinator was cancelled",
    grpc.StatusCode.UNAUTHENTICATED: "the coordinator does not accept this peer's token",
    grpc.StatusCode.PERMISSION_DENIED: "the coordinator does not let this peer take part",
    grpc.StatusCode.NOT_FOUND: "the coordinator does not know this peer or round",
    grpc.StatusCode.FAILED_PRECONDITION: "the round began without this peer (joined mid-round), or is over",
    grpc.StatusCode.OUT_OF_RANGE: "the coordinator has not announced that round yet",
    grpc.StatusCode.ALREADY_EXISTS: "that payload was already reported",
    grpc.StatusCode.INVALID_ARGUMENT: "the coordinator found the request malformed",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "the swarm is full",
}
# a refusal in one of these is the coordinator's own answer; any other code (UNIMPLEMENTED, UNKNOWN, ...)
# may come from some other server at that address
ANSWERED = frozenset(IN_WORDS) - UNREACHABLE
TOKEN_HELP = (
    "pass the file holding the token the coordinator's operator gave this peer with "
    "--coordinator-token-file FILE"
)


class CoordinatorError(ValueError):
    """A coordinator setting that cannot be used; the message names it."""


@dataclass(frozen=True, slots=True)
class CallFailed:
    """A coordinator call that did not succeed: its status code and the coordinator's own words."""

    code: grpc.StatusCode
    details: str = ""

    @property
    def unreachable(self) -> bool:
        """Not reached (as opposed to refused)."""
        return self.code in UNREACHABLE

    def __str__(self) -> str:
        words = IN_WORDS.get(self.code, "the call to the coordinator failed")
        return f"{words}; the coordinator says: {self.details}" if self.details else words


def token_refusal(address: str, failed: CallFailed, *, has_token: bool) -> str | None:
    """The message for a call refused for its token (None: refused for another reason)."""
    if failed.code == grpc.StatusCode.UNAUTHENTICATED:
        given = "refuses this peer's token" if has_token else "needs a token"
        return f"the coordinator {address} {given} ({failed.details}): {TOKEN_HELP}"
    # the coordinator also denies an evicted straggler's join, for a while: only a token's denial is final
    if failed.code == grpc.StatusCode.PERMISSION_DENIED and "token" in failed.details:
        return (
            f"the coordinator {address} refuses this peer's token ({failed.details}): a per-peer token "
            "is valid only with the --identity it was issued for; or " + TOKEN_HELP
        )
    return None


def check_access(
    address: str,
    *,
    token: str | None,
    tls_roots: bytes | None = None,
    tls: bool = False,
    timeout: timedelta = timedelta(seconds=CALL_TIMEOUT_S),
) -> bool:
    """Raises CoordinatorError if the coordinator at `address` refuses `token`; else whether it answered
    (False: it cannot be reached now, and the link keeps trying once the peer runs).

    Asks for the swarm's status, which changes nothing and which any known token may ask for; whether
    a per-peer token is this peer's is known only once the DHT has drawn its id (without --identity),
    so the link's first join tells that."""
    if tls or tls_roots is not None:
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=tls_roots))
    else:
        channel = grpc.insecure_channel(address)
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        try:
            stub.SwarmStatus(pb.SwarmStatusRequest(), timeout=timeout.total_seconds(), metadata=metadata)
        except grpc.RpcError as error:
            refusal = token_refusal(
                address, CallFailed(error.code(), error.details() or ""), has_token=token is not None
            )
            if refusal is not None:
                raise CoordinatorError(refusal) from None
            return error.code() in ANSWERED
    return True


@dataclass(frozen=True, slots=True)
class AnnouncedRound:
    """A round announced by the coordinator, in this machine's clock."""

    round: int
    compute_deadline: float
    exchange_deadline: float
    announced_at: float
    data_seed: int
    peers: tuple[str, ...]


@dataclass(slots=True)
class Progress:
    """What the heartbeats say about this peer."""

    round: int = -1
    throughput: float = 0.0
    min_samples: int = 0
    exchange_s: float = 0.0


class CoordinatorLink:
    """See the module docstring. Create, then `await start()` on the loop it will run on."""

    def __init__(
        self,
        address: str,
        peer_id: str,
        *,
        token: str | None = None,
        tls_roots: bytes | None = None,
        tls: bool = False,
        heartbeat_interval: float | None = None,
        first_contact_s: float | None = None,
        answered: bool = False,
    ):
        self.address, self.peer_id = address, peer_id
        self.first_contact_s = first_contact_s
        """Seconds from the start within which the coordinator must answer once (None: no bound)."""
        self.answered = answered
        """Whether the coordinator ever answered this peer (before the link, `check_access` may have)."""
        self._interval = heartbeat_interval
        self.heartbeat_interval = heartbeat_interval or DEFAULT_HEARTBEAT_S
        """Longest silence toward the coordinator (set from its join reply unless given)."""
        self._heard_at = -math.inf  # monotonic time of the last call the coordinator counts as a sign of life
        self.connected = False
        """Whether the last call reached the coordinator."""
        self.refusal: str | None = None
        """Why the link stopped for good: the coordinator refused this peer's token, or never answered."""
        self.member = False
        """Whether the coordinator counts this peer as a member."""
        self.compute_scale = 1.0
        """The share of each compute window the coordinator wants this peer to use."""
        self.progress = Progress()
        self.latest: AnnouncedRound | None = None
        self.offset = 0.0
        """The coordinator's clock minus this machine's, seconds."""
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._has_token = token is not None
        self._tls, self._tls_roots = tls or tls_roots is not None, tls_roots
        self._announced = asyncio.Condition()
        self._channel: grpc.aio.Channel | None = None
        self._stub: coordinator_pb2_grpc.CoordinatorStub | None = None
        self._task: asyncio.Task | None = None

    @staticmethod
    def credentials(token_file: str | None, ca: str | None) -> tuple[str | None, bytes | None, bool]:
        """(token, TLS roots, TLS) from `--coordinator-token-file` and `--coordinator-ca` (a PEM file,
        or `system` for the system's roots); raises CoordinatorError."""
        token = None
        if token_file:
            try:
                words = Path(token_file).read_text().split()
            except (OSError, UnicodeDecodeError) as error:
                raise CoordinatorError(
                    f"--coordinator-token-file: cannot read {token_file}: {error}"
                ) from None
            if len(words) != 1:
                raise CoordinatorError(f"--coordinator-token-file: {token_file} must hold exactly one token")
            token = words[0]
        if not ca:
            return token, None, False
        if ca == "system":
            return token, None, True
        try:
            return token, Path(ca).read_bytes(), True
        except OSError as error:
            raise CoordinatorError(f"--coordinator-ca: cannot read {ca}: {error}") from None

    @property
    def started(self) -> bool:
        return self._task is not None

    async def start(self) -> None:
        if self._tls:
            credentials = grpc.ssl_channel_credentials(root_certificates=self._tls_roots)
            self._channel = grpc.aio.secure_channel(self.address, credentials, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._task = asyncio.create_task(self._keep_member())

    async def stop(self) -> None:
        """Leaves (if reachable, within a second) and closes the channel."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.member:
            assert self._stub is not None  # a member: it joined through the stub
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self._stub.Leave(
                    pb.LeaveRequest(peer_id=self.peer_id), timeout=1.0, metadata=self._metadata
                )
        if self._channel is not None:
            await self._channel.close()

    async def wait_connected(self, timeout: timedelta) -> bool:
        """Whether the first join succeeds within `timeout` (False at once on a refused token)."""
        give_up = time.monotonic() + timeout.total_seconds()
        while not self.member and self.refusal is None and time.monotonic() < give_up:
            await asyncio.sleep(0.05)
        return self.member

    def local(self, coordinator_time: float) -> float:
        return coordinator_time - self.offset

    async def next_announcement(self, after: int, timeout: float) -> AnnouncedRound | None:
        """The first announced round numbered `after` or later whose compute deadline is still ahead;
        None if none comes within `timeout` or the coordinator becomes unreachable meanwhile."""
        give_up = time.time() + timeout
        async with self._announced:
            while True:
                latest = self.latest
                if latest is not None and latest.round >= after and latest.compute_deadline > time.time():
                    return latest
                remaining = give_up - time.time()
                if not self.connected or remaining <= 0:
                    return None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._announced.wait(), min(remaining, 1.0))

    async def report(self, request: pb.ReportRequest) -> pb.ReportReply | CallFailed:
        """The coordinator's answer to a ready payload, or why there is none."""
        request.peer_id = self.peer_id
        assert self._stub is not None  # a coordinated round's: the link is started
        try:
            reply = await self._call(self._stub.ReportReady, request, CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            return _failed(error)
        self._heard_at = time.monotonic()
        self.compute_scale = reply.compute_scale
        return reply

    async def result(self, round_number: int, deadline: float) -> pb.RoundResultReply | CallFailed:
        """The participant set of a round, waiting for its decision until `deadline` (local time)."""
        timeout = max(0.5, deadline - time.time())
        assert self._stub is not None  # a coordinated round's: the link is started
        try:
            return await self._call(
                self._stub.RoundResult, pb.RoundResultRequest(round=round_number), timeout
            )
        except grpc.aio.AioRpcError as error:
            return _failed(error)

    async def heartbeat(self) -> None:
        """Sends the progress now (after a round, so that the next one can start)."""
        progress = self.progress
        request = pb.HeartbeatRequest(
            peer_id=self.peer_id,
            round=progress.round,
            throughput=progress.throughput,
            min_samples=progress.min_samples,
            exchange_s=progress.exchange_s,
        )
        assert self._stub is not None  # after a coordinated round, or in the link's task: started
        reply = await self._call(self._stub.Heartbeat, request, CALL_TIMEOUT_S)
        self._heard_at = time.monotonic()
        self.compute_scale = reply.compute_scale
        self._measure(reply.now)

    # --- the task that keeps this peer a member ---

    async def _keep_member(self) -> None:
        backoff = 0.5
        started = time.monotonic()
        while True:
            stream = None
            try:
                await self._join()
                stream = asyncio.create_task(self._follow_rounds())
                while not stream.done():
                    wait = self._heard_at + self.heartbeat_interval - time.monotonic()
                    if wait <= 0:
                        await self.heartbeat()
                        wait = self.heartbeat_interval
                    await asyncio.wait({stream}, timeout=wait)
                stream.result()  # raises what ended the stream
                raise ConnectionError("the coordinator ended the round stream")
            except asyncio.CancelledError:
                raise
            except (grpc.aio.AioRpcError, ConnectionError) as error:
                failed = _failed(error) if isinstance(error, grpc.aio.AioRpcError) else None
                refusal = token_refusal(self.address, failed, has_token=self._has_token) if failed else None
                if refusal is not None:  # waiting would not help: the peer must be restarted with another
                    self.member, self.connected, self.refusal = False, False, refusal
                    async with self._announced:
                        self._announced.notify_all()
                    return
                if not self.answered and self._waited_too_long(started):
                    async with self._announced:
                        self._announced.notify_all()
                    return
                if failed is not None and not failed.unreachable:
                    self.member = False  # refused: unknown (dropped, evicted) or not allowed; join again
                    logger.warning(f"coordinator {self.address} refused this peer: {failed}; joining again")
                elif self.connected:
                    logger.warning(f"coordinator {self.address} unreachable; training on uncoordinated")
                self.connected = False
                async with self._announced:
                    self._announced.notify_all()
                await asyncio.sleep(backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2)
            else:
                backoff = 0.5
            finally:
                if stream is not None:
                    stream.cancel()

    def _waited_too_long(self, started: float) -> bool:
        """True, and the link stopped with the reason, once the coordinator has not answered a single
        call in `first_contact_s` since the start: a wrong address is told, not trained around forever."""
        waited = time.monotonic() - started
        if self.first_contact_s is None or waited < self.first_contact_s:
            return False
        self.member, self.connected = False, False
        self.refusal = (
            f"the coordinator {self.address} has not answered in {waited:.0f} s since this peer started: "
            "check the address and that the coordinator runs and is reachable from here (and, with TLS, "
            "--coordinator-ca), give it longer with --coordinator-wait, or leave --coordinator out to train "
            "without one"
        )
        return True

    async def _join(self) -> None:
        progress = self.progress
        request = pb.JoinRequest(
            peer_id=self.peer_id, throughput=progress.throughput, min_samples=progress.min_samples
        )
        assert self._stub is not None  # in the task `start` creates
        reply = await self._call(self._stub.Join, request, CALL_TIMEOUT_S)
        self._heard_at = time.monotonic()
        self._measure(reply.now)
        timeout = reply.heartbeat_timeout_s
        if self._interval is None:  # a third of the timeout: two heartbeats may be lost or late
            usable = math.isfinite(timeout) and timeout > 0
            self.heartbeat_interval = min(max(timeout / 3, 0.1), 60.0) if usable else DEFAULT_HEARTBEAT_S
        if not self.member:
            logger.info(f"joined the coordinator {self.address} at round {reply.round}")
        self.member = True

    async def _follow_rounds(self) -> None:
        assert self._stub is not None  # in the task `start` creates
        stream = self._stub.Rounds(pb.RoundsRequest(peer_id=self.peer_id), metadata=self._metadata)
        async for message in stream:
            self._measure(message.now)
            announced = AnnouncedRound(
                round=message.round,
                compute_deadline=self.local(message.compute_deadline),
                exchange_deadline=self.local(message.exchange_deadline),
                announced_at=self.local(message.now),
                data_seed=message.data_seed,
                peers=tuple(message.peers),
            )
            async with self._announced:
                if self.latest is None or announced.round >= self.latest.round:
                    self.latest = announced
                self._announced.notify_all()

    async def _call(self, method, request, timeout: float):
        try:
            reply = await method(request, timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as error:
            if error.code() in UNREACHABLE:
                self.connected = False
            elif error.code() in ANSWERED:
                self.answered = True  # with a refusal, but it answered
            raise
        self.connected = self.answered = True
        return reply

    def _measure(self, coordinator_now: float) -> None:
        """The clock offset, from a reply's `now` (good to the call's latency)."""
        if coordinator_now > 0:
            self.offset = coordinator_now - time.time()


def _failed(error: grpc.aio.AioRpcError) -> CallFailed:
    return CallFailed(error.code(), error.details() or "")
