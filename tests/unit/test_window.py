"""The compute window of an uncoordinated round without --compute-fraction (shoal.peer.job.window)."""

import pytest

from shoal.peer.job.window import FIRST_FRACTION, MARGIN_S, AutoWindow, round_seconds_for


def test_starts_at_half_a_round_then_computes_up_to_the_measured_exchange():
    window = AutoWindow(10.0)
    assert window.seconds(deadline=110.0, now=100.0) == pytest.approx(10.0 * (1 - FIRST_FRACTION))
    need = 0.1 + 1.5 * 0.2 + 0.05 + MARGIN_S
    window.observe((0.1, 0.2), encode_s=0.05)  # a quick exchange: the reserve shrinks after two, not at once
    assert window.reserve_s == pytest.approx(10.0 * FIRST_FRACTION)
    window.observe((0.1, 0.2), encode_s=0.05)
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


def test_one_quick_round_does_not_cut_the_next_short_and_a_long_round_starts_computing_longer():
    window = AutoWindow(10.0)
    for need in (2.0, 2.0, 0.5):
        window.observe((need - MARGIN_S, 0.0), encode_s=0.0)
    assert window.reserve_s == pytest.approx(2.0)  # the larger of the last two needs
    window.observe((0.5 - MARGIN_S, 0.0), encode_s=0.0)
    assert window.reserve_s == pytest.approx(0.5)
    long = AutoWindow(40.0)  # before anything was measured: half of a 10-second round, not of 40
    assert long.seconds(deadline=140.0, now=100.0) == pytest.approx(35.0)
    long.observe(None, encode_s=0.0)  # a miss doubles it, up to half of its own round
    assert long.reserve_s == pytest.approx(10.0)


def test_the_round_a_first_peer_chooses_fits_its_exchange():
    # idling for it (DeMo): latency and transfer in a twentieth of the round, in steps of 5 s from 10 s
    assert round_seconds_for(141_693, overlapped=False) == 35.0  # --model small: 1.3 s + 0.34 s
    assert round_seconds_for(None, overlapped=False) == 30.0  # unknown: the latency alone
    assert round_seconds_for(141_693, overlapped=False, gather=2) == 30.0  # one pull, not three
    # computing through it (eager DiLoCo, DeMo with overlap): the exchange ends within the round
    assert round_seconds_for(3_413_295, overlapped=True) == 20.0  # (1.3 s + 8.2 s) in half a round
    assert round_seconds_for(141_693, overlapped=True) == 10.0
    assert round_seconds_for(40_000_000, overlapped=True) == 195.0  # 97.3 s in half a round
