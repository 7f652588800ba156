"""When a peer counts as reaching none of its swarm, and when it sits a round out
(shoal.peer.swarm.isolation)."""

from shoal.peer.swarm.isolation import ISOLATED_AFTER, Isolation


def test_a_peer_that_pulls_nothing_and_serves_nothing_is_isolated_after_three_rounds_in_a_row():
    isolation = Isolation()
    assert [isolation.observe(others=2, pulled=0, served_total=0) for _ in range(ISOLATED_AFTER)] == [
        None,
        None,
        "isolated",
    ]
    assert isolation.isolated and isolation.rounds == 0
    assert isolation.observe(others=2, pulled=0, served_total=0) is None
    assert isolation.rounds == 1
    # the first payload it pulls ends it
    assert isolation.observe(others=2, pulled=1, served_total=0) == "back"
    assert not isolation.isolated and isolation.streak == 0


def test_one_round_that_reached_someone_starts_the_count_again():
    isolation = Isolation()
    for served in (0, 0, 500, 500, 500):  # served 500 bytes in the third round: someone pulled from it
        isolation.observe(others=1, pulled=0, served_total=served)
    assert not isolation.isolated and isolation.streak == 2


def test_a_peer_others_pull_from_is_not_isolated_though_it_pulls_nothing():
    """A public peer whose others are behind NAT with no relay: they reach it, it reaches none."""
    isolation = Isolation()
    for round_number in range(10):
        assert isolation.observe(others=2, pulled=0, served_total=1000 * (round_number + 1)) is None
    assert not isolation.isolated


def test_rounds_nobody_else_took_part_in_are_no_evidence():
    isolation = Isolation()
    for _ in range(10):
        isolation.observe(others=0, pulled=0, served_total=0)
    assert not isolation.isolated and isolation.streak == 0
    for _ in range(ISOLATED_AFTER):
        isolation.observe(others=1, pulled=0, served_total=0)
    isolation.observe(others=0, pulled=0, served_total=0)  # every peer sat this one out
    assert isolation.isolated


def test_an_isolated_peer_sits_out_all_but_every_third_round_the_same_rounds_on_every_peer():
    isolation = Isolation()
    assert not any(isolation.sits_out(r) for r in range(10))
    for _ in range(ISOLATED_AFTER):
        isolation.observe(others=1, pulled=0, served_total=0)
    assert [r for r in range(10) if not isolation.sits_out(r)] == [0, 3, 6, 9]
    # someone pulled its payload offered in a probe round: back
    assert isolation.observe(others=1, pulled=0, served_total=2000) == "back"
    assert not any(isolation.sits_out(r) for r in range(10))
