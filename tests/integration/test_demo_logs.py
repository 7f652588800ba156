"""`shoal demo` leaves nothing behind unless asked to keep its logs, and the logs it keeps say what each
peer did: the real command, a 2-peer swarm of processes, run twice (temporary folder, then
`--keep-logs DIR`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = [
    sys.executable,
    "-m",
    "shoal.peer.cli",
    "demo",
    "--peers",
    "2",
    "--rounds",
    "3",
    "--round-seconds",
    "2",
]


def demo(tmp: Path, *flags: str) -> subprocess.CompletedProcess:
    """`shoal demo` with its temporary folders made under `tmp`."""
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp)}
    return subprocess.run(
        [*DEMO, "--json", *flags], cwd=ROOT, capture_output=True, text=True, timeout=150, env=env
    )


@pytest.mark.timeout(330)
def test_the_demo_removes_its_folder_unless_asked_to_keep_its_logs(tmp_path, short_tmp):
    result = demo(short_tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["param_hash_agree"]
    assert "--keep-logs DIR keeps them" in result.stderr
    assert list(short_tmp.glob("shoal-demo-*")) == []  # (torch leaves its own there)

    kept = tmp_path / "kept"
    result = demo(short_tmp, "--keep-logs", str(kept))
    assert result.returncode == 0, result.stderr[-3000:]
    assert list(short_tmp.glob("shoal-demo-*")) == []
    for peer in ("peer0", "peer1"):
        lines = (kept / f"{peer}.log").read_text().splitlines()
        events = [json.loads(line)["event"] for line in lines if line.startswith("{")]
        assert "fit" in events and "round" in events and events[-1] == "summary", lines[-5:]
        assert events.index("fit") < events.index("started") < events.index("round")  # fitted first
    assert (kept / "coordinator.db").exists() and (kept / "peer0-checkpoints").is_dir()


@pytest.mark.timeout(60)
def test_keep_logs_refuses_a_folder_in_use(tmp_path):
    (tmp_path / "peer0.log").write_text("a previous demo\n")
    result = subprocess.run(
        [*DEMO, "--keep-logs", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=50
    )
    assert result.returncode == 2
    assert f"--keep-logs {tmp_path}: not an empty folder" in result.stderr
