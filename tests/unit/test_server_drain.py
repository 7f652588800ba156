"""How long a leaving peer serves (PayloadServer.drain): its own last payload until the others have it,
and the others' payloads it re-serves until nobody has asked for one for RESERVED_QUIET_S."""

import asyncio
import hashlib
import time
from types import SimpleNamespace

import pytest

from shoal.peer.swarm.counters import SwarmCounters
from shoal.peer.swarm.records import Announcement
from shoal.peer.swarm.server import RESERVED_QUIET_S, PayloadServer, round_pullers
from shoal.peer.swarm.state import Tally
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


def announcements(count: int) -> dict[bytes, Announcement]:
    return {
        bytes([i]) * 4: Announcement(bytes([i]) * 4, f"peer{i}", bytes([i]) * 32, 10, 1) for i in range(count)
    }


def test_every_peer_of_a_round_pulls_a_chosen_payload_not_only_the_other_chosen():
    """`--gather 2` of 5: the author of a chosen payload waits for the 4 others, the 3 left out too (a
    leaving author that waited only for the chosen left a slower peer of the last round without it)."""
    everyone = announcements(5)
    owners = list(everyone)
    chosen = {owner: everyone[owner] for owner in owners[:2]}
    me, left_out = owners[0], owners[4]
    assert round_pullers(me, chosen, everyone) == ({"peer1", "peer2", "peer3", "peer4"}, 4)
    assert round_pullers(left_out, chosen, everyone) == (set(), 0)
    assert round_pullers(me, everyone, None) == ({"peer1", "peer2", "peer3", "peer4"}, 4)  # no limit
    # under a coordinator's --gather its result names only the chosen; its tally counts every voter
    tally = Tally({(b"s" * 32, True): 4, (b"t" * 32, False): 3}, {})
    assert round_pullers(me, chosen, tally) == ({"peer1"}, 6)


def test_a_leaving_peer_waits_for_as_many_pullers_as_its_round_counted():
    async def main():
        node = server()
        digest = node.hold(7, b"mine", None)
        node.expect_pulls({"named"}, 3)
        request = PayloadRequest(round=7, digest=digest)
        assert await ask(node, request, "named") == b"mine"
        assert await ask(node, request, "second") == b"mine"
        started = time.monotonic()
        assert await node.drain(started + 0.5) is False  # one of the three never came
        assert time.monotonic() - started >= 0.5
        draining = asyncio.create_task(node.drain(time.monotonic() + 10))
        await asyncio.sleep(0.2)
        assert not draining.done()
        assert await ask(node, request, "third") == b"mine"
        assert await draining is True

    asyncio.run(main())
