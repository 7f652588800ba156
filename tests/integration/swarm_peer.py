"""One peer of the swarm integration test (run by test_swarm.py).

    python -m tests.integration.swarm_peer --initial-peer MADDR --start T --round-seconds S \
        --rounds R --index I --peers N --out FILE

Joins the DHT, trains the tiny GPT with DeMo (or DiLoCo, `--algorithm`) over a SwarmExchange for R
rounds on its own slice of the standard-library corpus, and writes a JSON report: a hash of the
final parameters, the losses, participants and lateness (seconds past the deadline) per round,
rejections.
`--die-after N` makes it kill -9 itself before round N.
"""

import argparse
import hashlib
import json
import os
import signal
import time
from datetime import timedelta

import torch
from hivemind.utils.crypto import RSAPrivateKey

from shoal.compression import DenseCodec
from shoal.peer.bootstrap import start_dht
from shoal.peer.data import BatchPlan, stdlib_corpus
from shoal.peer.demo import DeMo
from shoal.peer.diloco import DiLoCo
from shoal.peer.membership import record_validators
from shoal.peer.model import GPTConfig, TinyGPT
from shoal.peer.swarm import RoundSchedule, SwarmExchange


def train_demo(model, exchange, schedule, plan, streams, args):
    """One DeMo step per round."""
    optimizer = DeMo(model.parameters(), lr=2e-3, exchange=exchange, compression_topk=args.topk)
    losses, participants, lateness = [], [], []
    for step in range(args.rounds):
        if step == args.die_after:
            os.kill(os.getpid(), signal.SIGKILL)
        inputs, targets = plan.batch(streams.train, step, args.index)
        loss = model(inputs, targets=targets)
        loss.backward()
        optimizer.step(samples=inputs.shape[0])
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        participants.append(exchange.world_size)
        lateness.append(time.time() - schedule.deadline(exchange.last_round))
    return losses, participants, lateness, dict(optimizer.rejected)


def train_diloco(model, exchange, schedule, plan, streams, args, inner_steps: int = 5):
    """An outer step (one round) every `inner_steps` AdamW steps; eager mode exchanges in the background."""
    inner = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
    mode = args.algorithm.removeprefix("diloco-")
    losses, participants, lateness = [], [], []
    with DiLoCo(
        model, inner, exchange=exchange, inner_steps=inner_steps, mode=mode, outer_lr=0.4, codec=DenseCodec(8)
    ) as diloco:
        for step in range(args.rounds * inner_steps):
            inputs, targets = plan.batch(streams.train, step, args.index)
            loss = model(inputs, targets=targets)
            loss.backward()
            diloco.step(samples=inputs.shape[0])
            if (step + 1) % inner_steps == 0:
                losses.append(loss.item())
                participants.append(exchange.world_size)
                lateness.append(time.time() - schedule.deadline(exchange.last_round))
        diloco.finish()
    return losses, participants, lateness, {"diloco": diloco.stats.rejected} if diloco.stats.rejected else {}


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--initial-peer", "--out"):
        parser.add_argument(name, required=True)
    parser.add_argument("--start", type=float, required=True)
    parser.add_argument("--round-seconds", type=float, required=True)
    for name in ("--rounds", "--index", "--peers"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--die-after", type=int, default=None, help="kill -9 itself after this many rounds")
    parser.add_argument(
        "--topk", type=int, default=32, help="DeMo's compression_topk (part of the run config)"
    )
    parser.add_argument("--algorithm", choices=["demo", "diloco-standard", "diloco-eager"], default="demo")
    args = parser.parse_args()
    torch.set_num_threads(1)
    identity = RSAPrivateKey()
    dht = start_dht(
        [args.initial_peer],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        record_validators=record_validators("test", identity),
    )
    schedule = RoundSchedule(start_time=args.start, round_seconds=args.round_seconds)
    config = {"model": "tiny", "algorithm": args.algorithm, "lr": "2e-3", "compression_topk": str(args.topk)}
    exchange = SwarmExchange(
        dht,
        run="test",
        schedule=schedule,
        identity=identity,
        config=config,
        fetch_timeout=timedelta(seconds=5),
    )
    try:
        config_model = GPTConfig.preset("tiny")
        torch.manual_seed(0)
        model = TinyGPT(config_model)
        streams = stdlib_corpus(max_bytes=2 << 20)
        plan = BatchPlan(seq_len=config_model.seq_len, batch_size=8, workers=args.peers)
        if args.algorithm == "demo":
            losses, participants, lateness, rejected = train_demo(
                model, exchange, schedule, plan, streams, args
            )
        else:
            losses, participants, lateness, rejected = train_diloco(
                model, exchange, schedule, plan, streams, args
            )
        digest = hashlib.sha256(
            b"".join(p.detach().numpy().tobytes() for p in model.parameters())
        ).hexdigest()
        report = {
            "param_hash": digest,
            "losses": losses,
            "participants": participants,
            "lateness": lateness,
            "rejected": dict(exchange.rejected) | rejected,
            "received": exchange.bytes_received,
            "refused": exchange.refused,
        }
        with open(args.out, "w") as out:
            json.dump(report, out)
    finally:
        exchange.close()
        dht.shutdown()


if __name__ == "__main__":
    main()
