"""`shoal bench utilization`: the tokens/s a default swarm's peers train, against plain torch.

    shoal bench utilization                          # 4 peers, DeMo and DiLoCo, 10 rounds each
    shoal bench utilization --algorithms demo --rounds 6 --json
    shoal bench utilization --rate-mbit 10           # and each peer behind a 10 Mbit/s link (root)

For each algorithm, in one run:
1. plain torch: as many processes as peers, at once (the same share of the CPU each), each training
   the model with AdamW on one batch of `--batch-size` sequences a step, for `--plain-seconds`;
2. the swarm: real `shoal join` processes on 127.0.0.1, without a coordinator, at `shoal join`'s
   defaults but for the model, the run's length, the logs and batch 8: the round its first peer
   chooses, the compute window of shoal.peer.job.window; with `--rate-mbit`, also each in a network
   namespace of its own behind a link shaped to that rate each way (shoal.peer.bench.netlab).

Reported per peer: the tokens it trained in the rounds after the first two (the first plans half a
round before anything is measured, and the peers start their DHTs), over those rounds' length, and
that against plain torch's tokens/s: the share of the device the swarm keeps busy with training; and
the same counting only the rounds whose payload counted together with another peer's (`shared`), the
work that reached the swarm: a payload missed, late or of another state is work lost.
"""

import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

WARMUP_ROUNDS = 2
LONGEST_CHOSEN_S = 60.0
"""The longest round the bench waits for when shoal join chooses it."""


def plain(model: str, batch_size: int, seconds: float) -> float:
    """Tokens/s of plain torch training `model` (AdamW, one batch a step) for `seconds`."""
    import torch

    from shoal.peer.models.gpt import GPTConfig, TinyGPT

    config = GPTConfig.preset(model)
    torch.manual_seed(0)
    net = TinyGPT(config)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    rows = torch.randint(0, config.vocab_size, (batch_size, config.seq_len + 1))
    tokens, started = 0, None
    while started is None or time.perf_counter() - started < seconds:
        loss = net(rows[:, :-1], targets=rows[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if started is None:  # the first step warms the allocator up
            started = time.perf_counter()
        else:
            tokens += batch_size * config.seq_len
    return tokens / (time.perf_counter() - started)


def plain_processes(peers: int, model: str, batch_size: int, seconds: float) -> list[float]:
    """Plain torch's tokens/s in `peers` processes at once, each with the threads a demo peer gets."""
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // peers))}
    command = [sys.executable, "-m", "shoal.peer.bench.utilization", model, str(batch_size), str(seconds)]
    processes = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) for _ in range(peers)]
    return [float(p.communicate(timeout=seconds * 4 + 120)[0]) for p in processes]


class Loopback:
    """`nodes` peers on 127.0.0.1: NetLab's launcher without namespaces (each started process is stopped
    on exit)."""

    _processes: list[subprocess.Popen]

    def __init__(self, nodes: int):
        self.nodes, self._processes = nodes, []

    def address(self, node: int) -> str:
        return "127.0.0.1"

    def popen(self, node: int, argv: list[str], **kwargs) -> subprocess.Popen:
        process = subprocess.Popen(argv, start_new_session=True, **kwargs)
        self._processes.append(process)
        return process

    def __enter__(self) -> "Loopback":
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self._processes:
            if process.poll() is None:
                process.kill()
            process.wait()


