"""The coordinated rounds of SwarmExchange (shoal.peer.swarm.exchange): the plan of a round as the coordinator
announced it, and a round whose participant set the coordinator decides.

A peer reports its payload (digest, size, samples, state) to the coordinator instead of announcing it
in the DHT, waits for the round's decision, and pulls exactly the decided participants' payloads, so
that every participant aggregates the same set. Should the coordinator stop answering, the round is
announced in the DHT and finishes uncoordinated, and the plans fall back to the clock of its last
round. A strategy over a round's stages (shoal.peer.swarm.stages), as the uncoordinated round is: it
returns the round's `Outcome`.

Butterfly averaging (`average`, DiLoCo's dense pseudo-gradients, shoal.peer.algorithms.butterfly): in a
coordinated round of at least `butterfly.MIN_PARTICIPANTS`, pulling every payload becomes a reduce-
scatter and an all-gather. The participants that count (the exchange's state agreement, decided before
any byte moves: the coordinator's set and the states it announced) each own one piece; an owner pulls
its piece of every payload from its author (`PayloadRequest.shards`), averages it (clipped, sample-
weighted) and serves the mean (`reduced`); every participant then pulls the other means. Pieces carry no
digest: the puller validates shape and values, and a malformed one strikes its sender. A mean that is
malformed or not there by the deadline is averaged by the puller itself from the pieces of the payloads.
An owner that serves a well-formed but false mean is not caught (as in any butterfly all-reduce): if it
tells every peer the same it skews that piece for all, if not the state check of the next round finds
the split and re-syncs the minority. Runs that cannot trust their peers keep the gather (`--averaging
gather`, the default), where every peer clips every contribution itself.
"""

import asyncio
import contextlib
import dataclasses
import time
from collections import Counter
from datetime import timedelta

import grpc
import torch
from hivemind.utils.logging import get_logger

from shoal.peer.algorithms.butterfly import MIN_PARTICIPANTS, Part, Pieces
from shoal.peer.algorithms.exchange import Averaged
from shoal.peer.swarm.coordinator_link import AnnouncedRound, CallFailed, CoordinatorError, CoordinatorLink
from shoal.peer.swarm.pull import abandon
from shoal.peer.swarm.records import (
    DIGEST_BYTES,
    Announcement,
    RoundClock,
    RoundPlan,
    RoundSchedule,
    is_peer_id,
)
from shoal.peer.swarm.stages import Outcome, RoundStages, Snapshot
from shoal.peer.swarm.state import Tally
from shoal.protocol import MalformedPayloadError
from shoal.protocol.coordinator_pb2 import ReportReply, ReportRequest, RoundResultReply
from shoal.protocol.rules import TALLY_HOLDERS
from shoal.protocol.swarm_pb2 import PayloadRequest

logger = get_logger(__name__)


