"""Checkpoint faults a volunteer meets, on a real `shoal join` and real files: a checkpoint folder made
read-only mid-run (a counted warning naming the folder and --checkpoint-dir; training goes on; the last
good checkpoint stays intact), and a truncated newest checkpoint (named, moved aside, never kept; the
round really resumed is the one said)."""

import contextlib
import functools
import hashlib
import os
import shutil
import signal
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shoal.peer.checkpoint import CheckpointStore
from tests.integration import harness
from tests.integration.harness import events, kill, wait_until

COMMON = [
    "join",
    "--host",
    "127.0.0.1",
    "--log-format",
    "json",
    "--round-seconds",
    "1",
    "--checkpoint-every",
    "1",
]


def start(output: Path, *args: str) -> subprocess.Popen:
    return harness.start(*COMMON, *args, stdout=output.open("w"), stderr=subprocess.STDOUT)


def watch(output: Path, peer: subprocess.Popen) -> Callable[..., object]:
    """wait_until for this peer's test: fails at once if the peer exits, and shows the end of its output."""
    return functools.partial(wait_until, processes=[peer], logs=[output], interval_s=0.3)


def texts(seen: list[dict]) -> list[str]:
    return [e["text"] for e in seen if e.get("event") == "message"]


def rounds(seen: list[dict]) -> int:
    return sum(e.get("event") == "round" for e in seen)


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[None]:
    """No file can be created, renamed or removed in `folder`: mode 555, or for root (whom modes do not
    stop) the immutable attribute. Skips the test where neither holds."""
    if os.geteuid() == 0:
        made = subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
        undo = ["chattr", "-i", str(folder)]
    else:
        folder.chmod(0o555)
        made, undo = True, ["chmod", "755", str(folder)]
    try:
        probe = folder / "probe"
        if not made or not _fails(lambda: probe.write_bytes(b"")):
            pytest.skip("cannot make a folder read-only here")
        yield
    finally:
        if shutil.which(undo[0]):
            subprocess.run(undo, check=False)


def _fails(action: Callable[[], object]) -> bool:
    try:
        action()
    except OSError:
        return True
    return False


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.timeout(150)
def test_a_folder_made_read_only_mid_run_is_a_counted_warning_and_loses_no_checkpoint(tmp_path):
    folder, output = tmp_path / "checkpoints", tmp_path / "peer.jsonl"
    peer = start(output, "--run", "read-only", "--checkpoint-dir", str(folder), "--metrics-port", "0")
    try:
        wait = watch(output, peer)
        wait(lambda: len(CheckpointStore(folder).rounds()) >= 2, 90, "two checkpoints")
        with read_only(folder):
            before = {p.name: digest(p) for p in folder.glob("round-*.safetensors")}
            newest = CheckpointStore(folder).rounds()[-1]
            wait(lambda: any("could not write" in t for t in texts(events(output))), 30, "the warning")
            trained = rounds(events(output))
            wait(lambda: rounds(events(output)) >= trained + 3, 30, "3 more rounds")  # training went on
            warning = next(t for t in texts(events(output)) if "could not write" in t)
            assert str(folder) in warning and "--checkpoint-dir" in warning and "training goes on" in warning
            assert f"round-{newest}.safetensors is the newest intact one" in warning
            port = next(e["port"] for e in events(output) if e.get("event") == "metrics")
            exposition = (
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            )
            failures = next(
                line
                for line in exposition.splitlines()
                if line.startswith("shoal_checkpoint_write_failures_total")
            )
            assert float(failures.split()[1]) >= 3
            # the checkpoints written before are all there, unchanged, and no temporary file is left
            assert {p.name: digest(p) for p in folder.glob("round-*.safetensors")} == before
            assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []
            assert CheckpointStore(folder).load_latest()["round"] == newest
        peer.send_signal(signal.SIGTERM)  # writable again: the stop's checkpoint is written
        assert peer.wait(timeout=60) == 0, output.read_text()[-3000:]
        summary = next(e for e in events(output) if e.get("event") == "summary")
        assert summary["checkpoint"] == str(folder)
        assert CheckpointStore(folder).load_latest()["round"] > newest
    finally:
        kill(peer)


@pytest.mark.timeout(150)
def test_a_truncated_newest_checkpoint_is_named_moved_aside_and_not_kept(tmp_path):
    folder, first, second = tmp_path / "checkpoints", tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    peer = start(first, "--run", "damaged", "--checkpoint-dir", str(folder))
    try:
        watch(first, peer)(lambda: len(CheckpointStore(folder).rounds()) >= 3, 90, "three checkpoints")
        peer.send_signal(signal.SIGTERM)
        assert peer.wait(timeout=60) == 0, first.read_text()[-3000:]
    finally:
        kill(peer)
    oldest, good, newest = CheckpointStore(folder).rounds()
    damaged = folder / f"round-{newest}.safetensors"
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])  # a torn copy or a full disk

    peer = start(second, "--run", "damaged", "--checkpoint-dir", str(folder), "--max-rounds", "1")
    try:
        assert peer.wait(timeout=90) == 0, second.read_text()[-3000:]
    finally:
        kill(peer)
    said = texts(events(second))
    assert any(
        str(damaged) in t and "damaged" in t and f"round-{newest}.safetensors.damaged" in t for t in said
    ), said
    assert f"resumed from the checkpoint of round {good}" in said, said
    assert (folder / f"round-{newest}.safetensors.damaged").exists() and not damaged.exists()
    kept = CheckpointStore(folder).rounds()
    assert kept[:2] == [oldest, good] and len(kept) == 3 and kept[2] > newest  # no good one pruned for it
