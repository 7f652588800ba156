"""The tests' one wait (tests.integration.harness.wait_until): the first truthy value of its condition,
a failure that says what was awaited (with the logs' ends) once its time is up, and at once when a
process it watches has exited."""

import subprocess
import sys
import time

import pytest

from tests.integration.harness import WaitTimeout, wait_for, wait_until


def test_it_returns_the_first_truthy_value_of_the_condition():
    calls = []

    def condition() -> dict | None:
        calls.append(1)
        return {"round": 3} if len(calls) == 3 else None

    assert wait_until(condition, 5, "the third call", interval_s=0.01) == {"round": 3}
    assert len(calls) == 3


def test_out_of_time_it_says_what_it_waited_for_with_the_end_of_each_log(tmp_path):
    log = tmp_path / "peer.jsonl"
    log.write_text("early line\n" + "x" * 5000 + "the last words\n")
    started = time.monotonic()
    with pytest.raises(WaitTimeout) as failed:
        logs = [log, lambda: "last: 2 peers"]
        wait_until(lambda: False, 0.2, "the peer's round", logs=logs, interval_s=0.05)
    assert 0.2 <= time.monotonic() - started < 2
    assert isinstance(failed.value, AssertionError) and isinstance(failed.value, TimeoutError)
    said = str(failed.value)
    assert "the peer's round" in said and "the last words" in said and "last: 2 peers" in said
    assert "early line" not in said  # only the end of a long log


def test_a_condition_is_checked_once_even_with_no_time_left(tmp_path):
    log = tmp_path / "peer.jsonl"
    log.write_text('{"event": "summary", "rounds": 3}\n')
    assert wait_for(log, lambda e: e.get("event") == "summary", 0)["rounds"] == 3


def test_a_watched_process_that_exits_fails_the_wait_at_once_naming_it_and_its_status():
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    started = time.monotonic()
    with pytest.raises(AssertionError, match="exited with 3") as failed:
        wait_until(lambda: False, 60, "its address", processes={"the first peer": process})
    assert time.monotonic() - started < 30
    assert not isinstance(failed.value, TimeoutError)
    assert "the first peer" in str(failed.value) and "its address" in str(failed.value)


def test_what_a_process_did_just_before_it_exited_still_counts():
    process = subprocess.Popen([sys.executable, "-c", "print('the report')"], stdout=subprocess.DEVNULL)
    process.wait()
    seen = iter([None, "the report"])  # written as it exited: seen at the look after its exit
    assert wait_until(lambda: next(seen), 5, "the report", processes=[process]) == "the report"
