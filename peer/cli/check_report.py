"""`shoal check`: what a volunteer should know before joining.

- the device a peer would train on, its memory, the torch / CUDA versions and bf16 support;
- the addresses this machine listens on, and which case it is in: `public` (peers outside its
  network can dial it), `nat_relayed` (they cannot, but a `shoal bootstrap` relay among the initial
  peers relays for it) or `unreachable` (they cannot, and no relay does), with how to fix it. A relay
  among the initial peers dials this machine back (shoal.peer.swarm.relay); without one, the case is
  inferred from the addresses;
- with `--initial-peers`: whether the bootstrap peer answers, the DHT round-trip time, and the
  bandwidth from up to three shoal peers of the run, each measured by pulling 4 MiB from its probe
  handler (shoal.peer.swarm.exchange; a stock hivemind-dht node has none, so only the round trip is shown);
- with `--model`: whether it fits this device with `--algorithm` (shoal.peer.train.fit), as
  `shoal join` checks.
"""

import asyncio
import json
import sys
import time
from typing import IO, TYPE_CHECKING, cast

import torch
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPrivateKey

from shoal.peer.swarm.bootstrap import BootstrapError, private_only, start_dht
from shoal.peer.swarm.membership import record_validators
from shoal.peer.swarm.names import handler, peers_key
from shoal.peer.swarm.records import peer_records
from shoal.peer.swarm.relay import UNCHECKED, Reachability, check_reachability
from shoal.peer.train.hardware import choose_device, describe
from shoal.protocol.swarm_pb2 import PayloadChunk, ProbeRequest

if TYPE_CHECKING:
    from shoal.peer.data import TokenStreams

PROBE_BYTES = 4 << 20
PROBE_PEERS = 3
PROBE_TIMEOUT_S = 60.0


def device_report() -> dict:
    device = choose_device("auto")
    report = describe(device)
    report |= {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "bf16_autocast": device.type == "cuda" and torch.cuda.is_bf16_supported(),
    }
    return report


def reachability(addresses: list[str], port: int, reach: Reachability = UNCHECKED) -> dict:
    """Which case this machine is in (public, nat_relayed, unreachable), and what to do about it."""
    port_text = f"TCP port {port}" if port else "the TCP port (fix one with --port N)"
    forward = f"forward {port_text} from your router to this machine"
    public = [a for a in addresses if not private_only([a])]
    if reach.reachable:
        case, advice = "public", f"a relay dialled this machine back at {reach.observed}"
    elif reach.reachable is False:
        case = "nat_relayed"
        advice = (
            f"behind NAT: a relay sees this machine at {reach.observed} and cannot dial it; peers that "
            f"cannot dial you pull through the relay. To be dialled directly (sparing the relay), {forward}"
        )
    elif public:
        case = "public"
        advice = f"public address {', '.join(public)}: reachable if {port_text} is open in your firewall"
    else:
        case = "unreachable"
        advice = (
            "only private addresses, and no relay among the initial peers: peers outside your network "
            f"cannot reach you. Join through a `shoal bootstrap` node (it relays for you), or {forward}"
        )
    return {"addresses": addresses, "case": case, "reachable": case == "public", "advice": advice}


async def _probe(dht, peer_id: str, run: str) -> float:
    """Mbit/s of one PROBE_BYTES pull from a peer's probe handler."""
    p2p = await dht.replicate_p2p()
    try:
        started = time.perf_counter()
        stream = await p2p.iterate_protobuf_handler(
            PeerID.from_base58(peer_id), handler(run, "probe"), ProbeRequest(size=PROBE_BYTES), PayloadChunk
        )
        received = 0
        async for chunk in stream:
            received += len(chunk.data)
        elapsed = time.perf_counter() - started
    finally:
        await p2p.shutdown()
    if received == 0:
        raise ConnectionError("the peer sent nothing (rate-limited, or not a shoal peer of this run)")
    return received * 8 / elapsed / 1e6