class CoordinatedRounds:
    """A SwarmExchange's rounds under a coordinator (see the module docstring): `plan` and `round`, a
    strategy over the round's stages (shoal.peer.swarm.stages).

    It holds only its own state (the round after the last coordinated plan) and works over the
    stages, the exchange's round clock (whose pace it sets while a coordinator announces rounds) and
    the coordinator's link.
    """

    def __init__(self, stages: RoundStages, clock: RoundClock, link: CoordinatorLink | None):
        self.stages, self.clock, self.link = stages, clock, link
        self._planned = 0  # the round after the last coordinated plan

    @property
    def paced(self) -> bool:
        """Whether the clock keeps a coordinator's pace: it has announced a round to this peer."""
        return self._planned > 0

    async def plan(self, wait: float) -> RoundPlan | None:
        """The next round's plan; None if a reachable coordinator announced none within `wait`."""
        link = self.link
        if link is not None and not link.started:  # joins when ready to compute: round 0 waits for it
            await link.start()
            if not await link.wait_connected(timedelta(seconds=10)) and link.refusal is None:
                logger.warning(f"coordinator {link.address} unreachable: training uncoordinated")
        if link is not None and link.refusal is not None:
            raise CoordinatorError(link.refusal)
        if link is not None and link.connected:
            announced = await link.next_announcement(max(self.clock.untaken, self._planned), wait)
            if announced is None and link.connected:
                return None
            if announced is not None:
                return await self._coordinated_plan(announced, link.compute_scale)
        # the gather joins it, unless the computation runs past its deadline
        number = self.clock.take(None)
        if link is not None:  # busy with it uncoordinated: the coordinator, once back, continues after it
            link.progress.round = max(link.progress.round, number)
        slot = await self.stages.slot()
        return RoundPlan(round=number, coordinated=False, compute_seconds=None, data_seed=None, slot=slot)

    async def _coordinated_plan(self, announced: AnnouncedRound, compute_scale: float) -> RoundPlan:
        self._planned = announced.round + 1
        # should the coordinator go away, rounds go on at the pace of its last one
        length = max(announced.exchange_deadline - announced.announced_at, 0.5)
        start = announced.exchange_deadline - (announced.round + 1) * length
        self.clock.pace(RoundSchedule(start_time=start, round_seconds=length))
        peer_id = self.stages.peer_id
        if peer_id in announced.peers:
            slot = (announced.peers.index(peer_id), len(announced.peers))
        else:  # not expected this round (just joined, or evicted): computes, and only applies it
            slot = await self.stages.slot()
        return RoundPlan(
            round=announced.round,
            coordinated=True,
            compute_seconds=max(0.0, announced.compute_deadline - time.time()) * compute_scale,
            data_seed=announced.data_seed,
            slot=slot,
            exchange_deadline=announced.exchange_deadline,
            expected=len(announced.peers),
        )

    async def round(
        self, plan: RoundPlan, payload: bytes, samples: int, snapshot: Snapshot, pieces: Pieces | None = None
    ) -> Outcome:
        """Reports the payload to the coordinator, then aggregates exactly the participant set it decides,
        pulling each payload from its author or any participant that holds it, until the round's exchange
        deadline; with `pieces` and enough participants, averages it piece by piece instead (`_butterfly`).
        If the coordinator stops answering, the round finishes uncoordinated (it is announced in the DHT as
        well)."""
        stages, link, number = self.stages, self.link, plan.round
        mine = await stages.hold(number, payload, samples, snapshot, self.clock.schedule, coordinated=True)
        if pieces is not None:  # owners may ask for their piece as soon as the round is decided
            stages.server.cuttable_from(number, mine.digest)
        report, result = await self._report(number, mine, plan.exchange_deadline)
        if not isinstance(result, RoundResultReply):
            logger.warning(
                f"round {number}: no participant set from the coordinator ({result}); finishing the round "
                "with the payloads announced in the DHT"
            )
            await stages.announce(number, mine, self.clock.schedule)
            announced, _ = await stages.collect(
                number, mine, plan.exchange_deadline, self.clock.schedule.round_seconds
            )
            return await stages.settle(number, announced, mine, snapshot)
        if isinstance(report, ReportReply) and not report.included:
            stages.counts.late += not stages.isolation.sits_out(number)
        elif not isinstance(report, ReportReply):
            logger.warning(
                f"round {number}: the coordinator left this peer's payload out ({report}); applying the "
                "others' update, and taking part from a later round"
            )
        started = time.time()
        announced = decided(result, stages.limits.max_payload_bytes, stages.counts.rejected)
        tally = tally_of(result)
        reported = result.reported if tally is not None else len(result.participants)
        mine = dataclasses.replace(mine, owner=stages.peer_id.encode())
        if pieces is not None and len(announced) >= MIN_PARTICIPANTS:
            outcome = await self._butterfly(
                number, plan.exchange_deadline, announced, mine, snapshot, pieces, tally
            )
            exchange_s = time.time() - started
        else:
            outcome, exchange_s = await self._gather(
                number, plan.exchange_deadline, announced, mine, snapshot, tally, reported
            )
        stages.counts.coordinated_rounds += 1
        stages.counts.count_round(max(plan.expected, reported), reported)
        assert link is not None  # a coordinated plan comes from the link (`plan`), which `_report` called
        link.progress.round, link.progress.exchange_s = number, exchange_s
        with contextlib.suppress(grpc.aio.AioRpcError):
            await link.heartbeat()  # finished: the coordinator may start the next round
        return outcome

    async def _report(
        self, number: int, mine: Announcement, deadline: float
    ) -> tuple[ReportReply | CallFailed, RoundResultReply | CallFailed]:
        """Reports this peer's payload (unless it sits out: nobody could pull it, and the others would
        only wait for it), then waits for the round's result until `deadline`."""
        request = ReportRequest(
            round=number, digest=mine.digest, size=mine.size, samples=mine.samples, state=mine.state,
            synced=self.stages.standing.synced,
        )  # fmt: skip
        assert self.link is not None  # a coordinated plan comes from the link (`plan`)
        report: ReportReply | CallFailed
        if self.stages.isolation.sits_out(number):
            report = ReportReply(included=False)
        else:
            report = await self.link.report(request)
        unreachable = isinstance(report, CallFailed) and report.unreachable
        result = report if unreachable else await self.link.result(number, deadline)
        return report, result

    async def _gather(
        self,
        number: int,
        deadline: float,
        announced: dict[bytes, Announcement],
        mine: Announcement,
        snapshot: Snapshot,
        tally: Tally | None,
        reported: int,
    ) -> tuple[Outcome, float]:
        """Pulls every decided payload this peer lacks (with `--gather`: the chosen ones, the same on every
        peer; with a `tally`, the coordinator chose them) until `deadline` and settles the round; returns
        its outcome and the exchange time to report (`measured_exchange`)."""
        stages = self.stages
        started = time.time()
        chosen = announced if tally is not None else stages.chosen(number, announced)
        fetches = {
            asyncio.create_task(stages.fetch(number, a, announced)): a.digest
            for a in pull_order(list(chosen.values()), mine.owner)
            if not stages.server.holds(number, a.digest)
        }
        finished = [started]
        for fetch in fetches:
            fetch.add_done_callback(lambda _task: finished.append(time.time()))
        pending: set[asyncio.Task[None]] = set()
        if fetches:
            _, pending = await asyncio.wait(fetches, timeout=max(0.0, deadline - time.time()))
            stages.counts.rejected["missing"] += len(pending)
        slow = stages.puller.transferring([fetches[task] for task in pending])
        exchange_s = measured_exchange(started, time.time(), max(finished), bool(pending), slow)
        await abandon(list(fetches))
        settling = time.time()
        outcome = await stages.settle(number, announced, mine, snapshot, tally)
        exchange_s += time.time() - settling
        sent = mine.size * (reported - 1) if mine.owner in chosen else 0
        stages.counts.codec_bytes_sent += sent
        return outcome, exchange_s

    async def _butterfly(
        self,
        number: int,
        deadline: float,
        announced: dict[bytes, Announcement],
        mine: Announcement,
        snapshot: Snapshot,
        pieces: Pieces,
        tally: Tally | None,
    ) -> Outcome:
        """Averages the decided round piece by piece (shoal.peer.algorithms.butterfly): the participants whose
        contributions count (`agree`, the same list on every peer) own one piece each, in their order.
        This peer, if it owns piece i, pulls piece i of every other one's payload from its author and
        serves their mean (`_own_piece`); then it pulls every other owner's mean. A mean that has not
        come by the deadline is averaged here from its parts (`_recompute`), so a lost owner costs time,
        not the piece."""
        stages = self.stages
        agreement = await stages.agree(announced, mine, snapshot, tally)
        owners = agreement.counted
        count = len(owners)
        index = owners.index(mine.owner) if mine.owner in owners else None
        cuts = stages.server.cut(number, count) or []  # ready before the owners ask
        stages.server.averaging(number)
        slices: dict[int, list[torch.Tensor]] = {}
        clipped = 0
        if index is not None:
            slices[index], clipped = await self._own_piece(
                number, index, owners, announced, mine, cuts, pieces, deadline
            )
        order = [(index + step) % count for step in range(1, count)] if index is not None else range(count)
        pulls = {
            k: asyncio.create_task(self._owner_mean(number, k, count, announced[owners[k]], pieces))
            for k in order
        }
        if pulls:
            await asyncio.wait(pulls.values(), timeout=max(0.0, deadline - time.time()))
        for k, task in pulls.items():
            if task.done() and not task.cancelled() and task.exception() is None:
                slices[k] = task.result()
        await abandon(list(pulls.values()))
        for k in range(count):
            if k not in slices:  # its owner's mean did not come: average it here
                stages.counts.pieces_recomputed += 1
                mean = await self._recompute(number, k, count, owners, announced, mine, pieces)
                slices[k] = mean.tensors
        stages.counts.butterfly_rounds += 1
        averaged = Averaged(
            pieces=[slices[k] for k in range(count)],
            samples=sum(announced[o].samples for o in owners),
            clipped=clipped,
        )
        return Outcome(averaged, owners, mine.owner, agreement.adopted, counted=mine.owner in announced)

    async def _own_piece(
        self,
        number: int,
        index: int,
        owners: list[bytes],
        announced: dict[bytes, Announcement],
        mine: Announcement,
        cuts: list[bytes],
        pieces: Pieces,
        deadline: float,
    ) -> tuple[list[torch.Tensor], int]:
        """The mean of piece `index`, which this peer owns, from every owner's part of it: served to
        the others. Returns its tensors and how many parts were clipped."""
        stages, count = self.stages, len(owners)
        others = [a for a in pull_order([announced[o] for o in owners], mine.owner) if a.owner != mine.owner]
        parts = await self._parts(number, index, count, others, deadline, pieces)
        stages.counts.codec_bytes_sent += sum(len(piece) for k, piece in enumerate(cuts) if k != index)
        parts.append(Part(mine.owner, mine.samples, cuts[index]))
        parts.sort(key=lambda part: owners.index(part.sender))
        mean = await asyncio.to_thread(pieces.mean, index, count, parts, feedback=True)
        for sender, reason in mean.rejected:
            stages.ledger.refuse(sender, reason, number)
        pullers = {a.peer for o, a in announced.items() if o != mine.owner}
        stages.server.publish_mean(number, index, mean.data, pullers)
        stages.counts.codec_bytes_sent += len(mean.data) * (len(announced) - 1)
        return mean.tensors, mean.clipped

    async def _parts(
        self,
        number: int,
        index: int,
        count: int,
        authors: list[Announcement],
        deadline: float,
        pieces: Pieces,
    ) -> list[Part]:
        """Piece `index` of each author's payload, from the author, until `deadline` (rotation order,
        as `pull_order`, so that an author serves one owner at a time)."""

        async def pull(author: Announcement) -> Part:
            request = PayloadRequest(round=number, digest=author.digest, shard=index, shards=count)
            data = await self.stages.puller.piece(author.peer, request, pieces.max_bytes(index, count))
            return Part(author.owner, author.samples, data)

        tasks = [asyncio.create_task(pull(a)) for a in authors]
        if tasks:
            await asyncio.wait(tasks, timeout=max(0.0, deadline - time.time()))
        parts = []
        for author, task in zip(authors, tasks, strict=True):
            if task.done() and not task.cancelled() and task.exception() is None:
                parts.append(task.result())
                continue
            error = None if not task.done() or task.cancelled() else task.exception()
            if isinstance(error, MalformedPayloadError):
                self.stages.ledger.refuse(author.owner, error.reason, number)
            else:
                self.stages.counts.rejected["missing"] += 1
        await abandon(tasks)
        return parts

    async def _owner_mean(
        self, number: int, index: int, count: int, owner: Announcement, pieces: Pieces
    ) -> list[torch.Tensor]:
        """Owner `index`'s mean of its piece, decoded; a malformed one strikes the owner and is averaged
        here instead (raises)."""
        request = PayloadRequest(round=number, digest=owner.digest, shard=index, shards=count, reduced=True)
        limit = pieces.max_bytes(index, count)
        data = await self.stages.puller.piece(owner.peer, request, limit, observe=False)
        try:
            return await asyncio.to_thread(pieces.decode, index, count, data)
        except MalformedPayloadError as error:
            self.stages.ledger.refuse(owner.owner, error.reason, number)
            raise

    async def _recompute(
        self,
        number: int,
        index: int,
        count: int,
        owners: list[bytes],
        announced: dict[bytes, Announcement],
        mine: Announcement,
        pieces: Pieces,
    ):
        """Piece `index`'s mean, averaged here from the parts that come within the fetch timeout (the
        owner's mean did not come)."""
        authors = [announced[o] for o in owners if o != mine.owner]
        deadline = time.time() + self.stages.limits.fetch_timeout_s
        parts = await self._parts(number, index, count, authors, deadline, pieces)
        if mine.owner in owners and (cuts := self.stages.server.cut(number, count)) is not None:
            parts.append(Part(mine.owner, mine.samples, cuts[index]))
        parts.sort(key=lambda part: owners.index(part.sender))
        return await asyncio.to_thread(pieces.mean, index, count, parts)


