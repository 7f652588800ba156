"""The coordinated rounds of SwarmExchange (shoal.peer.swarm): the plan of a round as the coordinator
announced it, and a round whose participant set the coordinator decides.

A peer reports its payload (digest, size, samples, state) to the coordinator instead of announcing it
in the DHT, waits for the round's decision, and pulls exactly the decided participants' payloads, so
that every participant aggregates the same set. Should the coordinator stop answering, the round is
announced in the DHT and finishes uncoordinated, and the plans fall back to the clock of its last
round. Mixed into SwarmExchange, whose state and helpers these methods use.
"""

import asyncio
import contextlib
import time
from datetime import timedelta

import grpc
import torch
from hivemind.utils.logging import get_logger

from shoal.peer.coordination import UNREACHABLE
from shoal.peer.exchange import Contribution
from shoal.peer.state import StateSnapshot
from shoal.peer.swarm_records import Announcement, RoundPlan, RoundSchedule
from shoal.protocol import MalformedPayloadError
from shoal.protocol.coordinator_pb2 import ReportReply, ReportRequest, RoundResultReply

logger = get_logger(__name__)


class CoordinatedRounds:
    """SwarmExchange's rounds under a coordinator (see the module docstring)."""

    async def _plan(self, wait: float) -> RoundPlan | None:
        """The next round's plan; None if a reachable coordinator announced none within `wait`."""
        link = self.coordinator
        if link is not None and not link.started:  # joins when ready to compute: round 0 waits for it
            await link.start()
            if not await link.wait_connected(timedelta(seconds=10)):
                logger.warning(f"coordinator {link.address} unreachable: training uncoordinated")
        if link is not None and link.connected:
            announced = await link.next_announcement(max(self._next_round, self._planned), wait)
            if announced is None and link.connected:
                return None
            if announced is not None:
                self._planned = announced.round + 1
                # should the coordinator go away, rounds go on at the pace of its last one
                length = max(announced.exchange_deadline - announced.announced_at, 0.5)
                start = announced.exchange_deadline - (announced.round + 1) * length
                self.schedule = RoundSchedule(start_time=start, round_seconds=length)
                if self.peer_id in announced.peers:
                    slot = (announced.peers.index(self.peer_id), len(announced.peers))
                else:  # not expected this round (just joined, or evicted): computes, and only applies it
                    slot = await self._slot()
                return RoundPlan(
                    round=announced.round,
                    coordinated=True,
                    compute_seconds=max(0.0, announced.compute_deadline - time.time()) * link.compute_scale,
                    data_seed=announced.data_seed,
                    slot=slot,
                    exchange_deadline=announced.exchange_deadline,
                    expected=len(announced.peers),
                )
        number = self.next_round
        if link is not None:  # busy with it uncoordinated: the coordinator, once back, continues after it
            link.progress.round = max(link.progress.round, number)
        return RoundPlan(
            round=number, coordinated=False, compute_seconds=None, data_seed=None, slot=await self._slot()
        )

    async def _coordinated_round(
        self,
        plan: RoundPlan,
        payload: bytes,
        samples: int,
        snapshot: tuple[StateSnapshot, list[torch.Tensor]] | None,
    ) -> list[Contribution]:
        """Reports the payload to the coordinator, then aggregates exactly the participant set it decides,
        pulling each payload from its author or any participant that holds it, until the round's exchange
        deadline. If the coordinator stops answering, the round finishes uncoordinated (it is announced in
        the DHT as well)."""
        link, number = self.coordinator, plan.round
        mine = await self._hold(number, payload, samples, snapshot, coordinated=True)
        request = ReportRequest(
            round=number,
            digest=mine.digest,
            size=mine.size,
            samples=samples,
            state=mine.state,
            synced=self.synced,
        )
        report = await link.report(request)
        unreachable = isinstance(report, grpc.StatusCode) and report in UNREACHABLE
        result = report if unreachable else await link.result(number, plan.exchange_deadline)
        if not isinstance(result, RoundResultReply):
            logger.warning(
                f"round {number}: no answer from the coordinator ({result.name}); going on without it"
            )
            await self._announce(number, mine)
            announced, _ = await self._collect(number, mine, plan.exchange_deadline)
            return await self._settle(number, announced, mine, snapshot)
        if isinstance(report, ReportReply) and not report.included:
            self.late += 1
        elif not isinstance(report, ReportReply):
            logger.warning(
                f"round {number}: the coordinator refused the payload ({report.name}); applying only"
            )
        started = time.time()
        me = self.peer_id.encode()
        announced: dict[bytes, Announcement] = {}
        for participant in result.participants:
            owner = participant.peer_id.encode()
            value = {
                "peer": participant.peer_id,
                "digest": participant.digest,
                "size": participant.size,
                "samples": participant.samples,
                "state": participant.state,
                "synced": participant.synced,
            }
            try:
                announced[owner] = Announcement.parse(owner, value, self.max_payload_bytes)
            except MalformedPayloadError as error:  # every peer drops it alike: the set stays the same
                self.rejected[error.reason] += 1
        fetches = [
            asyncio.create_task(self._fetch(number, a, announced))
            for a in pull_order(list(announced.values()), me)
            if (number, a.digest) not in self._held
        ]
        if fetches:
            _, pending = await asyncio.wait(fetches, timeout=max(0.0, plan.exchange_deadline - time.time()))
            for task in pending:
                task.cancel()
            self.rejected["missing"] += len(pending)
            await asyncio.gather(*fetches, return_exceptions=True)
        self.coordinated_rounds += 1
        self._count_stragglers(max(plan.expected, len(result.participants)), len(result.participants))
        mine = Announcement(me, mine.peer, mine.digest, mine.size, mine.samples, mine.state, mine.synced)
        contributions = await self._settle(number, announced, mine, snapshot)
        link.progress.round, link.progress.exchange_s = number, time.time() - started
        with contextlib.suppress(grpc.aio.AioRpcError):
            await link.heartbeat()  # finished: the coordinator may start the next round
        return contributions


def pull_order(participants: list[Announcement], me: bytes) -> list[Announcement]:
    """The decided participants, starting after this peer in the coordinator's order (every peer sees
    the same): when pulls run one or a few at a time, each peer's upload then serves one puller at
    a time instead of every puller starting with the first participant."""
    owners = [a.owner for a in participants]
    start = owners.index(me) + 1 if me in owners else 0
    return participants[start:] + participants[:start]
