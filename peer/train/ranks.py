"""Several devices as one peer (`shoal join --nproc-per-node N`, or `shoal join` under `torchrun`):
data-parallel ranks inside the peer over torch.distributed (nccl between GPUs, gloo on CPUs). Rank 0
is the peer: it alone talks to the swarm, reads the data and runs the algorithm; the other ranks
only compute.

Each optimizer step, rank 0 announces it (its micro-batches and their size) and broadcasts its
parameters, then, micro-batch by micro-batch, draws every rank's batch from its own lane (the m-th
micro-batch of rank r is the peer's m N + r-th: the token ledger sees one peer that trained N times
the places) and broadcasts them; every rank runs its forward and backward pass; the gradients are
averaged across the ranks (one all-reduce); rank 0 takes the algorithm's step (DeMo's exchange,
DiLoCo's inner and outer steps). The swarm sees one peer, whose payload is built once from the
ranks' combined update and claims the samples of all its ranks.

    ranks = start_ranks(2, torch.device("cpu"), model)  # rank 0 (shoal join): the workers spawned, met
    trainer = Trainer(..., ranks=ranks)            # its steps run across them
    trainer.close()                                # the workers told to stop, and waited for

A worker (`python -m shoal.peer.train.ranks`, or a rank of torchrun other than 0) builds the model as rank
0 does and serves steps until told to stop (`serve`).
"""

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from shoal.peer.models.loading import load_model, recompute
from shoal.peer.train.hardware import autocast_for

STEP, STOP = 1, 0
TIMEOUT = timedelta(minutes=10)
"""How long a collective waits for the other ranks (a rank that died fails the others loudly)."""


class RanksError(ValueError):
    """The ranks asked for cannot run here (the message names --nproc-per-node)."""


class LocalRanks:
    """This process's place among the peer's ranks, and the collectives of a step."""

    def __init__(
        self,
        rank: int,
        world: int,
        device: torch.device,
        workers: Sequence[subprocess.Popen[bytes]] = (),
        store: Path | None = None,
    ):
        self.rank, self.world, self.device = rank, world, device
        self.workers, self.store = list(workers), store  # rank 0's spawned workers, and where they met

    def announce(self, micro_batches: int, batch_size: int, width: int, scale: float = 1.0) -> None:
        """Rank 0: a step of `micro_batches` micro-batches of `batch_size` rows of `width` tokens, the
        loss multiplied by `scale` (fp16's loss scale, a power of two) before its backward pass."""
        header = [STEP, micro_batches, batch_size, width, round(math.log2(scale))]
        dist.broadcast(torch.tensor(header, device=self.device), 0)

    def share(self, drawn: list[tuple[torch.Tensor, torch.Tensor]] | None, shape: tuple) -> tuple:
        """Every rank's (inputs, targets) of a micro-batch, from rank 0 (`drawn`, one per rank); this
        rank's returned."""
        if drawn is None:
            rows = torch.empty((self.world, 2, *shape), dtype=torch.long, device=self.device)
        else:
            rows = torch.stack([torch.stack([x, y]) for x, y in drawn]).to(self.device, torch.long)
        dist.broadcast(rows, 0)
        return rows[self.rank, 0], rows[self.rank, 1]

    def reduce_gradients(self, module: nn.Module) -> None:
        """The mean of every rank's gradients, on every rank (one flat all-reduce)."""
        params = [p for p in module.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat.div_(self.world)
        for p, mean in zip(params, _unflatten_dense_tensors(flat, grads), strict=True):
            p.grad = mean.view_as(p)

    def broadcast_parameters(self, module: nn.Module) -> None:
        """Rank 0's parameters and buffers on every rank (one flat broadcast per dtype)."""
        tensors = [*module.parameters(), *module.buffers()]
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            group = [t for t in tensors if t.dtype == dtype]
            flat = _flatten_dense_tensors([t.detach() for t in group])
            dist.broadcast(flat, 0)
            if self.rank != 0:
                with torch.no_grad():
                    for t, value in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
                        t.copy_(value)

    def close(self) -> None:
        """Rank 0: tells the workers to stop, waits for them, leaves the process group."""
        if self.rank == 0 and dist.is_initialized():
            with contextlib.suppress(RuntimeError):  # a worker that died already
                dist.broadcast(torch.tensor([STOP, 0, 0, 0, 0], device=self.device), 0)
        for worker in self.workers:
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                worker.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.store is not None:
            shutil.rmtree(self.store, ignore_errors=True)


def serve(ranks: LocalRanks, module: nn.Module, loss_fn: Callable, autocast: Callable) -> int:
    """A worker rank's loop: the steps rank 0 announces, until it says stop. Returns the steps served."""
    steps = 0
    while True:
        header = torch.empty(5, dtype=torch.long, device=ranks.device)
        dist.broadcast(header, 0)
        op, micro_batches, batch_size, width, scale_log2 = header.tolist()
        if op == STOP:
            return steps
        ranks.broadcast_parameters(module)
        for _ in range(micro_batches):
            inputs, targets = ranks.share(None, (batch_size, width))
            with autocast():
                loss = loss_fn(module, inputs, targets)
            (loss * (2.0**scale_log2 / micro_batches)).backward()
        ranks.reduce_gradients(module)
        for p in module.parameters():
            p.grad = None
        steps += 1


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU from rank 0's, or the CPU."""
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + rank)
    return device


