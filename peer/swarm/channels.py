"""Payload channels: long-lived libp2p streams between two peers, over which payloads are pulled.

Opening a libp2p stream costs a handshake of its own (the stream's opening and closing frames, and the
protocol's negotiation): about ten small packets, 1-2 KB on the wire with their TCP/IP headers. A
step's DeMo payload is about 9 KB, so a stream per pull was most of the exchange's overhead
(BENCHMARKS.md). A channel is opened once and then carries one request and its reply after another.

Wire format, both ways a 4-byte big-endian length, then that many bytes:

    request   length (at most MAX_REQUEST_BYTES), a serialized PayloadRequest
    reply     length, the payload; 0 when the peer does not hold it

The puller (`Channels`) keeps up to IDLE_PER_PEER idle channels per peer and opens another when all
are busy, so that two pulls from one peer never wait on each other. A channel that fails in any way is
closed, never reused; one that was idle may have been closed by the other side meanwhile, so a pull on
it is tried once more on a fresh one. Every wait is bounded by the timeout.

The server (`ChannelServer`) answers from the exchange's own handler (an async generator of
PayloadChunks, as for a one-off stream). It accepts at most MAX_CHANNELS_PER_PEER channels per
peer and MAX_CHANNELS in all, closes one idle for IDLE_TIMEOUT_S, and closes (and counts) any that
sends an oversized or malformed request.
"""

import asyncio
import contextlib
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable

from google.protobuf.message import DecodeError
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from shoal.protocol import MalformedPayloadError
from shoal.protocol.swarm_pb2 import PayloadChunk, PayloadRequest

HEADER_BYTES = 4
MAX_REQUEST_BYTES = 1024
READ_BYTES = 1 << 20  # a reply is read in pieces of this size, each within the timeout
IDLE_PER_PEER = 2
MAX_IDLE = 256  # idle channels kept in all (the least recently used go first)
MAX_CHANNELS_PER_PEER = 8
MAX_CHANNELS = 512
IDLE_TIMEOUT_S = 300.0

Serve = Callable[[PayloadRequest, P2PContext], AsyncIterator[PayloadChunk]]


class _Channel:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class Channels:
    """The puller's side; see the module docstring. Create and use on one event loop."""

    def __init__(self, p2p: P2P, protocol: str, timeout_s: float):
        self.p2p, self.protocol, self.timeout_s = p2p, protocol, timeout_s
        self.opened = 0
        """Channels opened (a pull that found one idle opened none)."""
        self._idle: OrderedDict[str, list[_Channel]] = OrderedDict()

    async def pull(self, peer: str, request: PayloadRequest, max_bytes: int) -> bytes:
        """The payload `peer` holds for `request` (empty if none), at most `max_bytes`; raises
        MalformedPayloadError (too_large) or a transient error (timeout, closed stream)."""
        idle = self._idle.get(peer)
        if idle:
            channel = idle.pop()
            try:
                return await self._ask(peer, channel, request, max_bytes)
            except MalformedPayloadError:
                raise
            except Exception:  # closed while idle, most likely: once more on a fresh channel
                pass
        return await self._ask(peer, await self._open(peer), request, max_bytes)

    def close(self) -> None:
        for channels in self._idle.values():
            for channel in channels:
                channel.close()
        self._idle.clear()

    async def _open(self, peer: str) -> _Channel:
        _, reader, writer = await asyncio.wait_for(
            self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), self.protocol), self.timeout_s
        )
        self.opened += 1
        return _Channel(reader, writer)

    async def _ask(self, peer: str, channel: _Channel, request: PayloadRequest, max_bytes: int) -> bytes:
        try:
            body = request.SerializeToString()
            channel.writer.write(len(body).to_bytes(HEADER_BYTES, "big") + body)
            await asyncio.wait_for(channel.writer.drain(), self.timeout_s)
            header = await asyncio.wait_for(channel.reader.readexactly(HEADER_BYTES), self.timeout_s)
            size = int.from_bytes(header, "big")
            if size > max_bytes:
                raise MalformedPayloadError("too_large", f"{peer} sent more than {max_bytes} bytes")
            parts, left = [], size
            while left:
                part = await asyncio.wait_for(
                    channel.reader.readexactly(min(left, READ_BYTES)), self.timeout_s
                )
                parts.append(part)
                left -= len(part)
        except BaseException:
            channel.close()
            raise
        self._keep(peer, channel)
        return b"".join(parts)

    def _keep(self, peer: str, channel: _Channel) -> None:
        idle = self._idle.setdefault(peer, [])
        self._idle.move_to_end(peer)
        if len(idle) >= IDLE_PER_PEER:
            channel.close()
            return
        idle.append(channel)
        while sum(len(channels) for channels in self._idle.values()) > MAX_IDLE:
            _, oldest = self._idle.popitem(last=False)
            for stale in oldest:
                stale.close()


class ChannelServer:
    """The serving side; see the module docstring. `handle` is a hivemind binary stream handler."""

    def __init__(
        self, serve: Serve, local_id: PeerID, protocol: str, timeout_s: float, rejected: Counter[str]
    ):
        self.serve, self.local_id, self.protocol = serve, local_id, protocol
        self.timeout_s, self.rejected = timeout_s, rejected
        self.open: Counter[PeerID] = Counter()
        self._writers: set[asyncio.StreamWriter] = set()

    async def handle(
        self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        peer = info.peer_id
        if self.open[peer] >= MAX_CHANNELS_PER_PEER or sum(self.open.values()) >= MAX_CHANNELS:
            self.rejected["channels"] += 1
            writer.close()
            return
        self.open[peer] += 1
        self._writers.add(writer)
        context = P2PContext(handle_name=self.protocol, local_id=self.local_id, remote_id=peer)
        try:
            while True:
                header = await asyncio.wait_for(reader.readexactly(HEADER_BYTES), IDLE_TIMEOUT_S)
                size = int.from_bytes(header, "big")
                if size > MAX_REQUEST_BYTES:
                    self.rejected["channel_request"] += 1
                    return
                body = await asyncio.wait_for(reader.readexactly(size), self.timeout_s)
                try:
                    request = PayloadRequest.FromString(body)
                except DecodeError:
                    self.rejected["channel_request"] += 1
                    return
                # the handler's chunks (at most 1 MiB each) go out as they are: no joined copy
                parts = [chunk.data async for chunk in self.serve(request, context)]
                writer.write(sum(map(len, parts)).to_bytes(HEADER_BYTES, "big"))
                for part in parts:
                    writer.write(part)
                    await asyncio.wait_for(writer.drain(), self.timeout_s)
                await asyncio.wait_for(writer.drain(), self.timeout_s)
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError, OSError):
            return  # closed by the puller, idle, or too slow to read: the channel is done
        finally:
            self.open[peer] -= 1
            if self.open[peer] <= 0:
                del self.open[peer]
            self._writers.discard(writer)
            writer.close()

    def close(self) -> None:
        """Closes every channel, so that their handlers return."""
        for writer in list(self._writers):
            with contextlib.suppress(Exception):
                writer.close()
