"""The compute window of an uncoordinated round without --compute-fraction (shoal.peer.window)."""

import pytest

from shoal.peer.window import FIRST_FRACTION, MARGIN_S, AutoWindow


def test_starts_at_half_a_round_then_computes_up_to_the_measured_exchange():
    window = AutoWindow(10.0)
    assert window.seconds(deadline=110.0, now=100.0) == pytest.approx(10.0 * (1 - FIRST_FRACTION))
    for _ in range(20):  # a quick exchange: the reserve shrinks toward its need, not at once
        before = window.reserve_s
        window.observe((0.1, 0.2), encode_s=0.05)
        assert window.reserve_s <= before
    need = 0.1 + 1.5 * 0.2 + 0.05 + MARGIN_S
    assert window.reserve_s == pytest.approx(need, rel=1e-3)
    assert window.seconds(deadline=110.0, now=100.4) == pytest.approx(9.6 - need, rel=1e-3)


def test_grows_at_once_when_the_exchange_needs_more_and_doubles_when_payloads_missed_the_deadline():
    window = AutoWindow(10.0)
    for _ in range(20):
        window.observe((0.0, 0.1), encode_s=0.0)
    window.observe((0.5, 2.0), encode_s=0.1)
    assert window.reserve_s == pytest.approx(0.5 + 1.5 * 2.0 + 0.1 + MARGIN_S)
    grown = window.reserve_s
    window.observe(None, encode_s=0.1)
    assert window.reserve_s == pytest.approx(min(2 * grown, 5.0))
    for _ in range(5):  # never more than the old default's half a round
        window.observe(None, encode_s=0.1)
    assert window.reserve_s == pytest.approx(5.0)
    window.observe((1.0, 30.0), encode_s=0.0)  # a measure past the round: still half a round at most
    assert window.reserve_s == pytest.approx(5.0)
