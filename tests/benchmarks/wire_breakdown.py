"""Where a peer's bytes on the wire go: reads a packet capture of one peer's interface (`shoal bench
wan --pcap DIR` writes one per run, of peer 0) and prints what that peer sent, per connection class
and per kind of packet, in one JSON object.

    python -m tests.benchmarks.wire_breakdown DIR/demo_compact-10mbit-peer0.pcap [--me 10.77.0.1]

Classes: `coordinator` (TCP to or from port 7733, the wan bench's coordinator), `peer <address>` (its
libp2p connection to each other peer: payload pulls, DHT, keep-alives), `other` (multicast, ARP).
Kinds, by the TCP payload's size: `ack` (none), `small` (under 200 B: stream frames, requests,
protocol negotiation), `medium` (under 2,000 B: also single segments of a bulk transfer, at most
one MSS) and `large` (the kernel's segmentation-offload frames of a bulk transfer). `wire` counts whole
frames (Ethernet, IP and TCP headers included), as the interface counters do; `payload` only TCP
payload; `retransmitted` the segments TCP sent again (already counted in their kind). Only the
standard pcap format (tcpdump's default) is read; no dependency.
"""

import argparse
import json
import struct
import sys
from collections import Counter, defaultdict
from typing import NamedTuple

COORDINATOR_PORT = 7733
ETHERNET_BYTES = 14


class Packet(NamedTuple):
    when: float
    length: int  # the whole frame's
    source: str | None
    destination: str | None
    protocol: int | None  # None: not IPv4
    source_port: int = 0
    destination_port: int = 0
    payload: int = 0  # TCP or UDP payload bytes
    sequence: int = 0  # TCP's


def packets(data: bytes):
    """Each frame of a pcap file, as a Packet."""
    magic = struct.unpack("<I", data[:4])[0]
    if magic not in (0xA1B2C3D4, 0xA1B23C4D):
        raise ValueError("not a little-endian pcap file (tcpdump -w writes one)")
    scale = 1e-6 if magic == 0xA1B2C3D4 else 1e-9
    offset = 24
    while offset + 16 <= len(data):
        seconds, fraction, captured, length = struct.unpack("<IIII", data[offset : offset + 16])
        frame = data[offset + 16 : offset + 16 + captured]
        offset += 16 + captured
        when = seconds + fraction * scale
        if len(frame) < ETHERNET_BYTES + 20 or frame[12:14] != b"\x08\x00":
            yield Packet(when, length, None, None, None)
            continue
        ip = frame[ETHERNET_BYTES:]
        header, protocol = (ip[0] & 15) * 4, ip[9]
        total = struct.unpack("!H", ip[2:4])[0]
        source, destination = ".".join(map(str, ip[12:16])), ".".join(map(str, ip[16:20]))
        ports, payload, sequence = (0, 0), 0, 0
        if protocol in (6, 17) and len(ip) >= header + 4:
            ports = struct.unpack("!HH", ip[header : header + 4])
            if protocol == 6 and len(ip) >= header + 13:
                payload = total - header - (ip[header + 12] >> 4) * 4
                sequence = struct.unpack("!I", ip[header + 4 : header + 8])[0]
            elif protocol == 17:
                payload = total - header - 8
        yield Packet(when, length, source, destination, protocol, *ports, payload, sequence)


def kind(payload: int) -> str:
    return "ack" if payload == 0 else "small" if payload < 200 else "medium" if payload < 2000 else "large"


def breakdown(data: bytes, me: str, *, since: float = 0.0, until: float = float("inf")) -> dict:
    """What `me` sent between `since` and `until` seconds after the first packet. A TCP segment that
    ends no further than what its connection already sent is also counted as `retransmitted`."""
    sent: defaultdict[str, Counter] = defaultdict(Counter)
    sent_up_to: dict[tuple, int] = {}  # per connection: bytes of sequence space sent, from its first segment
    first_sequence: dict[tuple, int] = {}
    first = None
    for p in packets(data):
        first = p.when if first is None else first
        if p.source != me:
            continue
        if p.protocol == 6:
            flow = (p.source_port, p.destination, p.destination_port)
            start = (p.sequence - first_sequence.setdefault(flow, p.sequence)) % (1 << 32)
            repeated = p.payload > 0 and start + p.payload <= sent_up_to.get(flow, 0)
            sent_up_to[flow] = max(sent_up_to.get(flow, 0), start + p.payload)
        if not since <= p.when - first < until:
            continue
        if p.protocol == 6 and COORDINATOR_PORT in (p.source_port, p.destination_port):
            where = "coordinator"
        elif p.protocol == 6:
            where = f"peer {p.destination}"
        else:
            where = "other"
        sort = kind(p.payload) if p.protocol == 6 else "other"
        counts = sent[where]
        counts[f"{sort}_packets"] += 1
        counts[f"{sort}_wire"] += p.length
        counts[f"{sort}_payload"] += p.payload
        counts["wire"] += p.length
        if p.protocol == 6 and repeated:
            counts["retransmitted_packets"] += 1
            counts["retransmitted_wire"] += p.length
    total = Counter()
    for counts in sent.values():
        total.update(counts)
    return {"sent": {where: dict(counts) for where, counts in sorted(sent.items())}, "total": dict(total)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pcap")
    parser.add_argument("--me", default="10.77.0.1", help="the captured peer's address (wan bench: peer 0)")
    parser.add_argument("--since", type=float, default=0.0, help="seconds after the first packet")
    parser.add_argument("--until", type=float, default=float("inf"))
    args = parser.parse_args()
    with open(args.pcap, "rb") as file:
        data = file.read()
    json.dump(breakdown(data, args.me, since=args.since, until=args.until), sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
