"""Payloads reach every participant even when their origin serves them only once: peers re-serve
what they pulled, and a puller falls back to them (real DHTs and libp2p streams, in one process)."""

import hashlib
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch

from shoal.peer.swarm.exchange import SwarmExchange
from shoal.peer.swarm.server import PROBE_MAX_BYTES, PayloadServer
from shoal.protocol.swarm_pb2 import PayloadRequest, ProbeRequest
from tests.integration.harness import swarm


class OnceServer(PayloadServer):
    """An origin with a thin uplink: it sends each of its own payloads to one puller only."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.served: set[tuple[int, bytes]] = set()

    async def serve(self, request, context):
        key = (request.round, request.digest)
        if key in self.served:
            return
        self.served.add(key)
        async for chunk in super().serve(request, context):
            yield chunk


class ServesOnce(SwarmExchange):
    server_type = OnceServer


@pytest.mark.timeout(90)
def test_a_payload_served_once_by_its_origin_reaches_every_peer_through_relays():
    with swarm([ServesOnce] + [SwarmExchange] * 3) as (exchanges, schedule):
        payloads = [bytes([i]) * 300_000 for i in range(4)]
        time.sleep(max(0.0, schedule.start_time - time.time()))
        with ThreadPoolExecutor(4) as pool:
            rounds = list(pool.map(lambda i: exchanges[i].gather(payloads[i], samples=i + 1), range(4)))
        expected = sorted(hashlib.sha256(p).digest() for p in payloads)
        for contributions in rounds:
            assert sorted(hashlib.sha256(c.payload).digest() for c in contributions) == expected
            assert [c.samples for c in contributions] == [c.samples for c in rounds[0]]  # one order
        # the origin served its payload to one peer; the two others got it from a relay
        assert len(exchanges[0].server.served) == 1
        assert sum(exchange.relayed for exchange in exchanges) >= 2
        assert not any(exchange.counts.rejected for exchange in exchanges)

        # the bandwidth probe (`shoal check`) is capped and rate-limited per asking peer
        def probe(asker: SwarmExchange) -> bytes:
            request = ProbeRequest(size=2**32 - 1)
            return asker._call(asker.puller.pull(exchanges[0].peer_id, "shoal.r.probe", request, 64 << 20))

        assert len(probe(exchanges[1])) == PROBE_MAX_BYTES
        assert probe(exchanges[1]) == b""
        assert exchanges[0].counts.rejected["probe_rate"] == 1
        assert len(probe(exchanges[2])) == PROBE_MAX_BYTES  # another peer is not limited by the first


@pytest.mark.timeout(90)
def test_a_leaving_peer_serves_its_last_payload_until_the_others_pulled_it_or_its_drain_ends():
    with swarm([SwarmExchange] * 2, round_seconds=3) as (exchanges, schedule):
        leaving, staying = exchanges
        payloads = [b"a" * 50_000, b"b" * 50_000]
        time.sleep(max(0.0, schedule.start_time - time.time()))
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda i: exchanges[i].gather(payloads[i], samples=1), range(2)))
        number, digest = leaving.server.mine
        assert leaving.server.expected_pullers == {staying.peer_id}
        for exchange in exchanges:
            exchange.server.pullers.clear()  # as if the other peer had not pulled it yet

        def pull() -> bytes:
            request = PayloadRequest(round=number, digest=digest)
            return staying._call(staying.puller.pull(leaving.peer_id, "shoal.r.payload", request, 1 << 20))

        with ThreadPoolExecutor(1) as pool:
            started = time.monotonic()
            closing = pool.submit(leaving.close, timedelta(seconds=20))
            time.sleep(1.5)  # the slower peer comes for it late
            assert pull() == payloads[0]
            assert closing.result(timeout=10) is True
            assert 1.5 <= time.monotonic() - started < 10  # waited for it, not for the whole drain
        # the peer that left never pulls the other's payload: that drain ends on its time limit
        started = time.monotonic()
        assert staying.close(timedelta(seconds=1)) is False
        assert 1 <= time.monotonic() - started < 5


@pytest.mark.timeout(90)
def test_peers_that_end_a_run_on_two_states_all_end_on_the_majoritys():
    """A split in a run's last round has no next round to heal it: `agree_final` does. Three real peers
    end on two states (two on one, one on another): the odd one takes the majority's state, verified
    by digest, and the two others keep theirs; a swarm that agrees ends at once, well before the wait."""
    with swarm([SwarmExchange] * 3, round_seconds=4) as (exchanges, schedule):
        agreed = [torch.linspace(-1, 1, 5000), torch.ones(3, 7)]
        odd = [torch.linspace(-1, 1, 5000) * 1.001, torch.ones(3, 7)]
        states = [agreed, [t.clone() for t in agreed], odd]
        time.sleep(max(0.0, schedule.start_time - time.time()))
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda i: exchanges[i].agree_final(7, states[i]), range(3)))
        assert results[0] is None and results[1] is None
        assert results[2] is not None
        for got, want in zip(results[2], agreed, strict=True):
            assert torch.equal(got, want)
        assert exchanges[2].counts.resyncs == 1

        started = time.monotonic()
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda i: exchanges[i].agree_final(8, agreed), range(3)))
        assert results == [None, None, None]
        assert time.monotonic() - started < 4  # everyone announced: no one waits out the 8 s
