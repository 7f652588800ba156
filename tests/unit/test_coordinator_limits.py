"""The coordinator's rate limits (shoal.coordinator.limits): token buckets per peer id and per address."""

import pytest

from shoal.coordinator.limits import Buckets, Limits, RateLimiter, client_address


def test_a_bucket_allows_its_burst_then_its_rate():
    bucket = Buckets(per_s=2.0, burst=3, max_keys=10)
    assert [bucket.take("a", 0.0) for _ in range(4)] == [True, True, True, False]
    assert not bucket.take("a", 0.4)  # 0.8 of a token
    assert bucket.take("a", 0.6) and not bucket.take("a", 0.6)
    assert bucket.take("b", 0.6)  # another key: its own bucket
    assert [bucket.take("a", 100.0) for _ in range(4)] == [
        True,
        True,
        True,
        False,
    ]  # refills to the burst only


def test_a_flood_of_keys_keeps_at_most_max_keys():
    bucket = Buckets(per_s=1.0, burst=1, max_keys=100)
    for i in range(10_000):
        bucket.take(f"id-{i}", 0.0)
    assert len(bucket) == 100


def test_joins_and_status_reads_are_charged_to_the_address_and_every_call_to_its_peer():
    limiter = RateLimiter(Limits(address_join_burst=5, address_status_burst=2, peer_burst=3))
    flood = [limiter.check("Join", f"12D3KooW{i:044d}", "198.51.100.7", 0.0) for i in range(8)]
    assert flood == [None] * 5 + ["address"] * 3
    assert limiter.check("Join", "12D3KooWother", "203.0.113.1", 0.0) is None  # another address
    assert [limiter.check("SwarmStatus", None, "198.51.100.7", 0.0) for _ in range(3)] == [
        None,
        None,
        "address",
    ]
    beats = [limiter.check("Heartbeat", "12D3KooWpeer", "203.0.113.1", 0.0) for _ in range(4)]
    assert beats == [None, None, None, "peer"]
    assert limiter.check("RoundResult", None, "203.0.113.1", 0.0) is None  # waits only: not charged


@pytest.mark.parametrize("timeout", [6.0, 0.9])
def test_an_honest_peers_pace_is_never_limited(timeout):
    """A heartbeat every third of the timeout, and per 5 s round a report and a heartbeat, for an hour."""
    limiter = RateLimiter(heartbeats_per_s=3 / timeout)
    beats = int(3600 / (timeout / 3))
    calls = [("Join", 0.0)] + [("Heartbeat", t * timeout / 3) for t in range(1, beats)]
    calls += [(m, t * 5.0 + d) for t in range(720) for m, d in (("Report", 3.0), ("Heartbeat", 4.0))]
    for method, at in sorted(calls, key=lambda c: c[1]):
        assert limiter.check(method, "12D3KooWhonest", "192.0.2.1", at) is None, (method, at)


def test_a_bucket_refills_with_every_epoch_since_it_was_last_taken_from():
    bucket = Buckets(per_s=0.001, burst=3, max_keys=10, per_epoch=2.0)
    assert [bucket.take("a", 0.0, epoch=5) for _ in range(4)] == [True, True, True, False]
    assert [bucket.take("a", 0.0, epoch=6) for _ in range(3)] == [True, True, False]
    assert not bucket.take("a", 0.0, epoch=4)  # an older epoch gives nothing back
    assert [bucket.take("a", 0.0, epoch=100) for _ in range(4)] == [True, True, True, False]  # burst only


def test_peers_that_keep_up_with_fast_rounds_are_never_limited_and_a_flood_still_is():
    """Rounds of a quarter second (a tiny model: the coordinator decides a round once all reported): a
    report and a heartbeat a round for 1,000 rounds; a heartbeat flood at the same pace is refused."""
    limiter = RateLimiter(heartbeats_per_s=3 / 6.0)
    for number in range(1000):
        for method, at in (("Report", 0.1), ("Heartbeat", 0.2)):
            assert limiter.check(method, "12D3KooWfast", "192.0.2.1", number / 4 + at, number) is None
    flood = [limiter.check("Heartbeat", "12D3KooWflood", "192.0.2.2", i / 400, i // 100) for i in range(1000)]
    assert flood.count("peer") > 900


@pytest.mark.parametrize(
    ("peer", "address"),
    [
        ("ipv4:127.0.0.1:51234", "127.0.0.1"),
        ("ipv6:[::1]:443", "::1"),
        ("ipv6:[::ffff:10.0.0.2]:80", "::ffff:10.0.0.2"),
        ("unix:/tmp/s", "unix:/tmp/s"),
    ],
)
def test_the_address_is_the_ip_without_the_port(peer, address):
    assert client_address(peer) == address


def test_bad_limits_are_refused():
    with pytest.raises(ValueError):
        Limits(peer_per_s=0)
    with pytest.raises(ValueError):
        Limits(address_join_burst=0)
    with pytest.raises(ValueError):
        Limits(peer_per_round=-1)
