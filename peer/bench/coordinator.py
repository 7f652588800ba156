"""`shoal bench coordinator`: the real coordinator under many simulated peers.

    shoal bench coordinator --peers 1000 --rounds 5 --json

A `shoal coordinator` process (its gRPC server, SQLite store and round policy, as shipped) on
127.0.0.1, and in this process N light peers, each on its own gRPC channel (one TCP connection, as
real peers have), doing what a `shoal join` peer does with its coordinator (peer/swarm/
coordinator_link.py): join, follow the `Rounds` stream, heartbeat whenever the coordinator has not
heard from it for a third of the heartbeat timeout, and in every round it is expected in: compute for
a random part of the compute window, report its payload, wait for the round's result, exchange for a
random fraction of a second, then report the round finished in its next heartbeat. No training and
no payloads: this measures the coordinator.

The first round waits for all N (`--min-peers N`). Figures, over the rounds after the first:
- `p50_ms`, `p99_ms`: latency of every unary call (Join, Heartbeat, ReportReady) seen by the peers;
- `rounds`: rounds decided; `rounds_on_time`: those in which every peer's report was included and
  every peer had the result within `ON_TIME_S` of the compute deadline (or before it, when all
  reported early);
- `coordinator_cpu_s_per_round` (user + system, from /proc) and `coordinator_peak_rss_mb` (VmHWM).
"""

import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import cast

import grpc

from shoal.coordinator.policy import Policy
from shoal.protocol import coordinator_pb2 as pb
from shoal.protocol import coordinator_pb2_grpc

ON_TIME_S = 1.0
"""How long after a round's compute deadline and the coordinator's report grace its result may reach
a peer and still count as on time."""
THROUGHPUT = 100.0  # samples per second each simulated peer states
MIN_SAMPLES = 8
CALL_S = 10.0
CHANNEL_OPTIONS = (("grpc.http2.bdp_probe", 0),)  # as peers' (coordinator_link.CHANNEL_OPTIONS)
BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


@dataclass(slots=True)
class Observed:
    """What the simulated peers saw."""

    latencies: list[float] = field(default_factory=list)
    """Seconds of every unary call after the first round."""
    failures: dict[str, int] = field(default_factory=dict)
    """Failed calls by method and status code."""
    lags: dict[int, list[float]] = field(default_factory=dict)
    """Per round: for every peer, when it had the result, seconds after the compute deadline."""
    excluded: dict[int, int] = field(default_factory=dict)
    """Per round: reports answered `included=False`."""
    expected: dict[int, int] = field(default_factory=dict)
    """Per round: simulated peers it expected (one that joined late misses the first)."""
    result_bytes: int = 0
    """The largest round result a peer received."""
    measuring: bool = False

    def failed(self, what: str, error: grpc.aio.AioRpcError) -> None:
        key = f"{what}:{error.code().name}"
        self.failures[key] = self.failures.get(key, 0) + 1


@dataclass(slots=True)
class CoordinatorLoad:
    peers: int
    """Clients in all, the abusive ones included."""
    abusive: int
    gather: int
    """The coordinator's --gather (0: every result lists every participant)."""
    result_bytes: int
    """The largest round result sent to a peer (each peer is sent one a round)."""
    rounds: int
    """Rounds decided of those asked for (fewer: the swarm stalled)."""
    rounds_on_time: int
    p50_ms: float
    p99_ms: float
    calls: int
    failures: dict[str, int]
    round_s: float
    """Mean seconds from one round's announcement to the next's."""
    elapsed_s: float
    """Seconds the clients ran, from the first join to the last call."""
    max_lag_s: float | None
    """The latest any peer had a round's result, seconds after its compute deadline (None: no round)."""
    coordinator_cpu_s_per_round: float
    coordinator_peak_rss_mb: float
    abuse_answers: dict[str, dict[str, int]]
    """What the abusive clients were answered, by abuse and status code."""
    abuse_counted: dict[str, float]
    """The coordinator's own counts of refused abuse (its Prometheus counters that are not 0)."""


def peer_ids(count: int, seed: float = 0) -> list[str]:
    """`count` distinct ids of the shape of libp2p ones (what the coordinator validates)."""
    rng = random.Random(seed)
    return [f"12D3KooW{''.join(rng.choices(BASE58, k=44))}" for _ in range(count)]


