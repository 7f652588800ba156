"""`shoal bench swarm-local`: a real swarm on loopback, and what it puts on the wire.

For each swarm size, N peer processes (this module run with `--worker`) join a hivemind DHT started
here, train the model with DeMo over a SwarmExchange for R clock-synchronous rounds, and report the
payload bytes they sent. The wire is measured, not modelled: the bytes the loopback interface carried
(/proc/net/dev, transmit side) from the first round's start (set once every peer is set up) to the
last round's deadline (a round skipped because a computation overran moves it on), so they
include libp2p framing and encryption, TCP/IP headers, DHT traffic (records, announcements, polling)
and retries. The prediction from the codec alone is that every payload that counts is pulled once by
each of the N - 1 other peers: `payload bytes * (N - 1)` per peer per round, and with a bounded
fan-in (`--gather G`, shoal.protocol.rules) `payload bytes * G * (N - 1) / N`, whatever N's
size. Overhead = measured / predicted - 1. Nothing else may use loopback meanwhile (the numbers would
include it).

Rounds per second are set by the clock (1 / round length); what is measured is whether every round
completed with every peer's payload, or the G chosen ones (`complete_rounds`), and whether the peers
ended on one model (`one_hash`).

With `coordinated`, a `shoal coordinator` (the demo's: first round waits for all N, compute windows of
half a round to a round, the same `--gather`) plans the rounds and decides their participants; its gRPC
traffic is on loopback too and counted. Rounds then start when the coordinator announces the first
(once all N joined), and the wire is measured from that announcement to the last peer's exit.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

MODELS = {"tiny": {}, "10m": {"n_layer": 12, "n_head": 4, "d_model": 256, "seq_len": 128}}
"""tiny: GPTConfig.preset('tiny'); 10m: the 'small' width with 12 layers, ~9.5M parameters."""


def loopback_tx_bytes() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[8])
    raise RuntimeError("no loopback interface in /proc/net/dev")


def worker(args: argparse.Namespace) -> None:
    import torch

    from shoal.peer.config.spec import PeerSpec
    from shoal.peer.data import stdlib_corpus
    from shoal.peer.job.assembly import PeerSummary, Workload, build_peer, start_peer
    from shoal.peer.models.gpt import GPTConfig, TinyGPT
    from shoal.peer.models.loading import LoadedModel, model_loss
    from shoal.peer.swarm.records import RoundSchedule

    torch.set_num_threads(1)
    spec = PeerSpec.of(
        run="bench",
        initial_peers=(args.initial_peer,),
        host="127.0.0.1",
        model=args.model,
        gather=args.gather,
        round_seconds=args.round_seconds,
        batch_size=4,
        device="cpu",
    )
    model_config = GPTConfig.preset("small" if args.model == "10m" else "tiny", **MODELS[args.model])
    torch.manual_seed(0)
    model = LoadedModel(TinyGPT(model_config), model_loss, model_config.seq_len, model_config.vocab_size)
    workload = Workload(torch.device("cpu"), model, stdlib_corpus(max_bytes=4 << 20))
    with start_peer(spec) as peer:
        args.start = _ready_then_start(Path(args.out))
        link = None
        if args.coordinator:
            from shoal.peer.swarm.coordinator_link import CoordinatorLink

            link = CoordinatorLink(args.coordinator, peer.dht.peer_id.to_base58())
        schedule = RoundSchedule(start_time=args.start, round_seconds=args.round_seconds)
        build_peer(
            peer,
            spec,
            schedule,
            workload,
            coordinator=link,
            fill_window=False,
            fetch_timeout=timedelta(seconds=args.round_seconds),
        )
        if not args.coordinator:  # a peer ready early would compute and exchange round 0 before the window
            time.sleep(max(0.0, args.start - time.time()))
        summary = PeerSummary.of(peer, [done.report for done in peer.rounds(max_rounds=args.rounds)])
        assert peer.exchange is not None  # build_peer connected it
        counts = peer.exchange.counts
        result = summary.event() | {
            "params": workload.model.parameters,
            "participants": summary.participants,
            "round_numbers": summary.round_numbers,
            "dht_read": counts.received["dht"],
            "dht_written": counts.sent["dht"],
            "dht_reads": counts.dht_reads,
            "dht_rewrites": counts.dht_rewrites,
        }
        Path(args.out).write_text(json.dumps(result))


def _ready_then_start(out: Path) -> float:
    """In a worker, set up but for the exchange: says so (`<out>.ready`) and returns round 0's start,
    once the benchmark has written it (`start` beside it: every peer was ready)."""
    out.with_suffix(".ready").touch()
    start = out.parent / "start"
    while not start.exists():
        time.sleep(0.1)
    return float(start.read_text())


def _start_when_ready(tmp: Path, processes: list, timeout_s: float) -> float:
    """Waits until every worker joined the DHT and built its model and data (on 2 cores, 16 peers took
    40-60 s, and one that came late joined a round or two in, on another state: it forked the run),
    then tells them when round 0 starts: time for the rest (the peer record, the compatibility read),
    5 s + 1 s a peer."""
    deadline = time.time() + timeout_s
    while not all((tmp / f"{i}.ready").exists() for i in range(len(processes))):
        if any(process.poll() is not None for process in processes):
            raise RuntimeError("a bench peer exited before it was ready")
        if time.time() > deadline:
            raise RuntimeError(f"bench peers not ready after {timeout_s:.0f} s")
        time.sleep(0.2)
    begin = time.time() + 5 + len(processes)
    written = tmp / "start.tmp"
    written.write_text(repr(begin))
    written.rename(tmp / "start")  # whole when a worker sees it
    return begin


def run_swarm(
    model: str, peers: int, rounds: int, round_seconds: float, gather: int = 0, coordinated: bool = False
) -> dict:
    from shoal.peer.cli.local_swarm import _start_coordinator, _stop
    from shoal.peer.swarm.bootstrap import TetheredDHT

    # the benchmark's bootstrap node: its process and p2pd end with the benchmark, even on kill -9
    node = TetheredDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    address = str(node.get_visible_maddrs()[0])
    with tempfile.TemporaryDirectory() as tmp:
        coordinator, linked = None, []
        if coordinated:
            started: list[subprocess.Popen] = []
            where, _ = _start_coordinator(Path(tmp), peers, round_seconds, False, str(gather), started)
            coordinator = started[0]
            linked = ["--coordinator", where]
        worker = [sys.executable, "-m", "shoal.peer.bench.swarm_local", "--worker", "--initial-peer", address]
        worker += ["--round-seconds", str(round_seconds), "--rounds", str(rounds), "--model", model]
        worker += ["--peers", str(peers), "--gather", str(gather), *linked]
        processes = [
            subprocess.Popen([*worker, "--index", str(i), "--out", f"{tmp}/{i}.json"], start_new_session=True)
            for i in range(peers)
        ]
        try:
            begin = _start_when_ready(Path(tmp), processes, timeout_s=60 + 10 * peers)
            if coordinated:
                _first_announcement(where, timeout_s=begin - time.time() + 120)
            else:
                time.sleep(max(0.0, begin - time.time()))
            start_bytes = loopback_tx_bytes()
            if not coordinated:
                boundaries = boundary_bytes(processes, begin, round_seconds, rounds)
            for process in processes:
                if process.wait(timeout=120 + (4 * rounds * round_seconds if coordinated else 0)) != 0:
                    raise RuntimeError(f"a bench peer exited with {process.returncode}")
            if coordinated:
                wire = loopback_tx_bytes() - start_bytes
        finally:
            for process in processes:
                if process.poll() is None:
                    os.killpg(process.pid, 9)
            if coordinator is not None:
                _stop([coordinator])
            node.shutdown()
        results = [json.loads(Path(f"{tmp}/{i}.json").read_text()) for i in range(peers)]
    last = max(max(r["round_numbers"]) for r in results)
    if not coordinated:  # to the deadline of the last round run: one whose computing overran is skipped
        wire = boundaries.get(last + 1, boundaries[max(boundaries)]) - start_bytes
    setting = {"model": model, "peers": peers, "gather": gather, "coordinated": coordinated}
    return _measured(setting, results, wire, rounds, round_seconds)


def _measured(setting: dict, results: list[dict], wire: int, rounds: int, round_seconds: float) -> dict:
    """The swarm's row: its wire bytes against the codec's prediction, and the peers' own counts."""
    peers, gather = setting["peers"], setting["gather"]
    last = max(max(r["round_numbers"]) for r in results)
    payload = statistics.mean(r["payload_bytes"] for r in results)
    counted = min(gather or peers, peers)
    predicted = payload * counted * (peers - 1) / peers
    measured = wire / peers / rounds
    columns = zip(*(r["participants"] for r in results), strict=True)
    complete = sum(all(p == counted for p in column) for column in columns)

    def per_round(key: str, digits: int | None = None) -> float:
        return round(statistics.mean(r[key] for r in results) / rounds, digits)

    return {
        "model": setting["model"],
        "params": results[0]["params"],
        "peers": peers,
        "gather": gather,
        "coordinated": setting["coordinated"],
        "rounds": rounds,
        # round numbers a peer skipped (its computation overran a round's deadline): the wire is
        # measured to the last one's deadline, and divided by the rounds run
        "rounds_skipped": last + 1 - rounds,
        "late_peers": sum(r["round_numbers"][0] > 0 for r in results),  # missed round 0's start
        "round_seconds": round_seconds,
        "rounds_per_second": 1 / round_seconds,
        "complete_rounds": complete,
        "one_hash": len({r["param_hash"] for r in results}) == 1,
        "payload_bytes": round(payload),
        "predicted_wire_bytes_per_peer_per_round": round(predicted),
        "wire_bytes_per_peer_per_round": round(measured),
        "overhead": measured / predicted - 1,
        # what the DHT reads and writes carried (serialized values, as the peers counted them)
        "dht_read_bytes_per_peer_per_round": per_round("dht_read"),
        "dht_written_bytes_per_peer_per_round": per_round("dht_written"),
        "dht_reads_per_peer_per_round": per_round("dht_reads", 1),
        "dht_stores_per_peer_per_round": per_round("dht_stores", 1),
        # writes sent again: to replicas the routing table had not known, or with hivemind's crawl
        "dht_rewrites": sum(r["dht_rewrites"] for r in results),
        "rejected": sum(sum(r["rejected"].values()) for r in results),
        "rejected_by_reason": dict(sum((Counter(r["rejected"]) for r in results), Counter())),
        "median_compute_s": statistics.median(r["median_compute_s"] for r in results),
    }


