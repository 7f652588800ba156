"""SwarmExchange: the Exchange of DeMo and DiLoCo over a hivemind DHT and its libp2p transport.

For round r, a participant
1. holds its serialized payload and serves it over payload channels (shoal.peer.swarm.channels:
   libp2p streams kept open between two peers, one request after another; also to one-off streams,
   for hivemind's own clients);
2. heartbeats its signed `PeerRecord` (shoal.peer.swarm.membership) and announces `(peer id, digest, size,
   samples)` under `<run>.round.<r>`, both under its public-key subkey, which only it can write
   (DHT values stay tiny: payload bytes never go through the DHT);
3. until the round's deadline, reads the announcements of compatible peers (same run configuration
   and shoal major.minor; others are refused, naming what differs) and pulls every payload it does
   not hold (shoal.peer.swarm.pull), with bounded concurrency, a timeout per call and retries with
   backoff: from the peer that announced it first, then from any other participant of the round,
   since every peer serves what it pulled (a relay that does not hold it yet answers with nothing).
   A payload is accepted only if its size and SHA-256 match the announcement; a source that sends
   other bytes is struck and not asked again for it;
4. at the deadline returns the payloads it holds, ordered by public key, so that participants
   holding the same payloads aggregate them in the same order.

Agreement: with each payload a participant announces the digest of its shared state at the start of
the round (shoal.peer.swarm.state: parameters, DiLoCo's outer momentum) and whether it was in sync last
round. At the deadline the state that weight earned by counted work holds is chosen (`state.decide`,
shoal.protocol.work: fresh identities weigh nothing); contributions computed on another state are left
out (`stale_state`), and a participant whose own state differs downloads the majority's from the
peers that hold it (several at once, 1 MiB pieces checked against a manifest,
another source taking over a lost one's pieces) and hands it to its optimizer (`Gathered.adopted`), which
loads it before applying the round. A new peer joins the same way: its first round re-syncs it. A peer
one or a few rounds behind rebuilds the majority's state instead, when that pulls fewer bytes: from a
state it still holds, by replaying the steps since with its optimizer's own transition (`replays_with`;
shoal.peer.swarm.replay), checked against the majority's digest.

Hostile peers: announcements are validated and size-capped before any download; replays, copies,
payloads that fail their announcement and contributions the optimizer drops (`reject`) are refused
and strike their sender, until a ban (shoal.peer.swarm.ledger).

Rounds are clock-synchronous: a `RoundSchedule` (start time, round length) fixes every deadline. A
participant that calls `gather` late joins the round in progress; one whose announcement comes too
late for others to pull is left out of their round. Peers that started a run at once converge on one
clock (`_follow_run_clock`).

Under a coordinator, step 2's announcement goes to it instead, and it decides the round's participants
for everyone; with butterfly averaging (`average`), steps 3-4 become a reduce-scatter and an
all-gather (shoal.peer.swarm.coordinated). Should it stop answering, the round finishes as above.

A round's stages (hold, announce or report, collect, settle, agree) run over explicit parts
(shoal.peer.swarm.stages): what it serves (`server`), its view of the run in the DHT (`directory`), what it
holds against other peers (`ledger`) and its downloads (`pull`). The uncoordinated round
(`RoundStages.uncoordinated`) and the coordinated one (`CoordinatedRounds`, shoal.peer.swarm.coordinated) are
two strategies over them, and each returns the round's `Outcome`. The rounds' clock is a `RoundClock`.

The DHT is the caller's (created before any thread: hivemind forks a process for it). This object
runs one event loop on a thread of its own for the handlers and downloads; `close()` stops it.
"""

import asyncio
import concurrent.futures
import dataclasses
import functools
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Protocol, cast

import hivemind
import torch
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.logging import get_logger

