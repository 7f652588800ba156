"""`shoal demo`: a whole swarm on this machine, each peer its own `shoal join` process on 127.0.0.1.

Unless `--no-coordinator`, a `shoal coordinator` process runs the rounds: its first round waits for
every peer, each round's participant set is exactly the payloads reported in time, and a peer slowed
on purpose (`--slow-peer I`: it sleeps before every round's computation, shoal.peer.job.faults) is
left out as a straggler, told to shrink its window, then evicted for a while. The first peer starts
the swarm (with a round clock far enough ahead for the others to start, used without a coordinator);
the others join through the address it prints. Every peer writes JSON lines (`--log-format json`); this
process merges their rounds into one live table (the mean loss, the swarm's tokens/s, bytes moved)
and, when every peer has left after the last round, prints a summary: the losses, whether every
peer ends on the same parameters, and the payload and state bytes each peer served per round (its
own count; DHT traffic is not included: `shoal bench swarm-local` measures the wire).

Monitoring: every peer and the coordinator serve Prometheus metrics on a free port; their endpoints
go into a file_sd target file (`--metrics-targets`, e.g. deploy/prometheus/targets/demo.json, which
deploy/prometheus/prometheus.yml reads), emptied when the demo ends.

Logs: each peer's `peerN.log` holds its JSON lines and then whatever it wrote to stderr; with the
coordinator's log, the peers' checkpoints and the coordinator's state, they are in a temporary folder
removed when the demo ends (kept, and named, if it fails), or in `--keep-logs DIR`, kept. Ctrl-C,
SIGTERM and SIGHUP stop every process the demo started, whatever it was doing; and each of them is
killed by the kernel (Linux: PR_SET_PDEATHSIG) if the demo itself dies without stopping them
(SIGKILL, a crash).
"""

import contextlib
import ctypes
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from statistics import fmean
from typing import IO, Any

from shoal.peer.algorithms.configs import DEFAULTS
from shoal.peer.config.settings import ALGORITHMS
from shoal.peer.files import replace_text
from shoal.peer.job.progress import Progress

STARTUP_S = 8.0  # importing torch and hivemind, starting a DHT, loading the corpus; more per extra peer
STARTUP_PER_PEER_S = 2.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOP_GRACE_S = 6.0  # a stopped peer's last checkpoint and its DHT's goodbye, before SIGKILL
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class DemoError(RuntimeError):
    """A peer failed; the message carries the end of its log."""