def boundary_bytes(processes: list, begin: float, round_seconds: float, rounds: int) -> dict[int, int]:
    """Loopback bytes at each round boundary (`begin + k * round_seconds`: k) while a peer runs, for at
    most four times the rounds' length."""
    samples: dict[int, int] = {}
    for k in range(4 * rounds + 1):
        if samples and all(process.poll() is not None for process in processes):
            break
        time.sleep(max(0.0, begin + k * round_seconds - time.time()))
        samples[k] = loopback_tx_bytes()
    return samples


def _first_announcement(address: str, timeout_s: float) -> None:
    """Returns when the coordinator at `address` announces its first round (followed as a non-member)."""
    import grpc

    from shoal.peer.bench.coordinator import peer_ids
    from shoal.protocol import coordinator_pb2, coordinator_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        stream = stub.Rounds(coordinator_pb2.RoundsRequest(peer_id=peer_ids(1, seed=7)[0]), timeout=timeout_s)
        next(stream)
        stream.cancel()


def main(
    *,
    as_json: bool,
    sizes: list[int],
    model: str,
    rounds: int,
    round_seconds: float,
    gather: int = 0,
    coordinated: bool = False,
) -> int:
    results = []
    for peers in sizes:
        results.append(run_swarm(model, peers, rounds, round_seconds, gather, coordinated))
        if not as_json:
            r = results[-1]
            print(
                f"{r['model']:>5} {r['params']:>10,} params  {r['peers']} peers"
                f"  {r['rounds_per_second']:.2f} rounds/s  complete {r['complete_rounds']}/{r['rounds']}"
                f"  {'one hash' if r['one_hash'] else 'HASHES DIFFER'}  payload {r['payload_bytes']:>10,} B"
                f"  predicted {r['predicted_wire_bytes_per_peer_per_round']:>11,} B"
                f"  wire {r['wire_bytes_per_peer_per_round']:>11,} B  overhead {100 * r['overhead']:+.1f}%",
                flush=True,
            )
    if as_json:
        print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--initial-peer")
    parser.add_argument("--round-seconds", type=float)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--index", type=int)
    parser.add_argument("--peers", type=int)
    parser.add_argument("--model", choices=list(MODELS))
    parser.add_argument("--gather", type=int, default=0)
    parser.add_argument("--coordinator")
    parser.add_argument("--out")
    worker(parser.parse_args())