from shoal.peer.algorithms.butterfly import Pieces
from shoal.peer.algorithms.exchange import (
    Averaged,
    Contribution,
    Exchange,
    Gathered,
    Plan,
    Replay,
    mean_by_gather,
)
from shoal.peer.swarm.anchor import Anchor, public_key
from shoal.peer.swarm.channels import Channels
from shoal.peer.swarm.coordinated import CoordinatedRounds
from shoal.peer.swarm.coordinator_link import CoordinatorLink
from shoal.peer.swarm.counters import SwarmCounters
from shoal.peer.swarm.directory import RunDirectory, first_record
from shoal.peer.swarm.isolation import Isolation
from shoal.peer.swarm.ledger import Ledger
from shoal.peer.swarm.membership import PeerRecord, owner_subkey
from shoal.peer.swarm.names import final_key
from shoal.peer.swarm.pull import Puller
from shoal.peer.swarm.records import (
    Announcement,
    LedgerProgress,
    RoundClock,
    RoundPlan,
    RoundSchedule,
    RoundStatus,
    SharedLedger,
)
from shoal.peer.swarm.relay import UNCHECKED, Reachability
from shoal.peer.swarm.replay import Step
from shoal.peer.swarm.server import PayloadServer
from shoal.peer.swarm.signing import record_key
from shoal.peer.swarm.stages import Outcome, RoundLimits, RoundStages, Snapshot
from shoal.peer.swarm.state import StateSnapshot
from shoal.protocol.rules import weighed

logger = get_logger(__name__)


class Abandoned(Exception):
    """A wait on the swarm given up because the peer's stop has spent its budget, or its DHT process
    is gone: the round in flight is not finished."""


class Stop(Protocol):
    """What the exchange reads of a peer's stop (shoal.peer.train.stopping.StopRequest)."""

    @property
    def urgent(self) -> bool: ...

    def spent(self) -> bool: ...

    def remaining(self) -> float | None: ...


CALL_POLL_S = 0.25  # how often a wait on the loop thread looks at the peer's stop and its DHT process
STOP_TIMEOUT_S = 5.0  # the longest closing the exchange (its server, its P2P replica) may take
FINAL_WAIT_ROUNDS = 2  # at a run's end, peers wait this many round lengths for the others' final states


def own_plan(plan: Plan | None) -> RoundPlan | None:
    """A plan a SwarmExchange made (`plan_round`), as its own type."""
    if plan is not None and not isinstance(plan, RoundPlan):
        raise TypeError(f"a SwarmExchange takes the plans it made (RoundPlan), not {type(plan).__name__}")
    return plan


