"""The stages of a SwarmExchange round (shoal.peer.swarm.exchange), over the parts a round works with.

A round is five stages:
1. hold: serve this peer's payload and state snapshot, keep its record alive (`RoundStages.hold`);
2. announce it in the DHT (`announce`), or report it to a coordinator (shoal.peer.swarm.coordinated);
3. collect the others' announcements and pull the chosen payloads until the deadline
   (shoal.peer.swarm.collect; under a coordinator, the decided set's payloads);
4. settle: the chosen payloads held, one per distinct payload (`settle`);
5. agree: the state vote, and a re-sync to the majority's state when this peer's differs (`agree`):
   by replaying the steps that led there from a state it holds, when that costs fewer bytes
   (shoal.peer.swarm.replay), or else by downloading it.

The parts are explicit: what the peer serves (`server`), its view of the run in the DHT (`directory`),
what it holds against the others (`ledger`), its downloads (`puller`), whether it reaches anyone
(`isolation`), and what one round leaves for the next (`Standing`). The uncoordinated round
(`RoundStages.uncoordinated`) and the coordinated one (`CoordinatedRounds.round`) are two strategies
over these stages, and each returns an `Outcome`: the round's result as one value.

Runs on the exchange's event loop thread.
"""

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import cast

import torch
from hivemind.utils.logging import get_logger

from shoal.peer.algorithms.exchange import Averaged, Contribution
from shoal.peer.swarm.anchor import Anchor
from shoal.peer.swarm.collect import Polls, Pulls, Reads, needed, pull_chosen, strike_unserved
from shoal.peer.swarm.counters import SwarmCounters
from shoal.peer.swarm.directory import RECORD_REFRESH_S, RunDirectory
from shoal.peer.swarm.isolation import Isolation
from shoal.peer.swarm.ledger import Ledger
from shoal.peer.swarm.names import round_key
from shoal.peer.swarm.pull import Puller, abandon
from shoal.peer.swarm.records import Announcement, RoundSchedule
from shoal.peer.swarm.replay import Counted, Step, parse_steps, plan_replay
from shoal.peer.swarm.replay import Plan as ReplayPlan
from shoal.peer.swarm.server import PayloadServer, round_pullers
from shoal.peer.swarm.state import StateSnapshot, Tally, decide, restore, state_size
from shoal.protocol import MalformedPayloadError
from shoal.protocol.rules import choose, eligible
from shoal.protocol.work import Work

Snapshot = tuple[StateSnapshot, list[torch.Tensor]] | None
"""A round's state: its digest and manifest, and the tensors (None: no state compared)."""

logger = get_logger(__name__)

CLAIM_ROUNDS = 3
"""Rounds running an announcer may claim to be in sync on another state than the one this peer holds
in sync before it is struck, each such round from then on (`RoundStages.false_claims`)."""

Transition = Callable[[list[torch.Tensor], Step, list[bytes], int], list[torch.Tensor] | None]
"""transition(state, step, the step's payloads in order, the round the result starts) -> the state
after the step, computed as the round computed it (SwarmExchange's, from its optimizer's
`Exchange.replay`); None: it cannot be replayed here."""


@dataclass(frozen=True)
class RoundLimits:
    """The settings every round's stages share (see SwarmExchange's arguments)."""

    max_payload_bytes: int
    fetch_timeout_s: float
    poll_interval_s: float
    gather_limit: int
    """At most this many payloads count in a round (`--gather`, shoal.protocol.rules); 0: every one."""