def network_report(initial_peers: list[str], run: str, port: int) -> dict:
    report: dict = {}
    try:
        dht = start_dht(
            initial_peers,
            host_maddrs=[f"/ip4/0.0.0.0/tcp/{port}"],
            record_validators=record_validators(run, RSAPrivateKey()),
        )
    except BootstrapError as error:
        return {"bootstrap": "failed", "error": str(error)}
    try:
        reach = check_reachability(dht, initial_peers)
        report["reachability"] = reachability([str(a) for a in dht.get_visible_maddrs()], port, reach)
        if not initial_peers:
            return report
        started = time.perf_counter()
        records, _ = peer_records(dht.get(peers_key(run), latest=True))
        report["bootstrap"] = "ok"
        report["dht_round_trip_ms"] = (time.perf_counter() - started) * 1000
        report["run_peers"] = len(records)
        bandwidth: dict[str, float | str] = {}
        for record in list(records.values())[:PROBE_PEERS]:
            try:
                mbit = asyncio.run(asyncio.wait_for(_probe(dht, record.peer_id, run), PROBE_TIMEOUT_S))
                bandwidth[record.peer_id] = round(mbit, 1)
            except Exception as error:  # any failure of one peer is reported, not raised
                bandwidth[record.peer_id] = f"failed: {type(error).__name__}: {error}"
        report["bandwidth_mbit_s"] = bandwidth
        return report
    finally:
        dht.shutdown()


def fit_report(spec) -> tuple[dict, str]:
    """Whether `spec`'s model fits this device (shoal.peer.train.fit), as `shoal join` would check it: (its
    numbers, the line that says so); {"error": ...} when it cannot fit or cannot be loaded."""
    from shoal.peer.job.assembly import Workload, fit_workload
    from shoal.peer.models.loading import load_model

    try:
        device = choose_device(spec.model.device)
        loaded = load_model(spec.model.name, seed=spec.run.seed, seq_len=spec.model.seq_len)
        # the fit reads no data: no streams (Workload types them as required)
        fitted = fit_workload(spec.changed(fit="auto"), Workload(device, loaded, cast("TokenStreams", None)))
    except ValueError as error:  # FitError, ModelError, DeviceError
        return {"error": str(error)}, f"fit        DOES NOT FIT: {error}"
    assert fitted is not None  # fit="auto": fit_workload returns None only with fit off
    text = f"fit        {fitted.describe()}"
    if fitted.late:
        text += f"\n           warning: {fitted.lateness()}"
    return fitted.record() | {"late": fitted.late}, text


def main(
    initial_peers: list[str], run: str, port: int, as_json: bool, stream: IO[str] | None = None, spec=None
) -> int:
    stream = stream or sys.stdout
    report = {"device": device_report(), "network": network_report(initial_peers, run, port)}
    failed = report["network"].get("bootstrap") == "failed"
    fit_text = None
    if spec is not None:
        report["fit"], fit_text = fit_report(spec)
    code = 2 if "error" in report.get("fit", {}) else 1 if failed else 0
    if as_json:
        stream.write(json.dumps(report) + "\n")
        return code
    device, network = report["device"], report["network"]
    lines = [
        f"device     {device['device']}: {device['name']}",
        f"memory     {_gib(device['memory_free'])} free of {_gib(device['memory_total'])}",
        f"torch      {device['torch']}, CUDA {device['cuda'] or 'not in this build'}"
        + (", bf16 autocast" if device["bf16_autocast"] else ""),
    ]
    if failed:
        lines.append(f"bootstrap  FAILED\n{network['error']}")
    else:
        reach = network["reachability"]
        lines.append(f"listening  {', '.join(reach['addresses'])}")
        lines.append(f"reachable  {reach['case']}: {reach['advice']}")
        if "bootstrap" in network:
            lines.append(
                f"bootstrap  ok, DHT round trip {network['dht_round_trip_ms']:.0f} ms, "
                f"{network['run_peers']} peers of run {run!r}"
            )
            for peer, value in network["bandwidth_mbit_s"].items():
                shown = f"{value} Mbit/s" if isinstance(value, float) else value
                lines.append(f"bandwidth  from {peer}: {shown}")
            if not network["bandwidth_mbit_s"]:
                lines.append("bandwidth  no shoal peer of this run to measure against")
    if fit_text is not None:
        lines.append(fit_text)
    stream.write("\n".join(lines) + "\n")
    return code


def _gib(value: int | None) -> str:
    return "unknown" if value is None else f"{value / 2**30:.1f} GiB"
