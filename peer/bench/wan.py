"""`shoal bench wan`: training over slow links, side by side with data-parallel all-reduce.

For each bandwidth and method, a NetLab (shoal.peer.bench.netlab) of N peer namespaces and one for the
coordinator, every link shaped with tbf to the bandwidth both ways; N shoal.peer.bench.wan_worker processes
train the same model on the same data for the same number of optimizer steps; then the lab is torn
down. Reported per run:

- tokens_per_s: the swarm's, the sum of every peer's tokens over its wall time;
- utilization: compute time over wall time (mean over peers); compute_only is the upper bound;
- bytes_per_peer: bytes a peer's interface sent (kernel counters inside its namespace, mean over
  peers), and `received_bytes_per_peer` likewise; `predicted_bytes_per_peer` is what the codec alone
  predicts (payload bytes x the peers that pull them; ddp: a ring all-reduce's 2 (N - 1) / N of the
  fp32 gradients); `wire_overhead` = measured / predicted - 1 (headers, framing, DHT and coordinator
  traffic, retries);
- final_val_loss: the mean validation loss of peer 0's model after the last step;
- coordinator_bytes_per_peer (shoal's methods): what the coordinator's interface received over the
  whole run (the peers' gRPC calls, joining included) over the number of peers: the coordinator's
  share of the overhead.
"""

import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from shoal.peer.bench.netlab import NetLab, NetLabError, available, raise_on_sigterm
from shoal.peer.bench.wan_worker import BUTTERFLY, METHODS, SWARM_METHODS

__all__ = ["METHODS", "QUICK", "SWARM_METHODS", "WanConfig", "main", "parse_bandwidths", "run"]

RATE = re.compile(r"^(\d+(?:\.\d+)?)\s*(kbit|mbit|gbit)$", re.IGNORECASE)
UNITS = {"kbit": 1e-3, "mbit": 1.0, "gbit": 1e3}
COORDINATOR_PORT = 7733


@dataclass(frozen=True, slots=True, kw_only=True)
class WanConfig:
    peers: int = 4
    steps: int = 48
    """Optimizer steps of every method (DiLoCo: steps / inner_steps outer rounds, 12 here). Over 4
    rounds (16 steps), the last round's exchange, which no inner phase follows to hide it, is a tenth
    of an eager run; over 12 it is 4-5%. Eager's update lands a round late, which costs most early in a
    run: over 16 steps eager ended 7% above standard's loss, over 48 below it (BENCHMARKS.md, "48
    steps at 10 Mbit/s")."""
    inner_steps: int = 4
    batch_size: int = 32
    """Sequences per step and peer: seconds of computation per step on a CPU core, as a volunteer's
    GPU would spend on a realistic batch (a step of a few hundred milliseconds cannot hide any round
    trip)."""
    model: str = "5m"
    methods: tuple[str, ...] = METHODS
    timeout_s: float = 3600.0
    """Per run."""


QUICK = WanConfig(peers=2, steps=8, inner_steps=4, methods=tuple(m for m in METHODS if m not in BUTTERFLY))
"""Without the butterfly methods: with 2 peers they gather like the others (butterfly.MIN_PARTICIPANTS)."""


def parse_bandwidths(text: str) -> list[float]:
    """ "10mbit,100mbit" -> [10.0, 100.0] (Mbit/s); ValueError naming a bad item."""
    rates = []
    for item in text.split(","):
        match = RATE.match(item.strip())
        if not match:
            raise ValueError(f"--bandwidth: {item.strip()!r} is not a rate like 10mbit, 512kbit or 1gbit")
        rates.append(float(match.group(1)) * UNITS[match.group(2).lower()])
    if not rates or any(not 0.01 <= r <= 100_000 for r in rates):
        raise ValueError("--bandwidth: rates must be between 10kbit and 100gbit")
    return rates


