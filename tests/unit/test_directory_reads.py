"""How far a RunDirectory read reaches (shoal.peer.swarm.directory): every replica when the key was not
read from all of them for a while, or when asked to; the nearest only in between."""

import asyncio

import pytest

from shoal.peer.swarm import directory as directory_module
from shoal.peer.swarm.bootstrap import REPLICAS
from shoal.peer.swarm.counters import SwarmCounters
from shoal.peer.swarm.directory import RunDirectory
from shoal.peer.swarm.names import peers_key, round_key
from tests.unit.test_run_clock import record


class Reads:
    """Stands in for hivemind.DHT: records the beam of each read, holds nothing."""

    def __init__(self):
        self.beams: list[tuple[str, int]] = []

    async def get(self, key, *, latest, return_future, beam_size, num_workers):
        assert latest and return_future and beam_size == num_workers
        self.beams.append((key, beam_size))


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(directory_module.time, "monotonic", lambda: now[0])
    return now


def directory(dht: Reads, round_seconds: float) -> RunDirectory:
    return RunDirectory(
        dht,
        run="run",
        owner=b"me",
        record=record(0.0, round_seconds),
        counts=SwarmCounters(),
        coordinated=False,
    )


def test_announcements_are_read_from_every_replica_a_quarter_of_a_round_apart(clock):
    dht = Reads()
    run = directory(dht, round_seconds=12.0)
    key = round_key("run", 5)
    for at in (0.0, 1.0, 2.9, 3.0, 4.0, 6.5):
        clock[0] = 1000.0 + at
        asyncio.run(run.announcements(key, max_payload_bytes=1 << 20))
    assert [beam for _, beam in dht.beams] == [REPLICAS, 1, 1, REPLICAS, 1, REPLICAS]
    assert run.counts.dht_reads == 6


def test_the_peer_list_is_read_fully_every_round_and_a_half_or_when_a_stranger_announced(clock):
    dht = Reads()
    run = directory(dht, round_seconds=12.0)
    for at, fully in ((0.0, False), (12.0, False), (18.0, False), (19.0, True), (20.0, False)):
        clock[0] = 1000.0 + at
        asyncio.run(run.compatible_peers(fully=fully))
    assert dht.beams == [(peers_key("run"), beam) for beam in (REPLICAS, 1, REPLICAS, REPLICAS, 1)]


def test_short_rounds_still_read_every_replica_at_most_once_a_second(clock):
    dht = Reads()
    run = directory(dht, round_seconds=2.0)
    key = round_key("run", 1)
    for at in (0.0, 0.5, 0.99, 1.0):
        clock[0] = 1000.0 + at
        asyncio.run(run.announcements(key, max_payload_bytes=1 << 20))
    assert [beam for _, beam in dht.beams] == [REPLICAS, 1, 1, REPLICAS]
