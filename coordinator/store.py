"""The coordinator's durable state: SQLite in WAL mode, written after every transition.

    members(peer_id, joined_at, throughput, min_samples, round, strikes, on_time, compute_scale)
    evicted(peer_id, until)
    rounds(number, announced_at, compute_deadline, exchange_deadline, data_seed, expected, decided_at,
           stragglers)                       every round ever announced: the swarm's history
    reports(round, peer_id, digest, size, samples, state, synced, at)
                                             the payloads of the last rounds (their participant sets)
    earned(round, peer_id)                   the participants of the last rounds whose vote weighed
    counted(peer_id, round)                  the rounds each peer counted in, of the last WORK_WINDOW
    meta(key, value)                         seed, next_round, counters, recent exchange times

`save(old, new)` writes only what differs between two states, in one transaction (heartbeats, which
change nothing durable but liveness, write nothing). `load` rebuilds the state; `rounds.resume` then
treats the members as alive from the restart on. A restart therefore keeps the round numbering, the
membership, the strikes and the reports of the round in progress.
"""

import contextlib
import json
import sqlite3
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TypeAlias, cast

from shoal.coordinator.rounds import KEEP_ROUNDS
from shoal.coordinator.state import Member, PayloadReport, Round, SwarmState

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS members (
    peer_id TEXT PRIMARY KEY, joined_at REAL, throughput REAL, min_samples INTEGER, round INTEGER,
    strikes INTEGER, on_time INTEGER, compute_scale REAL);
CREATE TABLE IF NOT EXISTS evicted (peer_id TEXT PRIMARY KEY, until REAL);
CREATE TABLE IF NOT EXISTS rounds (
    number INTEGER PRIMARY KEY, announced_at REAL, compute_deadline REAL, exchange_deadline REAL,
    data_seed INTEGER, expected TEXT, decided_at REAL, stragglers TEXT);
CREATE TABLE IF NOT EXISTS reports (
    round INTEGER, peer_id TEXT, digest BLOB, size INTEGER, samples INTEGER, state BLOB, synced INTEGER,
    at REAL, PRIMARY KEY (round, peer_id));
