"""A real `shoal coordinator` under 600 simulated peers (`shoal bench coordinator`'s, one gRPC channel
each): every round decided on time, every call answered. 600 peers hold 1,200 streams at once mid-round
(each its `Rounds` and a waiting `RoundResult`): past grpc's server-wide stream limit as it was (1,000),
where every new call stalled 2.5 s and peers fell silent."""

import pytest

from shoal.peer.bench import coordinator


@pytest.mark.timeout(180)
def test_six_hundred_peers_get_every_round_on_time():
    result = coordinator.run(peers=600, rounds=2)
    assert result.failures == {}, result
    assert result.rounds == 2 and result.rounds_on_time == 2, result
    assert result.p99_ms < 1000, result
