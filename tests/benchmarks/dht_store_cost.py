"""What one signed DHT write costs on the wire: N hivemind DHT nodes, each in a network namespace of
its own (shoal.peer.bench.netlab, so the kernel's interface counters see only their traffic); after they
have joined, node 1 stores a peer record (the size of shoal's) under its public-key subkey `--stores`
times. Needs root.

    python -m tests.benchmarks.dht_store_cost [--nodes 5] [--stores 10]

Prints one JSON object: bytes every node sent while idle (per second) and while node 1 stored.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shoal.peer.bench.netlab import NetLab

RECORD = {
    "peer_id": "12D3KooW" + "x" * 44,
    "version": "0.2.0",
    "config": {"model": "5m", "algorithm": "demo", "lr": "0.002", "seed": "0", "compression_topk": "4"},
    "device": "cpu",
    "throughput": 1.0,
    "round": 3,
    "start_time": 1.0,
    "round_seconds": 4.0,
    "samples": 10,
    "updated": 1.0,
}


def node(index: int, address: str, first: Path, store_at: float, stores: int) -> None:
    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.utils.crypto import RSAPrivateKey

    validator = RSASignatureValidator(RSAPrivateKey())
    while index > 0 and not first.exists():
        time.sleep(0.2)
    peers = [first.read_text()] if index > 0 else []
    dht = hivemind.DHT(
        start=True, initial_peers=peers, host_maddrs=[f"/ip4/{address}/tcp/0"], record_validators=[validator]
    )
    if index == 0:
        first.with_suffix(".tmp").write_text(str(dht.get_visible_maddrs()[0]))
        first.with_suffix(".tmp").rename(first)
    time.sleep(max(0.0, store_at - time.time()))
    if index == 1:
        for _ in range(stores):
            dht.store("run_peers", RECORD, time.time() + 60, subkey=validator.local_public_key)
    time.sleep(3600)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--stores", type=int, default=10)
    parser.add_argument("--node", nargs=4, help=argparse.SUPPRESS)  # INDEX ADDRESS FIRST STORE_AT
    args = parser.parse_args()
    if args.node:
        index, address, first, store_at = args.node
        return node(int(index), address, Path(first), float(store_at), args.stores)
    idle_s, store_s = 20.0, 30.0
    with NetLab(args.nodes, 100) as lab, tempfile.TemporaryDirectory() as scratch:
        store_at = time.time() + 40 + idle_s  # 40 s to start and join
        for index in range(args.nodes):
            command = [sys.executable, "-m", "tests.benchmarks.dht_store_cost", "--stores", str(args.stores)]
            command += ["--node", str(index), lab.address(index), f"{scratch}/first", str(store_at)]
            lab.popen(index, command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(max(0.0, store_at - idle_s - time.time()))
        before = [lab.counters(i)[0] for i in range(args.nodes)]
        time.sleep(max(0.0, store_at - time.time()))
        idle = [lab.counters(i)[0] for i in range(args.nodes)]
        time.sleep(store_s)
        stored = [lab.counters(i)[0] for i in range(args.nodes)]
    idle_rate = [(b - a) / idle_s for a, b in zip(before, idle, strict=True)]
    during = [b - a - rate * store_s for a, b, rate in zip(idle, stored, idle_rate, strict=True)]
    print(
        json.dumps(
            {
                "nodes": args.nodes,
                "stores": args.stores,
                "idle_bytes_per_s": [round(r) for r in idle_rate],
                "sent_per_store_by_writer": round(during[1] / args.stores),
                "sent_per_store_by_others": [round(d / args.stores) for i, d in enumerate(during) if i != 1],
                "sent_per_store_total": round(sum(during) / args.stores),
            }
        )
    )


if __name__ == "__main__":
    main()
