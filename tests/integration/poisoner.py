"""`shoal join` as an attacker (run by test_hostile.py): it trains like any peer and changes only what
it sends, as SHOAL_ATTACK says:

- sign_flip, sample_lie, random: every payload rewritten by shoal.peer.hostile.poison (sample_lie
  also claims 2^40 samples);
- unserved_then_replay: for its first rounds it announces payloads and never serves them, then it
  sends its first payload again with one unknown protobuf field appended (a new digest, the same
  content).

    SHOAL_ATTACK=sign_flip python -m tests.integration.poisoner join ARGS...
"""

import os
import sys

import torch

from shoal.peer import cli, hostile
from shoal.peer.swarm import SwarmExchange

ATTACK = os.environ["SHOAL_ATTACK"]
UNSERVED_ROUNDS = 5
UNKNOWN_FIELD = b"\xf8\x07\x01"  # field 127, varint 1: not in payload.proto
honest_gather, honest_serve = SwarmExchange.gather, SwarmExchange._serve
generator = torch.Generator().manual_seed(7)
sent: list[bytes] = []


def gather(self, payload, samples, state=None):
    sent.append(payload)
    if ATTACK == "unserved_then_replay":
        if len(sent) > UNSERVED_ROUNDS:
            payload = sent[0] + UNKNOWN_FIELD
    else:
        payload = hostile.poison(payload, "sign_flip" if ATTACK == "sample_lie" else ATTACK, generator)
        samples = hostile.LIED_SAMPLES if ATTACK == "sample_lie" else samples
    return honest_gather(self, payload, samples, state)


async def serve(self, request, context):
    if ATTACK == "unserved_then_replay" and len(sent) <= UNSERVED_ROUNDS:
        return  # an empty answer: "I hold nothing"
    async for chunk in honest_serve(self, request, context):
        yield chunk


SwarmExchange.gather, SwarmExchange._serve = gather, serve

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
