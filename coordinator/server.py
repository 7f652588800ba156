"""The coordinator's gRPC service (grpc.aio): a thin layer around the round state machine.

Each request is authenticated (shoal.coordinator.auth), turned into an event of
shoal.coordinator.rounds, applied, persisted (shoal.coordinator.store) before it is answered, and
its actions carried out: announcements go to every `Rounds` stream, decisions wake `RoundResult`
callers, refusals become the gRPC status code the state machine names. A ticker applies `Tick` every
`TICK_S` so that deadlines fire when no request comes. Everything runs on one event loop, so the
state has one writer and needs no lock.

Persisting is a group commit: the events applied while one transaction is being written (in a
thread, off the event loop) are written together in the next, the difference between the last
state written and the current one. An event's reply and actions wait for the transaction that holds
it, so nothing is answered, announced or decided before it is durable; and what callers read of
rounds (`RoundResult`, a new `Rounds` stream) is the last state written. One commit per report was
a disk flush per report on the event loop: a third of the coordinator's time at 1,000 peers.

Beside the Coordinator service the server offers the standard gRPC health service (`grpc.health.v1`,
unauthenticated, for load balancers) and server reflection (so grpcurl and friends work without the
.proto), and, with a metrics port, Prometheus metrics on `/metrics`.
"""

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shoal.coordinator.actions import (
    Abandoned,
    Action,
    Announced,
    Capped,
    Decided,
    Dropped,
    Refused,
    Reply,
    Struck,
)
from shoal.coordinator.auth import Tokens
from shoal.coordinator.events import Event, Heartbeat, Join, Leave, Report, Tick
from shoal.coordinator.limits import Limits, RateLimiter, client_address
from shoal.coordinator.metrics import CoordinatorMetrics
from shoal.coordinator.policy import Policy
from shoal.coordinator.replies import announcement, result_reply
from shoal.coordinator.rounds import initial_state, resume, round_result, transition
from shoal.coordinator.state import Round, SwarmState
from shoal.coordinator.store import StateStore
from shoal.coordinator.validation import check_peer_id
from shoal.protocol import coordinator_pb2 as pb
from shoal.protocol import coordinator_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
TICK_S = 0.1
MAX_REQUEST_BYTES = 16 * 1024  # every request is a few hundred bytes: larger ones are refused, counted
MAX_RECEIVE_BYTES = 4 * MAX_REQUEST_BYTES  # larger still: refused by grpc unread, not counted
MAX_WAIT_S = 600.0  # RoundResult waits at most this long, whatever the caller's deadline
RESULTS_KEPT = 4  # round results kept built (a late peer may still ask for an older one: built again)
REFUSAL_DELAY_S = 1.0  # an abusive call waits this long for its refusal (`_refuse_slowly`)
MAX_DELAYED = 1024  # at most so many at once: a client holding many calls open gets the rest at once
SUBSCRIBER_BACKLOG = 4  # announcements queued for a slow `Rounds` stream before the oldest is dropped


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsFiles:
    cert: Path
    key: Path


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
    """The Coordinator service over one swarm state."""

    def __init__(
        self,
        state: SwarmState,
        policy: Policy,
        store: StateStore | None = None,
        tokens: Tokens | None = None,
        metrics: CoordinatorMetrics | None = None,
        clock: Callable[[], float] = time.time,
        limiter: RateLimiter | None = None,
    ):
        self.state, self.policy, self.store, self.tokens = state, policy, store, tokens
        self.metrics, self.clock = metrics, clock
        self._subscribers: set[asyncio.Queue[tuple[int, bytes]]] = set()
        self._changed = asyncio.Event()  # set (and replaced) whenever a round is decided or abandoned
        self.limiter = limiter
        self.saved = state
        """The last state written to the store (the current one without a store): what callers read."""
        self._version = self._saved_version = 0  # of self.state, of self.saved
        self._dirty = asyncio.Event()  # state changed since the last transaction began
        self._flushed = asyncio.Event()  # set (and replaced) after every transaction
        self._write_error: Exception | None = None
        self._delayed = 0  # abusive calls waiting for their refusal
        self._results: dict[int, tuple[Round, bytes]] = {}
        """Each decided round's reply, built once: every member asks for it, and it lists every one."""

    # --- the state machine ---

    async def apply(self, event: Event) -> list[Action]:
        """Applies one event now, waits until it is durable, then acts. Returns the actions."""
        old = self.state
        new, actions = transition(old, self.clock(), event, self.policy)
        if new is not old:
            self.state = new
            self._version += 1
            if self.store is None:
                self.saved, self._saved_version = new, self._version
            else:
                await self._written(self._version)
        for action in actions:
            self._act(action)
        return actions

    async def _written(self, version: int) -> None:
        """Returns once the state `version` is written; raises if the write failed."""
        self._dirty.set()
        while self._saved_version < version:
            flushed = self._flushed
            await flushed.wait()
            if self._saved_version < version and self._write_error is not None:
                raise RuntimeError(f"the coordinator's state could not be written: {self._write_error}")

    async def write_forever(self) -> None:
        """Writes the state whenever it changed: one transaction for all that changed meanwhile. A
        failed write fails the calls waiting for it and is tried again at the next change."""
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            state, version = self.state, self._version
            try:
                # started only with a store (Coordinator.start)
                await asyncio.to_thread(cast(StateStore, self.store).save, self.saved, state)
            except Exception as error:  # the disk (full, gone): told to the callers
                logger.error(f"writing the state failed: {error}")
                self._write_error = error
            else:
                self.saved, self._saved_version, self._write_error = state, version, None
            self._flushed.set()
            self._flushed = asyncio.Event()

    async def flush(self) -> None:
        """Returns once everything applied so far is written."""
        if self.store is not None:
            await self._written(self._version)

    def _act(self, action: Action) -> None:
        if self.metrics is not None:
            self.metrics.observe(action, self.state)
        match action:
            case Announced(round=announced):
                sent = (announced.number, announcement(announced, self.clock()).SerializeToString())
                for queue in self._subscribers:  # serialized once for every stream
                    if queue.full():
                        queue.get_nowait()
                    queue.put_nowait(sent)
                logger.info(
                    f"round {announced.number}: {len(announced.expected)} peers, compute until "
                    f"+{announced.compute_deadline - announced.announced_at:.1f} s, exchange until "
                    f"+{announced.exchange_deadline - announced.announced_at:.1f} s"
                )
            case Decided(round=decided):
                self._wake()
                logger.info(
                    f"round {decided.number} decided: {len(decided.participants)} participants, "
                    f"{len(decided.stragglers)} stragglers"
                )
            case Struck(peer_id=peer_id, strikes=strikes, compute_scale=scale):
                logger.info(f"straggler {peer_id}: {strikes} strikes, compute scale {scale:g}")
            case Capped(peer_id=peer_id, round=number, claimed=claimed, bound=bound):
                logger.warning(
                    f"peer {peer_id} claimed {claimed} samples in round {number}, more than it can "
                    f"compute: counted as {bound}"
                )
            case Dropped(peer_id=peer_id, reason=reason):
                logger.info(f"peer {peer_id} dropped: {reason}")
            case Abandoned():
                self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def tick_forever(self) -> None:
        while True:
            await self.apply(Tick())
            await asyncio.sleep(TICK_S)

    async def _request(
        self,
        context: grpc.aio.ServicerContext,
        request: Message,
        peer_id: str | None,
        event: Event | None = None,
    ) -> dict[str, Any]:
        """Authenticates the call, charges it to its peer's and address's limits, applies its event;
        aborts with the refusal's status code."""
        if self.tokens is not None:
            refusal = self.tokens.check(context.invocation_metadata(), peer_id)
            if refusal is not None:
                await self._abort(context, refusal)
        method = type(request).__name__.removesuffix("Request")
        if request.ByteSize() > MAX_REQUEST_BYTES:  # larger than MAX_RECEIVE_BYTES: grpc refuses it unread
            if self.metrics is not None:
                self.metrics.oversized.labels(method=method.lower()).inc()
            await self._refuse_slowly(
                context, Refused("RESOURCE_EXHAUSTED", f"request over {MAX_REQUEST_BYTES} bytes")
            )
        if self.limiter is not None:
            address, now = client_address(context.peer()), time.monotonic()
            over = self.limiter.check(method, peer_id, address, now, self.state.next_round)
            if over is not None:
                if self.metrics is not None:
                    self.metrics.rate_limited.labels(method=method.lower(), by=over).inc()
                message = f"rate limited: too many calls from this {over}"
                await self._refuse_slowly(context, Refused("RESOURCE_EXHAUSTED", message))
        if event is None:
            return {}
        for action in await self.apply(event):
            if isinstance(action, Refused):
                await self._abort(context, action)
            if isinstance(action, Reply):
                return dict(action.fields)
        raise AssertionError(f"no reply to {event!r}")

    async def _refuse_slowly(self, context: grpc.aio.ServicerContext, refusal: Refused) -> None:
        """Refuses an abusive call (over a rate limit, oversized) after `REFUSAL_DELAY_S`, while fewer
        than `MAX_DELAYED` are waiting (then at once): a client that calls again as soon as it is
        answered, a retry loop or a flood, then costs one refusal a second, not as many as the event
        loop can answer, and honest calls do not queue behind them."""
        if self._delayed < MAX_DELAYED:
            self._delayed += 1
            try:
                await asyncio.sleep(REFUSAL_DELAY_S)
            finally:
                self._delayed -= 1
        await self._abort(context, refusal)

    async def _abort(self, context: grpc.aio.ServicerContext, refusal: Refused) -> None:
        if self.metrics is not None:
            self.metrics.refused.labels(code=refusal.code.lower()).inc()
        await context.abort(grpc.StatusCode[refusal.code], refusal.message)

    # --- the RPCs ---

    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext) -> pb.JoinReply:
        event = Join(request.peer_id, request.throughput, request.min_samples)
        reply = await self._request(context, request, request.peer_id, event)
        return pb.JoinReply(
            round=reply["round"], heartbeat_timeout_s=reply["heartbeat_timeout_s"], now=self.clock()
        )

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> pb.LeaveReply:
        await self._request(context, request, request.peer_id, Leave(request.peer_id))
        return pb.LeaveReply()

    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatReply:
        event = Heartbeat(
            request.peer_id, request.round, request.throughput, request.min_samples, request.exchange_s
        )
        reply = await self._request(context, request, request.peer_id, event)
        return pb.HeartbeatReply(compute_scale=reply["compute_scale"], now=self.clock())

    async def ReportReady(
        self, request: pb.ReportRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportReply:
        event = Report(
            request.peer_id,
            request.round,
            request.digest,
            request.size,
            request.samples,
            request.state,
            request.synced,
        )
        reply = await self._request(context, request, request.peer_id, event)
        return pb.ReportReply(**reply)

    async def Rounds(
        self, request: pb.RoundsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.RoundAnnouncement | bytes]:
        await self._request(context, request, request.peer_id)
        refusal = check_peer_id(request.peer_id)
        if refusal is not None:
            await self._abort(context, refusal)
        if len(self._subscribers) >= self.policy.max_members:
            await self._abort(context, Refused("RESOURCE_EXHAUSTED", "too many round subscribers"))
        queue: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue(maxsize=SUBSCRIBER_BACKLOG)
        self._subscribers.add(queue)
        sent = -1  # a round written but not yet broadcast is both open and on its way: sent once
        try:
            for pending in (self.saved.previous, self.saved.round):  # the open rounds, oldest first
                if pending is not None and pending.decided_at is None:
                    sent = pending.number
                    yield announcement(pending, self.clock())
            while True:
                number, message = await queue.get()
                if number > sent:
                    sent = number
                    yield message
        finally:
            self._subscribers.discard(queue)

    async def RoundResult(self, request: pb.RoundResultRequest, context: grpc.aio.ServicerContext) -> bytes:
        await self._request(context, request, None)
        give_up = time.monotonic() + MAX_WAIT_S
        while True:
            found = round_result(self.saved, request.round)
            if isinstance(found, Refused):
                await self._abort(context, found)
            if isinstance(found, Round):
                return self._result_reply(found)
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), max(0.0, give_up - time.monotonic()))
            except TimeoutError:
                await self._abort(context, Refused("DEADLINE_EXCEEDED", f"round {request.round} undecided"))

    def _result_reply(self, decided: Round) -> bytes:
        """The decided round's reply, serialized: built and serialized once per round (it lists every
        participant, and every member asks for it); each caller's clock reading is appended as a
        second message, which protobuf merges into the first (a later scalar field wins)."""
        cached = self._results.get(decided.number)
        if cached is None or cached[0] is not decided:
            cached = (decided, result_reply(decided, 0.0, self.policy.gather).SerializeToString())
            self._results[decided.number] = cached
            for number in sorted(self._results)[:-RESULTS_KEPT]:
                del self._results[number]
        # protobuf is untyped here
        return cached[1] + cast(bytes, pb.RoundResultReply(now=self.clock()).SerializeToString())

    async def SwarmStatus(
        self, request: pb.SwarmStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.SwarmStatusReply:
        await self._request(context, request, None)
        now, state = self.clock(), self.state
        current = state.round
        return pb.SwarmStatusReply(
            round=0 if current is None else current.number,
            members=[
                pb.MemberStatus(
                    peer_id=m.peer_id,
                    throughput=m.throughput,
                    round=m.round,
                    strikes=m.strikes,
                    compute_scale=m.compute_scale,
                    silent_s=max(0.0, now - m.last_seen),
                )
                for m in sorted(state.members.values(), key=lambda m: m.peer_id)
            ],
            compute_window_s=0.0 if current is None else current.compute_deadline - current.announced_at,
            exchange_window_s=0.0
            if current is None
            else current.exchange_deadline - current.compute_deadline,
            stragglers_total=state.stragglers_total,
            evictions_total=state.evictions_total,
            now=now,
        )


def _serialized(reply: Message | bytes) -> bytes:
    """A reply message serialized, or one the service serialized itself (bytes) as it is."""
    return reply if isinstance(reply, bytes) else reply.SerializeToString()


def add_service(service: CoordinatorService, server: grpc.aio.Server) -> None:
    """Registers the Coordinator service as the generated `add_CoordinatorServicer_to_server` does,
    but with replies that may come serialized (`_serialized`): what every member is sent alike is
    serialized once, not once per member."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["Coordinator"].methods:
        request = getattr(pb, method.input_type.name)
        if method.server_streaming:
            make = grpc.unary_stream_rpc_method_handler
        else:
            make = grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            getattr(service, method.name),
            request_deserializer=request.FromString,
            response_serializer=_serialized,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


class Coordinator:
    """A running coordinator: the gRPC server, its ticker, its state file."""

    def __init__(
        self,
        *,
        listen: str = "127.0.0.1:0",
        state_path: str | Path | None = None,
        policy: Policy | None = None,
        tokens: Tokens | None = None,
        tls: TlsFiles | None = None,
        metrics_port: int | None = None,
        limits: Limits | None = None,
    ):
        self.listen, self.state_path, self.tls = listen, state_path, tls
        self.limits = limits or Limits()
        self.policy = policy or Policy()
        self.tokens = tokens
        self.metrics_port = metrics_port
        self.port: int | None = None
        """The port bound, once started."""
        self.bound_metrics_port: int | None = None
        """The metrics port bound, once started (metrics_port 0: any free one)."""
        self.service: CoordinatorService | None = None
        self._server: grpc.aio.Server | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._writer: asyncio.Task[None] | None = None
        self._health = health.aio.HealthServicer()

    async def start(self) -> int:
        """Loads or creates the state, binds the port (raises OSError if it cannot), starts serving."""
        store = StateStore(self.state_path) if self.state_path is not None else None
        state = store.load() if store is not None else None
        now = time.time()
        state = initial_state(secrets.randbits(63)) if state is None else resume(state, now)
        if store is not None:
            store.save(None, state)
        metrics = None
        if self.metrics_port is not None:
            metrics = CoordinatorMetrics()
            host = self.listen.rpartition(":")[0].strip("[]")
            self.bound_metrics_port = metrics.serve(self.metrics_port, host)
        self.service = CoordinatorService(
            state, self.policy, store, self.tokens, metrics, limiter=self._limiter()
        )
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
                # every peer holds two streams at once (its `Rounds` and, after reporting, a waiting
                # `RoundResult`); grpc's aio server applies this limit to the whole server, and calls
                # beyond it wait: too low a limit stalls every call of a large swarm, mid-round
                ("grpc.max_concurrent_streams", 4 * self.policy.max_members + 100),
                ("grpc.so_reuseport", 0),  # a second coordinator on a port in use must fail, not share it
                # small calls: no bandwidth-estimation pings (peer/swarm/coordinator_link.py)
                ("grpc.http2.bdp_probe", 0),
            ],
            maximum_concurrent_rpcs=4 * self.policy.max_members + 100,
        )
        add_service(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        port: int
        try:
            if self.tls is None:
                port = server.add_insecure_port(self.listen)
            else:
                key_and_cert = (self.tls.key.read_bytes(), self.tls.cert.read_bytes())
                port = server.add_secure_port(self.listen, grpc.ssl_server_credentials([key_and_cert]))
        except RuntimeError as error:  # grpcio's "failed to bind": a port in use, or unusable TLS files
            port, reason = 0, str(error)
        else:
            reason = "the port is in use or the address is not this machine's"
        if port == 0:
            detail = "; or the TLS certificate and key are not a valid pair" if self.tls is not None else ""
            raise OSError(f"cannot listen on {self.listen}: {reason}{detail}")
        await server.start()
        for name in ("", SERVICE):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server, self.port = server, port
        self._ticker = asyncio.create_task(self.service.tick_forever())
        if store is not None:
            self._writer = asyncio.create_task(self.service.write_forever())
        return port

    def _limiter(self) -> RateLimiter:
        """Peers heartbeat three times per timeout (peer/swarm/coordinator_link.py): that, and more."""
        return RateLimiter(self.limits, heartbeats_per_s=3 / self.policy.heartbeat_timeout_s)

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace_s)
        if self._writer is not None:
            assert self.service is not None  # set before the writer is started
            with contextlib.suppress(RuntimeError, TimeoutError):  # logged by the writer
                await asyncio.wait_for(self.service.flush(), 10.0)
            self._writer.cancel()
        if self.service is not None and self.service.store is not None:
            self.service.store.close()
        if self.service is not None and self.service.metrics is not None:
            self.service.metrics.close()
