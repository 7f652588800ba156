"""One node of `shoal bench wan` (shoal.peer.bench.wan), run inside its network namespace:

    python -m shoal.peer.bench.wan_worker --method M --index I --peers N --steps S ... --out RESULT.json

Every method trains the same model from the same initial weights on the same per-worker batches
(BatchPlan over the standard-library corpus) for S optimizer steps of one batch each, and writes
{"compute_s", "wall_s", "tokens", "final_val_loss", "predicted_sent_bytes", ...} to RESULT.json:

- compute_only: AdamW alone, no network (the upper bound);
- ddp: AdamW after a torch.distributed gloo all-reduce of the full fp32 gradients every step (one
  flat buffer, as DistributedDataParallel's buckets amount to), through node 0's address;
- demo_compact, demo_overlap, diloco_standard, diloco_eager: a shoal peer (hivemind DHT,
  SwarmExchange) following the coordinator of the last namespace; DeMo with top-4 coefficients and
  1-bit values (demo_overlap: exchanged while the next step computes, applied a step late, with the
  lookahead), DiLoCo with 4-bit (blockwise) pseudo-gradients every H inner steps and an outer SGD of
  lr 0.4 with each mode's default Nesterov momentum (shoal.peer.algorithms.diloco: 0.9 standard, none eager).

Timing starts when every node is ready (gloo's barrier; the coordinator's first round, which waits for
every peer) and ends after the last step (DiLoCo: once the last outer update landed).
"""

import argparse
import json
import math
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from shoal.peer.algorithms.configs import AlgorithmConfig, DiLoCoConfig
from shoal.peer.algorithms.synchronizer import DiLoCoSynchronizer
from shoal.peer.config.spec import PeerSpec
from shoal.peer.data import BatchPlan, stdlib_corpus, validation_loss
from shoal.peer.files import replace_text
from shoal.peer.models.gpt import GPTConfig, TinyGPT
from shoal.peer.models.loading import model_loss

if TYPE_CHECKING:
    from shoal.peer.swarm.records import RoundPlan