class SimulatedPeer:
    """One peer's conversation with the coordinator (the shape of coordinator_link.CoordinatorLink)."""

    def __init__(self, peer_id: str, address: str, observed: Observed, rng: random.Random):
        self.peer_id, self.observed, self.rng = peer_id, observed, rng
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self.finished = -1  # the last round it finished
        self.interval = 2.0
        self.heard_at = 0.0

    async def call(self, what: str, method, request):
        start = time.perf_counter()
        try:
            reply = await method(request, timeout=CALL_S)
        except grpc.aio.AioRpcError as error:
            self.observed.failed(what, error)
            return None
        if self.observed.measuring:
            self.observed.latencies.append(time.perf_counter() - start)
        self.heard_at = time.monotonic()
        return reply

    async def run(self, until: asyncio.Event) -> None:
        joined = await self.call(
            "join",
            self.stub.Join,
            pb.JoinRequest(peer_id=self.peer_id, throughput=THROUGHPUT, min_samples=MIN_SAMPLES),
        )
        if joined is None:
            return
        self.interval = joined.heartbeat_timeout_s / 3
        tasks = [asyncio.create_task(self.heartbeats()), asyncio.create_task(self.rounds())]
        try:
            await until.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.channel.close()

    async def heartbeat(self) -> None:
        request = pb.HeartbeatRequest(
            peer_id=self.peer_id,
            round=self.finished,
            throughput=THROUGHPUT,
            min_samples=MIN_SAMPLES,
            exchange_s=0.5,
        )
        await self.call("heartbeat", self.stub.Heartbeat, request)

    async def heartbeats(self) -> None:
        while True:
            wait = self.heard_at + self.interval - time.monotonic()
            if wait <= 0:
                await self.heartbeat()
                wait = self.interval
            await asyncio.sleep(wait)

    async def rounds(self) -> None:
        stream = self.stub.Rounds(pb.RoundsRequest(peer_id=self.peer_id))
        try:
            async for announced in stream:
                if self.peer_id in announced.peers:
                    expected = self.observed.expected
                    expected[announced.round] = expected.get(announced.round, 0) + 1
                    await self.take_part(announced)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.CANCELLED:
                self.observed.failed("rounds", error)

    async def take_part(self, announced: pb.RoundAnnouncement) -> None:
        offset = time.time() - announced.now  # the same clock here: ~0
        compute_s = announced.compute_deadline - announced.now
        await asyncio.sleep(max(0.0, self.rng.uniform(0.2, 0.8) * compute_s))
        report = pb.ReportRequest(
            peer_id=self.peer_id,
            round=announced.round,
            digest=self.rng.randbytes(32),
            size=100_000,
            samples=MIN_SAMPLES,
            synced=True,
        )
        reply = await self.call("report", self.stub.ReportReady, report)
        if reply is not None and not reply.included:
            self.observed.excluded[announced.round] = self.observed.excluded.get(announced.round, 0) + 1
        try:
            result = await self.stub.RoundResult(
                pb.RoundResultRequest(round=announced.round), timeout=compute_s + 60
            )
            self.observed.result_bytes = max(self.observed.result_bytes, result.ByteSize())
        except grpc.aio.AioRpcError as error:
            self.observed.failed("round_result", error)
            return
        lag = time.time() - offset - announced.compute_deadline
        self.observed.lags.setdefault(announced.round, []).append(lag)
        await asyncio.sleep(self.rng.uniform(0.1, 0.5))  # the exchange
        self.finished = announced.round
        self.heard_at = 0.0  # report it at the next heartbeat check
        await self.heartbeat()


ABUSES = ("join_flood", "oversized_report", "heartbeat_storm")
STORM_S = 0.02  # heartbeats at 100x an honest peer's one per 2 s