def check_ranks(count: int, device: torch.device) -> None:
    """RanksError naming --nproc-per-node when this machine has fewer devices than ranks (GPUs from
    rank 0's, or CPU cores)."""
    if device.type == "cuda":
        have = torch.cuda.device_count() - (device.index or 0)
        what = f"{have} CUDA GPU(s) from {device}"
    elif device.type == "cpu":
        have, what = os.cpu_count() or 1, f"{os.cpu_count()} CPU cores"
    else:
        have, what = 1, f"one {device.type} device"
    if count > have:
        raise RanksError(f"--nproc-per-node {count}: this machine has {what}, one per rank")


def start_ranks(count: int, device: torch.device, model: dict) -> LocalRanks:
    """Rank 0 of `count`: spawns the other ranks (`python -m shoal.peer.train.ranks`), each building the
    model `model` names (load_model's arguments and `checkpointing`, `precision`), and meets them."""
    check_ranks(count, device)
    folder = Path(tempfile.mkdtemp(prefix="shoal-ranks-"))
    store = folder / "store"
    workers = []
    for rank in range(1, count):
        env = os.environ | {
            "SHOAL_RANK": str(rank),
            "SHOAL_WORLD": str(count),
            "SHOAL_RANKS_STORE": str(store),
            "SHOAL_RANKS_MODEL": json.dumps(model | {"device": str(rank_device(device, rank))}),
        }
        workers.append(subprocess.Popen([sys.executable, "-m", "shoal.peer.train.ranks"], env=env))
    try:
        join_group(0, count, device, f"file://{store}")
    except BaseException:
        for worker in workers:
            worker.kill()
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return LocalRanks(0, count, device, workers, folder)


def join_group(rank: int, world: int, device: torch.device, init_method: str) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=TIMEOUT)


def torchrun_ranks(device: torch.device) -> LocalRanks | None:
    """Under torchrun (RANK and WORLD_SIZE set, more than one rank): this process's place, the group
    met (env://); None otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or "RANK" not in os.environ:
        return None
    rank = int(os.environ["RANK"])
    mine = rank_device(device, int(os.environ.get("LOCAL_RANK", rank)))
    join_group(rank, world, mine, "env://")
    return LocalRanks(rank, world, mine)


def follow_rank_0() -> None:
    """A spawned worker leaves when rank 0 tells it to, or when rank 0 is gone: Ctrl-C and SIGTERM,
    which reach the whole process group, are rank 0's to handle (it stops at a round's end and tells
    the workers), and a thread exits the worker once its parent has died (killed: no collective would
    ever complete)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="rank-0-watch", daemon=True).start()


def worker_main() -> int:
    """A spawned worker rank: builds the model, meets rank 0, serves its steps."""
    rank, world = int(os.environ["SHOAL_RANK"]), int(os.environ["SHOAL_WORLD"])
    model = json.loads(os.environ["SHOAL_RANKS_MODEL"])
    follow_rank_0()
    device = torch.device(model["device"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    loaded = load_model(model["name"], seed=model["seed"], seq_len=model["seq_len"])
    if model["checkpointing"]:
        recompute(loaded.module, True)
    module = loaded.module.to(device)
    join_group(rank, world, device, f"file://{os.environ['SHOAL_RANKS_STORE']}")
    ranks = LocalRanks(rank, world, device)
    try:
        serve(ranks, module, loaded.loss_fn, autocast_for(device, model["precision"]))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
