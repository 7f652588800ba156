"""A peer's exit sends its neighbours nothing the closing connections do not tell them.

Removing a libp2p handler makes the daemon push its new protocol list to every connected peer
(libp2p's identify push). hivemind's DHT removes its 4 handlers before it ends its daemon, and a
SwarmExchange removed its 5: at 16 peers that was a quarter of a coordinated run's wire traffic
besides the payloads (BENCHMARKS.md). Measured here on loopback: the same exit, the stock way
against shoal's (`TetheredDHT`, `PayloadServer.stop(unregister=False)`), with 6 neighbours.
"""

import asyncio
import time

import hivemind
import pytest

from shoal.peer.bench.swarm_local import loopback_tx_bytes
from shoal.peer.swarm.bootstrap import start_dht
from shoal.peer.swarm.counters import SwarmCounters
from shoal.peer.swarm.server import PayloadServer

NEIGHBOURS = 6


def _exit_bytes(shoal_way: bool) -> int:
    """Loopback bytes of one peer's exit (its payload server's handlers, then its DHT), the peer being
    the one every neighbour joined through, so connected to all of them."""
    maddrs = ["/ip4/127.0.0.1/tcp/0"]
    leaving = start_dht([], host_maddrs=maddrs) if shoal_way else hivemind.DHT(start=True, host_maddrs=maddrs)
    initial = [str(a) for a in leaving.get_visible_maddrs()]
    neighbours = [
        hivemind.DHT(start=True, initial_peers=initial, host_maddrs=maddrs) for _ in range(NEIGHBOURS)
    ]
    loop = asyncio.new_event_loop()
    try:
        p2p = loop.run_until_complete(leaving.replicate_p2p())
        server = PayloadServer(
            run="exit", counts=SwarmCounters(), max_payload_bytes=1 << 20, keep_states=1, timeout_s=5.0
        )
        loop.run_until_complete(server.start(p2p))
        time.sleep(2)  # the pushes of the handlers added are out
        before = loopback_tx_bytes()
        loop.run_until_complete(server.stop(p2p, unregister=not shoal_way))
        loop.run_until_complete(p2p.shutdown())
        leaving.shutdown()
        time.sleep(1)
        return loopback_tx_bytes() - before
    finally:
        loop.close()
        if leaving.is_alive():
            leaving.shutdown()
        for neighbour in neighbours:
            neighbour.shutdown()


@pytest.mark.timeout(120)
def test_an_exit_pushes_no_protocol_updates_to_the_neighbours():
    stock, shoal = _exit_bytes(shoal_way=False), _exit_bytes(shoal_way=True)
    # 9 pushes of about 0.6 kB to each of 6 neighbours, against their connections' ends alone
    assert stock > 15_000, stock
    assert shoal < stock / 3, (shoal, stock)