class AbusiveClient:
    """A client from another address (::1) doing one of `ABUSES` as fast as the coordinator answers:
    joins under ever new ids, reports padded past the request limit, or a member's heartbeats at 100x
    the honest rate. Counts the answers by status code."""

    def __init__(self, abuse: str, peer_id: str, address: str, rng: random.Random):
        self.abuse, self.peer_id, self.rng = abuse, peer_id, rng
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self.answers: dict[str, int] = {}

    async def call(self, method, request) -> None:
        try:
            await method(request, timeout=CALL_S)
            code = "OK"
        except grpc.aio.AioRpcError as error:
            code = error.code().name
        self.answers[code] = self.answers.get(code, 0) + 1

    async def run(self, until: asyncio.Event) -> None:
        join = pb.JoinRequest(peer_id=self.peer_id, throughput=THROUGHPUT, min_samples=MIN_SAMPLES)
        await self.call(self.stub.Join, join)
        try:
            while not until.is_set():
                if self.abuse == "join_flood":
                    await self.call(self.stub.Join, pb.JoinRequest(peer_id=peer_ids(1, self.rng.random())[0]))
                elif self.abuse == "oversized_report":
                    padded = pb.ReportRequest(
                        peer_id=self.peer_id, round=0, digest=bytes(32), size=1, samples=1
                    )
                    padded.state = bytes(20_000)  # past the coordinator's 16 KiB request limit
                    await self.call(self.stub.ReportReady, padded)
                    await asyncio.sleep(STORM_S)
                else:
                    await self.call(self.stub.Heartbeat, pb.HeartbeatRequest(peer_id=self.peer_id, round=-1))
                    await asyncio.sleep(STORM_S)
        finally:
            await self.channel.close()


def _abuse_counted(metrics_port: str) -> dict[str, float]:
    """The coordinator's own counts of refused abuse, from its Prometheus endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=CALL_S) as response:
        text = response.read().decode()
    return {
        line.split(" ")[0].removeprefix("shoal_coordinator_"): float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(
            ("shoal_coordinator_rate_limited_requests_total", "shoal_coordinator_oversized_requests_total")
        )
        and float(line.rsplit(" ", 1)[1]) > 0
    }


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _start_coordinator(
    workdir: Path, peers: int, compute_s: float, gather: int
) -> tuple[subprocess.Popen, str, str]:
    """The coordinator process, its gRPC port and its metrics port."""
    command = [
        sys.executable,
        "-m",
        "shoal.peer.cli",
        "coordinator",
        "--listen",
        "[::]:0",  # IPv4 and IPv6: honest peers come from 127.0.0.1, abusive clients from ::1
        "--metrics-port",
        "0",
        "--state",
        str(workdir / "coordinator.db"),
        "--min-peers",
        str(peers),
        "--min-compute-s",
        str(compute_s),
        "--log-format",
        "json",
        "--gather",
        str(gather),
    ]
    log = (workdir / "coordinator.log").open("w")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    assert process.stdout is not None  # stdout=PIPE
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(
            f"the coordinator did not start: {(workdir / 'coordinator.log').read_text()[-2000:]}"
        )
    started = json.loads(line)
    return process, started["address"].rpartition(":")[2], started["metrics"].rpartition(":")[2]


async def _announcements(stream, stalled_s: float):
    """The stream's announcements, then None if none came for `stalled_s`."""
    iterator = stream.__aiter__()
    while True:
        try:
            yield await asyncio.wait_for(iterator.__anext__(), stalled_s)
        except (TimeoutError, StopAsyncIteration):
            yield None
            return


async def _drive(
    port: str, peers: int, abusive: int, rounds: int, compute_s: float, pid: int, seed: int
) -> tuple[Observed, dict, list[AbusiveClient]]:
    observed = Observed()
    until = asyncio.Event()
    rng = random.Random(seed)
    address = f"127.0.0.1:{port}"
    ids = peer_ids(peers, seed)
    simulated = [SimulatedPeer(p, address, observed, random.Random(rng.random())) for p in ids[abusive:]]
    abusers = [
        AbusiveClient(ABUSES[i % len(ABUSES)], p, f"[::1]:{port}", random.Random(rng.random()))
        for i, p in enumerate(ids[:abusive])
    ]
    began = time.monotonic()
    tasks = [
        asyncio.create_task(s.run(until))
        for s in cast("list[SimulatedPeer | AbusiveClient]", [*simulated, *abusers])
    ]
    watcher_channel = grpc.aio.insecure_channel(address)
    watcher = coordinator_pb2_grpc.CoordinatorStub(watcher_channel)
    marks: dict[str, float] = {}
    stream = watcher.Rounds(pb.RoundsRequest(peer_id=peer_ids(1, seed + 1)[0]))
    stalled_s = max(60.0, 10 * compute_s)  # no new round for this long: the swarm fell apart
    async for announcement in _announcements(stream, stalled_s):  # the watcher is no member
        if announcement is None:
            marks |= {"cpu_end": _cpu_seconds(pid), "end": time.monotonic(), "rss": _peak_rss_mb(pid)}
            marks.setdefault("cpu", marks["cpu_end"])
            marks.setdefault("at", marks["end"])
            break
        if announcement.round == 1:  # the first round (all joined) is done: measure from here
            observed.measuring = True
            marks = {"cpu": _cpu_seconds(pid), "at": time.monotonic()}
        if announcement.round == rounds + 1:
            marks |= {"cpu_end": _cpu_seconds(pid), "end": time.monotonic(), "rss": _peak_rss_mb(pid)}
            break
    stream.cancel()
    until.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    marks["elapsed"] = time.monotonic() - began
    await watcher_channel.close()
    marks["round_s"] = (
        marks["end"] - marks["at"]
    ) / rounds  # a stalled swarm's is too short: see rounds_on_time
    return observed, marks, abusers


