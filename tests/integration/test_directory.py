"""A run's DHT reads and writes on real hivemind DHTs ask only the replicas nearest their key
(shoal.peer.swarm.directory): a write lands on `REPLICAS` nodes, not hivemind's default 5, and a
read merges their entries into every peer's."""

import asyncio
import functools
import time

import pytest
from hivemind.dht.routing import DHTID
from hivemind.utils.crypto import RSAPrivateKey

from shoal.peer.swarm.bootstrap import REPLICAS, start_dht
from shoal.peer.swarm.counters import SwarmCounters
from shoal.peer.swarm.directory import RunDirectory
from shoal.peer.swarm.membership import owner_subkey, record_validators
from shoal.peer.swarm.names import round_key
from shoal.peer.swarm.records import Announcement, RoundSchedule
from tests.integration.test_membership import record

NODES = 7


async def _holds(key: str, _dht, node) -> bool:
    """In a DHT's process: whether its node stores `key` (its storage, not its cache)."""
    return node.protocol.storage.get(DHTID.generate(source=key)) is not None


@pytest.fixture
def directories():
    keys = [RSAPrivateKey() for _ in range(NODES)]
    first = start_dht(
        [], host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=record_validators("run", keys[0])
    )
    initial = [str(a) for a in first.get_visible_maddrs()]
    dhts = [first] + [
        start_dht(
            initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=record_validators("run", key)
        )
        for key in keys[1:]
    ]
    made = [
        RunDirectory(
            dht,
            run="run",
            owner=owner_subkey(key),
            record=record(peer_id=dht.peer_id.to_base58()),
            counts=SwarmCounters(),
        )
        for dht, key in zip(dhts, keys, strict=True)
    ]
    yield made
    for dht in reversed(dhts):
        dht.shutdown()


@pytest.mark.timeout(120)
def test_writes_land_on_the_replicas_and_reads_merge_them(directories):
    key = round_key("run", 1)
    schedule = RoundSchedule(start_time=time.time(), round_seconds=30.0)

    async def everyone_writes_then_reads() -> list[dict]:
        for index, directory in enumerate(directories):
            mine = Announcement(
                directory.owner, directory.record.peer_id, bytes([index]) * 32, 100, index + 1
            )
            await directory.store(key, mine.value(), time.time() + 60)
            await directory.store_record(1, schedule)
        for directory in directories:  # an announcement names no peer id: the author's record does
            await directory.compatible_peers()
        return [dict(await directory.announcements(key, 1000)) for directory in directories]

    seen = asyncio.run(everyone_writes_then_reads())
    owners = {directory.owner for directory in directories}
    for read in seen:
        assert read.keys() == owners  # every peer's entry, whichever node reads
        assert all(isinstance(a, Announcement) for a in read.values())
        assert {a.peer for a in read.values()} == {d.record.peer_id for d in directories}
    holders = [d.dht.run_coroutine(functools.partial(_holds, key)) for d in directories]
    assert sum(holders) == REPLICAS < 5  # hivemind's default would store on 5 of the 7
    assert all(d.counts.dht_reads == 2 and d.counts.dht_stores == 2 for d in directories)
    assert sum(d.counts.dht_rewrites for d in directories) == 0  # every routing table knew them
    compatible = asyncio.run(directories[-1].compatible_peers())
    assert compatible == owners


async def _node_id(_dht, node) -> bytes:
    return node.node_id.to_bytes()


async def _forget(node_ids: list[bytes], _dht, node) -> None:
    """In a DHT's process: drops these nodes from its routing table, as if it had never met them."""
    for node_id in map(DHTID.from_bytes, node_ids):
        if node_id in node.protocol.routing_table:
            del node.protocol.routing_table[node_id]


async def _owners(key: str, _dht, node) -> list[bytes]:
    """In a DHT's process: the subkeys its node stores under `key`."""
    found = node.protocol.storage.get(DHTID.generate(source=key))
    return [] if found is None else [subkey for subkey, _ in found.value.items()]


@pytest.mark.timeout(120)
def test_a_write_reaches_the_replicas_its_routing_table_did_not_know(directories):
    key = round_key("run", 2)
    key_id = DHTID.generate(source=key)
    ids = [d.dht.run_coroutine(_node_id) for d in directories]
    by_distance = sorted(range(NODES), key=lambda i: key_id.xor_distance(DHTID.from_bytes(ids[i])))
    replicas, writer = by_distance[:REPLICAS], directories[by_distance[-1]]
    writer.dht.run_coroutine(functools.partial(_forget, [ids[i] for i in replicas]))
    mine = Announcement(writer.owner, writer.record.peer_id, bytes(32), 100, 1)

    asyncio.run(writer.store(key, mine.value(), time.time() + 60))
    held = [directories[i].dht.run_coroutine(functools.partial(_owners, key)) for i in replicas]
    assert not any(writer.owner in owners for owners in held)  # it wrote to the nearest nodes it knew
    assert writer.counts.dht_rewrites == 0

    read = dict(asyncio.run(writer.announcements(key, 1000)))  # a read from every replica finds them
    assert writer.counts.dht_rewrites == 1
    held = [directories[i].dht.run_coroutine(functools.partial(_owners, key)) for i in replicas]
    assert all(writer.owner in owners for owners in held)
    assert writer.owner in read
    others = dict(asyncio.run(directories[replicas[0]].announcements(key, 1000)))
    assert others.keys() == {writer.owner}