MODELS = {
    "tiny": GPTConfig.preset("tiny"),
    "5m": GPTConfig.preset("small", n_layer=7),  # ~5.6M parameters
}
SWARM_FLAGS: dict[str, dict[str, str | int]] = {
    "demo_compact": {"algorithm": "demo", "compression": "compact"},
    "demo_overlap": {"algorithm": "demo-overlap", "compression": "compact"},
    "diloco_standard": {"algorithm": "diloco-standard", "value_bits": 4},
    "diloco_eager": {"algorithm": "diloco-eager", "value_bits": 4},
    "diloco_standard_butterfly": {"algorithm": "diloco-standard", "value_bits": 4, "averaging": "butterfly"},
    "diloco_eager_butterfly": {"algorithm": "diloco-eager", "value_bits": 4, "averaging": "butterfly"},
    "diloco_int8": {"algorithm": "diloco-standard", "compression": "int8"},
    "diloco_sparse": {"algorithm": "diloco-standard", "compression": "sparse"},
}
"""The shoal methods, as the `shoal join` flags their peers run with (DiLoCo's --inner-steps: the
benchmark's). DiLoCo's pseudo-gradients travel at 4 bits (blocks of 64) unless the method names a
`--compression`: int8 and sparse, as `shoal join` sends them."""
SWARM_METHODS: dict[str, AlgorithmConfig] = {
    method: PeerSpec.of(**flags).algorithm_config() for method, flags in SWARM_FLAGS.items()
}
EXTRA_METHODS = ("diloco_int8", "diloco_sparse")
"""Run only when named (`--methods`): `--compression int8` and `sparse`, as `shoal join` sends them."""
BUTTERFLY = tuple(
    method
    for method, algorithm in SWARM_METHODS.items()
    if isinstance(algorithm, DiLoCoConfig) and algorithm.averaging == "butterfly"
)
"""Averaged piece by piece (shoal.peer.algorithms.butterfly) instead of every peer pulling every payload."""
METHODS = ("compute_only", "ddp", *(m for m in SWARM_METHODS if m not in EXTRA_METHODS))
DDP_PORT = 29517


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=(*METHODS, *EXTRA_METHODS), required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--peers", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--inner-steps", type=int, default=1, help="DiLoCo's H")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--model", choices=list(MODELS), default="5m")
    parser.add_argument("--address", required=True, help="this node's IPv4 address")
    parser.add_argument("--first", help="node 0's address (ddp), or a file holding its multiaddress (swarm)")
    parser.add_argument("--coordinator", help="HOST:PORT (swarm methods)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = MODELS[args.model]
    model = TinyGPT(config)
    streams = stdlib_corpus(max_bytes=8 << 20)
    plan = BatchPlan(seq_len=config.seq_len, batch_size=args.batch_size, workers=args.peers)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return plan.batch(streams.train, step, args.index)

    if args.method in SWARM_METHODS:
        result = _swarm(args, model, batch, streams)
    else:
        result = _data_parallel(args, model, batch)
    result["final_val_loss"] = validation_loss(model, model_loss, streams.validation, config.seq_len)
    result["params"] = sum(p.numel() for p in model.parameters())
    result["tokens"] = args.steps * args.batch_size * config.seq_len
    Path(args.out).write_text(json.dumps(result))


def _data_parallel(args, model, batch) -> dict:
    import torch.distributed as dist

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    ddp = args.method == "ddp"
    if ddp:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")  # the namespace's link, not the hostname's
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{args.first}:{DDP_PORT}",
            rank=args.index,
            world_size=args.peers,
            timeout=timedelta(minutes=10),
        )
        dist.barrier()
    parameters = list(model.parameters())
    numel = sum(p.numel() for p in parameters)
    compute = 0.0
    started, wire = time.perf_counter(), interface_bytes()
    for step in range(args.steps):
        begin = time.perf_counter()
        inputs, targets = batch(step)
        model(inputs, targets=targets).backward()
        compute += time.perf_counter() - begin
        if ddp:
            flat = torch.cat([p.grad.reshape(-1) for p in parameters])
            dist.all_reduce(flat)
            flat /= args.peers
            offset = 0
            for p in parameters:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        begin = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        compute += time.perf_counter() - begin
    wall, (sent, received) = time.perf_counter() - started, _since(wire)
    if ddp:
        dist.destroy_process_group()
    # a ring all-reduce sends 2 (N - 1) / N of the buffer per rank
    predicted = args.steps * 2 * (args.peers - 1) / args.peers * 4 * numel if ddp else 0
    return {
        "compute_s": compute,
        "wall_s": wall,
        "sent_bytes": sent,
        "received_bytes": received,
        "predicted_sent_bytes": int(predicted),
        "exchanges": args.steps if ddp else 0,
        "time_s": {"compute": compute, "exchange": wall - compute},
    }


def _swarm_spec(args: argparse.Namespace, initial: tuple[str, ...]) -> PeerSpec:
    """A swarm method's peer: the method's `shoal join` flags, one 10-minute round clock (the
    coordinator paces the rounds), no checkpoints."""
    return PeerSpec.of(
        run="wan",
        initial_peers=initial,
        host=args.address,
        model=args.model,
        inner_steps=args.inner_steps,
        batch_size=args.batch_size,
        round_seconds=600.0,
        device="cpu",
        checkpoint_every=0,
        **SWARM_FLAGS[args.method],
    )


