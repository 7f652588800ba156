"""Every peer prints where it can be dialed, a joiner too, in human and JSON logs: once the first peer
has left, the address a joiner printed is enough for `shoal check`, and the join command it printed
joins the swarm through it (real `shoal join` processes on 127.0.0.1, OS-chosen ports)."""

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.integration import harness
from tests.integration.harness import kill

JOINED = re.compile(
    r"Joined the swarm as (\S+)\. Others can join through this peer with:\n  (shoal join .*)\n"
)


def start(out: Path, *args: str) -> subprocess.Popen:
    with out.open("w") as stdout, out.with_suffix(".err").open("w") as stderr:
        return harness.start(*args, env={"COLUMNS": "400"}, stdout=stdout, stderr=stderr)


def wait_for(out: Path, find, timeout_s: float):
    """The first truthy `find(text of out)` within `timeout_s`."""
    return harness.wait_until(
        lambda: find(out.read_text()),
        timeout_s,
        f"what is looked for in {out}",
        logs=[out, out.with_suffix(".err")],
        interval_s=0.5,
    )


def event(name: str, predicate=lambda e: True):
    def find(text: str) -> dict | None:
        events = (json.loads(line) for line in text.splitlines() if line.startswith("{"))
        return next((e for e in events if e.get("event") == name and predicate(e)), None)

    return find


@pytest.mark.timeout(240)
def test_a_joiner_prints_its_address_and_others_join_through_it_once_the_first_has_left(tmp_path):
    common = ["--host", "127.0.0.1", "--run", "relay", "--round-seconds", "2"]
    first = start(tmp_path / "first.jsonl", "join", *common, "--log-format", "json")
    processes = [first]
    try:
        started = wait_for(tmp_path / "first.jsonl", event("started"), 90)
        assert started["address"] == started["join_command"].split()[3]
        joiner = start(tmp_path / "joiner.txt", "join", *common, "--initial-peers", started["address"])
        processes.append(joiner)
        address, command = wait_for(
            tmp_path / "joiner.txt", lambda text: (m := JOINED.search(text)) and m.groups(), 90
        )
        assert address.startswith("/ip4/127.0.0.1/tcp/") and address != started["address"]
        assert command.startswith(f"shoal join --initial-peers {address} --run relay ")

        kill(first)  # the peer the joiner came through is gone: only the joiner's own address is left
        check = harness.shoal("check", "--initial-peers", address, "--run", "relay", "--json", timeout=90)
        assert check.returncode == 0, check.stderr[-2000:]
        assert json.loads(check.stdout)["network"]["bootstrap"] == "ok"

        # the command the joiner printed, as another volunteer runs it (JSON logs this time)
        late_out = tmp_path / "late.jsonl"
        late = start(late_out, *command.split()[1:], "--host", "127.0.0.1", "--log-format", "json")
        processes.append(late)
        own = wait_for(late_out, event("started"), 90)
        assert own["address"].startswith("/ip4/127.0.0.1/tcp/")
        assert own["join_command"].startswith(f"shoal join --initial-peers {own['address']} --run relay ")
        wait_for(late_out, event("round", lambda e: e["participants"] == 2), 90)
    finally:
        for process in processes:
            kill(process)


@pytest.mark.timeout(120)
def test_announce_maddrs_is_the_address_a_peer_gives_out(tmp_path):
    """A volunteer who forwards a port on the router gives others the router's public address."""
    out = tmp_path / "peer.jsonl"
    flags = ["--host", "127.0.0.1", "--announce-maddrs", "/ip4/203.0.113.5/tcp/31337", "--max-rounds", "1"]
    peer = start(out, "join", *flags, "--round-seconds", "2", "--log-format", "json")
    try:
        started = wait_for(out, event("started"), 90)
        assert started["address"].startswith("/ip4/203.0.113.5/tcp/31337/p2p/"), started
        assert started["join_command"].startswith(f"shoal join --initial-peers {started['address']} ")
        assert peer.wait(timeout=60) == 0
    finally:
        harness.kill(peer)