def run(
    method: str, rate_mbit: float, config: WanConfig, log_dir: Path, pcap_dir: Path | None = None
) -> dict:
    """One method at one bandwidth, in a NetLab of its own; with `pcap_dir`, peer 0's packets are
    captured there (headers only), for tests/benchmarks/wire_breakdown.py."""
    peers = config.peers
    with NetLab(peers + 1, rate_mbit) as lab, tempfile.TemporaryDirectory() as scratch:
        if pcap_dir is not None:
            _capture(lab, pcap_dir / f"{method}-{rate_mbit:g}mbit-peer0.pcap")
        first = lab.address(0) if method == "ddp" else str(Path(scratch) / "first.maddr")
        coordinator = f"{lab.address(peers)}:{COORDINATOR_PORT}"
        if method in SWARM_METHODS:
            _start_coordinator(lab, peers, method, Path(scratch), log_dir)
        outputs = [Path(scratch) / f"{i}.json" for i in range(peers)]
        workers = []
        for index in range(peers):
            command = [
                sys.executable,
                "-m",
                "shoal.peer.bench.wan_worker",
                "--method",
                method,
                "--index",
                str(index),
            ]
            command += ["--peers", str(peers), "--steps", str(config.steps), "--model", config.model]
            command += ["--inner-steps", str(config.inner_steps), "--batch-size", str(config.batch_size)]
            command += ["--address", lab.address(index), "--first", first, "--coordinator", coordinator]
            command += ["--out", str(outputs[index])]
            log: TextIO | Path = (log_dir / f"{method}-{rate_mbit:g}mbit-peer{index}.log").open("w")
            workers.append(lab.popen(index, command, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + config.timeout_s
        for index, worker in enumerate(workers):
            try:
                code = worker.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(
                    f"{method} at {rate_mbit:g} Mbit/s: peer {index} ran past the time limit"
                ) from None
            if code != 0:
                log = log_dir / f"{method}-{rate_mbit:g}mbit-peer{index}.log"
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
                raise RuntimeError(
                    f"{method} at {rate_mbit:g} Mbit/s: peer {index} exited with {code}:\n{tail}"
                )
        results = [json.loads(path.read_text()) for path in outputs]
        _, to_coordinator = lab.counters(peers)
    summary = summarize(method, rate_mbit, config, results)
    if method in SWARM_METHODS:  # the peers' gRPC traffic to it, the whole run (joining included)
        summary["coordinator_bytes_per_peer"] = round(to_coordinator / peers)
    return summary


def summarize(method: str, rate_mbit: float, config: WanConfig, results: list[dict]) -> dict:
    sent = statistics.fmean(r["sent_bytes"] for r in results)
    predicted = statistics.fmean(r["predicted_sent_bytes"] for r in results)
    return {
        "method": method,
        "bandwidth_mbit": rate_mbit,
        "tokens_per_s": sum(r["tokens"] / r["wall_s"] for r in results),
        "utilization": statistics.fmean(min(1.0, r["compute_s"] / r["wall_s"]) for r in results),
        "bytes_per_peer": round(sent),
        "final_val_loss": results[0]["final_val_loss"],
        "received_bytes_per_peer": round(statistics.fmean(r["received_bytes"] for r in results)),
        "predicted_bytes_per_peer": round(predicted),
        "wire_overhead": sent / predicted - 1 if predicted else None,
        "wall_s": max(r["wall_s"] for r in results),
        "peers": config.peers,
        "steps": config.steps,
        "params": results[0]["params"],
        "exchanges": results[0]["exchanges"],
        "time_s": {  # where a peer's wall time went (mean over peers): see wan_worker
            key: statistics.fmean(r["time_s"].get(key, 0.0) for r in results) for key in results[0]["time_s"]
        },
    }


def _capture(lab: NetLab, path: Path) -> None:
    """tcpdump on node 0's interface until the lab closes (its SIGTERM flushes the file)."""
    command = ["tcpdump", "-i", "eth0", "-s", "128", "-U", "-w", str(path)]
    capture = lab.popen(0, command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert capture.stderr is not None  # stderr=PIPE
    line = capture.stderr.readline()  # "listening on eth0 ..." once it captures
    if "listening on" not in line:
        raise RuntimeError(f"tcpdump did not start: {line.strip() or capture.wait()}")


def _start_coordinator(lab: NetLab, peers: int, method: str, scratch: Path, log_dir: Path) -> None:
    """The swarm's coordinator in the last namespace: the first round waits for every peer; windows so
    wide that rounds end when the peers are done (decided when all have reported), not on a clock."""
    command = [sys.executable, "-m", "shoal.peer.cli", "coordinator", "--log-format", "json"]
    command += ["--listen", f"0.0.0.0:{COORDINATOR_PORT}", "--state", str(scratch / "coordinator.db")]
    command += ["--min-peers", str(peers), "--min-compute-s", "600", "--max-compute-s", "1200"]
    command += ["--max-exchange-s", "1200", "--heartbeat-timeout-s", "60"]
    if method in SWARM_METHODS and SWARM_METHODS[method].overlapped:
        command.append("--overlap")  # peers compute round r + 1 while they exchange round r
    log = (log_dir / f"{method}-coordinator.log").open("a")
    coordinator = lab.popen(peers, command, stdout=subprocess.PIPE, stderr=log, text=True)
    assert coordinator.stdout is not None  # stdout=PIPE
    line = coordinator.stdout.readline()
    if not line.startswith("{"):
        raise RuntimeError(f"the coordinator did not start; see {log_dir / f'{method}-coordinator.log'}")


def main(
    *,
    as_json: bool,
    bandwidths: list[float],
    config: WanConfig,
    plot: str | None = None,
    pcap_dir: str | None = None,
) -> int:
    reason = available()
    if reason is None and pcap_dir is not None:
        reason = None if shutil.which("tcpdump") else "--pcap needs tcpdump"
        if reason is None and not Path(pcap_dir).is_dir():
            reason = f"--pcap: {pcap_dir} is not a directory"
    if reason is not None:
        print(f"shoal bench wan: {reason}", file=sys.stderr)
        return 2
    raise_on_sigterm()
    log_dir = Path(tempfile.mkdtemp(prefix="shoal-wan-"))
    print(f"shoal bench wan: logs in {log_dir}", file=sys.stderr)
    results = []
    try:
        for rate in bandwidths:
            for method in config.methods:
                started = time.perf_counter()
                result = run(method, rate, config, log_dir, Path(pcap_dir) if pcap_dir else None)
                result["run_s"] = time.perf_counter() - started
                results.append(result)
                if not as_json:
                    print(_row(result), flush=True)
    except (NetLabError, RuntimeError) as error:
        print(f"shoal bench wan: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("shoal bench wan: interrupted; namespaces removed", file=sys.stderr)
        return 130
    if plot:
        _plot(results, plot)
    if as_json:
        print(json.dumps({"results": results}))
    return 0


def _row(r: dict) -> str:
    overhead = "" if r["wire_overhead"] is None else f"  overhead {100 * r['wire_overhead']:+.1f}%"
    return (
        f"{r['method']:>16} {r['bandwidth_mbit']:>7g} Mbit/s  {r['tokens_per_s']:>9,.0f} tokens/s"
        f"  utilization {100 * r['utilization']:5.1f}%  sent {r['bytes_per_peer']:>12,} B/peer"
        f"  predicted {r['predicted_bytes_per_peer']:>12,}{overhead}  val loss {r['final_val_loss']:.4f}"
        f"  ({r['wall_s']:.0f} s)"
    )


def _plot(results: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("shoal bench wan: --plot needs matplotlib (pip install 'shoal[bench]')", file=sys.stderr)
        return
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for method in dict.fromkeys(r["method"] for r in results):
        points = sorted((r["bandwidth_mbit"], r["tokens_per_s"]) for r in results if r["method"] == method)
        axis.plot(*zip(*points, strict=True), marker="o", label=method)
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("bandwidth per peer, each way (Mbit/s)")
    axis.set_ylabel("swarm tokens/s")
    peers = results[0]["peers"] if results else 0
    axis.set_title(f"shoal bench wan: {peers} peers, {results[0]['params'] / 1e6:.1f}M parameters")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"shoal bench wan: plot in {path}", file=sys.stderr)
