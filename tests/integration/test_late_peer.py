"""A peer whose computation outlasts its rounds, as a volunteer on a slow machine runs it (`shoal join`,
DiLoCo, each round's computation 1.6 s against 1 s rounds): its payloads miss every round it computed
for, and it is told, with the numbers, in its log and in its summary's `late_rounds` (which said 0
when every round of a DiLoCo trial was late). And a peer slower to start than its run's start time plus
its rounds, under a coordinator, still trains them."""

import subprocess
import time

import pytest

from tests.integration.harness import kill, start, start_coordinator, wait_for


@pytest.mark.timeout(120)
def test_a_peer_late_round_after_round_is_counted_and_told_why(tmp_path):
    out = tmp_path / "peer.jsonl"
    flags = ["--host", "127.0.0.1", "--run", "late", "--log-format", "json", "--discover-seconds", "0"]
    flags += ["--algorithm", "diloco-standard", "--inner-steps", "2", "--round-seconds", "1"]
    flags += ["--max-rounds", "5", "--metrics-port", "0"]
    slow = {"SHOAL_FAULTS": "shoal.peer.job.faults:slow=1.6"}  # it computes past every round's deadline
    peer = start("join", *flags, env=slow, stdout=out.open("w"), stderr=subprocess.DEVNULL)
    try:
        summary = wait_for(out, lambda e: e.get("event") == "summary", 90)
        assert peer.wait(timeout=30) == 0
    finally:
        kill(peer)
    assert summary["late_rounds"] >= 4, summary  # every round; the first may start early enough
    told = wait_for(out, lambda e: e.get("event") == "late", 1)
    assert told["late"] and told["missed"] >= 3 and told["compute_s"] > 1.6
    said = wait_for(out, lambda e: "missed their round 3 rounds in a row" in e.get("text", ""), 1)["text"]
    assert "in rounds of 1 s" in said and "--compute-fraction" in said


@pytest.mark.timeout(120)
def test_a_coordinated_peer_that_starts_after_its_runs_clock_still_trains_its_rounds(tmp_path):
    """The run's clock (--start-time) put its rounds 0-2 a minute ago, as a loaded machine's slow start
    does to a `shoal demo` peer; the coordinator's round 0 waits for its peer, so the peer trains rounds
    0-2 with it. It used to leave at once, before contacting the coordinator, with 0 rounds."""
    coordinator, address = start_coordinator(tmp_path, 1, 1.0)
    out = tmp_path / "peer.jsonl"
    flags = ["--host", "127.0.0.1", "--run", "behind", "--log-format", "json", "--round-seconds", "1"]
    flags += ["--start-time", repr(time.time() - 60), "--until-round", "2", "--coordinator", address]
    peer = start("join", *flags, "--metrics-port", "0", stdout=out.open("w"), stderr=subprocess.DEVNULL)
    try:
        summary = wait_for(out, lambda e: e.get("event") == "summary", 90)
        assert peer.wait(timeout=30) == 0
    finally:
        kill(peer)
        kill(coordinator)
    assert (summary["rounds"], summary["first_round"], summary["last_round"]) == (3, 0, 2), summary
    assert summary["coordinated_rounds"] == 3, summary
