"""A peer whose token the coordinator refuses stops at once, naming `--coordinator-token-file`, and
exits 2, instead of training alone: `shoal join` subprocesses against a `shoal coordinator` subprocess
with a token file (a wrong token, none at all, the right one), and the peers' `CoordinatorLink`
against an in-process coordinator that is reached only once the peer runs."""

import asyncio
import contextlib
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.coordinator.auth import Tokens
from shoal.coordinator.server import Coordinator
from shoal.peer.swarm.coordinator_link import CoordinatorError, CoordinatorLink, check_access
from tests.integration.harness import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
SWARM_TOKEN, A_TOKEN = "swarm-token-0123456789", "peer-a-token-0123456789"
PEER_A = f"12D3KooW{'A' * 44}"
TIMEOUT_S = 90


@contextlib.contextmanager
def coordinator(tmp_path: Path, listen: str = "127.0.0.1:0") -> Iterator[str]:
    """A `shoal coordinator` on `listen` that accepts the swarm token and peer A's; yields its address."""
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(f"{SWARM_TOKEN}\n{PEER_A} {A_TOKEN}\n")
    command = [sys.executable, "-m", "shoal.peer.cli", "coordinator", "--listen", listen]
    command += ["--state", str(tmp_path / "c.db"), "--log-format", "json", "--token-file", str(tokens)]
    with (tmp_path / "coordinator.err").open("w") as stderr:
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True
        )
    try:
        yield json.loads(process.stdout.readline())["address"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        process.stdout.close()


def join(address: str, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "shoal.peer.cli", "join", "--host", "127.0.0.1", "--log-format", "json"]
    command += ["--coordinator", address, "--max-rounds", "1", *flags]
    return subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.timeout(TIMEOUT_S + 20)
@pytest.mark.parametrize(
    ("token", "said"),
    [
        ("wrong-token-0123456789", "refuses this peer's token (unknown token)"),
        (None, "needs a token (missing 'authorization: Bearer <token>' metadata)"),
    ],
)
def test_a_refused_token_exits_2_before_the_dht_starts(tmp_path, token, said):
    flags = []
    if token is not None:
        (tmp_path / "token").write_text(token + "\n")
        flags = ["--coordinator-token-file", str(tmp_path / "token")]
    with coordinator(tmp_path) as address:
        result = join(address, *flags)
    assert result.returncode == 2, result.stderr[-2000:]
    assert said in result.stderr
    assert "--coordinator-token-file FILE" in result.stderr
    assert result.stderr.count("UNAUTHENTICATED") == 0 and "Traceback" not in result.stderr
    assert '"started"' not in result.stdout  # no DHT, no round


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_a_token_refused_once_the_coordinator_comes_up_stops_the_peer(tmp_path):
    """The coordinator is down when the peer starts (it trains on meanwhile), then comes up refusing
    its token: the peer stops with the fix and exits 2, instead of training alone."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (tmp_path / "token").write_text("wrong-token-0123456789\n")
    out = tmp_path / "peer.jsonl"
    command = [sys.executable, "-m", "shoal.peer.cli", "join", "--host", "127.0.0.1", "--log-format", "json"]
    command += ["--coordinator", f"127.0.0.1:{port}", "--coordinator-token-file", str(tmp_path / "token")]
    command += ["--round-seconds", "2"]
    with out.open("w") as stdout, (tmp_path / "peer.err").open("w") as stderr:
        peer = subprocess.Popen(command, cwd=ROOT, stdout=stdout, stderr=stderr, start_new_session=True)
    try:
        wait_until(
            lambda: '"started"' in out.read_text(),
            TIMEOUT_S,
            "the peer to start",
            processes=[peer],
            logs=[tmp_path / "peer.err"],
            interval_s=0.5,
        )
        with coordinator(tmp_path, f"127.0.0.1:{port}"):
            assert peer.wait(timeout=60) == 2
        said = (tmp_path / "peer.err").read_text()
        assert "refuses this peer's token (unknown token)" in said and "--coordinator-token-file" in said
        assert said.count("unknown token") == 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(peer.pid, signal.SIGKILL)
        peer.wait()


@pytest.mark.timeout(TIMEOUT_S + 20)
def test_another_peers_token_exits_2_at_the_first_join(tmp_path):
    """A per-peer token under another identity (here: none, so a peer id drawn at random) is accepted
    for asking about the swarm, and refused at the link's first join: exit 2 with the fix."""
    (tmp_path / "token").write_text(A_TOKEN + "\n")
    with coordinator(tmp_path) as address:
        result = join(address, "--coordinator-token-file", str(tmp_path / "token"), "--round-seconds", "2")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "this token belongs to another peer" in result.stderr
    assert "valid only with the --identity it was issued for" in result.stderr


@pytest.mark.timeout(60)
def test_known_tokens_pass_the_check_before_the_start(tmp_path):
    with coordinator(tmp_path) as address:
        assert check_access(address, token=SWARM_TOKEN) is True
        check_access(address, token=A_TOKEN)  # whose peer id it is, the first join tells
        assert check_access("127.0.0.1:9", token=None) is False  # unreachable: the link keeps trying later
        with pytest.raises(CoordinatorError, match="refuses this peer's token"):
            check_access(address, token="wrong-token-0123456789")


@pytest.mark.timeout(30)
def test_a_link_refused_for_its_token_stops_and_says_why(tmp_path):
    """The coordinator reached only once the peer runs (it was down at the start): the link does not
    retry a refused token, and the round's plan raises with the fix."""

    async def scenario() -> None:
        tokens = Tokens([SWARM_TOKEN], {})
        server = Coordinator(listen="127.0.0.1:0", state_path=tmp_path / "c.db", tokens=tokens)
        port = await server.start()
        link = CoordinatorLink(f"127.0.0.1:{port}", PEER_A, token="wrong-token-0123456789")
        try:
            await link.start()
            started = time.monotonic()
            assert not await link.wait_connected(datetime.timedelta(seconds=10))
            assert time.monotonic() - started < 5  # at once, not after the wait
            assert link.refusal is not None and "--coordinator-token-file" in link.refusal
            assert not link.member and not link.connected
        finally:
            await link.stop()
            await server.stop(grace_s=0)

    asyncio.run(asyncio.wait_for(scenario(), 20))


@pytest.mark.timeout(30)
def test_a_coordinator_that_never_answers_stops_the_link_and_one_that_answered_once_does_not(tmp_path):
    """A wrong --coordinator address is told after --coordinator-wait (the plan raises, `shoal join`
    exits 2), while a coordinator that answered once and then went away is ridden out uncoordinated."""
    nowhere = free_port()  # free a moment ago: nothing answers there

    async def scenario() -> None:
        never = CoordinatorLink(f"127.0.0.1:{nowhere}", PEER_A, first_contact_s=1.0)
        server = Coordinator(listen="127.0.0.1:0", state_path=tmp_path / "c.db")
        port = await server.start()
        once = CoordinatorLink(f"127.0.0.1:{port}", PEER_A, first_contact_s=1.0)
        try:
            await never.start()
            await once.start()
            assert await once.wait_connected(datetime.timedelta(seconds=10))
            await server.stop(grace_s=0)
            deadline = time.monotonic() + 15
            await asyncio.to_thread(
                wait_until, lambda: never.refusal is not None, 15, "the refusal", interval_s=0.05
            )
            assert never.refusal is not None and "--coordinator-wait" in never.refusal
            assert not never.answered and not never.connected
            left = max(0.0, deadline - time.monotonic())
            await asyncio.to_thread(  # the outage is seen...
                wait_until, lambda: not once.connected, left, "the outage seen", interval_s=0.05
            )
            ridden_out = time.monotonic() + 2 * once.first_contact_s
            while time.monotonic() < ridden_out:  # ...and outlasts the first-contact bound, harmlessly
                await asyncio.sleep(0.05)
            assert not once.connected and once.answered and once.refusal is None
        finally:
            await never.stop()
            await once.stop()

    asyncio.run(asyncio.wait_for(scenario(), 25))
