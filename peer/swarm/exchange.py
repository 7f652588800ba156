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
round. At the deadline the majority state is chosen (`state.majority`); contributions computed on
another state are left out (`stale_state`), and a participant whose own state differs downloads the
majority's from the peers that hold it (several at once, 1 MiB pieces checked against a manifest,
another source taking over a lost one's pieces) and hands it to its optimizer (`Gathered.adopted`), which
loads it before applying the round. A new peer joins the same way: its first round re-syncs it.

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

Its parts, in shoal.peer.swarm: what it serves (`server`), its view of the run in the DHT (`directory`),
what it holds against other peers (`ledger`), its downloads (pull), the reads of an uncoordinated round
(`collect`) and coordinated rounds (`rounds`).

The DHT is the caller's (created before any thread: hivemind forks a process for it). This object
runs one event loop on a thread of its own for the handlers and downloads; `close()` stops it.
"""

import asyncio
import dataclasses
import functools
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta

import hivemind
import torch
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.logging import get_logger

from shoal.peer.algorithms.butterfly import Pieces
from shoal.peer.algorithms.exchange import Averaged, Contribution, Exchange, Gathered, mean_by_gather
from shoal.peer.swarm.channels import Channels
from shoal.peer.swarm.collect import collect
from shoal.peer.swarm.coordinated import CoordinatedRounds
from shoal.peer.swarm.coordinator_link import CoordinatorLink
from shoal.peer.swarm.counters import SwarmCounters
from shoal.peer.swarm.directory import RECORD_REFRESH_S, RunDirectory, first_record
from shoal.peer.swarm.isolation import Isolation
from shoal.peer.swarm.ledger import Ledger
from shoal.peer.swarm.membership import PeerRecord, owner_subkey
from shoal.peer.swarm.names import final_key, round_key
from shoal.peer.swarm.pull import Puller
from shoal.peer.swarm.records import Announcement, RoundPlan, RoundSchedule
from shoal.peer.swarm.relay import UNCHECKED, Reachability
from shoal.peer.swarm.server import PayloadServer, round_pullers
from shoal.peer.swarm.state import (
    StateSnapshot,
    Tally,
    decide,
    majority,
)
from shoal.protocol.rules import choose

logger = get_logger(__name__)

FINAL_WAIT_ROUNDS = 2  # at a run's end, peers wait this many round lengths for the others' final states


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
        keep_states: state snapshots of the last rounds served to joining and re-syncing peers.
        coordinator: the link to the swarm's coordinator, if it has one (see `plan_round`).
        rejoin: the initial peers, dialled again when this peer is alone in its run (directory).
        reachability: whether it can be dialed, and its relays (shoal.peer.swarm.relay).
        gather_limit: at most this many payloads count in a round, the same on every peer (`--gather`,
            shoal.protocol.rules): only those are pulled; 0: every one.
    """

    server_type: type[PayloadServer] = PayloadServer
    """What serves this peer's payloads, pieces, means and states (a hostile test peer's lies there)."""

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
        keep_states: int = 2,
        coordinator: CoordinatorLink | None = None,
        rejoin: Sequence[str] = (),
        reachability: Reachability = UNCHECKED,
        gather_limit: int = 0,
    ):
        if gather_limit < 0:
            raise ValueError(f"gather_limit must be >= 0, got {gather_limit}")
        self.gather_limit = gather_limit
        self.dht = dht
        self.run = run
        self.schedule = schedule
        self.max_payload_bytes = max_payload_bytes
        self.fetch_timeout_s = fetch_timeout.total_seconds()
        self.poll_interval_s = poll_interval.total_seconds()
        self.settled_s: float | None = None  # how far into its last round every compatible peer announced
        self.peer_id = dht.peer_id.to_base58()
        self.owner = owner_subkey(identity)
        self.counts = SwarmCounters()
        self.synced = False
        """Whether this peer held (or adopted) the majority's state in its last round."""
        self.last_payload_bytes = 0
        """Size of this peer's payload in its last round."""
        self.last_round: int | None = None
        """The round of the last `gather`."""
        self.coordinator = coordinator
        # touched only on the loop thread (`record` too, by `set_progress`):
        self.directory = RunDirectory(
            dht,
            run=run,
            owner=self.owner,
            record=first_record(self.peer_id, config, device, schedule, coordinator, reachability),
            counts=self.counts,
            rejoin=rejoin,
            relaying=reachability.relaying,
        )
        """This peer's view of its run in the DHT (shoal.peer.swarm.directory)."""
        self.ledger = Ledger(self.owner, self.counts, strike_limit=strike_limit, ban_rounds=ban_rounds)
        """Strikes, bans and replays (shoal.peer.swarm.ledger)."""
        self.isolation = Isolation()  # whether it reaches anyone (shoal.peer.swarm.isolation)
        self.server = self.server_type(
            run=run,
            counts=self.counts,
            max_payload_bytes=max_payload_bytes,
            keep_states=keep_states,
            timeout_s=self.fetch_timeout_s,
        )
        """What this peer serves (shoal.peer.swarm.server)."""
        self.server.relays = set(reachability.relays)
        self._adopted: list[torch.Tensor] | None = None
        self._own_counted = True  # whether the fan-in chose this peer's payload in its last round
        self._next_round = 0  # rounds before it are taken by a plan or a gather (`_take_round`)
        self._rounds_lock = threading.Lock()
        self.rounds = CoordinatedRounds(self)
        """The rounds under a coordinator (shoal.peer.swarm.coordinated)."""
        self._participants = [self.owner]
        self._me = self.owner  # this peer's key among the participants (its peer id under a coordinator)
        self._members: list[bytes] = []  # compatible peers seen in the last round, by public key
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="shoal-swarm", daemon=True)
        self._thread.start()
        self._p2p = self._call(self._start(max_concurrent_fetches))

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
        return self._puller.relayed

    @property
    def rank(self) -> int:
        return self._participants.index(self._me) if self._me in self._participants else 0

    @property
    def world_size(self) -> int:
        return len(self._participants)

    @property
    def next_round(self) -> int:
        """The round the next plan, or a `gather` without one, would take if called now."""
        return max(self._next_round, self.schedule.round_at(time.time()))

    def _take_round(self, planned: int | None, *, coordinated: bool = False) -> int:
        """Takes a round for a computation: the coordinator's `planned` one; uncoordinated, `planned` (None:
        the next round not taken) or, if the clock is past it, the round in progress (a late peer joins
        it). No later plan or gather takes it or an earlier one. The training thread plans while an
        overlapped optimizer gathers on its own thread: the lock keeps either from undoing the other's
        step, which would plan one round twice."""
        with self._rounds_lock:
            round_number = self._next_round if planned is None else planned
            if not coordinated:
                round_number = max(round_number, self.schedule.round_at(time.time()))
            self._next_round = max(self._next_round, round_number + 1)
            return round_number

    def plan_round(self, last_round: int | None = None) -> RoundPlan | None:
        """The round the next computation is for. With a reachable coordinator: the next round it
        announces (waiting for it), with its compute budget, data seed and this peer's slot; the
        `gather` given this plan then aggregates exactly the participant set the coordinator decides.
        Otherwise: the round in progress on the clock, uncoordinated, or the next one while an
        overlapped optimizer still gathers that one; the `gather` given it joins it (or, late, the
        round in progress then). The caller passes the plan along with the round's payload.

        `last_round`: the run ends after it (`--until-round`). None once the clock, at the coordinator's
        last pace, is a round past it and no plan came: the coordinator announces no more rounds (the
        others have left), and a peer it keeps out, evicted, would otherwise wait for one forever."""
        while True:  # in slices, so that a stop (Ctrl-C) is noticed by the caller's signal handler
            plan = self._call(self.rounds.plan(wait=1.0))
            if plan is not None:
                return plan
            if last_round is not None and self.schedule.round_at(time.time()) > last_round + 1:
                return None

    def gather(
        self, payload: bytes, samples: int, state: Sequence[torch.Tensor] | None = None, plan: object = None
    ) -> Gathered:
        return self._gather(payload, samples, state, None, plan)

    def average(
        self,
        payload: bytes,
        samples: int,
        state: Sequence[torch.Tensor] | None,
        pieces: Pieces,
        plan: RoundPlan | None = None,
    ) -> Averaged:
        """A coordinated round of at least `butterfly.MIN_PARTICIPANTS` is averaged piece by piece
        (shoal.peer.algorithms.butterfly); any other round is gathered."""
        result = self._gather(payload, samples, state, pieces, plan)
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
        round_number = self._take_round(None if plan is None else plan.round, coordinated=coordinated)
        self.last_round = round_number
        self.last_payload_bytes = len(payload)
        self._adopted = None
        snapshot = None if state is None else (StateSnapshot.capture(state, round_number), list(state))
        if coordinated:
            result = self._call(self.rounds.round(plan, bytes(payload), samples, snapshot, pieces))
        else:
            result = self._call(self._round(round_number, bytes(payload), samples, snapshot))
            if self.coordinator is not None:  # once it is back, the coordinator continues after this round
                self.coordinator.progress.round = max(self.coordinator.progress.round, round_number)
        # what the round's coroutines decided besides its contributions, handed over as one value
        adopted, self._adopted = self._adopted, None
        counted, self._own_counted = self._own_counted, True
        if isinstance(result, Averaged):
            return dataclasses.replace(result, adopted=adopted, counted=counted)
        return Gathered(tuple(result), adopted=adopted, counted=counted, round=round_number)

    def compatible_peers(self, *, fully: bool = False) -> set[bytes]:
        """Public-key subkeys of the peers whose record is compatible with this one's (itself included);
        the others are in `refused`, with what differs. `fully`: read from every replica."""
        return self._call(self.directory.compatible_peers(fully=fully))

    def set_progress(
        self, *, throughput: float, samples: int, compute_throughput: float = 0.0, min_samples: int = 0
    ) -> None:
        """What the next record says about this peer: samples per second, samples contributed; and
        what the heartbeats tell a coordinator: samples per second of computation, and the samples of
        this peer's smallest contribution to a round."""
        update = {"throughput": float(max(throughput, 0.0)), "samples": int(max(samples, 0))}
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
            poll_s=self.poll_interval_s,
            ignored=set(self.banned),
            max_payload_bytes=self.max_payload_bytes,
        )
        agreed = majority({owner: (a.state, a.synced) for owner, a in announced.items()})
        if agreed == mine.state:
            if any(a.state != agreed for a in announced.values()):
                logger.info("a peer ended the run on another state: serving ours for its re-sync")
                await asyncio.sleep(self.schedule.round_seconds)
            return None
        sources = [a.peer for owner, a in announced.items() if a.state == agreed and owner != self.owner]
        logger.warning(f"ended the run on another state than {len(sources)} peer(s): re-syncing to theirs")
        return await self._resync(agreed, sources, like)

    def reject(self, contribution: Contribution, reason: str) -> None:
        """Counts and strikes what the optimizer left out: malformed, `config_mismatch`, or screened
        (`opposed`, `outlier`: shoal.peer.algorithms.robust)."""
        number = contribution.round if contribution.round >= 0 else self.last_round
        self._loop.call_soon_threadsafe(self._count_and_strike, contribution.sender, reason, number)

    def refuse(self, reason: str) -> None:
        self._loop.call_soon_threadsafe(self.counts.rejected.update, (reason,))

    def _count_and_strike(self, owner: bytes, reason: str, round_number: int | None) -> None:
        self.counts.rejected[reason] += 1
        self._strike(owner, reason, round_number)

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
        until = time.monotonic() + drain.total_seconds()
        drained = drain <= timedelta(0) or self._call(self.server.drain(until))
        self._call(self._stop(unregister))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        return drained

    def __enter__(self) -> "SwarmExchange":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- on the loop thread ---

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _start(self, max_concurrent_fetches: int):
        p2p = await self.dht.replicate_p2p()
        self._puller = Puller(
            p2p,
            run=self.run,
            channels=Channels(p2p, self.server.channel_handler, self.fetch_timeout_s),
            owner=self.owner,
            timeout_s=self.fetch_timeout_s,
            max_concurrent=max_concurrent_fetches,
            strike=self._strike,
            counts=self.counts,
            relays_of=self.directory.relays_of,
            claims_reachable=self.directory.claims_reachable,
        )
        await self.server.start(p2p)
        # the record goes out before the first round, so that the others count this peer in their
        # data slots (and `shoal status` lists it) while it computes
        await self.directory.store_record(self.schedule.round_at(time.time()), self.schedule)
        return p2p

    async def _stop(self, unregister: bool) -> None:
        if self.coordinator is not None and self.coordinator.started:
            await self.coordinator.stop()
        await self.server.stop(self._p2p, unregister=unregister)
        self._puller.channels.close()
        await self._p2p.shutdown()

    def _strike(self, owner: bytes, reason: str, round_number: int | None) -> None:
        """A strike (shoal.peer.swarm.ledger) for what `owner` sent in `round_number` (None: the last)."""
        self.ledger.strike(owner, reason, round_number if round_number is not None else self.last_round or 0)

    async def _round(
        self,
        round_number: int,
        payload: bytes,
        samples: int,
        snapshot: tuple[StateSnapshot, list[torch.Tensor]] | None,
    ) -> list[Contribution]:
        mine = await self._hold(round_number, payload, samples, snapshot)
        announced, compatible = await self._collect(round_number, mine, self.schedule.deadline(round_number))
        self._members = sorted(compatible)
        held = sum(self.server.holds(round_number, a.digest) for a in announced.values())
        self.counts.count_round(len(compatible | {self.owner}), held)
        contributions = await self._settle(round_number, announced, mine, snapshot)
        self._follow_run_clock()
        return contributions

    def _follow_run_clock(self) -> None:
        """From the next round, the rounds of the run's clock, if peers that started the run at the same
        moment as this one follow another (`RunDirectory.take_run_clock`); a coordinator's rule instead."""
        coordinated = self.coordinator is not None and self.coordinator.connected
        schedule = None if coordinated else self.directory.take_run_clock()
        if schedule is not None:
            with self._rounds_lock:
                self.schedule = schedule
                self._next_round = schedule.round_at(time.time())  # joins the round in progress

    async def _hold(
        self,
        round_number: int,
        payload: bytes,
        samples: int,
        snapshot: tuple[StateSnapshot, list[torch.Tensor]] | None,
        *,
        coordinated: bool = False,
    ) -> Announcement:
        """Serves this peer's payload (and state snapshot) for the round and, uncoordinated, announces
        it in the DHT. A coordinator is told of it instead (`CoordinatedRounds.round`), and the record is
        then only kept alive: it serves `shoal status` and the fallback's data slots, and rewriting it
        and an announcement every round was most of a small payload's wire traffic (BENCHMARKS.md)."""
        digest = self.server.hold(round_number, payload, None if snapshot is None else snapshot[0])
        state = b"" if snapshot is None else snapshot[0].digest
        self.ledger.new_round(round_number)
        self._puller.new_round(round_number)
        refresh_s = RECORD_REFRESH_S if coordinated else 0.0
        await self.directory.store_record(round_number, self.schedule, refresh_s=refresh_s)
        self.directory.rejoin_if_alone(1 if self.isolation.isolated else self.counts.peers_seen)
        mine = Announcement(self.owner, self.peer_id, digest, len(payload), samples, state, self.synced)
        if not coordinated and not self.isolation.sits_out(round_number):
            await self._announce(round_number, mine)
        self.ledger.announced(digest, round_number)
        return mine

    async def _announce(self, round_number: int, mine: Announcement) -> None:
        key = round_key(self.run, round_number)
        await self.directory.store(key, mine.value(), self.schedule.deadline(round_number) + 60)

    async def _collect(
        self, round_number: int, mine: Announcement, deadline: float
    ) -> tuple[dict[bytes, Announcement], set[bytes]]:
        """Uncoordinated: until `deadline`, the announcements of compatible peers in the DHT and their
        payloads (shoal.peer.swarm.collect). Returns (the announcements taken, the compatible peers)."""
        return await collect(self, round_number, mine, deadline)

    def _chosen(self, round_number: int, announced: dict[bytes, Announcement]) -> dict[bytes, Announcement]:
        """The announcements whose payloads count in the round: at most `gather_limit` of them, in the
        rotation of shoal.protocol.rules, the same on every peer that took the same."""
        chosen = choose(self.run.encode(), round_number, announced.keys(), self.gather_limit)
        return {owner: a for owner, a in announced.items() if owner in chosen}

    async def _settle(
        self,
        round_number: int,
        announced: dict[bytes, Announcement],
        mine: Announcement,
        snapshot: tuple[StateSnapshot, list[torch.Tensor]] | None,
        tally: Tally | None = None,
    ) -> list[Contribution]:
        """The round's contributions from the chosen payloads held, in key order: one per distinct
        payload, only those computed on the majority's state (this peer re-syncs to it if its own
        differs). A payload the fan-in left out (this peer's too) does not count, but its announcement
        votes on the round's state with every other one. With a `tally` (a coordinator that chose the
        round's payloads itself), `announced` holds only the chosen, and the tally is the vote."""
        if tally is not None:
            voters, counted = tally, mine.owner in announced
        else:
            voters = announced if self.gather_limit else None
            announced = self._chosen(round_number, announced)
            counted = mine.owner in announced or not self.gather_limit
        self._own_counted = counted
        self.counts.left_out += not self._own_counted
        held = [owner for owner, a in announced.items() if self.server.holds(round_number, a.digest)]
        served = self.counts.sent["payload"] + self.counts.sent["state"]
        self.isolation.observe(len(announced.keys() - {mine.owner}), len(set(held) - {mine.owner}), served)
        held = await self._agree({owner: announced[owner] for owner in held}, mine, snapshot, voters)
        self.server.expect_pulls(*round_pullers(mine.owner, announced, voters))
        payloads = [self.server.held[(round_number, announced[owner].digest)] for owner in held]
        return [
            Contribution(rank, payload, announced[owner].samples, sender=owner, round=round_number)
            for rank, (owner, payload) in enumerate(zip(held, payloads, strict=True))
        ]

    async def _agree(
        self,
        announced: dict[bytes, Announcement],
        mine: Announcement,
        snapshot: tuple[StateSnapshot, list[torch.Tensor]] | None,
        voters: dict[bytes, Announcement] | Tally | None = None,
    ) -> list[bytes]:
        """The owners of `announced` whose contributions count, in key order: one per distinct payload,
        only those computed on the majority's state (this peer re-syncs to it if its own differs); the
        majority is that of `voters` when given (`state.decide`)."""
        decision = decide(announced, mine, compare_states=snapshot is not None, voters=voters)
        if decision.copies:
            self.counts.rejected["duplicate"] += len(decision.copies)
        if decision.stale:
            self.counts.rejected["stale_state"] += len(decision.stale)
        if decision.behind:
            self._adopted = await self._resync(decision.agreed, decision.sources, snapshot[1])
        if decision.compared:
            self.synced = not decision.behind or self._adopted is not None
        self._participants, self._me = decision.counted, mine.owner
        return decision.counted

    async def _slot(self) -> tuple[int, int]:
        """(this peer's place, count) among the compatible peers, ordered by public key, as last seen:
        its data slice in an uncoordinated round (shoal.peer.data.RoundSlices)."""
        members = self._members or sorted(await self.directory.compatible_peers())
        members = sorted(set(members) | {self.owner})
        return members.index(self.owner), len(members)

    async def _resync(self, digest: bytes, sources: list[str], like: list[torch.Tensor]) -> list | None:
        """The majority's state, pulled from `sources`; None (counted) if it could not be had."""
        adopted = await self._puller.state(digest, sources, like)
        if adopted is not None:
            self.counts.resyncs += 1
        return adopted

    async def _fetch(
        self, round_number: int, announcement: Announcement, holders: Mapping[bytes, Announcement]
    ) -> None:
        """Pulls one payload into `server.held` (shoal.peer.swarm.pull), until it is had or the round's task
        is cancelled."""
        data = await self._puller.payload(round_number, announcement, holders)
        if self.ledger.replayed_content(data, round_number):
            self.counts.rejected["replayed"] += 1
            self._strike(announcement.owner, "replayed", round_number)
            return
        self.server.held[(round_number, announcement.digest)] = data
