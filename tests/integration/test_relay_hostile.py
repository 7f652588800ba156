"""A `shoal bootstrap` relay (shoal.peer.swarm.relay) against bad requests, on loopback: real libp2p
daemons, the relay in a BootstrapNode, hostile and honest peers as hivemind P2P clients."""

import asyncio
import hashlib

import pytest
from hivemind.p2p import P2P, PeerID

from shoal.peer.swarm import relay as relay_module
from shoal.peer.swarm.bootstrap import BootstrapNode
from shoal.peer.swarm.names import handler
from shoal.peer.swarm.pull import RELAY_HANDLER
from shoal.protocol.swarm_pb2 import (
    PayloadChunk,
    PayloadRequest,
    ReachReply,
    ReachRequest,
    RelayRequest,
    StateRequest,
)
from tests.integration.harness import wait_until

GOOD = b"the payload of round 3" * 100


async def ask(p2p: P2P, relay: str, request: RelayRequest) -> bytes:
    stream = await p2p.iterate_protobuf_handler(
        PeerID.from_base58(relay), RELAY_HANDLER, request, PayloadChunk
    )
    return b"".join([chunk.data async for chunk in stream])


async def behind(initial: list[str], served: bytes, calls: list[int]) -> P2P:
    """A peer connected to the relay that serves `served` for any payload of run `r`."""
    p2p = await P2P.create(initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"])

    async def serve(_request, _context):
        calls.append(1)
        yield PayloadChunk(data=served)

    await p2p.add_protobuf_handler(handler("r", "payload"), serve, PayloadRequest, stream_output=True)
    return p2p


@pytest.mark.timeout(120)
def test_the_relay_checks_caches_and_refuses_what_it_must(monkeypatch):
    monkeypatch.setattr(relay_module, "BURST", 10)
    with BootstrapNode.start(host="127.0.0.1", port=0, relay_cache_bytes=1 << 20) as node:
        initial = [node.address]
        relay_id = initial[0].rpartition("/p2p/")[2]

        async def scenario() -> None:
            honest_calls, liar_calls = [], []
            honest = await behind(initial, GOOD, honest_calls)
            liar = await behind(initial, b"not what was announced", liar_calls)
            asker = await P2P.create(initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            try:
                await asyncio.to_thread(  # the relay is connected to the two peers behind it, and the asker
                    wait_until, lambda: node.connections() >= 3, 30, "three peers connected to the relay"
                )
                digest = hashlib.sha256(GOOD).digest()
                wanted = PayloadRequest(round=3, digest=digest)
                get = RelayRequest(run="r", peer=honest.peer_id.to_base58(), payload=wanted)
                # the payload, fetched once, then served from the cache
                assert await ask(asker, relay_id, get) == GOOD
                assert await ask(asker, relay_id, get) == GOOD
                assert len(honest_calls) == 1
                # bytes that do not match the digest asked for are not relayed, nor kept (a payload
                # cached is served whoever is asked for: its digest names it)
                other = PayloadRequest(round=4, digest=hashlib.sha256(b"round 4").digest())
                lie = RelayRequest(run="r", peer=liar.peer_id.to_base58(), payload=other)
                assert await ask(asker, relay_id, lie) == b""
                # malformed requests, and a peer the relay is not connected to (it dials nobody)
                stranger = PeerID.from_base58(relay_id).to_base58()[:-4] + "abcd"  # nobody
                for bad in (
                    RelayRequest(run="no spaces", peer=honest.peer_id.to_base58(), payload=wanted),
                    RelayRequest(run="r", peer="not-a-peer-id", payload=wanted),
                    RelayRequest(run="r", peer=honest.peer_id.to_base58()),
                    RelayRequest(
                        run="r", peer=honest.peer_id.to_base58(), payload=PayloadRequest(digest=b"x")
                    ),
                    RelayRequest(run="r", peer=stranger, state=StateRequest(state=digest, manifest=True)),
                ):
                    assert await ask(asker, relay_id, bad) == b""
                # a flood: past the burst, requests are refused until the bucket refills
                flood = await asyncio.gather(*(ask(asker, relay_id, get) for _ in range(30)))
                assert flood.count(GOOD) <= 15 and flood.count(b"") >= 15
                await asyncio.sleep(0.5)
                assert await ask(asker, relay_id, get) == GOOD  # served again: nothing broke
                # reachability: a peer on loopback is dialed back; asked again at once, not checked
                ports = [
                    int(str(a).split("/tcp/")[1].split("/")[0]) for a in await asker.get_visible_maddrs()
                ]
                call = asker.call_protobuf_handler
                reply = await call(
                    PeerID.from_base58(relay_id), "shoal.reach", ReachRequest(ports=ports[:1]), ReachReply
                )
                assert reply.checked and reply.reachable and reply.observed == "/ip4/127.0.0.1", reply
                again = await call(
                    PeerID.from_base58(relay_id), "shoal.reach", ReachRequest(ports=ports[:1]), ReachReply
                )
                assert not again.checked
                too_many = await call(
                    PeerID.from_base58(relay_id),
                    "shoal.reach",
                    ReachRequest(ports=list(range(1, 10))),
                    ReachReply,
                )
                assert not too_many.checked
            finally:
                for p2p in (honest, liar, asker):
                    await p2p.shutdown()

        asyncio.run(scenario())
        counts = node.relay_counters()
        assert counts["rejected"]["digest_mismatch"] == 1, counts
        assert counts["rejected"]["bad_request"] == 5, counts  # 4 relay requests, 1 reach
        assert counts["rejected"]["not_connected"] == 1, counts
        assert counts["rejected"].get("rate", 0) + counts["rejected"].get("too_many_streams", 0) >= 15, counts
        assert counts["rejected"]["reach_rate"] == 1, counts
        assert counts["streams"]["cached"] >= 2 and counts["streams"]["payload"] == 2, counts
        assert counts["cache"]["payloads"] == 1, counts