def _swarm(args, model, batch, streams) -> dict:
    import torch

    from shoal.peer.job.assembly import Workload, build_peer, start_peer
    from shoal.peer.models.loading import LoadedModel
    from shoal.peer.swarm.coordinator_link import CoordinatorLink
    from shoal.peer.swarm.records import RoundSchedule

    first = Path(args.first)
    spec = _swarm_spec(args, () if args.index == 0 else (_wait_for_text(first),))
    loaded = LoadedModel(model, model_loss, model.config.seq_len, model.config.vocab_size)
    with start_peer(spec) as peer:
        if args.index == 0:  # the others join through its address
            address = next(str(a) for a in peer.dht.get_visible_maddrs() if f"/ip4/{args.address}/" in str(a))
            replace_text(first, address)
        assert spec.run.round_seconds is not None  # _swarm_spec sets it
        trainer = build_peer(
            peer,
            spec,
            RoundSchedule(start_time=time.time(), round_seconds=spec.run.round_seconds),
            Workload(torch.device("cpu"), loaded, streams),
            coordinator=CoordinatorLink(args.coordinator, peer.dht.peer_id.to_base58()),
            batches=lambda step, _micro, _size, _plan: batch(step),
            fill_window=False,
            fetch_timeout=timedelta(seconds=120),
        )
        exchange = peer.exchange
        assert exchange is not None  # build_peer connected it
        # round 0 starts once every peer has joined the coordinator: time and wire count from its plan
        start: list[tuple[float, tuple[int, int]]] = []
        compute = planning = exchanging = 0.0
        payloads = 0
        rounds = math.ceil(args.steps / trainer.inner_steps)

        def planned(_plan: "RoundPlan") -> None:
            if not start:
                start.append((time.perf_counter(), interface_bytes()))

        for index, done in enumerate(peer.rounds(max_rounds=rounds, planned=planned)):
            planning += done.plan_s if index else 0.0
            compute += done.report.compute_s
            exchanging += done.report.exchange_s
            payloads += exchange.last_payload_bytes
        begin = time.perf_counter()
        peer.finish()
        finishing = time.perf_counter() - begin
        started, wire = start[0]
        wall = time.perf_counter() - started
        _linger(Path(args.out), args.peers)
        # counted once every peer is done: the others pull this peer's last payload (or mean) after its
        # own finish, and those bytes are in the prediction
        sent, received = _since(wire)
        return {
            "compute_s": compute,
            "wall_s": wall,
            "sent_bytes": sent,
            "received_bytes": received,
            # every other peer pulls each payload once, from its author; in a butterfly round each owner
            # pulls its piece, and every other peer each owner's mean (counted by the exchange)
            "predicted_sent_bytes": exchange.counts.codec_bytes_sent
            if args.method in BUTTERFLY
            else payloads * (args.peers - 1),
            "exchanges": trainer.rounds_done,
            "time_s": _swarm_time(wall, compute, planning, exchanging, finishing, trainer),
        }


def _swarm_time(
    wall: float, compute: float, planning: float, exchanging: float, finishing: float, trainer
) -> dict:
    """Where a swarm peer's wall time went, in seconds: computing, waiting for the coordinator's next
    round (`plan`), the optimizer's exchange on the training thread (DeMo: `exchanging`, the rounds'
    exchange phases; DiLoCo: encoding and waiting for the background exchange, whose own phases overlap
    the computation), the final `finish`, and the rest (bookkeeping)."""
    if not isinstance(trainer.sync, DiLoCoSynchronizer):
        blocking = exchanging
        background = {}
    else:
        stats = trainer.sync.diloco.stats
        blocking = stats.waited_s + stats.phase_seconds["apply"] - finishing
        background = {"exchange_s": stats.exchange_s, "hidden_s": stats.hidden_s}
    spent = {"compute": compute, "plan": planning, "exchange": blocking, "finish": finishing}
    spent["other"] = wall - sum(spent.values())
    return {**spent, **background}


def interface_bytes(device: str = "eth0") -> tuple[int, int]:
    """(bytes sent, bytes received) by this namespace's interface, as the kernel counts them; (0, 0)
    where there is no such interface."""
    statistics = Path("/sys/class/net") / device / "statistics"
    try:
        return int((statistics / "tx_bytes").read_text()), int((statistics / "rx_bytes").read_text())
    except OSError:
        return 0, 0


def _since(start: tuple[int, int]) -> tuple[int, int]:
    now = interface_bytes()
    return now[0] - start[0], now[1] - start[1]


def _linger(out: Path, peers: int, timeout_s: float = 300) -> None:
    """Keeps serving this peer's last payload until every peer is done: one that left at once would
    leave a slower one pulling from nobody until the round's deadline."""
    out.with_suffix(".done").touch()
    deadline = time.monotonic() + timeout_s
    while len(list(out.parent.glob("*.done"))) < peers and time.monotonic() < deadline:
        time.sleep(0.2)


def _wait_for_text(path: Path, timeout_s: float = 120) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.2)
    raise TimeoutError(f"{path} was not written within {timeout_s:.0f} s")


if __name__ == "__main__":
    main()
