"""One peer of the swarm integration test (run by test_swarm.py).

    python -m tests.integration.swarm_peer --initial-peer MADDR --start T --round-seconds S \
        --rounds R --index I --peers N --out FILE

Joins the DHT, trains the tiny GPT with DeMo over a SwarmExchange for R rounds on its own slice of
the standard-library corpus, and writes a JSON report: a hash of the final parameters, the first and
last losses, participants and lateness (seconds past the deadline) per round, rejections.
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

from shoal.peer.bootstrap import start_dht
from shoal.peer.data import BatchPlan, stdlib_corpus
from shoal.peer.demo import DeMo
from shoal.peer.membership import record_validators
from shoal.peer.model import GPTConfig, TinyGPT
from shoal.peer.swarm import RoundSchedule, SwarmExchange


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
    args = parser.parse_args()
    torch.set_num_threads(1)
    identity = RSAPrivateKey()
    dht = start_dht(
        [args.initial_peer],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        record_validators=record_validators("test", identity),
    )
    schedule = RoundSchedule(start_time=args.start, round_seconds=args.round_seconds)
    config = {"model": "tiny", "algorithm": "demo", "lr": "2e-3", "compression_topk": str(args.topk)}
    exchange = SwarmExchange(
        dht,
        run="test",
        schedule=schedule,
        identity=identity,
        config=config,
        fetch_timeout=timedelta(seconds=5),
    )
    try:
        config = GPTConfig.preset("tiny")
        torch.manual_seed(0)
        model = TinyGPT(config)
        optimizer = DeMo(model.parameters(), lr=2e-3, exchange=exchange, compression_topk=args.topk)
        streams = stdlib_corpus(max_bytes=2 << 20)
        plan = BatchPlan(seq_len=config.seq_len, batch_size=8, workers=args.peers)
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
        digest = hashlib.sha256(
            b"".join(p.detach().numpy().tobytes() for p in model.parameters())
        ).hexdigest()
        report = {
            "param_hash": digest,
            "losses": losses,
            "participants": participants,
            "lateness": lateness,
            "rejected": dict(exchange.rejected) | dict(optimizer.rejected),
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
