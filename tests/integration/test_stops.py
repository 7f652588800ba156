"""Every way an operator stops a `shoal join` ends it cleanly (issue 74): SIGTERM to its main process
(`docker stop`, `podman stop`, Kubernetes, systemd's `KillMode=mixed`), SIGINT to its process group
(Ctrl-C in a terminal), SIGTERM to every process it has (systemd's default `KillMode=control-group`,
`pkill`), and a second signal during the stop. Each ends with exit status 0, no abort message, its
checkpoint, and none of its processes (the DHT's, p2pd, torch's shared-memory manager) left behind.
Real `shoal join` processes on 127.0.0.1."""

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from shoal.peer.checkpoint import CheckpointStore
from shoal.peer.job.node import DRAIN_MAX_S
from tests.integration.harness import events, kill, start, wait_for, wait_until

COMMON = ["--model", "tiny", "--run", "stops", "--host", "127.0.0.1", "--log-format", "json"]
COMMON += ["--max-micro-batches", "4", "--validate-every", "0"]
ABORTS = ("terminate called", "Traceback", "exiting now", "Aborted")


def _descendants(pid: int) -> set[int]:
    """`pid` and every process under it, read from /proc (the peer's DHT process leads a session of
    its own, so its process group is not the peer's)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rpartition(")")[2].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        current = todo.pop()
        found.add(current)
        todo.extend(children.get(current, []))
    return found


def _running(pids: set[int]) -> set[int]:
    """Those of `pids` that still run (a zombie has ended)."""
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def _gone(pids: set[int], timeout_s: float) -> set[int]:
    """Those of `pids` still running once all have ended, or `timeout_s` has passed."""
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: not _running(pids), timeout_s, "the processes to end", interval_s=0.1)
    return _running(pids)


def _peer(tmp_path: Path, name: str, *args: str):
    out = tmp_path / f"{name}.jsonl"
    process = start(
        "join",
        *COMMON,
        "--checkpoint-dir",
        str(tmp_path / name),
        *args,
        stdout=out.open("w"),
        stderr=(tmp_path / f"{name}.err").open("w"),
    )
    return process, out


STOPS = {
    "main": lambda pids, pid: os.kill(pid, signal.SIGTERM),
    "group": lambda pids, pid: os.killpg(pid, signal.SIGINT),  # the terminal's Ctrl-C
    "every": lambda pids, pid: [os.kill(p, signal.SIGTERM) for p in pids],  # systemd, pkill
}


@pytest.mark.timeout(240)
def test_each_way_of_stopping_a_peer_ends_it_cleanly_with_its_checkpoint(tmp_path):
    """Three joiners of one swarm, each stopped another way at the same time, while the first peer
    trains on."""
    processes = []
    try:
        first, first_out = _peer(tmp_path, "first", "--round-seconds", "4", "--port", "0")
        processes.append(first)
        address = wait_for(first_out, lambda e: e.get("event") == "started", 60)["initial_peers"][0]
        joiners = {}
        for mode in STOPS:
            process, out = _peer(tmp_path, mode, "--initial-peers", address)
            processes.append(process)
            joiners[mode] = (process, out)
        for _, out in joiners.values():
            wait_for(out, lambda e: e.get("event") == "round" and e["participants"] >= 2, 120)
        trees = {mode: _descendants(process.pid) for mode, (process, _) in joiners.items()}
        for mode, tree in trees.items():  # the main process, torch's manager, the DHT's and its p2pd
            assert len(tree) >= 3, (mode, tree)
        stopped_at = time.time()
        for mode, (process, _) in joiners.items():
            STOPS[mode](trees[mode], process.pid)
        started = time.monotonic()
        for mode, (process, out) in joiners.items():
            left = DRAIN_MAX_S + 5 - (time.monotonic() - started)
            assert process.wait(timeout=max(left, 1)) == 0, (
                mode,
                (tmp_path / f"{mode}.err").read_text()[-2000:],
            )
            err = (tmp_path / f"{mode}.err").read_text()
            assert not any(abort in err for abort in ABORTS), (mode, err[-2000:])
            summary = next(e for e in events(out) if e.get("event") == "summary")
            assert summary["stopped"] is True and summary["rounds"] >= 1, (mode, summary)
            newest = max((tmp_path / mode).glob("round-*.safetensors"), key=os.path.getmtime)
            assert newest.stat().st_mtime >= stopped_at, mode  # the stop's own checkpoint
            state = CheckpointStore(tmp_path / mode).load_latest()
            assert state is not None and state["steps"] >= 1, mode
        for mode, tree in trees.items():
            assert not _gone(tree, 10), (mode, _running(tree))  # nothing orphaned
        # the first peer trains on without them
        last = max(e["round"] for e in events(first_out) if e.get("event") == "round")
        wait_for(first_out, lambda e: e.get("event") == "round" and e["round"] >= last + 2, 30)
        first_tree = _descendants(first.pid)
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=DRAIN_MAX_S + 5) == 0
        assert not _gone(first_tree, 10)
        # three joins and three stops cost the first peer no round: none skipped, none doubled
        rounds = [e for e in events(first_out) if e.get("event") == "round"]
        numbers = [e["round"] for e in rounds]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), numbers
        assert max(e["round_s"] for e in rounds[1:]) < 1.5 * 4, [e["round_s"] for e in rounds]
    finally:
        for process in processes:
            kill(process)


@pytest.mark.timeout(180)
def test_a_second_signal_ends_the_stop_at_once_keeping_the_last_complete_checkpoint(tmp_path):
    """A peer of long rounds, signalled twice early in a round: it leaves within seconds, not at the
    round's end, and its last checkpoint (of the round before) loads."""
    peer, out = _peer(tmp_path, "alone", "--round-seconds", "15", "--port", "0", "--checkpoint-every", "1")
    try:
        wait_for(out, lambda e: e.get("event") == "round" and e["round"] >= 1, 120)
        checkpoint = CheckpointStore(tmp_path / "alone").load_latest()
        assert checkpoint is not None
        tree = _descendants(peer.pid)
        peer.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # a second Ctrl-C, as a person presses it
        peer.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert peer.wait(timeout=15) == 0
        assert time.monotonic() - started < 6  # the round had about 13 s to go
        assert not _gone(tree, 10), _running(tree)
        err = (tmp_path / "alone.err").read_text()
        assert not any(abort in err for abort in ABORTS), err[-2000:]
        state = CheckpointStore(tmp_path / "alone").load_latest()
        assert state is not None and state["steps"] >= checkpoint["steps"]
    finally:
        kill(peer)
