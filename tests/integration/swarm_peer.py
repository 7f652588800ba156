"""One peer of the swarm integration tests (run by test_swarm.py).

    python -m tests.integration.swarm_peer --initial-peer MADDR --start T --round-seconds S \
        --until-round R --index I --peers N --out FILE [--algorithm demo|diloco-eager|...]

Joins the DHT and trains the tiny GPT as a swarm peer (shoal.peer.runtime.SwarmPeer) on its own
slice of the standard-library corpus until round R, then writes a JSON report: a hash of the final
parameters, per-round losses, participants and lateness (seconds past the deadline), rejections,
re-syncs. Without `--start` it joins a running swarm: the round clock comes from the DHT.
`--fault KIND@ROUND` (repeatable) makes it exit, hang or lie at that round (tests.integration.faults);
SIGTERM stops it at a round end with a
checkpoint (`--checkpoint-dir`), and `--resume` starts from the newest one.
`--hostile` makes it attack the others, one attack per round (ATTACKS), while it stays in sync.
`--claim-reachable` makes its record say it can be dialed, whatever its relays found (test_nat.py).
"""

import argparse
import hashlib
import json
from dataclasses import replace
from datetime import timedelta

import torch
import zstandard

from shoal.compression import DenseCodec
from shoal.peer.algorithms.configs import DEFAULTS, DeMoConfig, run_config
from shoal.peer.checkpoint import CheckpointStore
from shoal.peer.data import BatchPlan, stdlib_corpus
from shoal.peer.model import GPTConfig, TinyGPT
from shoal.peer.runtime import SwarmPeer
from shoal.peer.stopping import stop_on_signals
from shoal.peer.swarm.exchange import RoundSchedule, SwarmExchange
from shoal.peer.swarm.server import PayloadServer
from shoal.protocol import Payload
from tests.integration import faults
from tests.integration.faults import Fault

ATTACKS = ["none", "wrong_shape", "nan", "oversized", "digest", "replay"]
MAX_PAYLOAD_BYTES = 1 << 20


class ZeroingServer(PayloadServer):
    """Serves zeros in place of a payload's bytes while `lying` is set."""

    lying = False

    async def serve(self, request, context):
        async for chunk in super().serve(request, context):
            if self.lying:
                chunk.data = bytes(len(chunk.data))
            yield chunk


