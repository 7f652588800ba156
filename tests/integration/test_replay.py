"""Catch-up by replay (issue 76): a real `shoal join` peer of eager DiLoCo, frozen (SIGSTOP, every
process of it) for two rounds while two others train on, wakes up behind the swarm's state. It
rebuilds that state from the one it held, by pulling the payloads that counted meanwhile and replaying
the steps (shoal.peer.swarm.replay), for fewer bytes than the state it downloaded when it joined,
and trains on with the others to one hash."""

import os
import signal

import pytest

from tests.integration.harness import events, kill, start, wait_for, wait_until

UNTIL_ROUND = 16
PAUSED_ROUNDS = 2


def join(folder, name, *flags):
    command = ["join", "--host", "127.0.0.1", "--run", "replay", "--model", "tiny", "--log-format", "json"]
    command += ["--algorithm", "diloco-eager", "--inner-steps", "2", "--until-round", str(UNTIL_ROUND)]
    command += ["--compute-fraction", "0.4", "--checkpoint-dir", str(folder / name)]
    return start(
        *command,
        *flags,
        stdout=(folder / f"{name}.jsonl").open("w"),
        stderr=(folder / f"{name}.err").open("w"),
    )


def rounds(log):
    return [e["round"] for e in events(log) if e.get("event") == "round"]


@pytest.mark.swarm
@pytest.mark.timeout(240)
def test_a_peer_frozen_for_two_rounds_catches_up_by_replay_not_by_download(tmp_path):
    first = join(tmp_path, "first", "--round-seconds", "4")
    processes = [first]
    try:
        started = wait_for(
            tmp_path / "first.jsonl", lambda e: e.get("event") == "started", 90, processes=processes
        )
        address = started["initial_peers"][0]
        processes += [join(tmp_path, name, "--initial-peers", address) for name in ("second", "frozen")]
        frozen = processes[2]
        # frozen once it has trained together with the others for two rounds
        wait_for(
            tmp_path / "frozen.jsonl",
            lambda e: e.get("event") == "round" and e.get("shared") and e["round"] >= 4,
            120,
            processes=processes,
        )
        os.killpg(frozen.pid, signal.SIGSTOP)
        at = max(rounds(tmp_path / "first.jsonl"))
        try:
            wait_for(
                tmp_path / "first.jsonl",
                lambda e: e.get("event") == "round" and e["round"] >= at + PAUSED_ROUNDS,
                60,
                processes=processes[:2],
            )
        finally:
            os.killpg(frozen.pid, signal.SIGCONT)
        for process in processes:
            wait_until(lambda p=process: p.poll() is not None, 150, "the peers to end their run")
        assert [p.returncode for p in processes] == [0, 0, 0]
    finally:
        for process in processes:
            kill(process)
    summaries = {
        name: next(e for e in events(tmp_path / f"{name}.jsonl") if e["event"] == "summary")
        for name in ("first", "second", "frozen")
    }
    frozen_summary = summaries["frozen"]
    assert frozen_summary["replays"] >= 1, frozen_summary
    # at most one download, as it joined (the swarm's state), none after the freeze: replayed instead,
    # for fewer bytes than the state downloads would have pulled
    assert frozen_summary["resyncs"] <= 1, frozen_summary
    assert 0 < frozen_summary["replay_bytes"] < frozen_summary["replayed_state_bytes"], frozen_summary
    replayed = [e for e in events(tmp_path / "frozen.jsonl") if e.get("event") == "replayed"]
    assert any(e["round"] > at for e in replayed), replayed
    assert summaries["first"]["resyncs"] == summaries["second"]["resyncs"] == 0
    assert len({s["param_hash"] for s in summaries.values()}) == 1
    frozen_rounds = [e for e in events(tmp_path / "frozen.jsonl") if e.get("event") == "round"]
    assert any(e["shared"] for e in frozen_rounds if e["round"] > at + PAUSED_ROUNDS)  # trained on together
