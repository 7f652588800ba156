"""The checks of untrusted request fields: each returns the `Refused` that answers a malformed
request, or None. The round state machine (shoal.coordinator.rounds) runs them before an event changes
anything. A peer id's shape is the rule peers apply too (shoal.protocol.rules.is_peer_id).
"""

import math

from shoal.coordinator.actions import Refused
from shoal.coordinator.events import Report
from shoal.coordinator.state import SwarmState
from shoal.protocol.rules import is_peer_id

DIGEST_BYTES = 32
MAX_SAMPLES = 1 << 40
MAX_PAYLOAD_BYTES = 1 << 40


def check_peer_id(peer_id: str) -> Refused | None:
    if not is_peer_id(peer_id):
        return Refused("INVALID_ARGUMENT", f"peer_id {peer_id[:64]!r} is not a base58 libp2p peer id")
    return None


def check_member(state: SwarmState, peer_id: str) -> Refused | None:
    if peer_id in state.members:
        return None
    if peer_id in state.evicted:
        return Refused("NOT_FOUND", "evicted as a repeated straggler: join again once the eviction ends")
    return Refused("NOT_FOUND", "not a member of this swarm (never joined, left, or silent too long): join")


def check_progress(throughput: float, min_samples: int) -> Refused | None:
    if not (math.isfinite(throughput) and 0 <= throughput <= 1e12):
        return Refused("INVALID_ARGUMENT", f"throughput {throughput} is not a rate in samples per second")
    if not 0 <= min_samples <= MAX_SAMPLES:
        return Refused("INVALID_ARGUMENT", f"min_samples {min_samples} out of range")
    return None


def check_payload(event: Report) -> Refused | None:
    if len(event.digest) != DIGEST_BYTES or len(event.state) not in (0, DIGEST_BYTES):
        return Refused(
            "INVALID_ARGUMENT", f"digest and state must be {DIGEST_BYTES} bytes (state may be empty)"
        )
    if not 0 < event.size <= MAX_PAYLOAD_BYTES or not 0 <= event.samples <= MAX_SAMPLES:
        return Refused("INVALID_ARGUMENT", f"size {event.size} or samples {event.samples} out of range")
    return None