CREATE TABLE IF NOT EXISTS earned (round INTEGER, peer_id TEXT, PRIMARY KEY (round, peer_id));
CREATE TABLE IF NOT EXISTS counted (peer_id TEXT, round INTEGER, PRIMARY KEY (peer_id, round));
"""
RoundRow: TypeAlias = tuple[int, float, float, float, int, str, float | None, str]
"""A row of `rounds`: the member list and the stragglers as JSON."""


class StateStore:
    """One SQLite file holding one swarm's coordinator state."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        # the coordinator writes from one thread at a time, not always the same one (asyncio.to_thread)
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a reported payload survives a power cut
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        self._db.close()

    def load(self) -> SwarmState | None:
        """The saved state, or None if the file holds none yet."""
        meta = dict(self._db.execute("SELECT key, value FROM meta"))
        if "seed" not in meta:
            return None
        members = {
            row[0]: Member(
                peer_id=row[0],
                joined_at=row[1],
                last_seen=row[1],
                throughput=row[2],
                min_samples=row[3],
                round=row[4],
                strikes=row[5],
                on_time=row[6],
                compute_scale=row[7],
            )
            for row in self._db.execute("SELECT * FROM members")
        }
        evicted = dict(self._db.execute("SELECT peer_id, until FROM evicted"))
        counted: dict[str, list[int]] = {}
        for peer_id, number in self._db.execute("SELECT peer_id, round FROM counted ORDER BY round"):
            counted.setdefault(peer_id, []).append(number)
        # the kept history, an undecided previous round (with overlap) and the current one
        rows = self._db.execute("SELECT * FROM rounds ORDER BY number DESC LIMIT ?", (KEEP_ROUNDS + 2,))
        rounds: list[Round | None] = [self._round(row) for row in reversed(rows.fetchall())]
        if meta["current_round"] == "":  # between an abandoned round and the next announcement
            rounds.append(None)
        # with overlap, the round before the current one may still be undecided (abandoned ones are deleted)
        older = rounds[-2] if len(rounds) > 1 and rounds[-1] is not None else None
        return SwarmState(
            seed=int(meta["seed"]),
            members=members,
            evicted=evicted,
            round=rounds[-1] if rounds else None,
            previous=older if older is not None and older.decided_at is None else None,
            next_round=int(meta["next_round"]),
            # None only ever ends `rounds`
            history=tuple(r for r in cast(list[Round], rounds[:-1]) if r.decided_at is not None)[
                -KEEP_ROUNDS:
            ],
            exchange_times=tuple(json.loads(meta["exchange_times"])),
            stragglers_total=int(meta["stragglers_total"]),
            evictions_total=int(meta["evictions_total"]),
            counted={peer_id: tuple(rounds) for peer_id, rounds in counted.items()},
        )

    def save(self, old: SwarmState | None, new: SwarmState) -> None:
        """Writes what changed from `old` (None: everything) to `new`, atomically."""
        if old is new:
            return
        old_members = {} if old is None else old.members
        # members are immutable records: one that is the same object did not change (the common case:
        # one event touches one member), so only the others are compared field by field
        changed = [
            _durable(member)
            for peer_id, member in new.members.items()
            if old_members.get(peer_id) is not member
            and (peer_id not in old_members or _durable(old_members[peer_id]) != _durable(member))
        ]
        left = old_members.keys() - new.members.keys()
        meta = None if old is not None and _meta(old) == _meta(new) else _meta(new)
        old_rounds = {} if old is None else {r.number: r for r in _rounds(old)}
        new_rounds = {r.number: r for r in _rounds(new)}
        rounds_same = new_rounds.keys() == old_rounds.keys() and all(
            old_rounds[n] is r for n, r in new_rounds.items()
        )
        counted_same = old is not None and old.counted is new.counted
        if old is not None and not (
            changed or left or meta or not rounds_same or old.evicted != new.evicted or not counted_same
        ):
            return  # a heartbeat that changed only liveness: nothing durable, no transaction
        with self._transaction():
            if meta is not None:
                self._db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", meta.items())
            for peer_id in left:
                self._db.execute("DELETE FROM members WHERE peer_id = ?", (peer_id,))
            self._db.executemany("INSERT OR REPLACE INTO members VALUES (?, ?, ?, ?, ?, ?, ?, ?)", changed)
            if old is None or old.evicted != new.evicted:
                self._db.execute("DELETE FROM evicted")
                self._db.executemany("INSERT INTO evicted VALUES (?, ?)", new.evicted.items())
            for number, saved in new_rounds.items():
                if old_rounds.get(number) is not saved:
                    self._save_round(saved, old_rounds.get(number))
            for number, gone in old_rounds.items():
                if number not in new_rounds and gone.decided_at is None:  # abandoned: it never happened
                    self._db.execute("DELETE FROM rounds WHERE number = ?", (number,))
            if new_rounds.keys() != old_rounds.keys():  # reports are kept for the kept rounds only
                kept = ",".join(str(n) for n in new_rounds)
                self._db.execute(f"DELETE FROM reports WHERE round NOT IN ({kept or '-1'})")
                self._db.execute(f"DELETE FROM earned WHERE round NOT IN ({kept or '-1'})")
            if not counted_same:
                self._save_counted({} if old is None else old.counted, new.counted)

    def _save_round(self, saved: Round, previous: Round | None) -> None:
        known = previous.reports if previous is not None and previous.number == saved.number else {}
        # a report changes only the reports: the row (with every member's id) is written when the round
        # is announced and when it is decided, not once per report (N reports of N ids each)
        row = _round_row(saved)
        if previous is None or _round_row(previous) != row:
            *timing, decided_at, stragglers = row
            values = (*timing, json.dumps(saved.expected), decided_at, json.dumps(stragglers))
            self._db.execute("INSERT OR REPLACE INTO rounds VALUES (?, ?, ?, ?, ?, ?, ?, ?)", values)
            self._db.executemany(
                "INSERT OR REPLACE INTO earned VALUES (?, ?)", [(saved.number, p) for p in saved.earned]
            )
        for peer_id, report in saved.reports.items():
            if peer_id not in known:
                self._db.execute(
                    "INSERT OR REPLACE INTO reports VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        saved.number,
                        peer_id,
                        report.digest,
                        report.size,
                        report.samples,
                        report.state,
                        int(report.synced),
                        report.at,
                    ),
                )

    def _save_counted(self, old: Mapping[str, tuple[int, ...]], new: Mapping[str, tuple[int, ...]]) -> None:
        """Writes the difference between two records of counted rounds (a decided round adds its counted
        participants' rows and drops those that left the window)."""
        rows = {(p, n) for p, rounds in new.items() for n in rounds}
        was = {(p, n) for p, rounds in old.items() for n in rounds}
        self._db.executemany("DELETE FROM counted WHERE peer_id = ? AND round = ?", sorted(was - rows))
        self._db.executemany("INSERT OR REPLACE INTO counted VALUES (?, ?)", sorted(rows - was))

    def _round(self, row: RoundRow) -> Round:
        number = row[0]
        reports = {
            r[1]: PayloadReport(
                peer_id=r[1], digest=r[2], size=r[3], samples=r[4], state=r[5], synced=bool(r[6]), at=r[7]
            )
            for r in self._db.execute("SELECT * FROM reports WHERE round = ?", (number,))
        }
        earned = self._db.execute("SELECT peer_id FROM earned WHERE round = ? ORDER BY peer_id", (number,))
        return Round(
            number=number,
            announced_at=row[1],
            compute_deadline=row[2],
            exchange_deadline=row[3],
            data_seed=row[4],
            expected=tuple(json.loads(row[5])),
            reports=reports,
            decided_at=row[6],
            stragglers=tuple(json.loads(row[7])),
            earned=tuple(peer_id for (peer_id,) in earned),
        )

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")


def _round_row(saved: Round) -> tuple[int, float, float, float, int, float | None, tuple[str, ...]]:
    """What of a round its `rounds` row holds, but the member list (fixed when it is announced)."""
    return (
        saved.number,
        saved.announced_at,
        saved.compute_deadline,
        saved.exchange_deadline,
        saved.data_seed,
        saved.decided_at,
        saved.stragglers,
    )


def _rounds(state: SwarmState) -> list[Round]:
    return [r for r in (*state.history, state.previous, state.round) if r is not None]


def _meta(state: SwarmState) -> dict[str, str]:
    current = "" if state.round is None else str(state.round.number)
    values = {
        "seed": state.seed,
        "next_round": state.next_round,
        "current_round": current,
        "exchange_times": json.dumps(list(state.exchange_times)),
        "stragglers_total": state.stragglers_total,
        "evictions_total": state.evictions_total,
    }
    return {k: str(v) for k, v in values.items()}


def _durable(member: Member) -> tuple[str, float, float, int, int, int, int, float]:
    """What of a member survives a restart (liveness does not)."""
    return (
        member.peer_id,
        member.joined_at,
        member.throughput,
        member.min_samples,
        member.round,
        member.strikes,
        member.on_time,
        member.compute_scale,
    )
