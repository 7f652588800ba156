"""A peer killed with kill -9 takes its helpers with it: a real `shoal join` is started, its process tree
read from /proc (the DHT process and p2pd), the peer alone SIGKILLed, and every descendant must be gone
within seconds (shoal.peer.swarm.lifeline)."""

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.harness import wait_for, wait_until

ROOT = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 10

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[1])


def descendants(root: int) -> set[int]:
    """Every live process below `root`."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            parents[int(entry.name)] = stat[1]
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")  # a zombie has died; it waits to be reaped


@pytest.mark.timeout(120)
def test_kill_9_of_a_peer_ends_its_dht_process_and_p2pd(tmp_path):
    output = tmp_path / "peer.jsonl"
    join = ["join", "--host", "127.0.0.1", "--run", "lifeline", "--log-format", "json"]
    peer = subprocess.Popen(
        [sys.executable, "-m", "shoal.peer.cli", *join],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=output.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    children: set[int] = set()
    try:
        wait_for(output, lambda e: e.get("event") == "started", 90, processes=[peer])
        children = descendants(peer.pid)
        names = {Path(f"/proc/{pid}/exe").resolve().name for pid in children}
        assert len(children) >= 2 and "p2pd" in names, f"expected the DHT process and p2pd, found {names}"
        peer.send_signal(signal.SIGKILL)  # the peer alone, not its process group: no cleanup runs
        peer.wait(timeout=10)
        wait_until(
            lambda: not [pid for pid in children if alive(pid)],
            GONE_WITHIN_S,
            "the peer's helpers to end with it",
            logs=[lambda: f"the peer's helpers outlived it: {[pid for pid in children if alive(pid)]}"],
            interval_s=0.2,
        )
    finally:
        for pid in [peer.pid, *children]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        peer.wait(timeout=10)