@dataclass
class Standing:
    """What one round leaves for the next."""

    synced: bool = False
    """Whether this peer held (or adopted) the majority's state in its last round."""
    members: list[bytes] = field(default_factory=list)
    """Compatible peers seen in the last round, by public key."""
    settled_s: float | None = None
    """How far into its last round every compatible peer announced (`collect`)."""
    announce_s: float = 0.0
    """How long holding and announcing this peer's payload took, last round."""
    needed: tuple[float, float] | None = None
    """What the last round's exchange needed, `collect`'s, for the compute window (shoal.peer.job.window):
    seconds to announce and be read, and of the longest pull; None: a pull was still on at the
    deadline."""
    genesis: bool = False
    """Whether this peer's state is the run's initial one, drawn under its seed, not yet exchanged: the
    same on every peer, so it is in sync if its first round is the run's round 0."""
    claims: dict[bytes, tuple[int, int]] = field(default_factory=dict)
    """Announcers that claimed, in the last round, to be in sync on another state than this peer's,
    which it held in sync: the round of that claim, and how many rounds running they did."""


@dataclass(frozen=True)
class Agreement:
    """The `agree` stage's decision."""

    counted: list[bytes]
    """The owners whose contributions count, in key order."""
    adopted: list[torch.Tensor] | None
    """The majority's state, when this peer's differed and it could be pulled."""
    agreed: bytes | None = None
    """The majority's state digest (None: states not compared)."""


@dataclass(frozen=True)
class Outcome:
    """A round's result: its contributions (or a butterfly round's means) and what else it decided."""

    result: list[Contribution] | Averaged
    participants: list[bytes]
    """The owners whose contributions count, in order (the exchange's ranks)."""
    me: bytes
    """This peer's key among them."""
    adopted: list[torch.Tensor] | None = None
    counted: bool = True
    """Whether the fan-in chose this peer's own payload."""


def _signed(task: asyncio.Future) -> None:
    """Tells why a background signature of the run key failed (the next round signs again)."""
    if not task.cancelled() and task.exception() is not None:
        logger.warning(f"the run key's signature of this round's state was not written: {task.exception()!r}")


