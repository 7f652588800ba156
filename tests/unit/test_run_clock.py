"""Which round clock a run converges on when peers start it at once (shoal.peer.swarm.membership)."""

from collections import Counter

from shoal.peer.swarm import membership
from shoal.peer.swarm.membership import SHOAL_VERSION, PeerRecord

CONFIG = {"model": "tiny", "algorithm": "demo"}


def record(
    start_time: float, round_seconds: float = 2.0, config: dict | None = None, version: str = SHOAL_VERSION
):
    config = config or CONFIG
    return PeerRecord(
        peer_id="12D3KooWAWh5yFSnH2mTeaEXarpiTHz6NtC5BLTA3wBDS8pD1tn7",
        version=version,
        config=dict(config),
        device="cpu",
        throughput=0.0,
        round=0,
        start_time=start_time,
        round_seconds=round_seconds,
    )


def test_the_most_followed_clock_wins_then_the_earliest_start_then_the_shorter_rounds():
    assert membership.winning_clock(Counter({(100.0, 2.0): 1, (90.0, 2.0): 1})) == (90.0, 2.0)
    assert membership.winning_clock(Counter({(100.0, 2.0): 2, (90.0, 2.0): 1})) == (100.0, 2.0)
    assert membership.winning_clock(Counter({(90.0, 3.0): 1, (90.0, 2.0): 1})) == (90.0, 2.0)
    # the same answer whatever the order in which a peer counted them
    assert membership.winning_clock(Counter({(90.0, 2.0): 1, (100.0, 2.0): 1})) == (90.0, 2.0)


def test_only_a_peer_of_the_same_run_and_version_on_another_clock_is_one_to_follow():
    mine, other_clock = record(100.0), membership.other_clock
    assert other_clock(mine, record(90.0)) and other_clock(mine, record(100.0, 3.0))
    # until this peer follows it, a peer on another clock is not in its rounds
    assert "round clock" in membership.incompatibility(mine, record(90.0))
    assert not other_clock(mine, record(100.0))  # the same clock: a peer of the run, nothing to follow
    assert not other_clock(mine, record(90.0, config={**CONFIG, "algorithm": "diloco"}))  # another run
    assert not other_clock(mine, record(90.0, version="0.0.1"))  # another shoal
