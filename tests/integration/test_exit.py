"""A peer's exit sends its neighbours nothing the closing connections do not tell them.

Removing a libp2p handler makes the daemon push its new protocol list to every connected peer
(libp2p's identify push). hivemind's DHT removes its 4 handlers before it ends its daemon, and a
SwarmExchange removed its 5: at 16 peers that was a quarter of a coordinated run's wire traffic
besides the payloads (BENCHMARKS.md). Measured here on loopback: the same exit, the stock way
against shoal's (`TetheredDHT`, `PayloadServer.stop(unregister=False)`), with 6 neighbours, in a
network namespace of its own (`unshare --net`), whose loopback carries nothing else: the other
pytest-xdist worker's swarms share the machine's.
"""

import asyncio
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable

import hivemind
import pytest

from shoal.peer.bench.swarm_local import loopback_tx_bytes
from shoal.peer.swarm.bootstrap import start_dht
from shoal.peer.swarm.counters import SwarmCounters
from shoal.peer.swarm.server import PayloadServer
from tests.integration.harness import ROOT, wait_until

NEIGHBOURS = 6
QUIET_S = 0.5


def quiet(since: int | None = None) -> Callable[[], bool]:
    """A condition: the loopback has sent more than `since` bytes (None: whatever it has), then nothing
    for QUIET_S. The daemons send what a change makes them send at once (within 0.05 s, measured), and
    nothing else crosses this namespace's loopback while the peers are idle."""
    last = [loopback_tx_bytes(), time.monotonic()]

    def quiet_now() -> bool:
        sent = loopback_tx_bytes()
        if sent != last[0]:
            last[:] = [sent, time.monotonic()]
        return (since is None or sent > since) and time.monotonic() - last[1] >= QUIET_S

    return quiet_now


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
        added = loopback_tx_bytes()
        loop.run_until_complete(server.start(p2p))
        wait_until(quiet(since=added), 20, "the pushes of the handlers added to be out", interval_s=0.05)
        before = loopback_tx_bytes()
        loop.run_until_complete(server.stop(p2p, unregister=not shoal_way))
        loop.run_until_complete(p2p.shutdown())
        leaving.shutdown()
        wait_until(quiet(), 20, "the exit's bytes to be out", interval_s=0.05)
        return loopback_tx_bytes() - before
    finally:
        loop.close()
        if leaving.is_alive():
            leaving.shutdown()
        for neighbour in neighbours:
            neighbour.shutdown()


def _measure_alone() -> dict[str, int]:
    """Both exits, measured by this module run in a new network namespace (a new user namespace too,
    so that no root is needed), its loopback brought up first."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs unshare (util-linux) and ip (iproute2)")
    measure = f"ip link set lo up && exec {sys.executable} -m tests.integration.test_exit"
    done = subprocess.run(
        ["unshare", "--map-root-user", "--net", "sh", "-c", measure],
        cwd=ROOT, capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.timeout(120)
def test_an_exit_pushes_no_protocol_updates_to_the_neighbours():
    measured = _measure_alone()
    stock, shoal = measured["stock"], measured["shoal"]
    # 9 pushes of about 0.6 kB to each of 6 neighbours, against their connections' ends alone
    assert stock > 15_000, stock
    assert shoal < stock / 3, (shoal, stock)


if __name__ == "__main__":
    print(json.dumps({"stock": _exit_bytes(shoal_way=False), "shoal": _exit_bytes(shoal_way=True)}))