class HostileExchange(SwarmExchange):
    """A peer that sends an honest payload, then a different bad one each round, then honest ones
    again; it keeps the swarm's state by aggregating, after its first round, only the others'
    payloads, as they do once they drop its own."""

    server_type = ZeroingServer

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.attacks = 0  # rounds gathered so far (`rounds` is the exchange's coordinated rounds)
        self.first_payload = b""

    def gather(self, payload, samples, state=None, plan=None):
        attack = ATTACKS[self.attacks] if self.attacks < len(ATTACKS) else "none"
        self.attacks += 1
        self.first_payload = self.first_payload or payload
        self.server.lying = attack == "digest"
        message = Payload.FromString(payload)
        if attack == "wrong_shape":
            del message.tensors[-1]
            payload = message.SerializeToString()
        elif attack == "nan":
            for tensor in message.tensors:  # DeMo sends float32 values: as many NaNs, raw
                raw = zstandard.decompress(tensor.values) if tensor.values_zstd else tensor.values
                tensor.values = torch.full((len(raw) // 4,), float("nan")).numpy().tobytes()
                tensor.values_zstd = False
            payload = message.SerializeToString()
        elif attack == "oversized":
            payload = payload + bytes(MAX_PAYLOAD_BYTES)
        elif attack == "replay":
            payload = self.first_payload
        contributions = super().gather(payload, samples, state, plan)
        if self.attacks == 1:  # its honest first payload counts everywhere
            return contributions
        return contributions.only(c for c in contributions if c.sender != self.owner)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    for name in ("--initial-peer", "--out"):
        parser.add_argument(name, required=True)
    parser.add_argument("--start", type=float, default=None, help="round clock start (none: from the DHT)")
    parser.add_argument("--round-seconds", type=float, default=1.5)
    for name in ("--until-round", "--index", "--peers"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument(
        "--fault", type=Fault.parse, action="append", default=[], help="KIND@ROUND: faults.py"
    )
    parser.add_argument("--topk", type=int, default=32, help="DeMo's compression_topk (in the run config)")
    parser.add_argument("--algorithm", choices=list(DEFAULTS), default="demo")
    parser.add_argument("--hostile", action="store_true")
    parser.add_argument("--strike-limit", type=int, default=3)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--host", default="127.0.0.1", help="IPv4 address to listen on")
    parser.add_argument("--claim-reachable", action="store_true")
    parser.add_argument("--gather", type=int, default=0, help="bounded fan-in (in the run config)")
    return parser.parse_args()


def report_of(model, trainer, exchange, schedule, reports, *, resumed: bool, stopped: bool) -> dict:
    """What the test reads of this peer: its parameters' hash, rounds, losses, counters."""
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    report = {
        "param_hash": digest,
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        "rounds": [r.round for r in reports],
        "losses": [r.loss for r in reports],
        "participants": [r.participants for r in reports],
        "lateness": [r.finished_at - schedule.deadline(r.round) for r in reports],
        "rejected": dict(exchange.counts.rejected) | trainer.sync.rejected,
        "received": exchange.counts.bytes_received,
        "refused": exchange.refused,
        "resyncs": exchange.counts.resyncs,
        "banned": len(exchange.banned),
        "resumed": resumed,
        "stopped": stopped,
        "via_relay": dict(exchange.counts.via_relay),
        "left_out": exchange.counts.left_out,
        "payload_bytes": exchange.last_payload_bytes,
        "uncounted": trainer.sync.uncounted,
    }
    return report


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    stop = stop_on_signals()
    with SwarmPeer.start("test", [args.initial_peer], host_maddrs=[f"/ip4/{args.host}/tcp/0"]) as peer:
        if args.claim_reachable:
            peer.reachability = replace(peer.reachability, reachable=True)
        if args.start is None:
            schedule = RoundSchedule.discover(peer.dht, "test")
        else:
            schedule = RoundSchedule(start_time=args.start, round_seconds=args.round_seconds)
        named = DEFAULTS[args.algorithm]  # at the lr and inner steps these tests were written for
        if isinstance(named, DeMoConfig):
            algorithm = replace(named, lr=2e-3, topk=args.topk)
        else:
            algorithm = replace(named, lr=2e-3, inner_steps=5)
        exchange = peer.connect(
            schedule,
            run_config("tiny", algorithm, gather=args.gather),
            exchange_type=HostileExchange if args.hostile else faults.exchange_type(args.fault),
            fetch_timeout=timedelta(seconds=5),
            max_payload_bytes=MAX_PAYLOAD_BYTES,
            strike_limit=args.strike_limit,
            gather_limit=args.gather,
        )
        config_model = GPTConfig.preset("tiny")
        torch.manual_seed(0)
        model = TinyGPT(config_model)
        streams = stdlib_corpus(max_bytes=2 << 20)
        plan = BatchPlan(seq_len=config_model.seq_len, batch_size=8, workers=args.peers)
        trainer = peer.train(
            model,
            algorithm,
            lambda step, _micro, _size, _plan: plan.batch(streams.train, step, args.index),
            codec=None if isinstance(algorithm, DeMoConfig) else DenseCodec(8),
            checkpoints=CheckpointStore(args.checkpoint_dir) if args.checkpoint_dir else None,
        )
        resumed = trainer.resume() if args.resume else False
        reports, resynced = [], []
        planned = faults.inject(args.fault, exchange)
        for done in peer.rounds(until_round=args.until_round, stop=stop, planned=planned):
            reports.append(done.report)
            resynced.append(exchange.counts.resyncs - sum(resynced))
        peer.finish()  # the last round applied (no end-of-run agreement: the tests compare the rounds')
        report = report_of(model, trainer, exchange, schedule, reports, resumed=resumed, stopped=peer.stopped)
        report["resynced"] = resynced  # re-syncs in each of its rounds
        with open(args.out, "w") as out:
            json.dump(report, out)


if __name__ == "__main__":
    main()
