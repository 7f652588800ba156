"""What a peer is told when the coordinator refuses one of its calls is said in words, not as a gRPC
status code: the peers' `CoordinatorLink` against a real in-process coordinator, a peer joining while
round 0 is under way (the case every joiner meets in its first round)."""

import asyncio
import datetime
import re

import grpc
import pytest

from shoal.coordinator.metrics import REFUSAL_CODES
from shoal.coordinator.policy import Policy
from shoal.coordinator.server import Coordinator
from shoal.peer.swarm.coordinator_link import IN_WORDS, CallFailed, CoordinatorLink
from shoal.protocol import coordinator_pb2 as pb
from tests.integration.harness import wait_until

FIRST, JOINER = (f"12D3KooW{c * 44}" for c in "AB")
CODE_NAMES = re.compile("|".join(code.name for code in grpc.StatusCode))


async def wait_for_round(link: CoordinatorLink, timeout_s: float = 5.0) -> None:
    """Until `link` has heard of a round (polled off the event loop, which goes on serving it)."""
    await asyncio.to_thread(
        wait_until, lambda: link.latest is not None, timeout_s, "a round announced", interval_s=0.05
    )


@pytest.mark.timeout(30)
def test_a_joiners_first_report_and_an_unknown_round_are_told_in_words(tmp_path):
    async def scenario() -> None:
        policy = Policy(min_compute_s=5.0, heartbeat_timeout_s=5.0)
        server = Coordinator(listen="127.0.0.1:0", state_path=tmp_path / "c.db", policy=policy)
        address = f"127.0.0.1:{await server.start()}"
        first, joiner = CoordinatorLink(address, FIRST), CoordinatorLink(address, JOINER)
        try:
            await first.start()
            assert await first.wait_connected(datetime.timedelta(seconds=5))
            await wait_for_round(first)  # round 0, announced for the first peer alone
            await joiner.start()
            assert await joiner.wait_connected(datetime.timedelta(seconds=5))
            request = pb.ReportRequest(round=first.latest.round, digest=bytes(32), size=100, samples=8)
            refused = await joiner.report(request)
            assert isinstance(refused, CallFailed) and not refused.unreachable
            said = str(refused)
            assert said.startswith("the round began without this peer (joined mid-round), or is over")
            assert "joined after it was announced" in said  # the coordinator's own explanation
            unknown = await joiner.result(99, deadline=0.0)
            assert isinstance(unknown, CallFailed)
            assert str(unknown).startswith("the coordinator has not announced that round yet")
            for failed in (refused, unknown):
                assert not CODE_NAMES.search(str(failed)), str(failed)
        finally:
            await joiner.stop()
            await first.stop()
            await server.stop(grace_s=0)

    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_every_code_the_coordinator_sends_has_words():
    sent = {grpc.StatusCode[code.upper()] for code in REFUSAL_CODES} | {grpc.StatusCode.DEADLINE_EXCEEDED}
    assert sent <= IN_WORDS.keys()
    assert all(not CODE_NAMES.search(words) for words in IN_WORDS.values())