class SwarmExchange(Exchange):
    """Exchange over a hivemind swarm; see the module docstring.

    Args:
        dht: a running hivemind.DHT, with `membership.record_validators(run, identity)`.
        run: the run's name, shared by its participants; namespaces DHT keys and the handler.
        schedule: the rounds' clock.
        identity: this peer's RSA key; its records sit under the public-key subkey of the record key
            derived from it (shoal.peer.swarm.signing).
        config: the run's configuration (model, algorithm, hyperparameters); peers whose
            configuration or shoal version differ are refused, with the differing settings named.
        device: reported in this peer's record.
        max_payload_bytes: announcements of larger payloads are rejected unread.
        fetch_timeout: limit of one download attempt.
        max_concurrent_fetches: downloads in flight at once.
        poll_interval: how often announcements are re-read during a round (backing off to 4 times
            that, at most a tenth of a round, while nothing new comes).
        strike_limit, ban_rounds: a peer is ignored for `ban_rounds` after this many strikes (ledger).
        keep_states: state snapshots of the last rounds served to joining and re-syncing peers, and
            replayed from when this peer falls behind (shoal.peer.swarm.replay): with 3, a peer whose
            state parted from the swarm's two rounds ago still catches up by replay. Each is a copy
            of the shared state in memory.
        coordinator: the link to the swarm's coordinator, if it has one (see `plan_round`).
        rejoin: the initial peers, dialled again when this peer is alone in its run (directory).
        reachability: whether it can be dialed, and its relays (shoal.peer.swarm.relay).
        gather_limit: at most this many payloads count in a round, the same on every peer (`--gather`,
            shoal.protocol.rules): only those are pulled; 0: every one.
        tokens: the run's token ledger (`SharedLedger`: shoal.peer.data.ledger), kept with the shared
            state, its claims with the payloads.
        trust_key: the run key (`--trust-key`, 32 bytes): out of sync, this peer takes only the state it
            signed (shoal.peer.swarm.anchor); None: the headcount's. This peer signs the states it
            holds in sync if that key is its own, or if `starts_run` and no key is given.
        starts_run: this peer started the run (no --initial-peers): its key is the run key.
    """

    server_type: type[PayloadServer] = PayloadServer
    """What serves this peer's payloads, pieces, means and states (a hostile test peer's lies there)."""
    stages_type: type[RoundStages] = RoundStages
    """The stages of its rounds (a hostile test peer's announcement lies there)."""

    def __init__(
        self,
        dht: hivemind.DHT,
        *,
        run: str,
        schedule: RoundSchedule,
        identity: RSAPrivateKey,
        config: Mapping[str, str],
        device: str = "cpu",
        max_payload_bytes: int = 1 << 30,
        fetch_timeout: timedelta = timedelta(seconds=30),
        max_concurrent_fetches: int = 4,
        poll_interval: timedelta = timedelta(milliseconds=200),
        strike_limit: int = 3,
        ban_rounds: int = 10,
        keep_states: int = 3,
        coordinator: CoordinatorLink | None = None,
        rejoin: Sequence[str] = (),
        reachability: Reachability = UNCHECKED,
        gather_limit: int = 0,
        tokens: SharedLedger | None = None,
        trust_key: bytes | None = None,
        starts_run: bool = False,
    ):
        if gather_limit < 0:
            raise ValueError(f"gather_limit must be >= 0, got {gather_limit}")
        self.gather_limit, self.tokens = gather_limit, tokens  # tokens: kept with the shared state
        self.dht, self.run, self.coordinator = dht, run, coordinator
        self.clock = RoundClock(schedule)
        """The rounds this peer takes, on the run's clock (or its coordinator's pace)."""
        self.peer_id = dht.peer_id.to_base58()
        self.owner = owner_subkey(identity)
        self.counts = SwarmCounters()
        self.last_payload_bytes = 0
        """Size of this peer's payload in its last round."""
        self.last_round: int | None = None
        """The round of the last `gather`."""
        self.stop: Stop | None = None
        """The peer's stop, if it has one (shoal.peer.train.stopping.StopRequest): a wait on the swarm is
        abandoned once its budget is spent."""
        self._participants = [self.owner]  # whose contributions counted in the last round (the ranks)
        self._me = self.owner  # this peer's key among the participants (its peer id under a coordinator)
        # touched only on the loop thread (`record` too, by `set_progress`):
        record = first_record(self.peer_id, config, device, schedule, coordinator, reachability)
        directory = RunDirectory(
            dht, run=run, owner=self.owner, record=record, counts=self.counts, rejoin=rejoin,
            relaying=reachability.relaying,
        )  # fmt: skip
        fetch_timeout_s = fetch_timeout.total_seconds()
        server = self.server_type(
            run=run, counts=self.counts, max_payload_bytes=max_payload_bytes, keep_states=keep_states,
            timeout_s=fetch_timeout_s,
        )  # fmt: skip
        server.relays = set(reachability.relays)
        ledger = Ledger(self.owner, self.counts, strike_limit=strike_limit, ban_rounds=ban_rounds)
        limits = RoundLimits(max_payload_bytes, fetch_timeout_s, poll_interval.total_seconds(), gather_limit)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="shoal-swarm", daemon=True)
        self._thread.start()
        self.stages: RoundStages = self._call(
            self._start(server, directory, ledger, limits, max_concurrent_fetches)
        )
        """The round's stages over its parts (shoal.peer.swarm.stages)."""
        own_key = public_key(record_key(identity))
        signs = trust_key == own_key or (trust_key is None and starts_run)
        self.run_key = own_key if signs else trust_key
        """The run key this peer signs with or trusts (shoal.peer.swarm.anchor); None: none."""
        self.stages.anchor = Anchor(directory, self.counts, trust=self.run_key, signs=signs)
        self.rounds = CoordinatedRounds(self.stages, self.clock, coordinator)
        """The rounds under a coordinator (shoal.peer.swarm.coordinated)."""

    def at_genesis(self) -> None:
        """This peer's shared state is the run's initial one, drawn under its seed (no checkpoint
        resumed): in the run's round 0 it is in sync with every other peer's, by construction, and
        keeps it whatever a headcount of identities says (shoal.peer.swarm.state.decide)."""
        self.stages.standing.genesis = True

    def replays_with(self, replay: Replay) -> None:
        self.stages.transition = functools.partial(self._transition, replay)

    def _transition(
        self, replay: Replay, state: list[torch.Tensor], step: Step, payloads: list[bytes], starts: int
    ) -> list[torch.Tensor] | None:
        """A step replayed (shoal.peer.swarm.stages.Transition): the optimizer's, and the token ledger's
        on a twin of the state's, settled as the round's was (the claims that counted, less those the
        optimizer rejected)."""
        contributions = [
            Contribution(rank, payload, counted.samples, sender=counted.owner, round=step.round)
            for rank, (counted, payload) in enumerate(zip(step.counted, payloads, strict=True))
        ]
        rounds = (step.round, starts)
        if self.tokens is None:
            result = replay(state, contributions, rounds)
            return None if result is None else result[0]
        *model, view = state
        result = replay(model, contributions, rounds)
        if result is None:
            return None
        after, rejected = result
        try:
            ledger = self.tokens.twin(view)
        except ValueError:
            return None
        ledger.record_payloads(step.round, {c.sender: c.payload for c in contributions})
        for sender in rejected:
            ledger.reject(step.round, sender)
        return [*after, ledger.view_tensor(starts)]

    def counters(self) -> dict:
        """A consistent copy of the counters, for another thread (the metrics endpoint)."""
        return self.counts.snapshot(
            banned=len(self.banned), refused=len(self.refused), synced=self.synced, relayed=self.relayed,
            isolated=self.isolation.isolated, isolated_rounds=self.isolation.rounds,
        )  # fmt: skip

    @property
    def record(self) -> PeerRecord:
        """This peer's record, as last written (or about to be)."""
        return self.directory.record

    @property
    def server(self) -> PayloadServer:
        """What this peer serves (shoal.peer.swarm.server)."""
        return self.stages.server

    @property
    def directory(self) -> RunDirectory:
        """This peer's view of its run in the DHT (shoal.peer.swarm.directory)."""
        return self.stages.directory

    @property
    def ledger(self) -> Ledger:
        """Strikes, bans and replays (shoal.peer.swarm.ledger)."""
        return self.stages.ledger

    @property
    def puller(self) -> Puller:
        """Its downloads (shoal.peer.swarm.pull)."""
        return self.stages.puller

    @property
    def isolation(self) -> Isolation:
        """Whether it reaches anyone (shoal.peer.swarm.isolation)."""
        return self.stages.isolation

    @property
    def schedule(self) -> RoundSchedule:
        """The clock its rounds follow."""
        return self.clock.schedule

    @property
    def synced(self) -> bool:
        """Whether this peer held (or adopted) the majority's state in its last round."""
        return self.stages.standing.synced

    @property
    def refused(self) -> dict[str, str]:
        """Incompatible peers seen (peer id: which settings differ)."""
        return self.directory.refused

    @property
    def banned(self) -> dict[bytes, int]:
        """Banned peers and the first round they are heard again."""
        return self.ledger.banned

    @property
    def relayed(self) -> int:
        """Payloads pulled from a peer other than their author."""
        return self.puller.relayed

    @property
    def rank(self) -> int:
        return self._participants.index(self._me) if self._me in self._participants else 0

    @property
    def world_size(self) -> int:
        return len(self._participants)

    @property
    def shared(self) -> bool:
        """Whether this peer's payload of the last round counted together with another peer's: its work
        reached the swarm (not missed, late, of another state, or left out)."""
        return self._me in self._participants and len(self._participants) > 1

    def status(self) -> RoundStatus:
        """Where this peer's exchange stands after its last round (`RoundStatus`), for the job."""
        ledger = None
        if self.tokens is not None:
            ledger = LedgerProgress(*self.tokens.progress(), seq_len=self.tokens.seq_len)
        counts = self.counts
        return RoundStatus(
            round=self.last_round,
            needed=self.stages.standing.needed,
            shared=self.shared,
            late=counts.late,
            isolated=self.isolation.isolated,
            peers_seen=counts.peers_seen,
            stragglers=counts.round_stragglers,
            clocks_adopted=counts.clocks_adopted,
            resyncs=counts.resyncs,
            resync_bytes=counts.received["state"],
            replays=counts.replays,
            replay_bytes=counts.replay_bytes,
            payload_bytes=self.last_payload_bytes,
            bytes_sent=counts.bytes_sent,
            bytes_received=counts.bytes_received,
            round_seconds=self.schedule.round_seconds,
            ledger=ledger,
        )

    @property
    def coordinators_seen(self) -> dict[bytes, str]:
        """The peers of the run whose records say they follow a coordinator, and its address there."""
        return dict(self.directory.coordinators)

    @property
    def next_round(self) -> int:
        """The round the next plan, or a `gather` without one, would take if called now."""
        return self.clock.next_round

    def plan_round(self, last_round: int | None = None) -> RoundPlan | None:
        """The round the next computation is for. With a reachable coordinator: the next round it
        announces (waiting for it), with its compute budget, data seed and this peer's slot; the
        `gather` given this plan then aggregates exactly the participant set the coordinator decides.
        Otherwise: the round in progress on the clock, uncoordinated, or the next one while an
        overlapped optimizer still gathers that one; the `gather` given it joins it (or, late, the
        round in progress then). The caller passes the plan along with the round's payload.

        `last_round`: the run ends after it (`--until-round`). None once the clock, at the coordinator's
        last pace, is a round past it and no plan came: the coordinator announces no more rounds (the
        others have left), and a peer it keeps out, evicted, would otherwise wait for one forever. Not
        before the coordinator has announced a round: until then the clock is only the run's start
        time, and its first round waits for every peer it expects, however long they take to start."""
        while True:  # in slices, so that a stop (Ctrl-C) is noticed by the caller's signal handler
            plan = self._call(self.rounds.plan(wait=1.0))
            if plan is not None:
                return plan
            if (
                last_round is not None
                and self.rounds.paced
                and self.schedule.round_at(time.time()) > last_round + 1
            ):
                return None

    def gather(
        self,
        payload: bytes,
        samples: int,
        state: Sequence[torch.Tensor] | None = None,
        plan: Plan | None = None,
    ) -> Gathered:
        # no pieces: a gathered round
        return cast(Gathered, self._gather(payload, samples, state, None, own_plan(plan)))

    def average(
        self,
        payload: bytes,
        samples: int,
        state: Sequence[torch.Tensor] | None,
        pieces: Pieces,
        plan: Plan | None = None,
    ) -> Averaged:
        """A coordinated round of at least `butterfly.MIN_PARTICIPANTS` is averaged piece by piece
        (shoal.peer.algorithms.butterfly); any other round is gathered."""
        result = self._gather(payload, samples, state, pieces, own_plan(plan))
        return result if isinstance(result, Averaged) else Averaged.gathered(result)

    def _gather(
        self,
        payload: bytes,
        samples: int,
        state: Sequence[torch.Tensor] | None,
        pieces: Pieces | None,
        plan: RoundPlan | None,
    ) -> Gathered | Averaged:
        """The round `plan` names (None: the next on the clock, uncoordinated)."""
        coordinated = plan is not None and plan.coordinated
        round_number = self.clock.take(None if plan is None else plan.round, coordinated=coordinated)
        self.counts.late += plan is not None and not coordinated and round_number > plan.round  # missed
        self.last_round = round_number
        ledgered = self.tokens is not None and pieces is None and state is not None
        if ledgered:
            assert self.tokens is not None and state is not None  # `ledgered` says so
            lane = None if plan is None else plan.lane
            payload = bytes(payload) + (b"" if lane is None else lane.claim_bytes())
            state = [*state, self.tokens.view_tensor(round_number)]
        self.last_payload_bytes = len(payload)
        snapshot = None if state is None else (StateSnapshot.capture(state, round_number), list(state))
        if coordinated:
            assert plan is not None  # `coordinated` says so
            outcome = self._call(self.rounds.round(plan, bytes(payload), samples, snapshot, pieces))
        else:
            outcome = self._call(self._uncoordinated(round_number, bytes(payload), samples, snapshot))
            if self.coordinator is not None:  # once it is back, the coordinator continues after this round
                self.coordinator.progress.round = max(self.coordinator.progress.round, round_number)
        self._participants, self._me = outcome.participants, outcome.me
        adopted = outcome.adopted
        if ledgered:
            adopted = self._settle_tokens(round_number, outcome)
        if isinstance(outcome.result, Averaged):
            return dataclasses.replace(outcome.result, adopted=adopted, counted=outcome.counted)
        return Gathered(tuple(outcome.result), adopted=adopted, counted=outcome.counted, round=round_number)

    def _settle_tokens(self, round_number: int, outcome: Outcome) -> list[torch.Tensor] | None:
        """The round's claims, recorded in the token ledger; an adopted state's ledger taken, the rest
        returned for the optimizer."""
        assert self.tokens is not None  # a ledgered round's
        contributions = cast(list[Contribution], outcome.result)  # ledgered: no pieces, a gathered round
        self.tokens.record_payloads(round_number, {c.sender: c.payload for c in contributions})
        self.tokens.name(self.directory.peer_ids)
        if outcome.adopted is None:
            return None
        *adopted, view = outcome.adopted
        try:
            self.tokens.adopt_tensor(view, round_number)
        except ValueError as error:  # the majority's state is digest-checked: a bug, not an attack
            logger.error(f"the adopted state's token ledger could not be read: {error}")
        return adopted

    def compatible_peers(self, *, fully: bool = False) -> set[bytes]:
        """Public-key subkeys of the peers whose record is compatible with this one's (itself included);
        the others are in `refused`, with what differs. `fully`: read from every replica."""
        return self._call(self.directory.compatible_peers(fully=fully))

    def set_progress(
        self,
        *,
        throughput: float,
        samples: int,
        compute_throughput: float = 0.0,
        min_samples: int = 0,
        epoch: float = 0.0,
        tokens: int = 0,
    ) -> None:
        """What the next record says about this peer: samples per second, samples contributed, the
        swarm's epoch and tokens consumed as its token ledger has them; and what the heartbeats tell a
        coordinator: samples per second of computation, and the samples of this peer's smallest
        contribution to a round."""
        update = {"throughput": float(max(throughput, 0.0)), "samples": int(max(samples, 0))}
        update |= {"epoch": float(max(epoch, 0.0)), "tokens": int(max(tokens, 0))}
        self._loop.call_soon_threadsafe(functools.partial(self.directory.update_record, **update))
        if self.coordinator is not None:
            progress = self.coordinator.progress
            progress.throughput, progress.min_samples = max(compute_throughput, 0.0), max(min_samples, 0)

    def agree_final(self, last_round: int, state: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """The last step of a run that ends after `last_round` (`shoal join --until-round`): the peers
        ending it compare the states they ended on, and one that is not on the majority's takes it.

        Every round's state digests heal a split in the round after it, except in a run's last round:
        decisions each peer takes alone (a payload pulled or not by the deadline, a sender's suspicion
        history) can leave the peers on two models with no round left to repair it. Here each peer
        announces its state under `final_key`, waits until every compatible peer has (at most
        FINAL_WAIT_ROUNDS round lengths), and the majority rule of every round (`state.majority`,
        banned peers left out) picks the state; a peer of the majority that saw another state serves
        its snapshot one round length more, for the re-sync. Returns the majority's state, if this
        peer's differs and could be pulled; else None."""
        snapshot = StateSnapshot.capture(state, last_round + 1)
        return self._call(self._final(last_round, snapshot, list(state)))

    async def _final(
        self, last_round: int, snapshot: StateSnapshot, like: list[torch.Tensor]
    ) -> list[torch.Tensor] | None:
        self.server.keep_state(snapshot)  # served to a peer that re-syncs
        # announced: the state's manifest (its digest and size), no samples
        digest, size = snapshot.digest, len(snapshot.manifest)
        mine = Announcement(self.owner, self.peer_id, digest, size, 0, digest, self.synced)
        announced = await self.directory.everyone(
            final_key(self.run, last_round),
            mine,
            wait_s=FINAL_WAIT_ROUNDS * self.schedule.round_seconds,
            poll_s=self.stages.limits.poll_interval_s,
            ignored=set(self.banned),
            max_payload_bytes=self.stages.limits.max_payload_bytes,
        )
        states = {owner: (a.state, a.synced) for owner, a in announced.items()}
        agreed, earned = weighed(states, self.stages.work.weights(announced))
        if not earned and self.synced:  # a headcount of identities moves no peer in sync (`decide`)
            agreed = mine.state
        if agreed == mine.state:
            if any(a.state != agreed for a in announced.values()):
                logger.info("a peer ended the run on another state: serving ours for its re-sync")
                await asyncio.sleep(self.schedule.round_seconds)
            return None
        sources = [a.peer for owner, a in announced.items() if a.state == agreed and owner != self.owner]
        logger.warning(f"ended the run on another state than {len(sources)} peer(s): re-syncing to theirs")
        # `agreed` None (no one announced a state) is a digest no source serves: the re-sync fails
        return await self.stages.resync(cast(bytes, agreed), sources, like)

    def reject(self, contribution: Contribution, reason: str) -> None:
        """Counts and strikes what the optimizer left out: malformed, `config_mismatch`, or screened
        (`opposed`, `outlier`: shoal.peer.algorithms.robust)."""
        number = contribution.round if contribution.round >= 0 else self.last_round or 0
        self._loop.call_soon_threadsafe(self.ledger.refuse, contribution.sender, reason, number)
        if reason != "outlier":  # (an outlier is still applied: it counted)
            self._loop.call_soon_threadsafe(self.stages.work.drop, number, contribution.sender)
        if self.tokens is not None and reason != "outlier":  # an outlier is still applied
            self.tokens.reject(number, contribution.sender)

    def refuse(self, reason: str) -> None:
        self._loop.call_soon_threadsafe(self.counts.rejected.update, (reason,))

    def mean(self, tensor: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
        return mean_by_gather(self, tensor, weight, self.counts.rejected)

    def close(self, drain: timedelta = timedelta(0), *, unregister: bool = True) -> bool:
        """Removes the handlers, closes this process's P2P replica and stops the loop thread.

        `unregister` False leaves the handlers to the daemon, for a caller that shuts the DHT (and its
        libp2p daemon) down right after: each removal makes the daemon send its new protocol list to
        every connected peer (libp2p's identify push), 5 times N peers' pushes, about 0.6 kB each, for
        nothing when the daemon ends anyway.

        With `drain`, first goes on serving, for at most that long, until every other participant of
        the last round has pulled this peer's payload of it (a butterfly round: its mean, and pieces
        until none was asked for in PARTS_QUIET_S): a peer that leaves right after its last round
        would otherwise leave a slower one without it (that one's round would miss a payload and its
        parameters would differ). Returns whether all of them had it (True without drain)."""
        if not self._thread.is_alive():
            return True
        seconds = drain.total_seconds()
        left = None if self.stop is None else self.stop.remaining()
        if left is not None:  # a stop's drain ends with its budget
            seconds = min(seconds, left)
        drained = seconds <= 0
        try:
            if not drained:
                drained = self._call(self.server.drain(time.monotonic() + seconds))
        except Abandoned:
            drained = False
        try:  # closing the replica and the server: bounded even once a stop's budget is spent
            self._call(self._stop(unregister), timeout=STOP_TIMEOUT_S, abandon=False)
        except (Abandoned, TimeoutError) as error:
            logger.warning(f"the exchange did not close cleanly: {error}")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        return drained

    def __enter__(self) -> "SwarmExchange":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- on the loop thread ---

    def _call(self, coroutine, *, timeout: float | None = None, abandon: bool = True):
        """Runs `coroutine` on the loop thread and waits for its result, in slices: the wait is given up
        (the coroutine cancelled, `Abandoned` raised) once the peer's stop has spent its budget, or its
        DHT process has ended (nothing it waits on would ever come); TimeoutError past `timeout`.
        `abandon` False: only `timeout` and the DHT's end bound the wait (closing, after a stop)."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        limit = None if timeout is None else time.monotonic() + timeout
        while True:
            done, _ = concurrent.futures.wait([future], timeout=CALL_POLL_S)
            if done:
                return future.result()
            reason = None
            if abandon and self.stop is not None and self.stop.spent():
                reason = "the stop's time is spent" if not self.stop.urgent else "stopped at once"
            elif not self._dht_alive():
                reason = "the peer's DHT process has ended"
            elif limit is not None and time.monotonic() > limit:
                future.cancel()
                raise TimeoutError(f"no answer within {timeout:g} s")
            if reason is not None:
                future.cancel()
                raise Abandoned(reason)

    def _dht_alive(self) -> bool:
        alive = getattr(self.dht, "is_alive", None)  # a hivemind.DHT is a process of this one's
        try:
            return alive is None or alive()
        except AssertionError:  # not this process's child (a forked test): cannot tell, so alive
            return True

    async def _start(
        self,
        server: PayloadServer,
        directory: RunDirectory,
        ledger: Ledger,
        limits: RoundLimits,
        max_concurrent_fetches: int,
    ) -> RoundStages:
        p2p = await self.dht.replicate_p2p()
        puller = Puller(
            p2p,
            run=self.run,
            channels=Channels(p2p, server.channel_handler, limits.fetch_timeout_s),
            owner=self.owner,
            timeout_s=limits.fetch_timeout_s,
            max_concurrent=max_concurrent_fetches,
            strike=ledger.strike,
            counts=self.counts,
            relays_of=directory.relays_of,
            claims_reachable=directory.claims_reachable,
        )
        await server.start(p2p)
        # the record goes out before the first round, so that the others count this peer in their
        # data slots (and `shoal status` lists it) while it computes
        await directory.store_record(self.clock.next_round, self.clock.schedule)
        return self.stages_type(
            run=self.run, owner=self.owner, peer_id=self.peer_id, server=server, directory=directory,
            ledger=ledger, puller=puller, counts=self.counts, limits=limits,
        )  # fmt: skip

    async def _stop(self, unregister: bool) -> None:
        if self.coordinator is not None and self.coordinator.started:
            await self.coordinator.stop()
        await self.server.stop(self.puller.p2p, unregister=unregister)
        self.puller.channels.close()
        await self.puller.p2p.shutdown()

    async def _uncoordinated(self, number: int, payload: bytes, samples: int, snapshot: Snapshot) -> Outcome:
        outcome = await self.stages.uncoordinated(number, payload, samples, snapshot, self.clock.schedule)
        self._follow_run_clock()
        return outcome

    def _follow_run_clock(self) -> None:
        """From the next round, the rounds of the run's clock, if peers that started the run at the same
        moment as this one follow another (`RunDirectory.take_run_clock`); a coordinator's rule instead."""
        coordinated = self.coordinator is not None and self.coordinator.connected
        schedule = None if coordinated else self.directory.take_run_clock()
        if schedule is not None:
            self.clock.follow(schedule)
