"""tests/benchmarks/wire_breakdown.py reads tcpdump's pcap format and sorts a peer's packets right."""

import struct

import pytest

from tests.benchmarks.wire_breakdown import breakdown


def frame(
    source: str, destination: str, source_port: int, destination_port: int, payload: int, sequence: int = 0
) -> bytes:
    tcp = struct.pack("!HHIIBBHHH", source_port, destination_port, sequence, 0, 5 << 4, 0x10, 0, 0, 0)
    total = 20 + len(tcp) + payload
    ip = struct.pack(
        "!BBHHHBBH4s4s",
        0x45,
        0,
        total,
        0,
        0,
        64,
        6,
        0,
        bytes(map(int, source.split("."))),
        bytes(map(int, destination.split("."))),
    )
    return b"\x00" * 12 + b"\x08\x00" + ip + tcp + b"x" * payload


def pcap(frames: list[tuple[float, bytes]], snap: int = 128) -> bytes:
    out = struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, snap, 1)
    for when, data in frames:
        captured = data[:snap]
        out += struct.pack("<IIII", int(when), int(when % 1 * 1e6), len(captured), len(data))
        out += captured
    return out


def test_packets_are_sorted_by_connection_and_size_counting_whole_frames():
    me, peer, coordinator = "10.77.0.1", "10.77.0.2", "10.77.0.5"
    data = pcap(
        [
            (100.0, frame(me, coordinator, 40000, 7733, 189)),  # a report
            (100.1, frame(coordinator, me, 7733, 40000, 75)),  # its reply: received, not counted
            (100.2, frame(me, peer, 4001, 4002, 0, 2**32 - 100)),  # an acknowledgement
            (100.3, frame(me, peer, 4001, 4002, 9420, 2**32 - 100)),  # a payload (its sequence wraps)
            (100.4, frame(me, peer, 4001, 4002, 84, 9320)),  # a request
            (100.5, frame(me, peer, 4001, 4002, 1400, 2**32 - 100)),  # part of the payload again
            (105.0, frame(me, peer, 4001, 4002, 600, 9404)),  # after `until`
        ]
    )
    result = breakdown(data, me, until=4.0)
    assert result["sent"]["coordinator"] == {
        "small_packets": 1,
        "small_wire": 14 + 40 + 189,
        "small_payload": 189,
        "wire": 14 + 40 + 189,
    }
    sent = result["sent"][f"peer {peer}"]
    assert (sent["ack_packets"], sent["large_packets"], sent["small_packets"]) == (1, 1, 1)
    assert sent["large_wire"] == 14 + 40 + 9420 and sent["large_payload"] == 9420
    assert (sent["medium_packets"], sent["retransmitted_packets"]) == (1, 1)
    assert sent["retransmitted_wire"] == 14 + 40 + 1400
    assert result["total"]["wire"] == (14 + 40) * 5 + 189 + 9420 + 84 + 1400


def test_a_file_that_is_not_a_pcap_is_refused():
    with pytest.raises(ValueError, match="pcap"):
        breakdown(b"\x00" * 64, "10.77.0.1")
