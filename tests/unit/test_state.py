"""Shared-state snapshots: capture, manifest checks, restore, the majority rule and the multi-source
download (with a scripted fetch: the real transport is tested in tests/integration/test_swarm.py)."""

import asyncio
from collections import Counter

import pytest
import torch

from shoal.peer.swarm.state import (
    StateSnapshot,
    StateUnavailable,
    check_chunk,
    download,
    majority,
    parse_manifest,
    restore,
    state_size,
)
from shoal.protocol import MalformedPayloadError
from shoal.protocol.swarm_pb2 import StateManifest


def tensors(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(300, 7, generator=generator), torch.randn(5, generator=generator), torch.zeros(())]


def test_capture_then_restore_round_trips_exactly_in_pieces():
    state = tensors()
    snapshot = StateSnapshot.capture(state, round_number=7, chunk_bytes=1024)
    manifest = parse_manifest(snapshot.manifest, snapshot.digest, state_size(state))
    assert manifest.round == 7 and manifest.size == 4 * (2100 + 5 + 1) and len(manifest.chunk_digests) == 9
    pieces = [snapshot.chunk(i) for i in range(9)]
    for index, piece in enumerate(pieces):
        check_chunk(manifest, index, piece)
    restored = restore(b"".join(pieces), state)
    assert all(torch.equal(a, b) for a, b in zip(restored, state, strict=True))


def test_the_digest_covers_values_and_round():
    base = StateSnapshot.capture(tensors(), 3).digest
    assert StateSnapshot.capture(tensors(), 3).digest == base
    assert StateSnapshot.capture(tensors(), 4).digest != base
    changed = tensors()
    changed[1][2] = torch.nextafter(changed[1][2], torch.tensor(10.0))
    assert StateSnapshot.capture(changed, 3).digest != base


def test_bf16_and_float64_state_travels_as_float32():
    state = [torch.ones(4, dtype=torch.bfloat16), torch.full((2,), 0.5, dtype=torch.float64)]
    snapshot = StateSnapshot.capture(state, 0)
    assert len(snapshot.data) == 24
    assert [t.dtype for t in restore(snapshot.data, state)] == [torch.float32, torch.float32]


def corrupt_manifest(**fields) -> tuple[bytes, bytes]:
    import hashlib

    manifest = StateManifest(round=1, size=4096, chunk_bytes=1024, chunk_digests=[b"\0" * 32] * 4)
    for name, value in fields.items():
        if name == "chunk_digests":
            del manifest.chunk_digests[:]
            manifest.chunk_digests.extend(value)
        else:
            setattr(manifest, name, value)
    data = manifest.SerializeToString()
    return data, hashlib.sha256(data).digest()


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"size": 8192}, "wrong_structure"),
        ({"chunk_bytes": 16}, "bad_manifest"),
        ({"chunk_bytes": 1 << 23}, "bad_manifest"),
        ({"chunk_digests": [b"\0" * 32] * 3}, "bad_manifest"),
        ({"chunk_digests": [b"\0" * 31] * 4}, "bad_manifest"),
    ],
)
def test_hostile_manifests_are_rejected(fields, reason):
    data, digest = corrupt_manifest(**fields)
    with pytest.raises(MalformedPayloadError) as caught:
        parse_manifest(data, digest, expected_size=4096)
    assert caught.value.reason == reason


def test_a_manifest_must_match_its_digest_and_be_bounded():
    data, digest = corrupt_manifest()
    parse_manifest(data, digest, 4096)
    with pytest.raises(MalformedPayloadError, match="digest"):
        parse_manifest(data + b"\0", digest, 4096)
    huge, huge_digest = corrupt_manifest(chunk_digests=[b"\0" * 32] * 100_000)
    with pytest.raises(MalformedPayloadError) as caught:
        parse_manifest(huge, huge_digest, 4096)
    assert caught.value.reason == "too_large"


def test_restore_rejects_wrong_sizes_and_non_finite_values():
    state = tensors()
    data = StateSnapshot.capture(state, 0).data
    with pytest.raises(MalformedPayloadError, match="state bytes"):
        restore(data[:-4], state)
    poisoned = bytearray(data)
    poisoned[0:4] = torch.tensor([float("nan")]).numpy().tobytes()
    with pytest.raises(MalformedPayloadError) as caught:
        restore(bytes(poisoned), state)
    assert caught.value.reason == "non_finite"


def test_majority_counts_synced_voters_first_and_breaks_ties_by_digest():
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 32
    assert majority({}) is None and majority({b"1": (b"", False)}) is None
    assert majority({b"1": (b, False), b"2": (a, False), b"3": (b, False)}) == b
    assert majority({b"1": (b, False), b"2": (a, False)}) == a  # tie: smallest digest
    # two fresh joiners with the same initial state do not outvote the one peer in sync
    assert majority({b"1": (c, True), b"2": (a, False), b"3": (a, False)}) == c


class Sources:
    """A scripted fetch: each source serves the snapshot, lies, or fails after some requests."""

    def __init__(self, snapshot: StateSnapshot, behaviour: dict[str, str]):
        self.snapshot, self.behaviour, self.served = snapshot, behaviour, Counter()

    async def fetch(self, source: str, request) -> bytes:
        await asyncio.sleep(0)
        kind = self.behaviour[source]
        if kind == "dead" or (kind == "dies" and self.served[source] >= 3):
            raise ConnectionResetError(source)
        self.served[source] += 1
        if request.manifest:
            return self.snapshot.manifest
        piece = self.snapshot.chunk(request.chunk)
        return bytes(len(piece)) if kind == "liar" else piece


def run_download(snapshot: StateSnapshot, behaviour: dict[str, str], **kwargs):
    sources = Sources(snapshot, behaviour)
    rejected = Counter()
    result = asyncio.run(
        download(
            snapshot.digest,
            list(behaviour),
            sources.fetch,
            expected_size=len(snapshot.data),
            rejected=rejected,
            **kwargs,
        )
    )
    return result, sources, rejected


def test_download_spreads_pieces_over_sources_and_survives_liars_and_lost_sources():
    state = [torch.randn(20_000)]
    snapshot = StateSnapshot.capture(state, 5, chunk_bytes=1024)  # 79 pieces
    behaviour = {"dead": "dead", "liar": "liar", "dies": "dies", "good1": "ok", "good2": "ok"}
    (manifest, data), sources, rejected = run_download(snapshot, behaviour, parallel=3)
    assert data == snapshot.data and manifest.round == 5
    assert sources.served["good1"] > 1 and sources.served["good2"] > 1  # several sources served pieces
    assert rejected["digest_mismatch"] >= 1 and rejected["unreachable"] >= 1


def test_download_fails_cleanly_when_no_source_can_serve():
    snapshot = StateSnapshot.capture([torch.randn(3000)], 0, chunk_bytes=1024)
    with pytest.raises(StateUnavailable, match="manifest"):
        run_download(snapshot, {"a": "dead", "b": "dead"})
    with pytest.raises(StateUnavailable, match="pieces unavailable"):
        run_download(snapshot, {"a": "liar", "b": "liar"})
