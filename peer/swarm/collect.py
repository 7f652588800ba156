"""The parts of the collect stage of an uncoordinated round (`RoundStages.collect`,
shoal.peer.swarm.stages): until the round's deadline, the announcements of compatible peers read from
the DHT (`Reads`, when: `Polls`), and the chosen payloads pulled as they come (`pull_chosen`; under a
fan-in, once the chosen set is final: `Pulls`).

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from shoal.peer.swarm.names import round_key
from shoal.peer.swarm.records import Announcement

if TYPE_CHECKING:
    from shoal.peer.swarm.stages import RoundStages


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
    strangers: set[object] = field(default_factory=set)
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

    def stranger(self, owner: object) -> None:
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


class Reads:
    """What a round's reads of the DHT found: the compatible peers, the announcements taken (and
    when), and the owners whose announcement was refused."""

    def __init__(self, stages: "RoundStages", round_number: int, mine: Announcement):
        self.stages, self.round_number = stages, round_number
        self.key = round_key(stages.run, round_number)
        self.announced = {mine.owner: mine}
        self.announced_at: dict[bytes, float] = {}
        self.pulled_at: dict[bytes, float] = {}
        """When each pull ended (`pull_chosen`)."""
        self.ignored: set[bytes] = set()
        self.compatible: set[bytes] = set()

    async def read(self, polls: Polls, idle: bool) -> None:
        """Reads the announcements, taking the new ones that pass the ledger; a refused one is counted
        and strikes its author (unless banned already)."""
        directory, ledger = self.stages.directory, self.stages.ledger
        nearest = polls.nearest_only(idle)
        max_bytes = self.stages.limits.max_payload_bytes
        for owner, announcement in await directory.announcements(self.key, max_bytes, nearest=nearest):
            # compatible owners come from schema-checked records: signed public-key subkeys
            if owner not in self.compatible:
                polls.stranger(owner)
                continue
            if owner in self.announced or owner in self.ignored:
                continue
            reason = ledger.refusal(self.round_number, owner, announcement)
            if reason is not None:
                self.ignored.add(owner)
                if reason == "banned":
                    self.stages.counts.rejected[reason] += 1
                else:
                    ledger.refuse(owner, reason, self.round_number)
                continue
            self.announced[owner] = cast(Announcement, announcement)  # no refusal: not malformed
            self.announced_at[owner] = time.time()


def needed(
    stages: "RoundStages", reads: "Reads", fetches: dict[bytes, asyncio.Task], since: float, poll_s: float
) -> tuple[float, float] | None:
    """What this round's exchange needed, whenever the others announced (shoal.peer.job.window): storing
    this peer's announcement and `poll_s` for the others to read it (they poll at the shortest interval
    while announcements come, and all come together); and the longest pull, from its announcement read
    to its payload held. None if a payload was still being pulled at the deadline."""
    if not all(task.done() for task in fetches.values()):
        return None
    pulls = [
        reads.pulled_at[owner] - max(reads.announced_at[owner], since)
        for owner in fetches
        if owner in reads.pulled_at
    ]
    return stages.standing.announce_s + poll_s, max(pulls, default=0.0)


def strike_unserved(
    stages: "RoundStages",
    reads: Reads,
    fetches: dict[bytes, asyncio.Task],
    deadline: float,
    pulls_since: float,
) -> None:
    """A payload nobody could pull by the `deadline` strikes its author if the author said it held
    nothing, or if it was announced (and pulled: from `pulls_since`) a whole fetch timeout before:
    announcing without serving would otherwise cost nothing, and every peer would wait on it, round
    after round."""
    number = reads.round_number
    for owner, task in fetches.items():
        refused = (number, reads.announced[owner].digest) in stages.puller.refused_by_author
        pulled_s = deadline - max(reads.announced_at[owner], pulls_since)
        if not task.done() and (refused or pulled_s >= stages.limits.fetch_timeout_s):
            stages.ledger.refuse(owner, "unserved", number)


def pull_chosen(
    stages: "RoundStages",
    round_number: int,
    announced: dict[bytes, Announcement],
    fetches: dict[bytes, asyncio.Task],
    pulled_at: dict[bytes, float],
) -> None:
    """Pulls the chosen payloads (`RoundStages.chosen`) not held yet, and stops pulling those a later
    announcement displaced from the chosen set (with no limit: every payload announced)."""
    chosen = stages.chosen(round_number, announced)
    for owner in [owner for owner in fetches if owner not in chosen]:
        fetches.pop(owner).cancel()
    for owner, announcement in chosen.items():
        if owner not in fetches and not stages.server.holds(round_number, announcement.digest):
            fetches[owner] = asyncio.create_task(stages.fetch(round_number, announcement, announced))
            fetches[owner].add_done_callback(
                cast(
                    "Callable[[asyncio.Task], None]",
                    lambda _, owner=owner: pulled_at.__setitem__(owner, time.time()),
                )
            )
