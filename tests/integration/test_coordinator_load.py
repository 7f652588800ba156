"""A real `shoal coordinator` under 600 simulated peers (`shoal bench coordinator`'s, one gRPC channel
each): every round decided on time, every call answered. 600 peers hold 1,200 streams at once mid-round
(each its `Rounds` and a waiting `RoundResult`): past grpc's server-wide stream limit as it was (1,000),
where every new call stalled 2.5 s and peers fell silent."""

import pytest

from shoal.coordinator.server import REFUSAL_DELAY_S
from shoal.peer.bench import coordinator


@pytest.mark.timeout(180)
def test_six_hundred_peers_get_every_round_on_time():
    result = coordinator.run(peers=600, rounds=2)
    assert result.failures == {}, result
    assert result.rounds == 2 and result.rounds_on_time == 2, result
    # the stall at the old stream limit was 2.5 s a call; 1.1 s is seen with the other xdist worker's
    # swarm on the two cores (2026-12-01; BENCHMARKS' 500 ms target is for a quiet machine)
    assert result.p99_ms < 2000, result


@pytest.mark.timeout(180)
def test_abusive_clients_are_refused_counted_and_slow_no_honest_peer():
    """30 of 300 clients abuse from another address (::1): join floods under new ids, reports padded
    past the request limit, heartbeats at 100x the honest rate. The honest peers' rounds stay on time,
    and the coordinator refuses and counts each abuse; a refusal takes REFUSAL_DELAY_S, so an abusive
    client is refused about once a second, not as often as the coordinator could answer."""
    result = coordinator.run(peers=300, rounds=2, abusive=0.1)
    assert result.failures == {}, result
    assert result.rounds == 2 and result.rounds_on_time == 2, result
    for abuse in coordinator.ABUSES:
        answers = result.abuse_answers[abuse]
        refused = answers.get("RESOURCE_EXHAUSTED", 0)
        clients = result.abusive // len(coordinator.ABUSES)
        assert 0 < refused <= clients * (result.elapsed_s / REFUSAL_DELAY_S + 1), (abuse, answers, result)
    counted = result.abuse_counted
    assert counted['rate_limited_requests_total{by="address",method="join"}'] > 0, counted
    assert counted['rate_limited_requests_total{by="peer",method="heartbeat"}'] > 0, counted
    assert counted['oversized_requests_total{method="report"}'] > 0, counted
