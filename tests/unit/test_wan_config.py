"""`shoal bench wan`'s pure parts: bandwidth parsing and the summary of a run's peers."""

import pytest

from shoal.peer.bench.wan import QUICK, WanConfig, parse_bandwidths, summarize


def test_bandwidths_parse_in_mbit():
    assert parse_bandwidths("10mbit,100mbit") == [10.0, 100.0]
    assert parse_bandwidths(" 512kbit , 1Gbit ,2.5mbit") == [0.512, 1000.0, 2.5]


@pytest.mark.parametrize("text", ["", "10", "10mb", "fast", "10mbit,,", "-5mbit", "0kbit", "1000gbit"])
def test_bad_bandwidths_are_refused_naming_the_flag(text):
    with pytest.raises(ValueError, match="--bandwidth"):
        parse_bandwidths(text)


def peer(**fields):
    base = {
        "compute_s": 8.0,
        "wall_s": 10.0,
        "tokens": 4096,
        "sent_bytes": 1150,
        "received_bytes": 1100,
        "predicted_sent_bytes": 1000,
        "final_val_loss": 3.5,
        "params": 123,
        "exchanges": 4,
        "time_s": {"compute": 8.0, "exchange": 2.0},
    }
    return base | fields


def test_summary_adds_tokens_per_second_and_averages_the_rest():
    config = WanConfig(peers=2, steps=4)
    slow = peer(wall_s=20.0, compute_s=10.0, sent_bytes=1250, time_s={"compute": 10.0, "exchange": 10.0})
    result = summarize("demo_compact", 10.0, config, [peer(), slow])
    assert result["tokens_per_s"] == pytest.approx(4096 / 10 + 4096 / 20)
    assert result["utilization"] == pytest.approx((0.8 + 0.5) / 2)
    assert result["bytes_per_peer"] == 1200 and result["predicted_bytes_per_peer"] == 1000
    assert result["wire_overhead"] == pytest.approx(0.2)
    assert result["wall_s"] == 20.0 and result["final_val_loss"] == 3.5
    assert result["time_s"] == {"compute": 9.0, "exchange": 6.0}
    assert {
        "method",
        "bandwidth_mbit",
        "tokens_per_s",
        "utilization",
        "bytes_per_peer",
        "final_val_loss",
    } <= (result.keys())


def test_summary_of_a_run_without_network_has_no_overhead_and_utilization_at_most_one():
    result = summarize("compute_only", 10.0, QUICK, [peer(predicted_sent_bytes=0, compute_s=10.5)] * 2)
    assert result["wire_overhead"] is None and result["utilization"] == 1.0
