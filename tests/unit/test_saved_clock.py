"""The round clock a peer keeps in its checkpoint folder, read back when it restarts as a swarm's first
peer: only this run's, with these rounds, and never from a damaged file."""

import io
import json
import time

import pytest

from shoal.peer.config.settings import PeerSpec
from shoal.peer.job.clock import CLOCK_FILE, save_clock, saved_clock
from shoal.peer.job.progress import Progress
from shoal.peer.swarm.exchange import RoundSchedule


def settings(tmp_path, **changes) -> PeerSpec:
    return PeerSpec.of(**({"checkpoint_dir": str(tmp_path), "run": "r", "round_seconds": 2.0} | changes))


def read_back(chosen: PeerSpec) -> tuple[RoundSchedule | None, str]:
    stream = io.StringIO()
    found = saved_clock(chosen, Progress("json", stream))
    return found, stream.getvalue()


def test_the_clock_saved_is_the_clock_read_back(tmp_path):
    clock = RoundSchedule(start_time=time.time() - 100, round_seconds=2.0)
    save_clock(settings(tmp_path), clock)
    found, said = read_back(settings(tmp_path))
    assert found == clock and "continuing the round clock" in said


@pytest.mark.parametrize(
    "changes",
    [{"run": "other"}, {"round_seconds": 3.0}, {"start_time": 1_700_000_000.0}],
    ids=["another run", "other rounds", "--start-time given"],
)
def test_another_run_other_rounds_or_an_explicit_start_start_a_new_clock(tmp_path, changes):
    save_clock(settings(tmp_path), RoundSchedule(start_time=time.time(), round_seconds=2.0))
    assert read_back(settings(tmp_path, **changes))[0] is None


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[]",
        json.dumps({"run": "r", "round_seconds": 2.0}),
        json.dumps({"run": "r", "start_time": "soon", "round_seconds": 2.0}),
        json.dumps({"run": "r", "start_time": float("nan"), "round_seconds": 2.0}),
        json.dumps({"run": "r", "start_time": 1e30, "round_seconds": 2.0}),
    ],
)
def test_a_damaged_clock_file_is_ignored_with_a_message(tmp_path, content):
    (tmp_path / CLOCK_FILE).write_text(content)
    found, said = read_back(settings(tmp_path))
    assert found is None and "ignoring" in said


def test_no_file_no_folder_no_clock(tmp_path):
    assert read_back(settings(tmp_path))[0] is None
    assert read_back(PeerSpec.of(run="r"))[0] is None


def test_a_peer_that_chooses_its_rounds_continues_the_saved_ones(tmp_path):
    clock = RoundSchedule(start_time=time.time() - 100, round_seconds=20.0)
    save_clock(settings(tmp_path, round_seconds=20.0), clock)
    assert read_back(settings(tmp_path, round_seconds=None))[0] == clock  # not the rounds it would choose
