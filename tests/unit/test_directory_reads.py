"""How far a RunDirectory read reaches (shoal.peer.swarm.directory): every replica when the key was not
read from all of them for a while, or when asked to; the nearest only in between. And how often the
peer list is read at all: its last read stands for two rounds, less the records that expired since."""

import asyncio

import pytest
from hivemind.utils.timed_storage import ValueWithExpiration

from shoal.peer.swarm import directory as directory_module
from shoal.peer.swarm.bootstrap import REPLICAS
from shoal.peer.swarm.counters import SwarmCounters
from shoal.peer.swarm.directory import RunDirectory
from shoal.peer.swarm.names import peers_key, round_key
from shoal.peer.swarm.records import Announcement, RoundSchedule
from shoal.protocol import MalformedPayloadError
from tests.unit.test_run_clock import record


class Reads:
    """Stands in for hivemind.DHT: records the beam of each read, answers with `held`."""

    def __init__(self, held=None):
        self.beams: list[tuple[str, int]] = []
        self.held = held

    async def get(self, key, *, latest, return_future, beam_size, num_workers):
        assert latest and return_future and beam_size == num_workers
        self.beams.append((key, beam_size))
        return self.held


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


def test_reads_asked_of_the_nearest_start_the_quarter_round_and_do_not_reset_it(clock):
    dht = Reads()
    run = directory(dht, round_seconds=12.0)
    key = round_key("run", 5)
    for at, nearest in ((0.0, True), (1.0, False), (2.9, False), (3.0, False), (4.0, True), (6.5, True)):
        clock[0] = 1000.0 + at
        asyncio.run(run.announcements(key, max_payload_bytes=1 << 20, nearest=nearest))
    # a peer still missing a quarter of a round after the first read: every replica, then at most
    # every quarter of a round; reads asked of the nearest (a round's first): so, however long since
    assert [beam for _, beam in dht.beams] == [1, 1, 1, REPLICAS, 1, 1]


def test_the_peer_list_is_read_every_two_rounds_fully_every_eight_or_at_once_for_a_stranger(clock):
    # the first read asks the nearest replica (and starts the eight rounds): a stranger shows what it lacks
    dht = Reads()
    run = directory(dht, round_seconds=12.0)
    for at, fully in ((0.0, False), (12.0, False), (24.0, False), (30.0, True), (40.0, False), (54.0, False)):
        clock[0] = 1000.0 + at
        assert asyncio.run(run.compatible_peers(fully=fully)) == {b"me"}
    for at in (78.0, 102.0, 125.9, 126.0):  # 96 s (8 rounds) after the last read from every replica
        clock[0] = 1000.0 + at
        asyncio.run(run.compatible_peers())
    assert dht.beams == [(peers_key("run"), beam) for beam in (1, 1, REPLICAS, 1, 1, 1, REPLICAS)]


def test_between_reads_of_the_peer_list_a_peer_whose_record_expired_is_dropped(clock, monkeypatch):
    now = [5000.0]
    monkeypatch.setattr(directory_module.time, "time", lambda: now[0])
    mine = record(0.0, 12.0)
    held = {
        b"long": ValueWithExpiration(mine.dict(), 5100.0),
        b"short": ValueWithExpiration(mine.dict(), 5010.0),
        b"bad": ValueWithExpiration({"peer_id": 1}, 5100.0),  # malformed: counted, never compatible
        b"other": ValueWithExpiration(record(0.0, 12.0, config={"model": "other"}).dict(), 5100.0),
    }
    dht = Reads(ValueWithExpiration(held, 5100.0))
    run = RunDirectory(dht, run="run", owner=b"me", record=mine, counts=SwarmCounters())
    assert asyncio.run(run.compatible_peers()) == {b"me", b"long", b"short"}
    assert run.counts.rejected["bad_record"] == 1 and len(run.refused) == 1
    now[0], clock[0] = 5011.0, clock[0] + 11.0
    assert asyncio.run(run.compatible_peers()) == {b"me", b"long"}  # from the last read: no new one
    assert len(dht.beams) == 1
    now[0], clock[0] = 5030.0, clock[0] + 19.0
    assert asyncio.run(run.compatible_peers()) == {b"me", b"long", b"short"}  # read again: rewritten
    assert len(dht.beams) == 2


def test_short_rounds_still_read_every_replica_at_most_once_a_second(clock):
    dht = Reads()
    run = directory(dht, round_seconds=2.0)
    key = round_key("run", 1)
    for at in (0.0, 0.5, 0.99, 1.0):
        clock[0] = 1000.0 + at
        asyncio.run(run.announcements(key, max_payload_bytes=1 << 20))
    assert [beam for _, beam in dht.beams] == [REPLICAS, 1, 1, REPLICAS]


