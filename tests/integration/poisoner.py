"""`shoal join` as an attacker (run by test_hostile.py): it trains like any peer and changes only what
it sends, as SHOAL_ATTACK says:

- sign_flip, sample_lie, random: every payload rewritten by shoal.peer.bench.hostile.poison (sample_lie
  also claims 2^40 samples);
- topk: every payload with 4x the run's top-k (hostile.TOPK_FACTOR: a config_mismatch);
- unserved_and_replay: its first payload is honest and served; after that, one round in two it
  announces its payload and answers every pull of it with nothing, and the other it sends its first
  payload again with an unknown protobuf field appended (a new digest every time, the old content);
- claim_and_stale_digest: its honest payload, claiming 2^40 samples, announced with a random digest
  of the state it was computed on (issue 47: under `--gather 2` the old fan-in chose two such peers
  every round, none of whose payloads could count, and eager DiLoCo divided by a world size of 0).

    SHOAL_ATTACK=sign_flip python -m tests.integration.poisoner join ARGS...
"""

import hashlib
import os
import sys

import torch

from shoal.peer import cli
from shoal.peer.bench import hostile
from shoal.peer.swarm import exchange as exchange_module
from shoal.peer.swarm.exchange import SwarmExchange
from shoal.peer.swarm.records import Announcement
from shoal.peer.swarm.server import PayloadServer

ATTACK = os.environ["SHOAL_ATTACK"]
honest_gather = SwarmExchange.gather
generator = torch.Generator().manual_seed(7)
sent: list[bytes] = []
unserved: set[bytes] = set()  # digests announced and never served


def unknown_field(value: int) -> bytes:
    """Field 127 (not in payload.proto), varint `value` < 128."""
    return b"\xf8\x07" + bytes([value % 128])


def gather(self, payload, samples, state=None, plan=None):
    if ATTACK == "claim_and_stale_digest":
        samples = hostile.LIED_SAMPLES
    elif ATTACK == "unserved_and_replay":
        sent.append(payload)
        if len(sent) % 2 == 0:
            unserved.add(hashlib.sha256(payload).digest())
        elif len(sent) > 1:
            payload = sent[0] + unknown_field(len(sent))
    else:
        payload = hostile.poison(payload, "sign_flip" if ATTACK == "sample_lie" else ATTACK, generator)
        samples = hostile.LIED_SAMPLES if ATTACK == "sample_lie" else samples
    return honest_gather(self, payload, samples, state, plan)


class UnservingServer(PayloadServer):
    async def serve(self, request, context):
        if request.digest in unserved:
            return  # an empty answer: "I hold nothing"
        async for chunk in super().serve(request, context):
            yield chunk


def stale(owner, peer, digest, size, samples, state, synced):
    """The announcement of this peer's payload, with a random state digest."""
    state = os.urandom(len(state)) if state else state
    return Announcement(owner, peer, digest, size, samples, state, synced)


# every exchange this process builds (`shoal join`'s)
SwarmExchange.gather, SwarmExchange.server_type = gather, UnservingServer
if ATTACK == "claim_and_stale_digest":
    exchange_module.Announcement = stale

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