class RoundStages:
    """The stages of a round (see the module docstring) over its parts."""

    def __init__(
        self,
        *,
        run: str,
        owner: bytes,
        peer_id: str,
        server: PayloadServer,
        directory: RunDirectory,
        ledger: Ledger,
        puller: Puller,
        counts: SwarmCounters,
        limits: RoundLimits,
    ):
        self.run, self.owner, self.peer_id = run, owner, peer_id
        self.server, self.directory, self.ledger, self.puller = server, directory, ledger, puller
        self.counts, self.limits = counts, limits
        self.isolation = Isolation()
        self.standing = Standing()
        self.transition: Transition | None = None
        """How this peer replays a step (None: it re-syncs by download only)."""
        self.anchor: Anchor | None = None
        """The run key's signatures of the shared state (shoal.peer.swarm.anchor; None: no run key)."""
        self.work = Work()
        """Each identity's counted contributions in the rounds this peer ended in sync: what its vote
        on a round's state weighs (shoal.protocol.work)."""
        self._named: set[bytes] = set()  # announcers already named in the log for a false state
        self._state = b""  # the digest of this peer's state in its current round
        self._step: Step | None = None  # the last round's step, recorded against the state it led to
        self._coordinated = False  # whether the round in progress is a coordinator's
        self._signing: asyncio.Future | None = None  # the run key's last signature, while it is written

    async def uncoordinated(
        self, number: int, payload: bytes, samples: int, snapshot: Snapshot, schedule: RoundSchedule
    ) -> Outcome:
        """A round with no coordinator: every stage, until the round's deadline on `schedule`."""
        began = time.time()
        mine = await self.hold(number, payload, samples, snapshot, schedule)
        if not self.isolation.sits_out(number):
            await self.announce(number, mine, schedule)
        self.standing.announce_s = time.time() - began
        deadline = schedule.deadline(number)
        idle = self._signing is None or self._signing.done()
        if self.anchor is not None and self.anchor.signs and self.standing.synced and self._state and idle:
            # the run key signs the state this round starts from, in the background: no round waits on
            # that DHT write (through a relay, behind NAT, it can take a while)
            self._signing = asyncio.ensure_future(self.anchor.sign(number, self._state, deadline + 60))
            self._signing.add_done_callback(_signed)
        announced, compatible = await self.collect(number, mine, deadline, schedule.round_seconds)
        self.standing.members = sorted(compatible)
        held = sum(self.server.holds(number, a.digest) for a in announced.values())
        self.counts.count_round(len(compatible | {self.owner}), held)
        return await self.settle(number, announced, mine, snapshot)

    async def hold(
        self,
        number: int,
        payload: bytes,
        samples: int,
        snapshot: Snapshot,
        schedule: RoundSchedule,
        *,
        coordinated: bool = False,
    ) -> Announcement:
        """Serves this peer's payload (and state snapshot) for the round; returns its announcement.
        Under a coordinator the record is only kept alive: it serves `shoal status` and the fallback's
        data slots, and rewriting it and an announcement every round was most of a small payload's
        wire traffic (BENCHMARKS.md)."""
        if self.standing.genesis:  # (the state of a peer whose first round is later is behind)
            self.standing.synced, self.standing.genesis = self.standing.synced or number == 0, False
        digest = self.server.hold(number, payload, None if snapshot is None else snapshot[0])
        if snapshot is not None and self._step is not None:  # (set only when it ended in sync)
            self.server.steps.record(snapshot[0].digest, self._step)
        self._step = None
        state = self._state = b"" if snapshot is None else snapshot[0].digest
        self._coordinated = coordinated  # (a coordinator admits the peers: no run key signs or is asked)
        self.ledger.new_round(number)
        self.puller.new_round(number)
        refresh_s = RECORD_REFRESH_S if coordinated else 0.0
        await self.directory.store_record(number, schedule, refresh_s=refresh_s)
        self.directory.rejoin_if_alone(1 if self.isolation.isolated else self.counts.peers_seen)
        self.ledger.announced(digest, number)
        return Announcement(
            self.owner, self.peer_id, digest, len(payload), samples, state, self.standing.synced
        )

    async def announce(self, number: int, mine: Announcement, schedule: RoundSchedule) -> None:
        """Writes this peer's announcement under the round's key, until a minute past its deadline."""
        await self.directory.store(round_key(self.run, number), mine.value(), schedule.deadline(number) + 60)

    async def collect(
        self, number: int, mine: Announcement, deadline: float, round_seconds: float
    ) -> tuple[dict[bytes, Announcement], set[bytes]]:
        """Until `deadline`, the announcements of compatible peers in the DHT and their chosen payloads
        (shoal.peer.swarm.collect: `pull_chosen` pulls them as they come). Returns (the announcements
        taken, the compatible peers)."""
        limits, standing = self.limits, self.standing
        reads = Reads(self, number, mine)
        fetches: dict[bytes, asyncio.Task] = {}
        polls = Polls(limits.poll_interval_s, round_seconds)
        pulls = Pulls(limits.gather_limit, provisional_from=time.time() + (deadline - time.time()) / 2)
        started = deadline - round_seconds
        if standing.settled_s is not None and 0 < limits.gather_limit < len(standing.members):
            # the pulls wait for every compatible peer: no read before they were all in last round
            # (`Pulls.settled_s`), where it would find some missing
            await asyncio.sleep(
                max(0.0, min(started + standing.settled_s, pulls.provisional_from) - time.time())
            )
        while True:
            waiting = not reads.compatible <= reads.announced.keys() | reads.ignored
            busy = waiting or not all(task.done() for task in fetches.values())
            idle = polls.records_read and not busy and not polls.unknown
            if idle and not polls.looks_on(len(reads.compatible), len(standing.members)):
                await asyncio.sleep(max(0.0, deadline - time.time()))
                break
            if idle:
                await asyncio.sleep(min(polls.idle_s(), max(0.0, deadline - time.time())))
                # a newcomer seen now would be too late to pull
                if deadline - time.time() < polls.longest_s:
                    await asyncio.sleep(max(0.0, deadline - time.time()))
                    break
            if polls.records_due():
                reads.compatible = await self.directory.compatible_peers(fully=polls.unknown)
                polls.read_records()
            taken, read_at = len(reads.announced), time.time()
            await reads.read(polls, idle)
            if pulls.due(reads.compatible, reads.announced.keys() | reads.ignored, read_at):
                pull_chosen(self, number, reads.announced, fetches, reads.pulled_at)
            # while pulls wait for the chosen set, a new announcement does not hasten the next read
            poll_s = polls.next_poll_s(news=polls.unknown or (len(reads.announced) > taken and pulls.started))
            remaining = deadline - time.time()
            if remaining <= 0:
                break
            await asyncio.sleep(min(poll_s, remaining))
        strike_unserved(self, reads, fetches, deadline, pulls.since)
        standing.needed = needed(self, reads, fetches, pulls.since, 2 * polls.shortest_s)
        await abandon(list(fetches.values()))
        standing.settled_s = pulls.settled_s(started, polls.shortest_s)
        return reads.announced, reads.compatible

    def chosen(self, number: int, announced: dict[bytes, Announcement]) -> dict[bytes, Announcement]:
        """The announcements whose payloads count in the round: at most `gather_limit` of them, in the
        rotation of shoal.protocol.rules among those on the majority's state, the same on every peer
        that took the same."""
        limit = self.limits.gather_limit
        candidates = self.eligible(announced) if limit else announced.keys()
        picked = choose(self.run.encode(), number, candidates, limit)
        return {owner: a for owner, a in announced.items() if owner in picked}

    def eligible(self, announced: Mapping[bytes, Announcement], *, claims: bool = True) -> list[bytes]:
        """The announcers a bounded fan-in chooses among: those on the state earned weight holds (this
        peer's own, in sync, if none backs any), less those claiming beyond belief
        (shoal.protocol.rules.eligible; `claims` False: the state alone)."""
        states = {owner: (a.state, a.synced) for owner, a in announced.items()}
        own = self._state if self.standing.synced else b""
        sizes = {owner: a.samples for owner, a in announced.items()} if claims else None
        return eligible(states, sizes, self.work.weights(announced), own)

    async def fetch(
        self, number: int, announcement: Announcement, holders: Mapping[bytes, Announcement]
    ) -> None:
        """Pulls one payload into `server.held` (shoal.peer.swarm.pull), until it is had or the round's
        task is cancelled; a payload an earlier round sent, re-encoded, is refused."""
        data = await self.puller.payload(number, announcement, holders)
        if self.ledger.replayed_content(data, number):
            self.ledger.refuse(announcement.owner, "replayed", number)
            return
        self.server.held[(number, announcement.digest)] = data

    async def settle(
        self,
        number: int,
        announced: dict[bytes, Announcement],
        mine: Announcement,
        snapshot: Snapshot,
        tally: Tally | None = None,
    ) -> Outcome:
        """The round's contributions from the chosen payloads held, in key order: one per distinct
        payload, only those computed on the majority's state (`agree`). A payload the fan-in left out
        (this peer's too) does not count, but its announcement votes on the round's state with every
        other one. With a `tally` (a coordinator that chose the round's payloads itself), `announced`
        holds only the chosen, and the tally is the vote."""
        gather_limit = self.limits.gather_limit
        voters: dict[bytes, Announcement] | Tally | None
        if tally is not None:
            voters, counted = tally, mine.owner in announced
        else:
            voters = announced if gather_limit else None
            if gather_limit:  # no slot (rules.eligible): another state, counted as in `agree`, or a
                # claim beyond belief, struck every round it is announced, chosen or not
                on_state = {*self.eligible(announced, claims=False), mine.owner}
                if stale := len(announced.keys() - on_state):
                    self.counts.rejected["stale_state"] += stale
                for owner in sorted(on_state - {*self.eligible(announced), mine.owner}):
                    self.ledger.refuse(owner, "overclaim", number)
            announced = self.chosen(number, announced)
            counted = mine.owner in announced or not gather_limit
        self.counts.left_out += not counted
        held = [owner for owner, a in announced.items() if self.server.holds(number, a.digest)]
        served = self.counts.sent["payload"] + self.counts.sent["state"]
        self.isolation.observe(len(announced.keys() - {mine.owner}), len(set(held) - {mine.owner}), served)
        agreement = await self.agree({owner: announced[owner] for owner in held}, mine, snapshot, voters)
        if agreement.agreed is not None:  # (given only when this peer ended the round in sync)
            step = tuple(
                Counted(owner, announced[owner].digest, announced[owner].samples, announced[owner].size)
                for owner in agreement.counted
            )
            self._step = Step(number, agreement.agreed, step)
        self.server.expect_pulls(*round_pullers(mine.owner, announced, voters))
        payloads = [self.server.held[(number, announced[owner].digest)] for owner in agreement.counted]
        contributions = [
            Contribution(rank, payload, announced[owner].samples, sender=owner, round=number)
            for rank, (owner, payload) in enumerate(zip(agreement.counted, payloads, strict=True))
        ]
        return Outcome(contributions, agreement.counted, mine.owner, agreement.adopted, counted)

    async def agree(
        self,
        announced: dict[bytes, Announcement],
        mine: Announcement,
        snapshot: Snapshot,
        voters: dict[bytes, Announcement] | Tally | None = None,
    ) -> Agreement:
        """Which of `announced` count, in key order: one per distinct payload, only those computed on the
        majority's state; this peer re-syncs to that state if its own differs. The majority is that of
        `voters` when given (`state.decide`)."""
        compare = snapshot is not None
        ballots = announced if voters is None else voters
        weights = None if isinstance(ballots, Tally) else self.work.weights(ballots)
        signed = unanchored = None
        anchored = self.anchor is not None and self.anchor.verifies and not self._coordinated
        if compare and anchored and not self.standing.synced:
            # nothing verified here to weigh a vote by: only the state the run key signed is taken, and
            # without one this peer keeps its own, out of sync (shoal.peer.swarm.anchor)
            assert snapshot is not None and self.anchor is not None
            signed = await self.anchor.signed(snapshot[0].round)
            unanchored = signed is None
        elif compare and anchored and any(a.state != mine.state for a in announced.values()):
            # in sync, but others hold another state: a peer whose own step came out otherwise (a young
            # record of suspicion screens otherwise than the veterans') would keep its state against
            # theirs, backed by its own record of work; the run key's signature settles it
            assert snapshot is not None and self.anchor is not None
            found = await self.anchor.signed(snapshot[0].round, quiet=True)
            signed = found if found is not None and found != mine.state else None
        anchor = mine.state if unanchored else signed
        decision = decide(
            announced, mine, compare_states=compare, voters=voters, weights=weights, anchor=anchor
        )
        adopted = None
        if decision.behind:
            assert snapshot is not None  # behind only when states are compared
            # `agreed` None (no one announced a state) is a digest no source serves: the re-sync fails
            agreed = cast(bytes, decision.agreed)
            # a coordinator admitted this round's participants: founders of a run whose initial states
            # differ (torch draws other initial weights on other kernel sets) split at round 0 for good
            # if neither could take the other's state before anyone earned a vote
            backed = (
                decision.earned
                or not self.standing.synced
                or self._coordinated
                or self.known(ballots, agreed)
            )
            if self.standing.synced:  # (a newcomer's state is on no path the others took)
                number, like = snapshot[0].round, snapshot[1]
                adopted = await self.replay(number, agreed, decision.sources, like, any_cost=not backed)
            if adopted is None and not backed:
                # no counted work backs that state, and no step this peer could check leads there: a
                # headcount of identities, which cost nothing, does not move a peer in sync off its own
                self.counts.rejected["unbacked_state"] += 1
                decision = decide(announced, mine, compare_states=compare, voters=voters, own=True)
            elif adopted is None:
                adopted = await self.resync(agreed, decision.sources, snapshot[1])
        if decision.copies:
            self.counts.rejected["duplicate"] += len(decision.copies)
        if decision.stale:
            self.counts.rejected["stale_state"] += len(decision.stale)
        if decision.compared:
            assert snapshot is not None  # compared only when there is a state
            if mine.synced and not decision.behind and not isinstance(ballots, Tally):
                self.false_claims(snapshot[0].round, ballots, cast(bytes, decision.agreed), decision.earned)
            # in sync: on the agreed state, and this round it agreed with another peer (or took that
            # state), or it was in sync already: a restarted peer alone in its first round is not
            agreeing = (
                adopted is not None
                or isinstance(ballots, Tally)
                or any(a.state == decision.agreed for o, a in ballots.items() if o != self.owner)
            )
            self.standing.synced = (
                (not decision.behind or adopted is not None) and (self.standing.synced or agreeing)
            ) and not unanchored
            if self.standing.synced and set(decision.counted) - {self.owner}:
                # what this round counted, for the votes it earns (`work`): not a round this peer
                # counted alone, which nobody else checked (two peers cut apart would each earn
                # its own vote, and then keep its own state where they meet again)
                self.work.record(snapshot[0].round, decision.counted)
        return Agreement(decision.counted, adopted, decision.agreed if self.standing.synced else None)

    def known(self, ballots: Mapping[bytes, Announcement] | Tally, state: bytes) -> bool:
        """Whether an announcer of `state` had a contribution counted in a round this peer recorded: in a
        swarm too young for earned votes, what lets a peer in sync download a headcount's state (a
        fresh identity never counted; an honest peer that parted from the others had been). Under a
        coordinator's tally, whose votes name no one: the coordinator admitted them."""
        if isinstance(ballots, Tally):
            return True
        return any(a.state == state and self.work.counted(owner) for owner, a in ballots.items())

    def false_claims(
        self, number: int, ballots: Mapping[bytes, Announcement], agreed: bytes, earned: bool
    ) -> None:
        """Strikes the announcers that claim to be in sync on another state than `agreed`, which this peer
        holds in sync, `CLAIM_ROUNDS` rounds running (counted as `false_state`, their earned vote
        forfeited): an honest peer that parted from the swarm catches up within a round or two (by
        replay, or a download; two when it misses a payload again in the round it heals), or says it
        is not in sync. While no earned vote backs `agreed` (a young swarm), only identities
        never counted here are struck: two honest peers that could not heal a split would otherwise
        ban each other."""
        claimants = {
            owner
            for owner, a in ballots.items()
            if a.synced and a.state and a.state != agreed and owner != self.owner
            and (earned or not self.work.counted(owner))
        }  # fmt: skip
        previous = self.standing.claims
        self.standing.claims = {
            owner: (
                number,
                1 + (previous[owner][1] if owner in previous and previous[owner][0] == number - 1 else 0),
            )
            for owner in claimants
        }
        for owner in sorted(claimants):
            if self.standing.claims[owner][1] < CLAIM_ROUNDS:
                continue
            self.ledger.refuse(owner, "false_state", number)
            self.work.forfeit(owner)
            if owner not in self._named and len(self._named) < 1024:  # (bounded, whatever the flood)
                self._named.add(owner)
                logger.warning(
                    f"peer {ballots[owner].peer} claims to be in sync on a state that no round this peer "
                    f"verified leads to, {CLAIM_ROUNDS} rounds running: struck"
                )

    async def replay(
        self,
        number: int,
        digest: bytes,
        sources: list[str],
        like: list[torch.Tensor],
        *,
        any_cost: bool = False,
    ) -> list[torch.Tensor] | None:
        """The majority's state `digest` of round `number`, rebuilt from a state this peer holds and
        the steps since (shoal.peer.swarm.replay), when that pulls fewer bytes than the state (or
        `any_cost`: the state may not be downloaded); None (told why, where it is news) if it cannot
        be, or must not."""
        if self.transition is None or not sources:
            return None
        counts, limits = self.counts, self.limits
        for source in sources[:2]:
            data = await self.puller.steps(digest, source)
            counts.received["replay"] += len(data)
            counts.replay_bytes += len(data)
            try:
                chain = parse_steps(data, limits.max_payload_bytes) if data else []
            except MalformedPayloadError as error:
                counts.rejected[error.reason] += 1
                continue
            plan = plan_replay(chain, self.server.states.keys(), self.server.holds)
            if plan is None:
                continue
            if plan.bytes + len(data) >= state_size(like) and not any_cost:
                logger.info(
                    f"the swarm's state is cheaper to download than {len(plan.steps)} steps to replay"
                )
                return None
            return await self._replay(number, digest, plan, sources, like)
        counts.rejected["replay_unavailable"] += 1
        logger.warning(
            "no peer keeps the steps from a state this peer holds to the swarm's: downloading the state"
        )
        return None

    async def _replay(
        self, number: int, digest: bytes, plan: ReplayPlan, sources: list[str], like: list[torch.Tensor]
    ) -> list[torch.Tensor] | None:
        counts, transition = self.counts, cast(Transition, self.transition)
        pulled = 0
        for round_number, counted in plan.missing:
            data = await self.puller.kept(round_number, counted, sources)
            if data is None:
                counts.rejected["replay_unavailable"] += 1
                logger.warning(f"a payload of round {round_number} is kept by no peer: downloading the state")
                return None
            self.server.held[(round_number, counted.digest)] = data
            pulled += len(data)
        counts.replay_bytes += pulled
        try:
            state = restore(self.server.states[plan.start].data, like)
        except (KeyError, MalformedPayloadError):  # (gone meanwhile: kept states turn over)
            return None
        for index, step in enumerate(plan.steps):
            starts = plan.steps[index + 1].round if index + 1 < len(plan.steps) else number
            payloads = [self.server.held.get((step.round, c.digest)) for c in step.counted]
            if any(p is None for p in payloads):  # dropped from `held` meanwhile
                return None
            after = await asyncio.to_thread(transition, state, step, cast(list[bytes], payloads), starts)
            if after is None:
                return None
            state = after
        if StateSnapshot.capture(state, number).digest != digest:
            counts.rejected["replay_mismatch"] += 1
            logger.warning(
                f"replaying {len(plan.steps)} step(s) did not give the swarm's state (this device may "
                "compute the shared step differently, or a peer sent false steps): downloading it"
            )
            return None
        counts.replays += 1
        counts.replayed_state_bytes += state_size(like)
        logger.info(
            f"caught up by replaying {len(plan.steps)} step(s): {pulled:,} payload bytes pulled, "
            f"where the state is {state_size(like):,}"
        )
        return state

    async def resync(self, digest: bytes, sources: list[str], like: list[torch.Tensor]) -> list | None:
        """The majority's state, pulled from `sources`; None (counted) if it could not be had."""
        adopted = await self.puller.state(digest, sources, like)
        if adopted is not None:
            self.counts.resyncs += 1
        return adopted

    async def slot(self) -> tuple[int, int]:
        """(this peer's place, count) among the compatible peers, ordered by public key, as last seen:
        its data slice in an uncoordinated round (shoal.peer.data.RoundSlices)."""
        members = self.standing.members or sorted(await self.directory.compatible_peers())
        members = sorted(set(members) | {self.owner})
        return members.index(self.owner), len(members)