def main(
    *,
    peers: int,
    rounds: int,
    algorithm: str,
    round_seconds: float,
    as_json: bool,
    averaging: str = "gather",
    model: str = "tiny",
    coordinator: bool = True,
    slow_peer: int | None = None,
    metrics_targets: str | None = None,
    keep_logs: str | None = None,
    codec: tuple[str, ...] = (),
    stream: IO[str] | None = None,
) -> int:
    stream = stream or sys.stdout
    for number in STOP_SIGNALS:  # `kill`, a closed terminal: the peers stop too, as on Ctrl-C
        signal.signal(number, _interrupt)
    # with --json, stdout carries only the summary; the live view goes to stderr
    progress = Progress("human", sys.stderr if as_json else stream, title=f"shoal demo · {peers} peers")
    try:
        summary = run(
            peers=peers,
            rounds=rounds,
            algorithm=algorithm,
            averaging=averaging,
            round_seconds=round_seconds,
            model=model,
            progress=progress,
            coordinator=coordinator,
            slow_peer=slow_peer,
            metrics_targets=metrics_targets,
            keep_logs=keep_logs,
            codec=codec,
        )
    except DemoError as error:
        progress.close()
        print(f"shoal demo: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the peers and the coordinator are stopped
        progress.close()
        return 130
    progress.close()
    if as_json:
        stream.write(json.dumps(summary) + "\n")
    else:
        agree = "all peers hold the same parameters" if summary["param_hash_agree"] else "PARAMETERS DIFFER"
        if slow_peer is not None:
            agree = agree.replace("all peers", "all peers but the slow one")
            agree += f"; {summary['stragglers_excluded']} late payloads left out"
        stream.write(
            f"{summary['peers']} peers, {summary['rounds']} rounds in {summary['wall_s']:.0f} s: loss "
            f"{summary['initial_loss']:.3f} -> {summary['final_loss']:.3f} "
            f"(validation {summary['validation_loss']:.3f}); {agree}; "
            f"{summary['bytes_sent_per_peer_per_round'] / 1024:.1f} KiB sent per peer per round\n"
        )
    return 0 if summary["param_hash_agree"] else 1


def run(
    *,
    peers: int,
    rounds: int,
    algorithm: str,
    round_seconds: float,
    model: str,
    progress: Progress,
    averaging: str = "gather",
    coordinator: bool = True,
    slow_peer: int | None = None,
    metrics_targets: str | None = None,
    keep_logs: str | None = None,
    codec: tuple[str, ...] = (),
) -> dict:
    """Runs the demo; returns its summary. The log folder is `keep_logs` (kept), else a temporary one,
    removed at the end unless the demo fails (DemoError, whose message names it)."""
    events: queue.Queue[tuple[int, dict[str, Any]]]
    started, events, processes = time.perf_counter(), queue.Queue(), []
    logs = _log_folder(keep_logs)
    start_time = time.time() + STARTUP_S + STARTUP_PER_PEER_S * peers
    threads = str(max(1, (os.cpu_count() or 1) // peers))
    common = _join_flags(model, algorithm, averaging, round_seconds, rounds, codec)
    targets = TargetsFile(Path(metrics_targets) if metrics_targets else logs / "prometheus-targets.json")

    def launch(index: int, *flags: str) -> None:
        # the slow peer sleeps for two rounds' worth before each round's computation (shoal.peer.job.faults)
        slow = f"shoal.peer.job.faults:slow={2 * round_seconds!r}" if index == slow_peer else ""
        command = [sys.executable, "-m", "shoal.peer.cli", "join", *common, *flags]
        command += ["--checkpoint-dir", str(logs / f"peer{index}-checkpoints")]
        processes.append(_start_peer(index, command, logs, threads, events, faults=slow))

    helpers: list[subprocess.Popen]
    helpers, failed = [], False  # helpers: the coordinator, once started
    try:
        kept = "" if keep_logs else " (removed at the end; shoal demo --keep-logs DIR keeps them)"
        progress.message(
            f"starting {peers} peers ({algorithm}, rounds of {round_seconds:g} s); logs in {logs}{kept}"
        )
        if coordinator:
            coordinator_address = _coordinate(logs, peers, round_seconds, algorithm, codec, helpers, targets)
            common += ["--coordinator", coordinator_address]
            progress.message(f"coordinator on {coordinator_address}")
        progress.message(f"Prometheus targets (file_sd) in {targets.path}")
        launch(0, "--start-time", repr(start_time))
        address = _first_address(events, processes[0], logs / "peer0.log")
        for index in range(1, peers):
            launch(index, "--initial-peers", address)
        summaries = _follow(events, processes, rounds, round_seconds, progress, logs, targets)
        late = sum(s["late_rounds"] for i, s in summaries.items() if i != "losses")
        stragglers = _stragglers(coordinator_address) if helpers else late
    except KeyboardInterrupt:
        progress.message("interrupted: stopping the peers")
        raise
    except DemoError as error:
        failed = True  # keep the logs, to be read
        raise DemoError(f"{error}\nlogs kept in {logs}") from None
    finally:
        _tear_down(processes + helpers, targets, None if keep_logs or failed else logs)
    demo = {"peers": peers, "rounds": rounds, "algorithm": algorithm, "round_seconds": round_seconds}
    demo |= {"coordinator": coordinator, "wall_s": time.perf_counter() - started}
    return _summary(summaries, demo, slow_peer=slow_peer, stragglers=stragglers)


def _coordinate(
    logs: Path,
    peers: int,
    round_seconds: float,
    algorithm: str,
    codec: tuple[str, ...],
    helpers: list[subprocess.Popen],
    targets: "TargetsFile",
) -> str:
    """Starts the demo's coordinator (into `helpers`), its metrics in `targets`; returns its address."""
    gather = dict(zip(codec[::2], codec[1::2], strict=True)).get("--gather", "0")
    overlapped = DEFAULTS[ALGORITHMS[algorithm]].overlapped
    address, metrics = _start_coordinator(logs, peers, round_seconds, overlapped, gather, helpers)
    targets.add("coordinator", metrics)
    return address


def _join_flags(
    model: str, algorithm: str, averaging: str, round_seconds: float, rounds: int, codec: tuple[str, ...]
) -> list[str]:
    """The `shoal join` flags every peer of the demo shares."""
    flags = ["--host", "127.0.0.1", "--run", "demo", "--log-format", "json", "--model", model]
    flags += ["--algorithm", algorithm, "--averaging", averaging, "--round-seconds", str(round_seconds)]
    # its peers share this machine's cores: 64 micro-batches a step at most leaves them time to exchange
    flags += ["--max-micro-batches", "64"]
    return [*flags, "--until-round", str(rounds - 1), "--metrics-port", "0", *codec]


def _tear_down(processes: list[subprocess.Popen], targets: "TargetsFile", logs: Path | None) -> None:
    """Stops every process of the demo, its Prometheus targets with them, and removes `logs` if given."""
    for number in STOP_SIGNALS:  # a second Ctrl-C must not cut the stopping short
        signal.signal(number, signal.SIG_IGN)
    targets.clear()  # the swarm is gone: Prometheus stops scraping it
    _stop(processes)
    if logs is not None:
        shutil.rmtree(logs, ignore_errors=True)


def _start_peer(
    index: int, command: list[str], logs: Path, threads: str, events: queue.Queue, *, faults: str = ""
) -> subprocess.Popen:
    """Peer `index`, its JSON lines copied to `events` and its log by a reader thread; `faults`: its
    SHOAL_FAULTS (shoal.peer.job.faults; empty: none)."""
    env = {**os.environ, "OMP_NUM_THREADS": threads, "SHOAL_FAULTS": faults}
    # appending, the peer's stderr and the JSON lines copied by _read share the file without
    # overwriting each other
    log = (logs / f"peer{index}.log").open("a")
    process = _spawn(command, log, env)
    threading.Thread(target=_read, args=(index, process.stdout, events, log), daemon=True).start()
    return process


def _summary(summaries: dict, demo: dict, *, slow_peer: int | None, stragglers: int) -> dict:
    """The demo's JSON summary, from the peers' own summaries (and their losses by round)."""
    losses = summaries.pop("losses")
    honest = {i: s for i, s in summaries.items() if i != slow_peer}
    hashes = {s["param_hash"] for s in honest.values()}
    return {
        "peers": demo["peers"],
        "rounds": demo["rounds"],
        "initial_loss": fmean(losses[min(losses)]),
        "final_loss": fmean(losses[max(losses)]),
        # the honest peers' final model on the embedded data's held-out files (one value where they agree)
        "validation_loss": fmean(s["validation_loss"] for s in honest.values()),
        "param_hash_agree": len(hashes) == 1,
        "bytes_sent_per_peer_per_round": fmean(
            s["bytes_sent"] / max(s["rounds"], 1) for s in summaries.values()
        ),
        "wall_s": demo["wall_s"],
        "algorithm": demo["algorithm"],
        "round_seconds": demo["round_seconds"],
        "resyncs": sum(s["resyncs"] for s in summaries.values()),
        "coordinator": demo["coordinator"],
        "stragglers_excluded": stragglers,
        "coordinated_rounds": sum(s["coordinated_rounds"] for s in summaries.values()),
        "butterfly_rounds": sum(s["butterfly_rounds"] for s in summaries.values()),
        "pieces_recomputed": sum(s["pieces_recomputed"] for s in summaries.values()),
        "dht_stores_per_peer_per_round": fmean(
            s["dht_stores"] / max(s["rounds"], 1) for s in summaries.values()
        ),
    }


class TargetsFile:
    """A Prometheus file_sd target file listing the demo's metrics endpoints (deploy/prometheus/
    prometheus.yml reads `targets/*.json` next to it), rewritten whole as endpoints appear."""

    def __init__(self, path: Path):
        self.path = path
        self.endpoints: dict[str, list[str]] = {"peer": [], "coordinator": []}

    def add(self, role: str, address: str | None) -> None:
        if address:
            self.endpoints[role].append(address)
            self._write()

    def clear(self) -> None:
        self.endpoints = {role: [] for role in self.endpoints}
        self._write()

    def _write(self) -> None:
        groups = [
            {"targets": sorted(addresses), "labels": {"role": role, "swarm": "demo"}}
            for role, addresses in self.endpoints.items()
            if addresses
        ]
        try:
            replace_text(self.path, json.dumps(groups, indent=2) + "\n")  # Prometheus never reads half
        except OSError as error:
            raise DemoError(f"--metrics-targets {self.path}: {error.strerror}") from None


def _start_coordinator(
    logs: Path, peers: int, round_seconds: float, overlap: bool, gather: str, started: list[subprocess.Popen]
) -> tuple[str, str]:
    """A `shoal coordinator` on a free loopback port whose first round waits for every peer; rounds
    compute for half of `round_seconds`, and at most twice that; with `overlap`, the next round is
    announced as soon as a peer reports the last; it chooses the `gather` payloads that count (the
    peers' --gather). Adds it to `started` at once (an interruption while it starts stops it too);
    returns its address and its metrics endpoint."""
    command = [sys.executable, "-m", "shoal.peer.cli", "coordinator", "--listen", "127.0.0.1:0"]
    command += ["--metrics-port", "0"]
    command += ["--state", str(logs / "coordinator.db"), "--log-format", "json", "--min-peers", str(peers)]
    command += ["--min-compute-s", repr(round_seconds / 2), "--max-compute-s", repr(round_seconds)]
    command += ["--eviction-s", repr(10 * round_seconds)] + (["--overlap"] if overlap else [])
    command += ["--gather", gather]
    process = _spawn(command, (logs / "coordinator.log").open("w"))
    started.append(process)
    assert process.stdout is not None  # _spawn: stdout=PIPE
    line = process.stdout.readline()  # its first line says where it listens (no torch: quick)
    try:
        listening = json.loads(line)
        return listening["address"], listening["metrics"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise DemoError(f"the coordinator did not start:\n{_tail(logs / 'coordinator.log')}") from None


def _stragglers(address: str) -> int:
    """Payloads the coordinator left out of rounds as late, from its SwarmStatus."""
    import grpc

    from shoal.protocol import coordinator_pb2, coordinator_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        return stub.SwarmStatus(coordinator_pb2.SwarmStatusRequest(), timeout=10).stragglers_total


def _log_folder(keep_logs: str | None) -> Path:
    """`--keep-logs DIR` (created if missing; DemoError if it cannot be), else a new temporary folder."""
    if not keep_logs:
        return Path(tempfile.mkdtemp(prefix="shoal-demo-"))
    folder = Path(keep_logs)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DemoError(f"--keep-logs {keep_logs}: {error.strerror}") from None
    return folder


def _read(index: int, lines: IO[str], events: queue.Queue, log: IO[str]) -> None:
    """Passes a peer's JSON lines on as events, and copies every line to its log (which it closes)."""
    with log:
        for line in lines:
            log.write(line)
            log.flush()
            with contextlib.suppress(json.JSONDecodeError):
                event = json.loads(line)
                if isinstance(event, dict):
                    events.put((index, event))
    events.put((index, {"event": "exit"}))


def _first_address(events: queue.Queue, first: subprocess.Popen, log: Path, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            _index, event = events.get(timeout=1)
        except queue.Empty:
            continue
        if event.get("event") == "started" and event.get("initial_peers"):
            return next(
                (a for a in event["initial_peers"] if "/ip4/127.0.0.1/" in a), event["initial_peers"][0]
            )
        if event.get("event") == "exit":
            raise DemoError(f"the first peer exited ({first.wait()}):\n{_tail(log)}")
    raise DemoError(f"the first peer printed no address within {timeout_s:.0f} s:\n{_tail(log)}")


def _follow(events, processes, rounds, round_seconds, progress, logs, targets: TargetsFile) -> dict:
    """Merges the peers' rounds into rows until every peer has exited; returns their summaries
    and, under "losses", every round's losses."""
    summaries: dict = {}
    by_round: dict[int, dict[int, dict]] = {}
    latest: dict[int, int] = {}  # peer: the last round it reported
    shown = -1
    exited: set[int] = set()
    deadline = time.monotonic() + STARTUP_S * 4 + len(processes) * 10 + rounds * round_seconds * 3
    while len(exited) < len(processes):
        if time.monotonic() > deadline:
            raise DemoError("the swarm did not finish in time")
        try:
            index, event = events.get(timeout=1)
        except queue.Empty:
            continue
        kind = event.get("event")
        if kind == "round":
            by_round.setdefault(event["round"], {})[index] = event
            latest[index] = max(latest.get(index, -1), event["round"])
            # a round is shown once every live peer has reported it or a later one
            done = min(latest.get(i, -1) for i in range(len(processes)) if i not in exited)
            for number in sorted(n for n in by_round if shown < n <= done):
                progress.round(_row(number, by_round[number]))
                shown = number
        elif kind == "summary":
            summaries[index] = event
        elif kind == "metrics" and isinstance(event.get("address"), str):
            targets.add("peer", event["address"])
        elif kind == "exit":
            exited.add(index)
            code = processes[index].wait()
            if code != 0:
                raise DemoError(f"peer {index} exited with {code}:\n{_tail(logs / f'peer{index}.log')}")
    for number in sorted(by_round):
        if number > shown:
            progress.round(_row(number, by_round[number]))
    missing = set(range(len(processes))) - summaries.keys()
    if missing:
        raise DemoError(f"peers {sorted(missing)} left no summary")
    if not by_round:
        raise DemoError(f"the peers left without training a round:\n{_tail(logs / 'peer0.log')}")
    summaries["losses"] = {n: [e["loss"] for e in peers.values()] for n, peers in by_round.items()}
    return summaries


def _row(number: int, peers: dict[int, dict]) -> dict:
    rows = list(peers.values())
    return {
        "round": number,
        "loss": fmean(r["loss"] for r in rows),
        "tokens_per_s": sum(r["tokens_per_s"] for r in rows),
        "participants": max(r["participants"] for r in rows),
        # the peers whose payload counted together with another's in the round
        "together": f"{sum(bool(r.get('shared')) for r in rows)}/{len(rows)}",
        "micro_batches": "/".join(str(r["micro_batches"]).split("x")[0] for r in rows),
        "bytes_up": sum(r["bytes_up"] for r in rows),
        "bytes_down": sum(r["bytes_down"] for r in rows),
        "round_s": fmean(r["round_s"] for r in rows),
    }


def _interrupt(_signum, _frame) -> None:
    raise KeyboardInterrupt


def _spawn(command: list[str], log: IO[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """A child of the demo: its stdout a pipe, its stderr `log`, in a session of its own (so that it
    and what it starts can be stopped as a group), and ended with the demo (`_ends_with`)."""
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=_ends_with(os.getpid()),
    )


def _ends_with(parent: int):
    """A `preexec_fn` that has the kernel kill the child when this process dies, however it dies (Linux;
    elsewhere None: the demo's own signal handlers stop its children). SIGKILL, not SIGTERM: a peer
    stops on SIGTERM at its round's end, after its checkpoint, which can take long on a loaded machine
    with nobody left to escalate; what a peer started ends with it (its DHT process, and p2pd in that
    process's group, watch their parent: shoal.peer.swarm.lifeline)."""
    if not sys.platform.startswith("linux"):
        return None

    def ends_with_parent() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the demo died before the request took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return ends_with_parent


def _stop(processes: list[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to every process group (each peer's DHT and p2pd too) at once, then SIGKILL to what is
    left after `grace_s`: one at a time, a loaded machine's peers would take their graces in turn."""
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        with contextlib.suppress(ProcessLookupError):  # what lingers, and children left after a clean exit
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
