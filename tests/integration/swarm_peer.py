"""One peer of the swarm integration tests (run by test_swarm.py).

    python -m tests.integration.swarm_peer --initial-peer MADDR --start T --round-seconds S \
        --until-round R --out FILE [--algorithm demo|diloco-eager|...]

Joins the DHT and trains the tiny GPT as a swarm peer, built as `shoal join` builds one
(shoal.peer.job.assembly), on its windows of the standard-library corpus in each round until round R, then
writes a JSON report: a hash of the final parameters, per-round losses, participants and lateness
(seconds past the deadline), rejections, re-syncs. Without `--start` it joins a running swarm: the
round clock comes from the DHT. `--fault KIND@ROUND` (repeatable) makes it exit, hang, lie or attack
from that round (tests.integration.faults); SIGTERM stops it at a round end with a checkpoint
(`--checkpoint-dir`), and `--resume` starts from the newest one.
"""

import argparse
import json
from datetime import timedelta
from pathlib import Path

import torch

from shoal.peer.algorithms.configs import DEFAULTS
from shoal.peer.config.spec import PeerSpec
from shoal.peer.data import stdlib_corpus
from shoal.peer.job.assembly import PeerSummary, Workload, build_peer, start_peer
from shoal.peer.job.faults import Faults
from shoal.peer.models.loading import load_model
from shoal.peer.swarm.exchange import RoundSchedule
from shoal.peer.train.stopping import stop_on_signals
from tests.integration import faults
from tests.integration.faults import Fault

MAX_PAYLOAD_BYTES = 1 << 20
SETTINGS = {
    "run": "test",
    "lr": 2e-3,
    "inner_steps": 5,
    "checkpoint_every": 0,
    "device": "cpu",
    "max_micro_batches": 64,  # the load the tests were sized for (tests/conftest.py)
}
"""What every test peer shares, by `shoal join` flag name (also the in-process peers')."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    for name in ("--initial-peer", "--out"):
        parser.add_argument(name, required=True)
    parser.add_argument("--start", type=float, default=None, help="round clock start (none: from the DHT)")
    parser.add_argument("--round-seconds", type=float, default=1.5)
    parser.add_argument("--until-round", type=int, required=True)
    parser.add_argument(
        "--fault", type=Fault.parse, action="append", default=[], help="KIND@ROUND: faults.py"
    )
    parser.add_argument("--topk", type=int, default=32, help="DeMo's compression_topk (in the run config)")
    parser.add_argument("--algorithm", choices=list(DEFAULTS), default="demo")
    parser.add_argument("--strike-limit", type=int, default=3)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--host", default="127.0.0.1", help="IPv4 address to listen on")
    parser.add_argument("--gather", type=int, default=0, help="bounded fan-in (in the run config)")
    return parser.parse_args()


def report_of(peer, schedule, reports, *, resumed: bool) -> dict:
    """What the test reads of this peer: its run's summary (shoal.peer.job.assembly.PeerSummary), each
    round's lateness (seconds past its deadline), its refusals."""
    summary = PeerSummary.of(peer, reports)
    counts = summary.counts
    return {
        "param_hash": summary.param_hash,
        "finite": summary.finite,
        "rounds": summary.round_numbers,
        "losses": summary.losses,
        "participants": summary.participants,
        "lateness": [r.finished_at - schedule.deadline(r.round) for r in reports],
        "rejected": counts["rejected"],
        "received": counts["bytes_received"],
        "refused": peer.exchange.refused,
        "resyncs": counts["resyncs"],
        "banned": counts["banned"],
        "resumed": resumed,
        "stopped": summary.stopped,
        "via_relay": counts["via_relay"],
        "left_out": counts["left_out_rounds"],
        "payload_bytes": peer.exchange.last_payload_bytes,
        "uncounted": counts["uncounted_rounds"],
    }


def spec_of(args: argparse.Namespace) -> PeerSpec:
    """The peer's spec: the tiny GPT at the learning rate and inner steps these tests were written for,
    one micro-batch a step, no periodic checkpoint."""
    return PeerSpec.of(
        **SETTINGS,
        initial_peers=(args.initial_peer,),
        host=args.host,
        algorithm=args.algorithm,
        gather=args.gather,
        round_seconds=args.round_seconds,
        checkpoint_dir=args.checkpoint_dir,
        **({"topk": args.topk} if args.algorithm.startswith("demo") else {}),
    )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    stop = stop_on_signals()
    spec = spec_of(args)
    workload = Workload(torch.device("cpu"), load_model("tiny"), stdlib_corpus(max_bytes=2 << 20))
    with start_peer(spec) as peer:
        if args.start is None:
            schedule = RoundSchedule.discover(peer.dht, "test")
        else:
            schedule = RoundSchedule(start_time=args.start, round_seconds=args.round_seconds)
        trainer = build(peer, spec, schedule, workload, args.fault, args.strike_limit)
        resumed = trainer.resume() if args.resume else False
        report = train(peer, schedule, args.until_round, stop, resumed=resumed)
        # whole or not at all: tests wait for the file to exist, then read it (one read an empty file
        # that was still being written, a clean-clone CI run, 2026-12-02)
        out = Path(args.out)
        partial = out.with_name(out.name + ".partial")
        partial.write_text(json.dumps(report))
        partial.replace(out)


def build(peer, spec: PeerSpec, schedule, workload: Workload, fault_list=(), strike_limit: int = 3):
    """The test peer's trainer: as `shoal join` builds it, one micro-batch a step, short fetches."""
    return build_peer(
        peer,
        spec,
        schedule,
        workload,
        fill_window=False,
        faults=Faults(exchange_type=faults.exchange_type(fault_list)),
        fetch_timeout=timedelta(seconds=5),
        max_payload_bytes=MAX_PAYLOAD_BYTES,
        strike_limit=strike_limit,
    )


def train(peer, schedule, until_round: int, stop=None, *, resumed: bool = False) -> dict:
    """Its rounds until `until_round`, then its report (`report_of`)."""
    reports, resynced = [], []
    for done in peer.rounds(until_round=until_round, stop=stop):
        reports.append(done.report)
        resynced.append(peer.exchange.counts.resyncs - sum(resynced))
    peer.finish()  # the last round applied (no end-of-run agreement: the tests compare the rounds')
    report = report_of(peer, schedule, reports, resumed=resumed)
    report["resynced"] = resynced  # re-syncs in each of its rounds
    return report


if __name__ == "__main__":
    main()
