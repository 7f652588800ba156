"""`shoal bench wan`'s network (shoal.peer.bench.netlab) and a small run of it: 2 peers at 20 Mbit/s.

Runs where the test has root and iproute2 (`ip`, `tc`), as on CI; skipped with the reason elsewhere.
Checks that the shaping measurably slows a bulk transfer, that everything is torn down (also after a
failure inside the lab), and that a swarm method trains over the shaped links with bytes measured on
the namespaces' interfaces.
"""

import contextlib
import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.peer.bench import netlab
from shoal.peer.bench.netlab import NetLab
from shoal.peer.bench.wan import WanConfig, run
from tests.integration.harness import listening, wait_until

reason = netlab.available()
pytestmark = pytest.mark.skipif(reason is not None, reason=reason or "")

SERVER = """
import socket
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("0.0.0.0", 5001))
server.listen()
connection, _ = server.accept()
received = 0
while chunk := connection.recv(1 << 16):
    received += len(chunk)
connection.sendall(b"ok")
print(received)
"""
CLIENT = """
import socket, sys, time
connection = socket.create_connection((sys.argv[1], 5001), timeout=60)
started = time.perf_counter()
connection.sendall(bytes(int(sys.argv[2])))
connection.shutdown(socket.SHUT_WR)
assert connection.recv(2) == b"ok"
print(time.perf_counter() - started)
"""


def ours() -> list[str]:
    return [name for name in netlab.namespaces() if name.startswith(f"shl{os.getpid()}-")]


def workers(prefix: str) -> list[int]:
    """The bench's workers (`python -m shoal.peer.bench.wan_worker`) running in namespaces named `prefix*`
    (once `ip netns exec` has become the worker)."""
    found = []
    for namespace in netlab.namespaces():
        if namespace.startswith(prefix):
            pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout
            for pid in pids.split():
                with contextlib.suppress(OSError):
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    if argv[1:3] == [b"-m", b"shoal.peer.bench.wan_worker"]:
                        found.append(int(pid))
    return found


def bulk_transfer(lab: NetLab, size: int) -> tuple[float, int, int]:
    """Seconds to send `size` bytes from node 1 to node 0, and node 1's (sent, received) bytes."""
    server = lab.popen(0, [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    wait_until(lambda: listening(lab.namespace(0), 5001), 20, "the server listening", processes=[server])
    before = lab.counters(1)
    client = lab.popen(
        1, [sys.executable, "-c", CLIENT, lab.address(0), str(size)], stdout=subprocess.PIPE, text=True
    )
    seconds = float(client.communicate(timeout=60)[0])
    assert int(server.communicate(timeout=10)[0]) == size
    after = lab.counters(1)
    return seconds, after[0] - before[0], after[1] - before[1]


@pytest.mark.timeout(120)
def test_shaping_slows_a_bulk_transfer_to_the_rate_and_everything_is_torn_down():
    size = 4_000_000
    with NetLab(2, 20) as lab:
        assert len(ours()) == 3  # two nodes and the bridge's
        shaped, sent, _ = bulk_transfer(lab, size)
    assert ours() == []
    with NetLab(2, None) as lab:
        unshaped, _, _ = bulk_transfer(lab, size)
    assert ours() == []
    rate_mbit = size * 8 / shaped / 1e6
    assert 14 < rate_mbit < 21, rate_mbit  # tbf at 20 Mbit/s, less TCP/IP headers
    assert unshaped * 5 < shaped, (unshaped, shaped)
    assert size <= sent < size * 1.1  # the interface counters see the payload and its headers


@pytest.mark.timeout(60)
def test_a_failure_inside_the_lab_still_tears_it_down():
    with pytest.raises(RuntimeError, match="boom"), NetLab(3, 10) as lab:
        sleeper = lab.popen(2, [sys.executable, "-c", "import time; time.sleep(600)"])
        assert len(ours()) == 4
        raise RuntimeError("boom")
    assert ours() == []
    assert sleeper.poll() is not None  # the processes it started are gone too


@pytest.mark.timeout(300)
def test_two_peers_train_demo_compact_over_20_mbit_links(tmp_path):
    config = WanConfig(peers=2, steps=3, model="tiny", methods=("demo_compact",))
    result = run("demo_compact", 20.0, config, tmp_path)
    assert ours() == []
    assert result["exchanges"] == 3 and result["peers"] == 2
    assert 0 < result["utilization"] <= 1 and result["tokens_per_s"] > 0
    # each peer served its payloads to the other, measured on its interface (plus protocol overhead)
    assert result["bytes_per_peer"] >= result["predicted_bytes_per_peer"] > 0
    assert result["received_bytes_per_peer"] > 0
    assert 0 < result["final_val_loss"] < 6


@pytest.mark.timeout(120)
def test_sigterm_stops_the_benchmark_and_removes_its_namespaces(tmp_path):
    """ddp at 1 Mbit/s would run for an hour: SIGTERM after it started ends it within seconds."""
    command = [sys.executable, "-m", "shoal.peer.cli", "bench", "wan", "--methods", "ddp", "--peers", "2"]
    command += ["--steps", "50", "--batch-size", "4", "--bandwidth", "1mbit"]
    bench = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    prefix = f"shl{bench.pid}-"
    until = functools.partial(
        wait_until,
        processes={"shoal bench wan": bench},
        logs=[lambda: bench.stderr.read() if bench.poll() is not None else ""],  # read once it has exited
        interval_s=0.2,
    )
    try:
        until(lambda: any(n.startswith(prefix) for n in netlab.namespaces()), 60, "its namespaces")
        until(lambda: len(workers(prefix)) == 2, 30, "its 2 workers running")
        bench.send_signal(signal.SIGTERM)  # the workers are importing torch or training
        assert bench.wait(timeout=40) == 130
    finally:
        if bench.poll() is None:
            bench.kill()
    assert not any(n.startswith(prefix) for n in netlab.namespaces())
    assert "interrupted; namespaces removed" in bench.stderr.read()
    leftovers = subprocess.run(["pgrep", "-f", "shoal.peer.bench.wan_worker"], capture_output=True, text=True)
    assert leftovers.stdout.strip() == ""
