"""Issue 77's flood of identities on a real hivemind DHT: N fresh identities, each with its own Ed25519
key, write a valid peer record (the run's configuration, so they count as compatible) and an
announcement claiming to be in sync on a poisoned state, as an attacker with one machine can. The
entries are signed by their own keys and placed on the storage node directly (writing 10,000 through
the network would measure the attacker's link, not the victim). An honest peer on a second node then
reads them as a round does (`RunDirectory.compatible_peers`, `announcements`: every signature checked
on receipt, every entry parsed) and decides the round (`state.decide` with 3 earned peers): the time,
the DHT bytes it received and the Python memory the reads and the decision allocated at their peak
(tracemalloc, the peer's process, not its DHT child's; the decision is timed again untraced).

    python -m tests.benchmarks.sybil_dht_flood [--announcers 1000,5000] [--json]
"""

import argparse
import asyncio
import functools
import gc
import hashlib
import json
import sys
import time
import tracemalloc

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer

from shoal.peer.swarm.bootstrap import start_dht
from shoal.peer.swarm.counters import SwarmCounters
from shoal.peer.swarm.directory import RunDirectory, first_record
from shoal.peer.swarm.membership import owner_subkey, record_validators
from shoal.peer.swarm.names import peers_key, round_key
from shoal.peer.swarm.records import Announcement, RoundSchedule
from shoal.peer.swarm.signing import Ed25519RecordValidator, owner_marker
from shoal.peer.swarm.state import decide
from shoal.protocol.work import WORK_WINDOW, Work

RUN = "flood"
CONFIG = {"model": "tiny", "algorithm": "demo"}
GOOD, POISON = b"\x80" * 32, b"\x90" * 32
BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def fake_peer_id(index: int) -> str:
    """A base58 string of a peer id's shape, distinct per index (no node behind it)."""
    digits, number = [], index
    for _ in range(44):
        number, digit = divmod(number, 58)
        digits.append(BASE58[digit])
    return "12D3KooW" + "".join(digits)


def signed(key: Ed25519PrivateKey, dht_key: str, value: object, expiration: float) -> tuple[bytes, bytes]:
    """(subkey, signed serialized value) of `value` under `dht_key`, written as `key`'s owner."""
    subkey = owner_marker(key)
    record = DHTRecord(
        DHTID.generate(source=dht_key).to_bytes(),
        MSGPackSerializer.dumps(subkey),
        MSGPackSerializer.dumps(value),
        expiration,
    )
    return subkey, Ed25519RecordValidator(key).sign_value(record)


async def _place(dht_key: str, entries: list[tuple[bytes, bytes]], expiration: float, _dht, node) -> int:
    """In the storage node's process: the entries, into its own storage under `dht_key`."""
    key_id = DHTID.generate(source=dht_key)
    return sum(node.protocol.storage.store(key_id, value, expiration, subkey=sub) for sub, value in entries)


def flood(count: int) -> dict:
    schedule = RoundSchedule(start_time=time.time(), round_seconds=30.0)
    storage_key, reader_key = RSAPrivateKey(), RSAPrivateKey()
    storage = start_dht(
        [], host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=record_validators(RUN, storage_key)
    )
    reader = start_dht(
        [str(a) for a in storage.get_visible_maddrs()],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        record_validators=record_validators(RUN, reader_key),
    )
    try:
        expiration = time.time() + 600
        records, announcements = [], []
        for index in range(count):
            key = Ed25519PrivateKey.generate()
            peer = fake_peer_id(index)
            record = first_record(peer, CONFIG, "cpu", schedule, None).dict()
            records.append(signed(key, peers_key(RUN), record, expiration))
            owner = owner_marker(key)
            value = Announcement(owner, peer, hashlib.sha256(owner).digest(), 1000, 8, POISON, True).value()
            announcements.append(signed(key, round_key(RUN, 0), value, expiration))
        placed = 0  # (in slices: a request of 50 entries, 25 KB, broke hivemind's pipe to its DHT process)
        for dht_key, entries in ((peers_key(RUN), records), (round_key(RUN, 0), announcements)):
            for start in range(0, count, 10):
                place = functools.partial(_place, dht_key, entries[start : start + 10], expiration)
                placed += storage.run_coroutine(place)
        assert placed == 2 * count, placed
        counts = SwarmCounters()
        me = owner_subkey(reader_key)
        own = first_record(reader.peer_id.to_base58(), CONFIG, "cpu", schedule, None)
        directory = RunDirectory(reader, run=RUN, owner=me, record=own, counts=counts)
        honest = [me, b"honest-1", b"honest-2"]
        work = Work()
        for number in range(WORK_WINDOW):
            work.record(number, honest)
        mine = Announcement(me, reader.peer_id.to_base58(), b"\x01" * 32, 1000, 8, GOOD, True)

        async def round_reads() -> tuple[set, list, float, float]:
            await directory.store_record(0, schedule)
            started = time.perf_counter()
            compatible = await directory.compatible_peers(fully=True)
            read = time.perf_counter()
            found = await directory.announcements(round_key(RUN, 0), 1 << 20)
            return compatible, found, read - started, time.perf_counter() - read

        gc.collect()
        tracemalloc.start()
        compatible, found, records_s, announcements_s = asyncio.run(round_reads())
        parsed = {owner: a for owner, a in found if isinstance(a, Announcement)}
        ballots = (
            parsed | {me: mine} | {o: Announcement(o, "peer", o * 3, 1000, 8, GOOD, True) for o in honest[1:]}
        )
        decide(ballots, mine, compare_states=True, weights=work.weights(ballots))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        started = time.perf_counter()  # (timed untraced: tracing slows every allocation)
        decision = decide(ballots, mine, compare_states=True, weights=work.weights(ballots))
        decide_s = time.perf_counter() - started
        assert decision.agreed == GOOD and not decision.behind and len(decision.stale) == len(parsed)
        return {
            "announcers": count,
            "compatible_read": len(compatible) - 1,
            "announcements_read": len(parsed),
            "records_s": round(records_s, 3),
            "announcements_s": round(announcements_s, 3),
            "decide_ms": round(decide_s * 1e3, 2),
            "dht_bytes_received": counts.received["dht"],
            "peak_mib": round(peak / 2**20, 1),
            "state_kept": decision.agreed == GOOD,
        }
    finally:
        reader.shutdown()
        storage.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--announcers", default="1000,5000", help="comma-separated flood sizes")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [flood(int(n)) for n in args.announcers.split(",")]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print("| fresh identities | records read (s) | announcements read (s) | decide (ms) | DHT bytes received "
          "| peak Python memory (MiB) | state kept |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['announcers']:,} | {r['compatible_read']:,} ({r['records_s']:.2f}) "
              f"| {r['announcements_read']:,} ({r['announcements_s']:.2f}) | {r['decide_ms']:.1f} "
              f"| {r['dht_bytes_received']:,} | {r['peak_mib']:.1f} | {r['state_kept']} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
