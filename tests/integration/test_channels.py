"""Payload channels (shoal.peer.swarm.channels) between two real libp2p daemons on loopback: reuse,
recovery from a channel the server closed, and what a hostile peer's requests and replies get."""

import asyncio
from collections import Counter

import pytest
from hivemind.p2p import P2P

from shoal.peer.swarm import channels as swarm_channels
from shoal.peer.swarm.channels import HEADER_BYTES, MAX_REQUEST_BYTES, Channels, ChannelServer
from shoal.protocol import MalformedPayloadError
from shoal.protocol.swarm_pb2 import PayloadChunk, PayloadRequest
from tests.integration.harness import wait_until

PROTOCOL = "shoal.test.payloads"


async def two_peers() -> tuple[P2P, P2P]:
    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client = await P2P.create(
        host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await server.get_visible_maddrs()
    )
    return server, client


def serving(payloads: dict[bytes, bytes], asked: list):
    async def serve(request: PayloadRequest, context):
        asked.append((request.round, request.digest, context.remote_id))
        data = payloads.get(request.digest, b"")
        for start in range(0, len(data), 1 << 20):
            yield PayloadChunk(data=data[start : start + (1 << 20)])

    return serve


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 60))


@pytest.mark.timeout(90)
def test_pulls_reuse_one_channel_and_recover_when_the_server_closed_it():
    async def scenario():
        server, client = await two_peers()
        try:
            big = bytes(range(256)) * 12_000  # 3 MB: several read pieces
            payloads, asked, rejected = {b"a" * 32: b"x" * 9_400, b"b" * 32: big}, [], Counter()
            channel_server = ChannelServer(serving(payloads, asked), server.peer_id, PROTOCOL, 10, rejected)
            await server.add_binary_stream_handler(PROTOCOL, channel_server.handle)
            channels = Channels(client, PROTOCOL, timeout_s=10)
            peer = server.peer_id.to_base58()
            for _ in range(3):
                assert (
                    await channels.pull(peer, PayloadRequest(round=7, digest=b"a" * 32), 10_000)
                    == b"x" * 9_400
                )
            assert await channels.pull(peer, PayloadRequest(round=7, digest=b"b" * 32), len(big)) == big
            assert await channels.pull(peer, PayloadRequest(round=7, digest=b"c" * 32), 10_000) == b""
            assert channels.opened == 1  # five pulls, one stream
            assert [a[:2] for a in asked[:1]] == [(7, b"a" * 32)] and asked[0][2] == client.peer_id
            # two pulls at once do not wait on each other: a second channel
            both = await asyncio.gather(
                *(channels.pull(peer, PayloadRequest(round=8, digest=b"b" * 32), len(big)) for _ in range(2))
            )
            assert both == [big, big] and channels.opened == 2
            # the server closes its channels (as on its idle timeout): the next pull opens a fresh one
            channel_server.close()
            await asyncio.to_thread(
                wait_until,
                lambda: not channel_server.open,
                10,
                "the server's channels closed",
                interval_s=0.05,
            )
            assert (
                await channels.pull(peer, PayloadRequest(round=9, digest=b"a" * 32), 10_000) == b"x" * 9_400
            )
            assert channels.opened == 3
            assert not rejected
            channels.close()
        finally:
            await client.shutdown()
            await server.shutdown()

    run(scenario())


@pytest.mark.timeout(90)
def test_hostile_requests_and_replies_are_refused_and_counted(monkeypatch):
    monkeypatch.setattr(swarm_channels, "MAX_CHANNELS_PER_PEER", 2)

    async def scenario():
        server, client = await two_peers()
        try:
            payloads, rejected = {b"a" * 32: b"y" * 5_000}, Counter()
            channel_server = ChannelServer(serving(payloads, []), server.peer_id, PROTOCOL, 10, rejected)
            await server.add_binary_stream_handler(PROTOCOL, channel_server.handle)

            async def raw(message: bytes) -> bytes:
                """What the server answers to `message` sent on a fresh stream, until it closes it."""
                _, reader, writer = await client.call_binary_stream_handler(server.peer_id, PROTOCOL)
                writer.write(message)
                await writer.drain()
                try:
                    return await asyncio.wait_for(reader.read(), 10)
                finally:
                    writer.close()

            # a request longer than allowed: closed unanswered, before its body is read
            assert await raw((MAX_REQUEST_BYTES + 1).to_bytes(HEADER_BYTES, "big")) == b""
            assert rejected["channel_request"] == 1
            # bytes that are not a PayloadRequest
            assert await raw((3).to_bytes(HEADER_BYTES, "big") + b"\xff\xff\xff") == b""
            assert rejected["channel_request"] == 2
            # a valid request still gets its answer on a raw stream
            body = PayloadRequest(round=1, digest=b"a" * 32).SerializeToString()
            _, reader, writer = await client.call_binary_stream_handler(server.peer_id, PROTOCOL)
            writer.write(len(body).to_bytes(HEADER_BYTES, "big") + body)
            header = await asyncio.wait_for(reader.readexactly(HEADER_BYTES), 10)
            assert int.from_bytes(header, "big") == 5_000
            assert await reader.readexactly(5_000) == b"y" * 5_000
            # more channels than a peer may hold open: the extra one is closed at once
            _, _, other_writer = await client.call_binary_stream_handler(server.peer_id, PROTOCOL)
            other_writer.write(b"\x00")  # the stream reaches the server with its first bytes
            await other_writer.drain()
            await asyncio.to_thread(
                wait_until,
                lambda: channel_server.open[client.peer_id] == 2,
                10,
                "the server holding both channels open",
                interval_s=0.05,
            )
            assert await raw(len(body).to_bytes(HEADER_BYTES, "big") + body) == b""
            assert rejected["channels"] == 1
            writer.close()
            other_writer.close()
            # the server sees both closed (else it refuses the next channel as a third)
            await asyncio.to_thread(
                wait_until, lambda: not channel_server.open, 10, "both channels closed", interval_s=0.1
            )

            # a server that sends more than the puller expects: rejected as too large, channel dropped
            channels = Channels(client, PROTOCOL, timeout_s=10)
            with pytest.raises(MalformedPayloadError) as error:
                await channels.pull(
                    server.peer_id.to_base58(), PayloadRequest(round=1, digest=b"a" * 32), 4_999
                )
            assert error.value.reason == "too_large"
            assert not channels._idle.get(server.peer_id.to_base58())
            channels.close()
        finally:
            await client.shutdown()
            await server.shutdown()

    run(scenario())


@pytest.mark.timeout(60)
def test_a_server_that_never_answers_times_out():
    async def scenario():
        server, client = await two_peers()
        try:

            async def silent(_info, reader, writer):
                await reader.read()  # reads the request, never answers

            await server.add_binary_stream_handler(PROTOCOL, silent)
            channels = Channels(client, PROTOCOL, timeout_s=1)
            with pytest.raises(TimeoutError):
                await channels.pull(
                    server.peer_id.to_base58(), PayloadRequest(round=1, digest=b"a" * 32), 100
                )
            channels.close()
        finally:
            await client.shutdown()
            await server.shutdown()

    run(scenario())
