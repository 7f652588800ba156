"""`shoal join` with one lie: in butterfly rounds (shoal.peer.algorithms.butterfly) this peer serves
garbage for the mean of the piece it owns, while its cuts of its own payload stay honest (run by
test_butterfly.py).

    python -m tests.integration.butterfly_liar join ARGS...
"""

import sys

from shoal.peer import cli
from shoal.peer.swarm.exchange import SwarmExchange

honest_piece = SwarmExchange._piece


async def lying_piece(self, request, context) -> bytes:
    data = await honest_piece(self, request, context)
    return b"\xff" * len(data) if request.reduced and data else data


SwarmExchange._piece = lying_piece

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
