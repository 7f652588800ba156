"""A peer is never silently alone (issue 76): one whose state is replaced by the swarm's round after
round is told why, by the cause it can see (shoal.peer.job.round_reports.tell_resyncs)."""

import dataclasses
import io
import json
from types import SimpleNamespace

from shoal.peer.job.progress import Progress
from shoal.peer.job.round_reports import RESYNCS_TOLD, tell_resyncs
from shoal.peer.swarm.records import RoundStatus

START = RoundStatus(
    round=0, needed=None, shared=False, late=0, isolated=False, peers_seen=2, stragglers=0,
    clocks_adopted=0, resyncs=0, resync_bytes=0, payload_bytes=100, bytes_sent=0, bytes_received=0,
    round_seconds=8.0, ledger=None,
)  # fmt: skip


def told(rounds: list[tuple[int, int]]) -> list[dict]:
    """The events and messages after rounds of (re-syncs so far, late rounds so far)."""
    stream = io.StringIO()
    progress = Progress("json", stream)
    before, streak = None, 0
    for number, (resyncs, late) in enumerate(rounds):
        counts = {"resyncs": resyncs, "late": late, "resync_bytes": resyncs * 1000}
        status = dataclasses.replace(START, round=number, **counts)
        streak = tell_resyncs(progress, status, before, streak, SimpleNamespace(round=number))
        before = status
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_three_resyncs_in_a_row_on_time_name_the_shared_step():
    events = told([(0, 0), (1, 0), (2, 0), (3, 0), (4, 0)])
    warnings = [e for e in events if e["event"] == "message"]
    assert len(warnings) == 1 and RESYNCS_TOLD == 3
    assert "computes the shared step to other bits" in warnings[0]["text"]
    assert "3,000 state bytes" in warnings[0]["text"]
    resyncing = [{k: v for k, v in e.items() if k != "time"} for e in events if e["event"] == "resyncing"]
    assert resyncing == [{"event": "resyncing", "round": 3, "streak": 3, "late": False, "bytes": 3000}]


def test_late_resyncs_name_the_lateness_and_a_break_starts_the_count_again():
    late = told([(0, 0), (1, 1), (2, 2), (3, 3)])
    assert "came after the round's deadline" in next(e for e in late if e["event"] == "message")["text"]
    broken = told([(0, 0), (1, 0), (2, 0), (2, 0), (3, 0), (4, 0)])  # two, a round in sync, two
    assert not [e for e in broken if e["event"] == "message"]


def test_each_replay_is_an_event_and_replays_count_in_the_streak():
    stream = io.StringIO()
    progress = Progress("json", stream)
    before, streak = None, 0
    for number, (resyncs, replays) in enumerate([(0, 0), (0, 1), (1, 1), (1, 2)]):
        counts = {"resyncs": resyncs, "replays": replays, "replay_bytes": replays * 10}
        status = dataclasses.replace(START, round=number, **counts)
        streak = tell_resyncs(progress, status, before, streak, SimpleNamespace(round=number))
        before = status
    events = [json.loads(line) for line in stream.getvalue().splitlines()]
    replayed = [(e["round"], e["replays"], e["bytes"]) for e in events if e["event"] == "replayed"]
    assert replayed == [(1, 1, 10), (3, 2, 20)]
    warning = next(e["text"] for e in events if e["event"] == "message")
    assert "last 3 rounds" in warning and "2 time(s) by replay" in warning
