"""`shoal join` as an attacker (run by test_hostile.py): it trains like any peer and changes only what
it sends, as SHOAL_ATTACK says:

sign_flip, sample_lie or random: every payload rewritten by shoal.peer.hostile.poison (sample_lie
also claims 2^40 samples).

    SHOAL_ATTACK=sign_flip python -m tests.integration.poisoner join ARGS...
"""

import os
import sys

import torch

from shoal.peer import cli, hostile
from shoal.peer.swarm import SwarmExchange

ATTACK = os.environ["SHOAL_ATTACK"]
honest_gather = SwarmExchange.gather
generator = torch.Generator().manual_seed(7)


def gather(self, payload, samples, state=None):
    payload = hostile.poison(payload, "sign_flip" if ATTACK == "sample_lie" else ATTACK, generator)
    samples = hostile.LIED_SAMPLES if ATTACK == "sample_lie" else samples
    return honest_gather(self, payload, samples, state)


SwarmExchange.gather = gather

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
