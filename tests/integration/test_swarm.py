"""DeMo over a real hivemind swarm: a stock `hivemind-dht` bootstrap node and peers in separate
processes on 127.0.0.1, OS-chosen ports."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HIVEMIND_DHT = Path(sys.executable).with_name("hivemind-dht")


def start(command: list[str], **kwargs) -> subprocess.Popen:
    """Its own process session, so that stop() also ends the DHT and p2pd processes it forks."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True, **kwargs)


def stop(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def bootstrap_address(node: subprocess.Popen, timeout_s: float = 30) -> str:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        line = node.stderr.readline()
        found = re.search(r"--initial_peers (/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)", line)
        if found:
            return found.group(1)
    raise TimeoutError("hivemind-dht printed no address")


def run_swarm(
    tmp_path,
    peers: int,
    rounds: int,
    round_seconds: float,
    die: dict[int, int] | None = None,
    extra: dict[int, list[str]] | None = None,
) -> list:
    """Reports of the peers that finished (None for those told to die); `extra`: more flags per peer."""
    die, extra = die or {}, extra or {}
    node = start(
        [str(HIVEMIND_DHT), "--host_maddrs", "/ip4/127.0.0.1/tcp/0"], stderr=subprocess.PIPE, text=True
    )
    processes = [node]
    try:
        address = bootstrap_address(node)
        begin = time.time() + 15  # room for every peer to import torch/hivemind and join
        outs = [tmp_path / f"peer{i}.json" for i in range(peers)]
        for i in range(peers):
            flags = (["--die-after", str(die[i])] if i in die else []) + extra.get(i, [])
            processes.append(
                start(
                    [
                        sys.executable,
                        "-m",
                        "tests.integration.swarm_peer",
                        "--initial-peer",
                        address,
                        "--start",
                        str(begin),
                        "--round-seconds",
                        str(round_seconds),
                        "--rounds",
                        str(rounds),
                        "--index",
                        str(i),
                        "--peers",
                        str(peers),
                        "--out",
                        str(outs[i]),
                        *flags,
                    ]
                )
            )
        for i, process in enumerate(processes[1:]):
            code = process.wait(timeout=begin - time.time() + rounds * round_seconds + 60)
            assert code == (-signal.SIGKILL if i in die else 0)
        return [None if i in die else json.loads(out.read_text()) for i, out in enumerate(outs)]
    finally:
        for process in processes:
            stop(process)


@pytest.mark.timeout(240)
def test_three_peers_train_demo_over_the_swarm_and_agree(tmp_path):
    peers, rounds = 3, 10
    reports = run_swarm(tmp_path, peers, rounds, round_seconds=1.5)
    assert len({r["param_hash"] for r in reports}) == 1, "peers ended with different parameters"
    for report in reports:
        assert report["participants"] == [peers] * rounds
        assert report["rejected"] == {}
        assert report["received"] > 0
        assert max(report["lateness"]) < 0.5  # every round ends at its deadline
    first = sum(r["losses"][0] for r in reports) / peers
    last = sum(r["losses"][-1] for r in reports) / peers
    assert last < first


@pytest.mark.timeout(240)
def test_killing_a_peer_mid_run_does_not_stall_the_others(tmp_path):
    rounds = 8
    reports = run_swarm(tmp_path, peers=3, rounds=rounds, round_seconds=1.5, die={2: 3})
    for report in reports[:2]:
        assert len(report["losses"]) == rounds
        assert report["participants"][:3] == [3, 3, 3] and report["participants"][-1] == 2
        assert max(report["lateness"]) < 0.5  # no round waited past its deadline for the dead peer


@pytest.mark.timeout(240)
def test_a_peer_with_another_run_configuration_is_refused_naming_the_setting(tmp_path):
    rounds = 5
    reports = run_swarm(tmp_path, peers=3, rounds=rounds, round_seconds=1.5, extra={2: ["--topk", "4"]})
    for report in reports[:2]:
        assert report["participants"] == [2] * rounds
        (reason,) = report["refused"].values()
        assert "compression_topk is 4 there, 32 here" in reason
    assert reports[0]["param_hash"] == reports[1]["param_hash"]
    assert reports[2]["participants"] == [1] * rounds
    assert "compression_topk is 32 there, 4 here" in next(iter(reports[2]["refused"].values()))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["standard", "eager"])
def test_three_peers_train_diloco_over_the_swarm(tmp_path, mode):
    peers, rounds = 3, 5
    reports = run_swarm(
        tmp_path,
        peers,
        rounds,
        round_seconds=1.5,
        extra={i: ["--algorithm", f"diloco-{mode}"] for i in range(peers)},
    )
    for report in reports:
        # world_size is that of the last completed round: in eager mode the round just started is in flight
        seen = report["participants"] if mode == "standard" else report["participants"][1:]
        assert seen == [peers] * len(seen) and report["rejected"] == {}
        assert report["losses"][-1] < report["losses"][0]
    if mode == "standard":  # eager peers overlap their rounds and differ by their own fresh shares
        assert all(max(r["lateness"]) < 0.5 for r in reports)
        assert len({r["param_hash"] for r in reports}) == 1
