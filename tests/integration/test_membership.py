"""Signed, schema-checked swarm records on real DHTs, and the compatibility check."""

import time

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from shoal.peer.swarm.bootstrap import start_dht
from shoal.peer.swarm.membership import (
    SHOAL_VERSION,
    PeerRecord,
    check_run_name,
    incompatibility,
    owner_subkey,
    record_validators,
    run_hash,
)

CONFIG = {"model": "tiny", "algorithm": "demo", "compression_topk": "32"}


def record(**changes) -> PeerRecord:
    base = PeerRecord(
        peer_id="12D3KooWAWh5yFSnH2mTeaEXarpiTHz6NtC5BLTA3wBDS8pD1tn7",
        version=SHOAL_VERSION,
        config=CONFIG,
        device="cpu",
        throughput=10.0,
        round=3,
    )
    return base.copy(update=changes)


@pytest.fixture
def two_dhts():
    alice, mallory = RSAPrivateKey(), RSAPrivateKey()
    first = start_dht(
        [], host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=record_validators("run", alice)
    )
    second = start_dht(
        [str(a) for a in first.get_visible_maddrs()],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        record_validators=record_validators("run", mallory),
    )
    yield (first, alice), (second, mallory)
    second.shutdown()
    first.shutdown()


@pytest.mark.timeout(60)
def test_nobody_else_can_overwrite_a_peers_record(two_dhts):
    (first, alice), (second, _) = two_dhts
    expires = time.time() + 30
    assert first.store("run_peers", record().dict(), expires, subkey=owner_subkey(alice))
    forged = record(device="evil").dict()
    assert not second.store("run_peers", forged, expires + 1, subkey=owner_subkey(alice))
    assert not second.store("run_peers", forged, expires + 1, subkey=b"plain subkey")  # no owner marker
    stored = second.get("run_peers", latest=True).value
    assert [entry.value["device"] for entry in stored.values()] == ["cpu"]


@pytest.mark.timeout(60)
def test_records_that_break_the_schema_are_refused_by_the_dht(two_dhts):
    (first, alice), _ = two_dhts
    expires = time.time() + 30
    for bad in (
        {**record().dict(), "round": -1},
        {**record().dict(), "throughput": "fast"},
        {**record().dict(), "extra": 1},
        {"peer_id": "x"},
    ):
        assert not first.store("run_peers", bad, expires, subkey=owner_subkey(alice))


def test_compatible_records_and_named_differences():
    assert incompatibility(record(), record(peer_id="other", device="cuda:0")) is None
    other = {**CONFIG, "compression_topk": "4", "lr": "1e-3"}
    reason = incompatibility(record(), record(config=other))
    assert reason == "compression_topk is 4 there, 32 here; lr is 1e-3 there, the default here"
    assert "major.minor" in incompatibility(record(), record(version="9.0.0"))
    # a record's run hash is its configuration's: not written, every reader derives it
    assert "run_hash" not in record().dict() and record().run_hash == run_hash(CONFIG)


@pytest.mark.parametrize("name", ["", "has space", "-leading", "x" * 65, "dots.not.allowed"])
def test_bad_run_names_are_refused(name):
    with pytest.raises(ValueError, match="run name"):
        check_run_name(name)
