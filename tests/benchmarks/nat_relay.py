"""Peers behind NAT training through a `shoal bootstrap` relay, against the same peers dialable.

Builds shoal.peer.bench.netlab topologies (needs root and iptables): node 0 runs `shoal bootstrap
--public`; N peers run `shoal join --initial-peers <it>`, each either on the bridge (`direct`) or in
a home network behind a masquerading router of its own (`nat`). The first peer starts the run, the
others join once it trains. For each topology it prints: the rounds in which every peer's payload was
aggregated (after the swarm was whole), whether all ended on one model, the bytes each peer's
interface carried per round, the bytes through the bootstrap node and its relay, and the seconds from a
joiner's start to the end of the first round its payload was aggregated in.

    python -m tests.benchmarks.nat_relay [--peers 3] [--rounds 15] [--round-seconds 3] [--algorithm demo]
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from shoal.peer.bench.netlab import NetLab
from tests.integration.harness import SHOAL, events, metrics, wait_for, wait_until

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # one torch thread per peer, as the tests run them


def measure(topology: str, args: argparse.Namespace, scratch: Path) -> dict:
    homes = range(1, args.peers + 1) if topology == "nat" else ()
    with NetLab(args.peers + 1, None, homes=homes) as lab:
        boot_out, address_file = scratch / "boot.out", scratch / "boot.address"
        boot = lab.popen(
            0,
            [*SHOAL, "bootstrap", "--host", lab.address(0), "--public", "--metrics-port", "0",
             "--address-file", str(address_file)],
            stdout=boot_out.open("w"), stderr=subprocess.STDOUT, env=ENV,
        )  # fmt: skip
        url = wait_until(
            lambda: (
                address_file.exists()
                and address_file.read_text().strip()
                and re.search(r"(http://\S+/metrics)", boot_out.read_text())
            ),
            60,
            "the bootstrap node's address and metrics",
            processes=[boot],
            logs=[boot_out],
            interval_s=0.5,
        )
        address, url = address_file.read_text().strip(), url.group(1)
        flags = ["--run", "bench", "--model", "tiny", "--algorithm", args.algorithm, "--log-format", "json"]
        flags += ["--round-seconds", str(args.round_seconds), "--until-round", str(args.rounds)]
        outs, launched = [], []
        for peer in range(1, args.peers + 1):
            out = scratch / f"{topology}{peer}.jsonl"
            extra = ["--discover-seconds", "0"] if peer == 1 else []
            launched.append(time.time())
            lab.popen(
                peer, [*SHOAL, "join", "--initial-peers", address, *flags, *extra],
                stdout=out.open("w"), stderr=(scratch / f"{topology}{peer}.err").open("w"), env=ENV,
            )  # fmt: skip
            outs.append(out)
            if peer == 1:
                wait_for(out, lambda e: e.get("event") == "round", 120)
        before, counted_from = [lab.counters(node) for node in range(args.peers + 1)], time.time()
        summaries = [
            wait_for(out, lambda e: e.get("event") == "summary", 60 + 3 * args.rounds * args.round_seconds)
            for out in outs
        ]
        after = [lab.counters(node) for node in range(args.peers + 1)]
        relay = metrics(lab, url)
    rounds = [[e for e in events(out) if e.get("event") == "round"] for out in outs]
    full = [[e["round"] for e in peer if e["participants"] == args.peers] for peer in rounds]
    whole = min(min(f) for f in full if f) if all(full) else None
    complete = min(sum(r >= whole for r in f) for f in full) if whole is not None else 0
    start, seconds = summaries[0]["round_clock"]
    first_in = [
        round(start + (f[0] + 1) * seconds - at, 1) if f else None
        for f, at in zip(full[1:], launched[1:], strict=True)
    ]
    measured_rounds = max(1.0, start + (args.rounds + 1) * seconds - counted_from) / seconds
    per_round = [
        ((b[0] - a[0]) + (b[1] - a[1])) / measured_rounds for a, b in zip(before, after, strict=True)
    ]  # bytes sent + received by each node's interface per round, once every peer was started
    return {
        "topology": topology,
        "peers": args.peers,
        "algorithm": args.algorithm,
        "rounds_after_whole": args.rounds - whole + 1 if whole is not None else 0,
        "complete_rounds": complete,
        "one_model": len({s["param_hash"] for s in summaries}) == 1,
        "peer_bytes_per_round": round(statistics.mean(per_round[1:])),
        "bootstrap_bytes_per_round": round(per_round[0]),
        "relay_payload_sent_bytes": relay.get('shoal_relay_sent_bytes_total{kind="payload"}', 0.0),
        "relay_payload_fetched_bytes": relay.get('shoal_relay_fetched_bytes_total{kind="payload"}', 0.0),
        "relay_state_bytes": relay.get('shoal_relay_sent_bytes_total{kind="state"}', 0.0),
        "via_relay_payload_bytes": sum(s["via_relay"].get("payload", 0) for s in summaries),
        "joiner_first_contribution_s": first_in,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--round-seconds", type=float, default=3.0)
    parser.add_argument("--algorithm", default="demo", choices=["demo", "diloco"])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for topology in ("direct", "nat"):
            folder = Path(scratch) / topology
            folder.mkdir()
            rows.append(measure(topology, args, folder))
            print(json.dumps(rows[-1]), flush=True)
    print(
        "| topology | complete rounds | one model | peer bytes/round | bootstrap bytes/round "
        "| relay sent / fetched (payloads) | joiner's first contribution (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['topology']} | {row['complete_rounds']}/{row['rounds_after_whole']} "
            f"| {row['one_model']} | "
            f"{row['peer_bytes_per_round']:,} | {row['bootstrap_bytes_per_round']:,} | "
            f"{row['relay_payload_sent_bytes']:,.0f} / {row['relay_payload_fetched_bytes']:,.0f} | "
            f"{', '.join(map(str, row['joiner_first_contribution_s']))} |"
        )


if __name__ == "__main__":
    main()