def swarm(
    peers: int,
    model: str,
    algorithm: str,
    rounds: int,
    round_seconds: float | None,
    batch_size: int,
    rate_mbit: float | None = None,
) -> list[dict]:
    """Each peer's rounds (their `round` events) of a swarm of `shoal join` processes, on 127.0.0.1, or
    with `rate_mbit` each in a network namespace of its own behind a link shaped to that rate each way
    (shoal.peer.bench.netlab; needs root). `round_seconds` None: the round the first peer chooses."""
    from shoal.peer.bench.netlab import NetLab
    from shoal.peer.cli import local_swarm

    threads = str(max(1, (os.cpu_count() or 1) // peers))
    events: queue.Queue = queue.Queue()
    net = Loopback(peers) if rate_mbit is None else NetLab(peers, rate_mbit)
    with tempfile.TemporaryDirectory(prefix="shoal-utilization-") as logs, net as lab:
        processes = []

        def launch(index: int, *flags: str) -> None:
            command = [sys.executable, "-m", "shoal.peer.cli", "join", "--host", lab.address(index)]
            command += ["--run", "utilization", "--log-format", "json", "--model", model]
            command += ["--algorithm", algorithm, "--until-round", str(rounds - 1)]
            if round_seconds is not None:
                command += ["--round-seconds", str(round_seconds)]
            command += ["--batch-size", str(batch_size), *flags]
            log = (Path(logs) / f"peer{index}.log").open("a")
            env = {**os.environ, "OMP_NUM_THREADS": threads}
            process = lab.popen(index, command, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
            threading.Thread(
                target=local_swarm._read, args=(index, process.stdout, events, log), daemon=True
            ).start()
            processes.append(process)

        start = time.time() + local_swarm.STARTUP_S + local_swarm.STARTUP_PER_PEER_S * peers
        launch(0, "--start-time", repr(start))
        address = local_swarm._first_address(events, processes[0], Path(logs) / "peer0.log")
        for index in range(1, peers):
            launch(index, "--initial-peers", address)
        longest = round_seconds or LONGEST_CHOSEN_S
        for index, process in enumerate(processes):
            if process.wait(timeout=start - time.time() + rounds * longest * 3 + 120) != 0:
                raise RuntimeError(f"peer {index} exited with {process.returncode}: see its log")
        return [_rounds(Path(logs) / f"peer{index}.log") for index in range(peers)]


def _rounds(log: Path) -> dict:
    rounds = {}
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("event") == "round":
                rounds[event["round"]] = event
    return rounds


def measure(rounds_of: dict, first: int, last: int) -> dict:
    """A peer's tokens/s and compute share over rounds [first, last]: over the wall time its loop spent
    in them (an overlapped algorithm's round starts while the last one is exchanged, so the clock's
    rounds would not bound its computation), and at least the clock's rounds (a missed round counts)."""
    kept = [rounds_of[n] for n in range(first, last + 1) if n in rounds_of]
    clock_s = (last - first + 1) * kept[0]["round_seconds"]
    span = max(sum(e["round_s"] for e in kept), clock_s)
    return {
        "tokens_per_s": sum(e["tokens"] for e in kept) / span,
        # the work that reached the swarm: rounds whose payload counted with another peer's
        "shared_tokens_per_s": sum(e["tokens"] for e in kept if e.get("shared")) / span,
        "compute_share": sum(e["phases"]["compute"] for e in kept) / span,
        "rounds": len(kept),
        "shared_rounds": sum(bool(e.get("shared")) for e in kept),
    }


def run(
    *,
    peers: int,
    model: str,
    algorithm: str,
    rounds: int,
    round_seconds: float | None,
    batch_size: int,
    rate_mbit: float | None = None,
) -> dict:
    chosen = round_seconds or LONGEST_CHOSEN_S
    baseline = plain_processes(peers, model, batch_size, seconds=min(30.0, rounds * chosen / 2))
    logs = swarm(peers, model, algorithm, rounds, round_seconds, batch_size, rate_mbit)
    last = min(max(r) for r in logs if r)
    per_peer = [measure(r, WARMUP_ROUNDS, last) for r in logs]
    plain_tps = statistics.fmean(baseline)
    swarm_tps = statistics.fmean(p["tokens_per_s"] for p in per_peer)
    return {
        "algorithm": algorithm,
        "link": "loopback" if rate_mbit is None else f"{rate_mbit:g} Mbit/s",
        "peers": peers,
        "model": model,
        "round_seconds": next(iter(logs[0].values()))["round_seconds"],
        "rounds_measured": last - WARMUP_ROUNDS + 1,
        "plain_tokens_per_s": plain_tps,
        "swarm_tokens_per_s": swarm_tps,
        "utilization": swarm_tps / plain_tps,
        "shared_utilization": statistics.fmean(p["shared_tokens_per_s"] for p in per_peer) / plain_tps,
        "shared_rounds": sum(p["shared_rounds"] for p in per_peer),
        "peer_rounds": sum(p["rounds"] for p in per_peer),
        "compute_share": statistics.fmean(p["compute_share"] for p in per_peer),
        "per_peer": per_peer,
    }


def main(
    *,
    as_json: bool,
    peers: int,
    model: str,
    algorithms: tuple[str, ...],
    rounds: int,
    round_seconds: float | None,
    batch_size: int,
    rates: tuple[float | None, ...] = (None,),
) -> int:
    results = []
    for rate, algorithm in ((rate, algorithm) for rate in rates for algorithm in algorithms):
        result = run(
            peers=peers,
            model=model,
            algorithm=algorithm,
            rounds=rounds,
            round_seconds=round_seconds,
            batch_size=batch_size,
            rate_mbit=rate,
        )
        results.append(result)
        if not as_json:
            print(
                f"{algorithm:<14} {result['link']:<12} {peers} peers, {model}, "
                f"rounds of {result['round_seconds']:g} s: plain torch "
                f"{result['plain_tokens_per_s']:7.0f} "
                f"tokens/s, swarm peer {result['swarm_tokens_per_s']:7.0f} tokens/s: "
                f"{result['utilization']:6.1%} (compute {result['compute_share']:.1%} of each round); "
                f"counted with another peer: {result['shared_utilization']:6.1%} "
                f"({result['shared_rounds']} of {result['peer_rounds']} peer-rounds)",
                flush=True,
            )
    if as_json:
        print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":  # one plain-torch process: MODEL BATCH SECONDS, prints its tokens/s
    print(plain(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
