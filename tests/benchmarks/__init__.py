"""Benchmarks: run with `python -m tests.benchmarks.<name>`; not collected by pytest."""

import json
import time
from collections.abc import Callable
from datetime import timedelta

from shoal.peer.algorithms.exchange import LoopbackExchange, run_loopback


def time_loopback_mode(
    mode: str, work: Callable[[int, LoopbackExchange], dict], workers: int, latency_s: float
) -> None:
    """Runs `work` on `workers` loopback workers whose collectives take `latency_s` longer; prints one
    JSON line: the mode, the latency, the wall time and worker 0's figures (rounded). The workers stand
    for swarm peers over a slow link: untrusted, they screen every round."""
    start = time.perf_counter()
    results = run_loopback(workers, work, latency=timedelta(seconds=latency_s), trusted=False)
    wall = time.perf_counter() - start
    row = {"mode": mode, "latency_s": latency_s, "wall_s": round(wall, 2)}
    print(json.dumps(row | {k: round(v, 2) for k, v in results[0].items()}), flush=True)
