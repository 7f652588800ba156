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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

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


TAIL_CHARS = 3000
"""How much of the end of each log a failed wait shows."""

T = TypeVar("T")
Processes = Sequence[subprocess.Popen] | Mapping[str, subprocess.Popen]


class WaitTimeout(AssertionError, TimeoutError):
    """A `wait_until` whose condition did not hold in time: a failed test (AssertionError) and a
    TimeoutError, as the waits it replaced raised one or the other."""


def wait_until(
    condition: Callable[[], T],
    timeout_s: float,
    what: str,
    *,
    processes: Processes = (),
    logs: Iterable[Path | Callable[[], str]] = (),
    interval_s: float = 0.25,
) -> T:
    """The first truthy value of `condition()`, called every `interval_s` for at most `timeout_s`
    (at least once). What every test waits for (an event in a log, a file, a metric, a process
    state) is waited for here, never guessed with a sleep.

    Fails at once (AssertionError), naming it and its exit status, if one of `processes` (a mapping:
    by name, read again at each poll) has exited while the condition does not hold; after `timeout_s`,
    raises WaitTimeout. Either message says `what` was awaited, and ends with each of `logs`: a file's
    last TAIL_CHARS characters, or a callable's text (a process's captured errors, the last state
    seen)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        exited = _exited(processes)
        if exited:
            value = condition()  # what it did just before it exited
            if value:
                return value
            raise AssertionError(f"{exited} while waiting for {what}{_tails(logs)}")
        left = deadline - time.monotonic()
        if left <= 0:
            raise WaitTimeout(f"timed out after {timeout_s:g} s waiting for {what}{_tails(logs)}")
        time.sleep(min(interval_s, left))


def _exited(processes: Processes) -> str:
    """Those of `processes` that have exited, with their exit status; empty if none has."""
    named = processes.items() if isinstance(processes, Mapping) else ((None, p) for p in processes)
    return ", ".join(
        f"{name or _command(process)} exited with {process.returncode}"
        for name, process in named
        if process.poll() is not None
    )


def _command(process: subprocess.Popen) -> str:
    args = process.args if isinstance(process.args, list | tuple) else [process.args or ""]
    shown = " ".join(str(arg) for arg in args)[:200]
    return f"process {process.pid}" + (f" ({shown})" if shown else "")


def _tails(logs: Iterable[Path | Callable[[], str]]) -> str:
    said = []
    for log in logs:
        if isinstance(log, Path):
            text = log.read_text(errors="replace")[-TAIL_CHARS:] if log.exists() else "(not written)"
            said.append(f"\n--- the end of {log}:\n{text}")
        elif text := log():
            said.append(f"\n--- {text}")
    return "".join(said)


def wait_for(path: Path, predicate, timeout_s: float, *, processes: Processes = ()) -> dict:
    """The first event of the JSON-lines log `path` that `predicate` accepts, within `timeout_s`
    (wait_until: `processes` must not exit meanwhile)."""
    return wait_until(
        lambda: next((event for event in events(path) if predicate(event)), None),
        timeout_s,
        f"a matching event in {path}",
        processes=processes,
        logs=[path],
        interval_s=0.5,
    )


def listening(namespace: str, port: int) -> bool:
    """Whether a TCP socket listens on `port` in the network namespace `namespace` (the kernel's socket
    tables, read from inside it)."""
    tables = subprocess.run(
        ["ip", "netns", "exec", namespace, "cat", "/proc/net/tcp", "/proc/net/tcp6"],
        capture_output=True, text=True, timeout=30,
    ).stdout  # fmt: skip
    rows = (line.split() for line in tables.splitlines())  # state 0A: LISTEN
    return any(len(row) > 3 and row[1].endswith(f":{port:04X}") and row[3] == "0A" for row in rows)


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
