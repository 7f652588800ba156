"""`shoal join` with one lie: in butterfly rounds (shoal.peer.algorithms.butterfly) this peer serves
garbage for the mean of the piece it owns, while its cuts of its own payload stay honest (run by
test_butterfly.py).

    python -m tests.integration.butterfly_liar join ARGS...
"""

import sys

from shoal.peer import cli
from shoal.peer.swarm.exchange import SwarmExchange
from shoal.peer.swarm.server import PayloadServer


class LyingServer(PayloadServer):
    async def piece(self, request, context) -> bytes:
        data = await super().piece(request, context)
        return b"\xff" * len(data) if request.reduced and data else data


SwarmExchange.server_type = LyingServer  # every exchange this process builds (`shoal join`'s)

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
