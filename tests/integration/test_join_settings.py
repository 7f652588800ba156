"""`shoal join` with a setting this machine cannot use, run as a volunteer runs it (a subprocess): it
exits 2 with the flag named, before the DHT starts (no `started` event, no join command printed), and
a port in use is told before torch is even imported."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 90


def join(*flags: str) -> tuple[subprocess.CompletedProcess, float]:
    """Runs `shoal join --host 127.0.0.1 --log-format json FLAGS`; returns it and its wall seconds."""
    command = [sys.executable, "-m", "shoal.peer.cli", "join", "--host", "127.0.0.1", "--log-format", "json"]
    started = time.monotonic()
    result = subprocess.run(
        [*command, *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return result, time.monotonic() - started


def assert_refused_before_start(result: subprocess.CompletedProcess, flag: str) -> None:
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("shoal join: error: " + flag), result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert '"started"' not in result.stdout and "shoal join --initial-peers" not in result.stdout


@pytest.fixture
def listening() -> socket.socket:
    """A TCP port on 127.0.0.1 that something already listens on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken


@pytest.mark.timeout(TIMEOUT_S + 10)
@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_a_port_in_use_is_told_at_once(listening, flag):
    port = str(listening.getsockname()[1])
    # the bad model comes after the port: the port is checked first
    result, seconds = join(flag, port, "--model", "huge")
    assert_refused_before_start(result, f"{flag} {port}: the port is in use on 127.0.0.1")
    assert f"{flag} 0 for any free one" in result.stderr
    assert "torch" not in result.stderr
    assert seconds < 30  # no torch import (which alone takes seconds, tens of them on a loaded machine)


@pytest.mark.timeout(TIMEOUT_S + 10)
@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--model", "huge"], "--model huge: expected one of tiny, small, base"),
        (["--model", "no_such_module:build"], "--model no_such_module:build: No module named"),
        (["--data", "/nonexistent"], "--data /nonexistent: no such file or directory"),
        (
            ["--data", "/etc/hostname", "--tokenizer", "/etc"],
            "--tokenizer /etc: the folder holds no tokenizer.json",
        ),
        (["--coordinator-token-file", "/nonexistent", "--coordinator", "127.0.0.1:9"], "--coordinator-token"),
        (["--initial-peers", "127.0.0.1:31337"], "--initial-peers '127.0.0.1:31337' is not a multiaddress"),
        (
            ["--initial-peers", "/ip4/127.0.0.1/tcp/31337"],
            "--initial-peers '/ip4/127.0.0.1/tcp/31337' has no peer id",
        ),
        (
            ["--announce-maddrs", "203.0.113.5:31337"],
            "--announce-maddrs '203.0.113.5:31337' is not a multiaddress",
        ),
        (["--announce-maddrs", "/ip4/203.0.113.5/udp/9"], "--announce-maddrs '/ip4/203.0.113.5/udp/9'"),
        (["--nproc-per-node", "1000"], "--nproc-per-node 1000: this machine has"),
        (["--nproc-per-node", "2", "--max-micro-batches", "1"], "--nproc-per-node 2: each rank computes"),
    ],
)
def test_an_unusable_model_or_data_exits_2_before_the_dht_starts(flags, named):
    result, _ = join(*flags)
    assert_refused_before_start(result, named)


@pytest.mark.timeout(TIMEOUT_S + 10)
def test_a_device_this_machine_lacks_exits_2():
    if torch.cuda.is_available():  # one past the GPUs it has
        lacking = f"cuda:{torch.cuda.device_count()}"
        said = f"--device {lacking}: only {torch.cuda.device_count()} CUDA GPUs here"
    else:
        lacking, said = "cuda", "--device cuda: this torch build sees no CUDA GPU"
    result, _ = join("--device", lacking)
    assert_refused_before_start(result, said)


@pytest.mark.timeout(TIMEOUT_S + 10)
def test_a_checkpoint_folder_that_cannot_be_written_exits_2(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    result, _ = join("--checkpoint-dir", str(blocker / "checkpoints"))
    assert_refused_before_start(result, f"--checkpoint-dir: cannot write in {blocker / 'checkpoints'}")


@pytest.mark.timeout(TIMEOUT_S + 10)
@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a read-only folder")
def test_a_read_only_checkpoint_folder_exits_2(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        result, _ = join("--checkpoint-dir", str(folder))
    finally:
        folder.chmod(0o700)
    assert_refused_before_start(result, f"--checkpoint-dir: cannot write in {folder} (Permission denied)")


@pytest.mark.timeout(TIMEOUT_S + 10)
def test_a_model_that_cannot_fit_is_refused_with_its_numbers():
    result, _ = join("--max-memory", "0.002", "--algorithm", "diloco-eager")
    assert_refused_before_start(result, "--model tiny with diloco-eager does not fit in 2.0 MiB")
    for told in ("one sample needs", "parameters 0.5 MiB", "activations", "--activation-checkpointing on"):
        assert told in result.stderr, result.stderr
