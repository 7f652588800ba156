"""Nothing outlives `shoal demo` (issue 47): stopped mid-run by SIGTERM, SIGINT or SIGHUP, or killed
outright with SIGKILL (no handler runs: the kernel's parent-death signal ends the children), every
process it started (coordinator, peers, their DHT processes and libp2p daemons) is gone 10 s later."""

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.harness import wait_until

ROOT = Path(__file__).resolve().parents[2]


def _children() -> dict[int, int]:
    """{pid: parent pid} of every live process."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if fields[0] != "Z":  # a zombie has ended: only its parent has yet to reap it
                    parents[int(entry.name)] = int(fields[1])
    return parents


def _descendants(root: int) -> set[int]:
    parents, found, grew = _children(), {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in found} - found
        found |= more
        grew = bool(more)
    return found - {root}


def _alive(pids: set[int]) -> set[int]:
    return pids & set(_children())


def _rounds(log: Path) -> int:
    if not log.exists():
        return 0
    count = 0
    for line in log.read_text(errors="replace").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            count += json.loads(line).get("event") == "round" if line.startswith("{") else 0
    return count


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "signum",
    [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL],
    ids=["SIGTERM", "SIGINT", "SIGHUP", "SIGKILL"],
)
def test_no_process_outlives_a_stopped_demo(tmp_path, signum):
    logs = tmp_path / "logs"
    command = [sys.executable, "-m", "shoal.peer.cli", "demo", "--peers", "2", "--rounds", "60"]
    command += ["--keep-logs", str(logs)]
    with (tmp_path / "demo.out").open("w") as out:
        demo = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=out, start_new_session=True)
    started: set[int] = set()
    try:
        # mid-run: every process up, a round done
        wait_until(
            lambda: _rounds(logs / "peer1.log") >= 1,
            90,
            "the demo's first round",
            processes=[demo],
            logs=[tmp_path / "demo.out"],
            interval_s=0.2,
        )
        started = _descendants(demo.pid)
        names = " ".join(
            Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace") for pid in started
        )
        assert "coordinator" in names and "p2pd" in names, names  # what must end
        os.kill(demo.pid, signum)
        wait_until(
            lambda: not _alive(started),
            10,
            f"every process of the demo to end after {signal.Signals(signum).name}",
            logs=[lambda: f"still running: {_alive(started)}"],
            interval_s=0.2,
        )
        code = demo.wait(timeout=10)
        assert code == (-signal.SIGKILL if signum == signal.SIGKILL else 130), code
    finally:
        for pid in _alive(started | {demo.pid}):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        demo.wait()
