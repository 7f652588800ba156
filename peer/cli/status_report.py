"""`shoal status`: the swarm's peers as their signed DHT records describe them, like a health page.

It joins the DHT as a client (it serves nothing and is not listed), reads `<run>_peers`, and prints
one row per peer: id, shoal version, device, throughput, round, how long ago the record was written,
samples contributed, and the swarm's epoch over its data and tokens consumed as the peer's token
ledger has them. A record that breaks the schema is counted, not shown.
"""

import json
import sys
import time
from typing import IO

from hivemind.utils.crypto import RSAPrivateKey
from rich.console import Console
from rich.table import Table

from shoal.peer.swarm.bootstrap import start_dht
from shoal.peer.swarm.membership import record_validators
from shoal.peer.swarm.names import peers_key
from shoal.peer.swarm.records import peer_records


def read_peers(initial_peers: list[str], run: str) -> tuple[list[dict], int]:
    """(one dict per valid peer record, how many records were malformed); raises BootstrapError."""
    dht = start_dht(
        initial_peers,
        host_maddrs=["/ip4/0.0.0.0/tcp/0"],
        client_mode=True,
        record_validators=record_validators(run, RSAPrivateKey()),
    )
    try:
        records, malformed = peer_records(dht.get(peers_key(run), latest=True))
    finally:
        dht.shutdown()
    now = time.time()
    rows = [
        {
            "peer_id": record.peer_id,
            "version": record.version,
            "device": record.device,
            "throughput": record.throughput,
            "round": record.round,
            "last_seen_s": max(0.0, now - record.updated) if record.updated else None,
            "samples": record.samples,
            "epoch": record.epoch,
            "tokens": record.tokens,
            "run_hash": record.run_hash,
        }
        for record in records.values()
    ]
    return sorted(rows, key=lambda row: (-row["round"], row["peer_id"])), malformed


def main(initial_peers: list[str], run: str, as_json: bool, stream: IO[str] | None = None) -> int:
    stream = stream or sys.stdout
    rows, malformed = read_peers(initial_peers, run)
    if as_json:
        stream.write(json.dumps({"run": run, "peers": rows, "malformed_records": malformed}) + "\n")
        return 0
    console = Console(file=stream, highlight=False, soft_wrap=True)
    if not rows:
        console.print(f"no peer of run {run!r} is announced in this DHT (is --run right?)", markup=False)
        return 0
    configurations = len({row["run_hash"] for row in rows})
    title = f"run {run}: {len(rows)} peers, round {rows[0]['round']}"
    if configurations > 1:
        title += f", {configurations} different configurations"
    table = Table(title=title, title_justify="left")
    for header in (
        "peer",
        "version",
        "device",
        "samples/s",
        "round",
        "last seen",
        "samples",
        "epoch",
        "tokens",
    ):
        table.add_column(header, justify="left" if header in ("peer", "device") else "right")
    for row in rows:
        seen = "-" if row["last_seen_s"] is None else f"{row['last_seen_s']:.0f} s ago"
        table.add_row(
            row["peer_id"],
            row["version"],
            row["device"],
            f"{row['throughput']:,.1f}",
            str(row["round"]),
            seen,
            f"{row['samples']:,}",
            f"{row['epoch']:.2f}",
            f"{row['tokens']:,}",
        )
    console.print(table)
    if malformed:
        console.print(f"{malformed} malformed records ignored", markup=False)
    return 0