def run(
    *, peers: int, rounds: int, compute_s: float = 5.0, abusive: float = 0.0, gather: int = 0, seed: int = 0
) -> CoordinatorLoad:
    """`peers` clients, of which the fraction `abusive` abuse (ABUSES, in turn) and the others are peers;
    the coordinator's results list `gather` payloads each (0: all)."""
    hostile = round(peers * abusive)
    with tempfile.TemporaryDirectory(prefix="shoal-bench-coordinator-") as tmp:
        process, port, metrics_port = _start_coordinator(Path(tmp), peers - hostile, compute_s, gather)
        try:
            # a bound on the whole run, so that it ends even when a client task died (a test's timeout
            # raised inside a task is kept by asyncio, and the run waited for it for ever)
            deadline_s = 60 + rounds * (compute_s + 30)
            driven = _drive(port, peers, hostile, rounds, compute_s, process.pid, seed)
            try:
                observed, marks, abusers = asyncio.run(asyncio.wait_for(driven, deadline_s))
            except TimeoutError:
                raise RuntimeError(f"the load run did not end within {deadline_s:g} s") from None
            counted = _abuse_counted(metrics_port)
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)
    measured = [r for r in range(1, rounds + 1) if observed.lags.get(r)]  # decided: a peer had the result
    late = Policy().report_grace_s + ON_TIME_S
    on_time = sum(
        len(observed.lags[r]) == observed.expected[r]
        and not observed.excluded.get(r)
        and max(observed.lags[r]) <= late
        for r in measured
    )
    quantiles = statistics.quantiles(observed.latencies, n=100) if len(observed.latencies) > 1 else [0.0] * 99
    answers: dict[str, dict[str, int]] = {}
    for client in abusers:
        into = answers.setdefault(client.abuse, {})
        for code, count in client.answers.items():
            into[code] = into.get(code, 0) + count
    return CoordinatorLoad(
        peers=peers,
        abusive=hostile,
        gather=gather,
        result_bytes=observed.result_bytes,
        rounds=len(measured),
        rounds_on_time=on_time,
        p50_ms=quantiles[49] * 1000,
        p99_ms=quantiles[98] * 1000,
        calls=len(observed.latencies),
        failures=observed.failures,
        round_s=marks["round_s"],
        elapsed_s=marks["elapsed"],
        max_lag_s=max((max(observed.lags[r]) for r in measured), default=None),
        coordinator_cpu_s_per_round=(marks["cpu_end"] - marks["cpu"]) / rounds,
        coordinator_peak_rss_mb=marks["rss"],
        abuse_answers=answers,
        abuse_counted=counted,
    )


def main(
    *, peers: list[int], rounds: int, compute_s: float, abusive: float, gather: int, as_json: bool
) -> int:
    results = []
    for count in peers:
        result = run(peers=count, rounds=rounds, compute_s=compute_s, abusive=abusive, gather=gather)
        results.append(result)
        if not as_json:
            print(_line(result, rounds), flush=True)
    if as_json:
        print(json.dumps({"results": [asdict(r) for r in results]}))
    return 0


def _line(result: CoordinatorLoad, asked: int) -> str:
    lag = "-" if result.max_lag_s is None else f"{result.max_lag_s:+.2f} s"
    return (
        f"{result.peers:>5} peers  {result.rounds_on_time}/{asked} rounds on time ({result.rounds} decided)  "
        f"p50 {result.p50_ms:.1f} ms  p99 {result.p99_ms:.1f} ms  round {result.round_s:.1f} s  lag {lag}  "
        f"coordinator {result.coordinator_cpu_s_per_round:.2f} CPU s/round, "
        f"{result.coordinator_peak_rss_mb:.0f} MB  result {result.result_bytes / 1000:.1f} kB  "
        f"failures {result.failures or 0}"
        + (f"\n       {result.abusive} abusive: answered {result.abuse_answers}" if result.abusive else "")
    )
