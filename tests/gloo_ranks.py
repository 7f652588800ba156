"""A real torch.distributed job on loopback for the tests: `world` gloo processes, each running
`python -m MODULE RANK WORLD STORE OUT ARGS...`, whose results the test reads back.

The test calls `run_ranks(tmp_path, "tests.x.module", *args)`; the module ends in
`serve_rank(work)`, `work(rank, world, *args)` returning what the rank hands back (tensors, numbers,
lists and dicts of them: saved with torch.save, read back with weights_only=True).
"""

import os
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]


def run_ranks(tmp_path: Path, module: str, *args: str, world: int = 2, timeout_s: float = 120) -> list:
    """Starts the `world` ranks of `module`, waits for them all (at most `timeout_s`) and returns their
    results in rank order; a rank that failed fails the test with its output."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    store = tmp_path / "store"
    outs = [tmp_path / f"rank{rank}.pt" for rank in range(world)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, str(rank), str(world), str(store), str(outs[rank]), *args],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(world)
    ]
    try:
        logs = [p.communicate(timeout=timeout_s)[0].decode() for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log
    return [torch.load(out, weights_only=True) for out in outs]


def serve_rank(work: Callable[..., object]) -> None:
    """One rank of `run_ranks`: joins the gloo group, saves `work(rank, world, *args)` and leaves."""
    rank, world, store_path, out, *args = sys.argv[1:]
    store = dist.FileStore(store_path, int(world))
    dist.init_process_group(
        "gloo", store=store, rank=int(rank), world_size=int(world), timeout=timedelta(seconds=60)
    )
    torch.save(work(int(rank), int(world), *args), out)
    # Both ranks wait until both results are on disk, then leave without gloo's C++ teardown: torch 2.13's
    # gloo threads sometimes abort the process at exit ("terminate called without an active exception",
    # twice in clean-clone CI runs, once with destroy_process_group after a barrier), after the work is done.
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)
