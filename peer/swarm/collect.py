"""The collection of an uncoordinated round of SwarmExchange (shoal.peer.swarm.exchange): until the round's
deadline, the announcements of compatible peers read from the DHT, and the chosen payloads pulled as
they come (under a fan-in, once the chosen set is final: `Pulls`).

DHT reads are most of an uncoordinated round's wire traffic besides the payloads (BENCHMARKS.md):
every read answers with every peer's entry from each node it asks. `Polls` decides when to read (no
I/O): the announcements are re-read at the poll interval, backing off to 4 polls' time (at most a tenth
of a round) while nothing new comes, since a peer whose record outlives it is waited for until the
deadline; the round's first read asks only the nearest replica (most peers have yet to announce). The
peer list (the larger entries) is asked for at the start of the round (the directory answers from its
last read for two rounds) and read again at once for each unknown announcer, not while waiting: a peer
that left is dropped when its record expires anyway, and a newcomer shows up as an unknown announcer.
Once every compatible peer's payload is in, nothing more is read while this peer sees as many peers
as last round (a newcomer shows up in the next round's first read, or in the peer list); while it sees
fewer, or in its first round, the announcements are read at most twice a round from the nearest replica
(its peer list may have lost records, or they expired: their authors then announce as unknown peers),
and not within the longest poll interval of the deadline (too late to pull).
Under a fan-in, pulls wait for the chosen set to be final (`Pulls`), and so does the round's first
read: until every compatible peer was in last round.
"""

import asyncio
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from shoal.peer.swarm.counters import SwarmCounters
from shoal.peer.swarm.directory import RunDirectory
from shoal.peer.swarm.ledger import Ledger
from shoal.peer.swarm.names import round_key
from shoal.peer.swarm.pull import Puller, abandon
from shoal.peer.swarm.records import Announcement, RoundSchedule
from shoal.peer.swarm.server import PayloadServer


@dataclass
class Polls:
    """When a round re-reads its announcements and the peer list (see the module docstring); times are
    `time.monotonic()`'s."""

    shortest_s: float
    round_seconds: float
    records_read: bool = False
    """Whether the peer list was read this round."""
    unknown: bool = False
    """An unknown peer announced since the peer list was last read."""
    announcements_read: bool = False
    """Whether the announcements were read this round."""
    strangers: set[bytes] = field(default_factory=set)
    poll_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.poll_s = self.shortest_s

    @property
    def longest_s(self) -> float:
        return max(self.shortest_s, min(4 * self.shortest_s, self.round_seconds / 10))

    def records_due(self) -> bool:
        return self.unknown or not self.records_read

    def read_records(self) -> None:
        self.records_read, self.unknown = True, False

    def stranger(self, owner: bytes) -> None:
        """An announcement by a peer not in the peer list: the list is re-read at once, once per peer."""
        self.unknown = self.unknown or owner not in self.strangers
        self.strangers.add(owner)

    def next_poll_s(self, news: bool) -> float:
        """The wait before the next read of the announcements: the shortest after news, else doubled."""
        self.poll_s = self.shortest_s if news else min(2 * self.poll_s, self.longest_s)
        return self.poll_s

    def nearest_only(self, idle: bool) -> bool:
        """Whether this read of the announcements asks the nearest replica only: the round's first
        (most peers have yet to announce) and those once every payload is in; every replica otherwise,
        at most every quarter of a round (shoal.peer.swarm.directory)."""
        first, self.announcements_read = not self.announcements_read, True
        return first or idle

    def idle_s(self) -> float:
        """The wait between reads of the announcements once every payload is in: half a round, at
        least a second and a poll."""
        return max(1.0, self.shortest_s, self.round_seconds / 2)

    @staticmethod
    def looks_on(seen: int, last_round: int) -> bool:
        """Whether to go on reading the announcements once every payload is in, seeing `seen` compatible
        peers (itself included) against `last_round`'s (0: none yet): only while fewer. A peer whose
        list lost records would otherwise train alone (a hostile-peer test's honest peers did, one round,
        and lost 3.7% against a clean run); one that sees all of last round's would read for nothing (at
        16 peers, 0.9 reads of 3.3 kB a round)."""
        return seen < last_round or last_round == 0


@dataclass
class Pulls:
    """When a round starts pulling (no I/O). Under a fan-in (`gather`) smaller than the compatible peers,
    the chosen set is final only once every one of them announced: a payload pulled before that may be
    displaced by a later announcement, and its bytes are wasted (at 16 peers, 4.4-6.2 payloads were
    pulled a round for 3.75 chosen: docs/SCALE.md). So pulls wait for every compatible peer, or for
    `provisional_from` (halfway from this peer's announcement to the deadline), whichever comes first;
    without a fan-in every payload counts, and they start at once."""

    gather: int
    provisional_from: float
    since: float = math.inf
    """When pulls started (`time.time()`)."""
    settled: float = math.inf
    """When the read that found every compatible peer announced began (`time.time()`)."""
    missed: bool = False
    """Whether a read found one missing."""

    def due(self, compatible: set[bytes], taken: set[bytes], read_at: float) -> bool:
        """Whether to pull, after a read begun at `read_at` found `taken` (announced or refused)."""
        if self.settled == math.inf:
            if compatible <= taken:
                self.settled = read_at
            else:
                self.missed = True
        if self.since == math.inf and (
            not 0 < self.gather < len(compatible)
            or self.settled < math.inf
            or time.time() >= self.provisional_from
        ):
            self.since = time.time()
        return self.started

    @property
    def started(self) -> bool:
        return self.since < math.inf

    def settled_s(self, round_started: float, poll_s: float) -> float | None:
        """How far into the round every compatible peer was in (None: never), for the next round's first
        read: from the start of the read that found them (its latency would otherwise add up round
        after round), and a poll sooner if none was missing, so that it follows them as they come
        sooner and finds one missing now and then."""
        if self.settled == math.inf:
            return None
        return self.settled - round_started - (0.0 if self.missed else poll_s)


