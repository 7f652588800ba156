"""Coordinated rounds with a slow peer (real DHTs, libp2p and a `shoal coordinator` process; the peers
in this process): large payloads are pulled as soon as they are reported, while the slow peer still
computes, and every peer still aggregates the same decided set; small payloads wait for the decision."""

import hashlib
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from shoal.peer.bootstrap import start_dht
from shoal.peer.coordination import CoordinatorLink
from shoal.peer.membership import record_validators
from shoal.peer.swarm import RoundSchedule, SwarmExchange
from shoal.peer.swarm_coordinated import EARLY_PULL_BYTES
from tests.integration.test_coordinator_server import coordinator

CONFIG = {"model": "tiny", "algorithm": "diloco-standard"}
SLOW_S = 3.0


class Timed(SwarmExchange):
    """Records when each pulled payload arrived."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.arrived: dict[tuple[int, bytes], float] = {}

    async def _fetch(self, round_number, announcement, holders):
        await super()._fetch(round_number, announcement, holders)
        self.arrived[(round_number, announcement.digest)] = time.time()


@pytest.mark.timeout(120)
def test_large_payloads_move_while_a_slow_peer_computes(tmp_path):
    flags = ["--min-peers", "3", "--min-compute-s", "60", "--max-compute-s", "120"]
    with coordinator(tmp_path, *flags) as (_, address):
        identities = [RSAPrivateKey() for _ in range(3)]
        validators = record_validators("early", identities[0])
        dhts = [start_dht([], host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=validators)]
        initial = [str(a) for a in dhts[0].get_visible_maddrs()]
        for identity in identities[1:]:
            validators = record_validators("early", identity)
            dhts.append(
                start_dht(initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=validators)
            )
        exchanges = []
        try:
            for dht, identity in zip(dhts, identities, strict=True):
                link = CoordinatorLink(address, dht.peer_id.to_base58())
                schedule = RoundSchedule(start_time=time.time(), round_seconds=600.0)
                exchanges.append(
                    Timed(
                        dht,
                        run="early",
                        schedule=schedule,
                        identity=identity,
                        config=CONFIG,
                        coordinator=link,
                    )
                )
            reported: dict[int, float] = {}

            def peer(index: int, size: int):
                exchange = exchanges[index]
                plan = exchange.plan_round()
                if index == 2:  # the slow one
                    time.sleep(SLOW_S)
                    reported[plan.round] = time.time()
                payload = hashlib.sha256(bytes([index, plan.round])).digest() * (size // 32)
                return plan.round, exchange.gather(payload, samples=index + 1)

            for size in (EARLY_PULL_BYTES + 64 * 1024, 32 * 1024):
                with ThreadPoolExecutor(3) as pool:
                    rounds = list(pool.map(lambda i, s=size: peer(i, s), range(3)))
                number = rounds[0][0]
                assert {r[0] for r in rounds} == {number}
                sets = [sorted((c.samples, hashlib.sha256(c.payload).digest()) for c in r[1]) for r in rounds]
                assert sets[0] == sets[1] == sets[2] and [s for s, _ in sets[0]] == [1, 2, 3]
                # how long before the slow peer reported each fast peer had its first payload of the round
                lead = [
                    reported[number] - min(t for (n, _), t in exchanges[i].arrived.items() if n == number)
                    for i in (0, 1)
                ]
                if size > EARLY_PULL_BYTES:
                    assert all(ahead > 1.0 for ahead in lead), lead  # pulled while the slow peer computed
                else:
                    assert all(ahead < 0 for ahead in lead), lead  # after the decision
                assert not any(sum(e.rejected.values()) for e in exchanges), [e.rejected for e in exchanges]
        finally:
            for exchange in exchanges:
                exchange.close()
            for dht in dhts:
                dht.shutdown()
