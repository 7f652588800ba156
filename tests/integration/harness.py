"""What integration tests start, stop and watch: `shoal` processes (each in its own session, so that a
kill ends its DHT process and p2pd too), their JSON-lines logs, free ports, and swarms of real
SwarmExchanges in this process (`swarm`)."""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from hivemind.utils.crypto import RSAPrivateKey

from shoal.peer.swarm.bootstrap import start_dht
from shoal.peer.swarm.exchange import RoundSchedule, SwarmExchange
from shoal.peer.swarm.membership import record_validators
from tests.integration.launcher import launch

ROOT = Path(__file__).resolve().parents[2]
SHOAL = [sys.executable, "-m", "shoal.peer.cli"]
HIVEMIND_DHT = Path(sys.executable).with_name("hivemind-dht")


STDIO = {"stdin", "stdout", "stderr"}


def spawn(command: list[str], *, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    """`command` in its own process session (so that `kill` ends the DHT and p2pd processes it forks),
    from the repository root, one thread for torch; `env`: more variables. `python -m MODULE ...` is
    forked from the zygote that has imported torch and hivemind already (tests.integration.launcher)."""
    variables = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    piped = subprocess.PIPE in (kwargs.get(name) for name in STDIO)
    if (
        command[:2] == [sys.executable, "-m"]
        and kwargs.keys() <= STDIO | {"text"}
        and (kwargs.get("text") or not piped)
    ):
        return launch(command[1:], env=variables, **{k: v for k, v in kwargs.items() if k in STDIO})
    return subprocess.Popen(command, cwd=ROOT, env=variables, start_new_session=True, **kwargs)


def start(*args: str, **kwargs) -> subprocess.Popen:
    """`shoal ARGS...` (spawn)."""
    return spawn([*SHOAL, *args], text=True, **kwargs)


def kill(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def bootstrap_address(node: subprocess.Popen, timeout_s: float = 30) -> str:
    """The address a stock `hivemind-dht` node (spawned with stderr=PIPE, text=True) prints for joiners."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        line = node.stderr.readline()
        found = re.search(r"--initial_peers (/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)", line)
        if found:
            return found.group(1)
    raise TimeoutError("hivemind-dht printed no address")


def start_coordinator(folder: Path, min_peers: int, round_seconds: float) -> tuple[subprocess.Popen, str]:
    """A `shoal coordinator` on a free loopback port whose first round waits for `min_peers` (a test's
    swarm then starts when its peers are ready, however long a loaded machine takes to start them),
    computing for half of `round_seconds` to all of it, its log in `folder`; and its address."""
    address = f"127.0.0.1:{free_port()}"
    flags = ["--listen", address, "--state", str(folder / "coordinator.db"), "--min-peers", str(min_peers)]
    flags += ["--min-compute-s", repr(round_seconds / 2), "--max-compute-s", repr(round_seconds)]
    log = (folder / "coordinator.log").open("w")
    return start("coordinator", *flags, "--metrics-port", "0", stdout=subprocess.DEVNULL, stderr=log), address


def shoal(*args: str, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*SHOAL, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def events(path: Path) -> list[dict]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.startswith("{")]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for(path: Path, predicate, timeout_s: float) -> dict:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        for event in events(path):
            if predicate(event):
                return event
        time.sleep(0.5)
    raise TimeoutError(f"no matching event in {path}: {path.read_text()[-2000:] if path.exists() else ''}")


def metrics(lab, url: str) -> dict[str, float]:
    """The exposition's samples by name and labels, as in `shoal_relay_sent_bytes{kind="payload"}`
    scraped from inside node 0's namespace of `lab` (a shoal.peer.bench.netlab.NetLab)."""
    read = f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=10).read().decode())"
    text = subprocess.run(
        ["ip", "netns", "exec", lab.namespace(0), sys.executable, "-c", read],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


CONFIG = {"model": "tiny", "algorithm": "demo"}


@contextlib.contextmanager
def swarm(
    kinds: list[type[SwarmExchange]], round_seconds: float = 6, schedules: list[RoundSchedule] | None = None
) -> Iterator[tuple[list, RoundSchedule]]:
    """(exchanges, the schedule): one exchange of each kind, in this process; all closed on exit.
    `schedules`: each exchange's own round clock instead of one for all."""
    identities = [RSAPrivateKey() for _ in kinds]
    dhts = [
        start_dht(
            [], host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=record_validators("r", identities[0])
        )
    ]
    initial = [str(a) for a in dhts[0].get_visible_maddrs()]
    for identity in identities[1:]:
        dhts.append(
            start_dht(
                initial,
                host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                record_validators=record_validators("r", identity),
            )
        )
    schedule = RoundSchedule(start_time=time.time() + 2, round_seconds=round_seconds)
    exchanges = []
    try:
        for i, (kind, dht, identity) in enumerate(zip(kinds, dhts, identities, strict=True)):
            own = schedules[i] if schedules else schedule
            exchanges.append(kind(dht, run="r", schedule=own, identity=identity, config=CONFIG))
        yield exchanges, schedule
    finally:
        for exchange in exchanges:
            exchange.close()
        for dht in dhts:
            dht.shutdown()