class CollectHost(Protocol):
    """What `collect` uses of its SwarmExchange."""

    run: str
    schedule: RoundSchedule
    directory: RunDirectory
    ledger: Ledger
    counts: SwarmCounters
    max_payload_bytes: int
    gather_limit: int
    fetch_timeout_s: float
    poll_interval_s: float
    settled_s: float | None
    _members: list[bytes]
    server: PayloadServer
    _puller: Puller

    def _strike(self, owner: bytes, reason: str, round_number: int | None) -> None: ...
    def _count_and_strike(self, owner: bytes, reason: str, round_number: int | None) -> None: ...
    def _chosen(self, number: int, announced: dict[bytes, Announcement]) -> dict[bytes, Announcement]: ...
    async def _fetch(self, number: int, announcement: Announcement, holders: Mapping) -> None: ...


async def collect(
    swarm: CollectHost, round_number: int, mine: Announcement, deadline: float
) -> tuple[dict[bytes, Announcement], set[bytes]]:
    """Until `deadline`, the announcements of compatible peers in the DHT, their chosen payloads pulled
    (`pull_chosen`). Returns (the announcements taken, the compatible peers)."""
    key = round_key(swarm.run, round_number)
    announced = {mine.owner: mine}
    announced_at: dict[bytes, float] = {}
    ignored: set[bytes] = set()
    fetches: dict[bytes, asyncio.Task] = {}
    compatible: set[bytes] = set()
    polls = Polls(swarm.poll_interval_s, swarm.schedule.round_seconds)
    pulls = Pulls(swarm.gather_limit, provisional_from=time.time() + (deadline - time.time()) / 2)
    started = deadline - swarm.schedule.round_seconds
    if swarm.settled_s is not None and 0 < swarm.gather_limit < len(swarm._members):
        # the pulls wait for every compatible peer: no read before they were all in last round
        # (`Pulls.settled_s`), where it would find some missing
        await asyncio.sleep(max(0.0, min(started + swarm.settled_s, pulls.provisional_from) - time.time()))
    while True:
        waiting = not compatible <= announced.keys() | ignored
        busy = waiting or not all(task.done() for task in fetches.values())
        idle = polls.records_read and not busy and not polls.unknown
        if idle and not polls.looks_on(len(compatible), len(swarm._members)):
            await asyncio.sleep(max(0.0, deadline - time.time()))
            break
        if idle:
            await asyncio.sleep(min(polls.idle_s(), max(0.0, deadline - time.time())))
            if deadline - time.time() < polls.longest_s:  # a newcomer seen now would be too late to pull
                await asyncio.sleep(max(0.0, deadline - time.time()))
                break
        if polls.records_due():
            compatible = await swarm.directory.compatible_peers(fully=polls.unknown)
            polls.read_records()
        taken, read_at = len(announced), time.time()
        nearest = polls.nearest_only(idle)
        for owner, announcement in await swarm.directory.announcements(
            key, swarm.max_payload_bytes, nearest=nearest
        ):
            # compatible owners come from schema-checked records: signed public-key subkeys
            if owner not in compatible:
                polls.stranger(owner)
                continue
            if owner in announced or owner in ignored:
                continue
            reason = swarm.ledger.refusal(round_number, owner, announcement)
            if reason is not None:
                ignored.add(owner)
                swarm.counts.rejected[reason] += 1
                if reason != "banned":
                    swarm._strike(owner, reason, round_number)
                continue
            announced[owner] = announcement
            announced_at[owner] = time.time()
        if pulls.due(compatible, announced.keys() | ignored, read_at):
            pull_chosen(swarm, round_number, announced, fetches)
        # while pulls wait for the chosen set, a new announcement does not hasten the next read
        poll_s = polls.next_poll_s(news=polls.unknown or (len(announced) > taken and pulls.started))
        remaining = deadline - time.time()
        if remaining <= 0:
            break
        await asyncio.sleep(min(poll_s, remaining))
    # a payload nobody could pull by the deadline strikes its author if the author said it held nothing,
    # or if it was announced (and pulled) a whole fetch timeout before: announcing without serving would
    # otherwise cost nothing, and every peer would wait on it, round after round
    for owner, task in fetches.items():
        refused = (round_number, announced[owner].digest) in swarm._puller.refused_by_author
        pulled_s = deadline - max(announced_at[owner], pulls.since)
        if not task.done() and (refused or pulled_s >= swarm.fetch_timeout_s):
            swarm._count_and_strike(owner, "unserved", round_number)
    await abandon(list(fetches.values()))
    swarm.settled_s = pulls.settled_s(started, polls.shortest_s)
    return announced, compatible


def pull_chosen(
    swarm: CollectHost,
    round_number: int,
    announced: dict[bytes, Announcement],
    fetches: dict[bytes, asyncio.Task],
) -> None:
    """Pulls the chosen payloads (`swarm._chosen`) not held yet, and stops pulling those a later
    announcement displaced from the chosen set (with no limit: every payload announced)."""
    chosen = swarm._chosen(round_number, announced)
    for owner in [owner for owner in fetches if owner not in chosen]:
        fetches.pop(owner).cancel()
    for owner, announcement in chosen.items():
        if owner not in fetches and not swarm.server.holds(round_number, announcement.digest):
            fetches[owner] = asyncio.create_task(swarm._fetch(round_number, announcement, announced))