def pull_order(participants: list[Announcement], me: bytes) -> list[Announcement]:
    """The decided participants, starting after this peer in the coordinator's order (every peer sees
    the same): when pulls run one or a few at a time, each peer's upload then serves one puller at
    a time instead of every puller starting with the first participant."""
    owners = [a.owner for a in participants]
    start = owners.index(me) + 1 if me in owners else 0
    return participants[start:] + participants[:start]


def decided(result: RoundResultReply, max_bytes: int, rejected: Counter[str]) -> dict[bytes, Announcement]:
    """The participants the coordinator decided, as announcements by owner (their peer id). One that
    breaks the limits is dropped and counted in `rejected`: every peer drops it alike, so the set stays
    the same everywhere."""
    announced: dict[bytes, Announcement] = {}
    for participant in result.participants:
        owner = participant.peer_id.encode()
        value = [
            participant.digest,
            participant.size,
            participant.samples,
            participant.state,
            participant.synced,
        ]
        try:
            announced[owner] = Announcement.parse(owner, value, max_bytes, participant.peer_id)
        except MalformedPayloadError as error:
            rejected[error.reason] += 1
    return announced


def tally_of(result: RoundResultReply) -> Tally | None:
    """The state vote of a round whose payloads the coordinator chose (its `--gather`): every
    participant's state, counted; None when the result lists every participant (the vote is theirs).
    A vote whose state is not a digest, and a holder that is not a peer id, are left out."""
    if not result.votes:
        return None
    votes: Counter[tuple[bytes, bool]] = Counter()
    holders: dict[bytes, tuple[str, ...]] = {}
    for vote in result.votes:
        if len(vote.state) not in (0, DIGEST_BYTES):
            continue
        votes[(vote.state, vote.synced)] += vote.count
        named = tuple(peer for peer in vote.holders[:TALLY_HOLDERS] if is_peer_id(peer))
        holders[vote.state] = (*holders.get(vote.state, ()), *named)
    return Tally(votes, holders)


def measured_exchange(started: float, now: float, last_pulled: float, missing: bool, slow: bool) -> float:
    """The exchange time a peer reports to the coordinator, whose exchange window follows the members'
    recent ones (shoal.coordinator.policy.exchange_window, times its headroom). All pulled: the time it
    took. Some payloads missing at the deadline while their bytes were still coming (`slow`): the whole
    wait, so that the window grows until they fit. Missing because every source failed (a peer nobody
    can reach, a relay gone): only the time until the last payload it did get, 0 (no measurement) if none,
    so that payloads that never arrive do not stretch every round by the headroom, up to the
    coordinator's longest window."""
    if not missing or slow:
        return now - started
    return last_pulled - started