def test_a_peer_that_takes_the_runs_clock_reads_the_peer_list_again(clock):
    dht = Reads()
    run = directory(dht, round_seconds=12.0)
    asyncio.run(run.compatible_peers())
    run.run_clock = (500.0, 6.0)  # another peer's clock, which the run follows
    assert run.take_run_clock() is not None
    asyncio.run(run.compatible_peers())  # judged on the old clock: not answered from the last read
    assert len(dht.beams) == 2


def test_another_clock_is_followed_only_on_a_read_from_every_replica(clock, monkeypatch):
    monkeypatch.setattr(directory_module.time, "time", lambda: 5000.0)
    others = {bytes([i]): ValueWithExpiration(record(900.0, 12.0).dict(), 5100.0) for i in range(2)}
    dht = Reads(ValueWithExpiration(others, 5100.0))  # what a node hiding every other record shows
    run = directory(dht, round_seconds=12.0)
    asyncio.run(run.compatible_peers())
    assert [beam for _, beam in dht.beams] == [1, REPLICAS]  # the nearest's answer, then everyone's
    assert run.run_clock == (900.0, 12.0)  # here every replica agrees: followed


class Stores(Reads):
    """Also stands in for a write straight to the replicas: each takes it."""

    async def run_coroutine(self, write, *, return_future):
        return [b"replica"], True


def test_a_write_no_read_from_every_replica_confirmed_is_forgotten_once_it_expired(clock, monkeypatch):
    now = [5000.0]
    monkeypatch.setattr(directory_module.time, "time", lambda: now[0])
    run = directory(Stores(), round_seconds=12.0)
    asyncio.run(run.store(round_key("run", 1), {"x": 1}, 5010.0))
    asyncio.run(run.store(round_key("run", 2), {"x": 2}, 5020.0))
    now[0] = 5011.0
    asyncio.run(run.store(round_key("run", 3), {"x": 3}, 5030.0))
    assert set(run._unconfirmed) == {round_key("run", 2), round_key("run", 3)}


def test_an_announcement_is_pulled_from_the_peer_id_its_authors_record_names(clock, monkeypatch):
    monkeypatch.setattr(directory_module.time, "time", lambda: 5000.0)
    theirs = record(0.0, 12.0).copy(update={"peer_id": "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"})
    dht = Reads(ValueWithExpiration({b"them": ValueWithExpiration(theirs.dict(), 5100.0)}, 5100.0))
    run = RunDirectory(dht, run="run", owner=b"me", record=record(0.0, 12.0), counts=SwarmCounters())
    assert asyncio.run(run.compatible_peers()) == {b"me", b"them"}
    value = [b"d" * 32, 10, 1]
    dht.held = ValueWithExpiration(
        {
            b"me": ValueWithExpiration(value, 5100.0),
            b"them": ValueWithExpiration(value, 5100.0),
            b"stranger": ValueWithExpiration(value, 5100.0),  # no record read: not an announcement yet
        },
        5100.0,
    )
    read = dict(asyncio.run(run.announcements(round_key("run", 1), max_payload_bytes=100)))
    assert read[b"me"].peer == run.record.peer_id and read[b"them"].peer == theirs.peer_id
    assert read[b"stranger"].reason == "bad_announcement"
    with pytest.raises(MalformedPayloadError, match="announcement is not"):  # named fields: not this form
        Announcement.parse(b"them", {"digest": b"d" * 32, "size": 10, "samples": 1}, 100, theirs.peer_id)
    assert read[b"them"].value() == value  # what goes into the DHT: no names, no peer id


def test_a_second_record_write_in_a_round_expires_later_so_that_no_replica_refuses_it(monkeypatch):
    monkeypatch.setattr(directory_module.time, "time", lambda: 1000.0)
    run = directory(Reads(), round_seconds=12.0)
    writes = []

    async def store(key, value, expiration):
        writes.append((value["round"], expiration))

    monkeypatch.setattr(run, "store", store)
    schedule = RoundSchedule(start_time=1000.0, round_seconds=12.0)
    for _ in range(2):  # at start, then in round 0: the same round, the same deadline
        asyncio.run(run.store_record(0, schedule))
    asyncio.run(run.store_record(1, schedule))
    assert [expiration for _, expiration in writes] == pytest.approx([1048.0, 1048.001, 1060.0])
