"""How long a leaving peer serves (PayloadServer.drain): its own last payload until the others have it,
and the others' payloads it re-serves until nobody has asked for one for RESERVED_QUIET_S."""

import asyncio
import hashlib
import time
from types import SimpleNamespace

import pytest

from shoal.peer.swarm.counters import SwarmCounters
from shoal.peer.swarm.server import RESERVED_QUIET_S, PayloadServer
from shoal.protocol.swarm_pb2 import PayloadRequest

pytestmark = pytest.mark.timeout(30)


def server() -> PayloadServer:
    return PayloadServer(
        run="r", counts=SwarmCounters(), max_payload_bytes=1 << 20, keep_states=1, timeout_s=1
    )


async def ask(server: PayloadServer, request: PayloadRequest, peer: str = "asker") -> bytes:
    context = SimpleNamespace(remote_id=SimpleNamespace(to_base58=lambda: peer))
    return b"".join([chunk.data async for chunk in server.serve(request, context)])


def test_a_leaving_peer_serves_what_it_re_serves_until_it_is_no_longer_asked_for():
    async def main():
        node = server()
        digest = node.hold(7, b"mine", None)
        node.expected_pullers = {"asker"}
        other = b"another peer's payload"
        theirs = PayloadRequest(round=7, digest=hashlib.sha256(other).digest())
        node.held[(7, theirs.digest)] = other
        assert await ask(node, PayloadRequest(round=7, digest=digest)) == b"mine"
        started = time.monotonic()
        assert await node.drain(started + 10) is True  # its own was pulled; it re-served nothing
        assert time.monotonic() - started < 0.5
        assert await ask(node, theirs) == other
        started = time.monotonic()
        draining = asyncio.create_task(node.drain(started + 10))
        await asyncio.sleep(RESERVED_QUIET_S / 2)
        assert not draining.done()
        # asked again: served, and the drain goes on from there
        assert (
            await ask(node, PayloadRequest(round=7, digest=hashlib.sha256(other).digest()), "late") == other
        )
        assert await draining is True
        assert 1.5 * RESERVED_QUIET_S - 0.2 <= time.monotonic() - started < 1.5 * RESERVED_QUIET_S + 1
        # asked for one it does not hold: nothing, and no wait
        assert await ask(node, PayloadRequest(round=7, digest=b"x" * 32)) == b""
        started = time.monotonic()
        assert await node.drain(started + 10) is True and time.monotonic() - started < 0.5

    asyncio.run(main())
