"""The coordinator's SQLite state store: what a restarted coordinator loads is what it last saved."""

import hashlib
import sqlite3
from dataclasses import replace

from shoal.coordinator.actions import Abandoned, Announced
from shoal.coordinator.events import Heartbeat, Join, Leave, Report, Tick
from shoal.coordinator.policy import Policy
from shoal.coordinator.rounds import KEEP_ROUNDS, initial_state, resume, transition
from shoal.coordinator.store import StateStore

A, B, C, D = (f"QmPeer{c * 16}" for c in "ABCD")
P = Policy(min_compute_s=10, max_compute_s=100, initial_exchange_s=5, heartbeat_timeout_s=1000)
P = replace(P, shrink_after=1, evict_after=2, eviction_s=30, forgive_after=3)


def report(peer, number, **fields):
    digest = hashlib.sha256(f"{peer}/{number}".encode()).digest()
    return Report(peer, number, digest, size=1000 + number, samples=7, **fields)


def durable(state):
    """The state less what does not survive a restart: members' liveness and the restart time."""
    members = {p: replace(m, last_seen=0.0, heard=True) for p, m in state.members.items()}
    return replace(state, members=members, resumed_at=None)


def reloaded(path):
    store = StateStore(path)
    try:
        return store.load()
    finally:
        store.close()


class Coordinator:
    """The machine with a store: saves after every transition, as the server does."""

    def __init__(self, path, state=None, policy=P):
        self.path, self.store, self.policy = path, StateStore(path), policy
        self.state = initial_state(seed=99) if state is None else state
        self.store.save(None, self.state)
        self.actions = []

    def __call__(self, *steps):
        for now, event in steps:
            old = self.state
            self.state, actions = transition(old, now, event, self.policy)
            self.store.save(old, self.state)
            self.actions += actions
        return self.state

    def play(self, reporters):
        """The current round: `reporters` report, the deadline passes, the participants finish it."""
        current = self.state.round
        end = current.compute_deadline + P.report_grace_s
        self(*[(current.announced_at + 1, report(p, current.number)) for p in reporters], (end, Tick()))
        return self(*[(end + 1, Heartbeat(p, current.number)) for p in reporters])


def two_members(path):
    """A and B, expected in round 1 (announced at 2, deadlines 12 and 17)."""
    coordinator = Coordinator(path)
    coordinator((0, Join(A)), (0, Join(B)), (1, report(A, 0)), (2, Heartbeat(A, 0)))
    assert coordinator.state.round.number == 1 and coordinator.state.round.expected == (A, B)
    return coordinator


def test_a_fresh_file_holds_no_state(tmp_path):
    assert reloaded(tmp_path / "coordinator.db") is None


def test_the_file_is_in_wal_mode(tmp_path):
    StateStore(tmp_path / "coordinator.db").close()
    with sqlite3.connect(tmp_path / "coordinator.db") as db:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_every_saved_state_loads_back(tmp_path):
    path = tmp_path / "coordinator.db"
    coordinator = Coordinator(path)
    steps = [
        (0, Join(A, throughput=5.0, min_samples=20)),
        (0, Join(B)),
        (0, Join(C)),
        (1, report(A, 0, state=bytes(range(32)), synced=True)),
        (2, Heartbeat(A, 0, throughput=4.0, exchange_s=3.0)),
        (3, report(A, 1)),
        (4, report(B, 1)),
        (12.5, Tick()),  # C is struck
        (13, Heartbeat(A, 1)),
        (13, Heartbeat(B, 1, min_samples=3, exchange_s=1.5)),
        (14, report(A, 2)),
        (14, report(B, 2)),
        (23.5, Tick()),  # C is evicted
        (24, Heartbeat(A, 2)),
        (24, Heartbeat(B, 2)),
        (25, Join(D)),
        (26, Leave(D)),
    ]
    for step in steps:
        state = coordinator(step)
        assert durable(reloaded(path)) == durable(state)
    assert state.evicted == {C: 53.5} and state.stragglers_total == 2 and state.evictions_total == 1
    assert state.exchange_times == (3.0, 1.5) and state.members[A].throughput == 4.0
    while state.round.number < KEEP_ROUNDS + 6:  # more rounds than are kept; C's eviction ends on the way
        state = coordinator.play([A, B])
        assert durable(reloaded(path)) == durable(state)
    assert state.evicted == {} and len(state.history) == KEEP_ROUNDS
    for step in [
        (state.round.announced_at, Join(C)),
        (state.round.announced_at + 1, report(A, state.round.number)),
    ]:
        state = coordinator(step)
        assert durable(reloaded(path)) == durable(state)
    assert state.round.decided_at is None and list(state.round.reports) == [A]


def test_two_open_rounds_of_an_overlapped_swarm_load_back(tmp_path):
    path = tmp_path / "coordinator.db"
    coordinator = Coordinator(path, policy=replace(P, overlap=True, min_start_members=2))
    steps = [
        (0, Join(A)),
        (0, Join(B)),
        (1, report(A, 0)),  # announces round 1 while round 0 is open
        (2, report(A, 1)),
        (3, report(B, 1)),  # round 1 decided before round 0
        (10.5, Tick()),  # round 0 decided at its deadline, B struck; round 2 announced
        (11, report(B, 2)),  # round 3 announced while round 2 is open
        (12, Heartbeat(A, 7)),  # both open rounds abandoned
        (13, report(A, 8)),
    ]
    for step in steps:
        state = coordinator(step)
        assert durable(reloaded(path)) == durable(state)
        if step[0] == 3:
            assert state.previous.number == 0 and state.round.decided_at == 3
        if step[0] == 11:
            assert (state.previous.number, state.round.number) == (2, 3)
    assert [r.number for r in state.history] == [0, 1] and state.previous.number == 8
    assert state.round.number == 9 and reloaded(path).previous.reports.keys() == {A}
    with sqlite3.connect(path) as db:  # the abandoned rounds are gone, with their reports
        assert [n for (n,) in db.execute("SELECT number FROM rounds")] == [0, 1, 8, 9]
        assert db.execute("SELECT COUNT(*) FROM reports WHERE round IN (2, 3)").fetchone() == (0,)
    # more rounds than are kept, each announced while the one before is open
    t = 14.0
    while len(state.history) < KEEP_ROUNDS or state.round.number < 20:
        older, newer = state.previous, state.round
        state = coordinator((t, report(B, older.number)), (t + 1, report(A, newer.number)))
        assert durable(reloaded(path)) == durable(state)
        t += 2
    assert len(state.history) == KEEP_ROUNDS and state.previous is not None


def test_an_abandoned_round_is_not_resurrected(tmp_path):
    path = tmp_path / "coordinator.db"
    coordinator = two_members(path)
    state = coordinator((3, report(A, 1)), (4, Heartbeat(B, 5)))
    assert any(isinstance(a, Abandoned) for a in coordinator.actions) and state.round.number == 6
    loaded = reloaded(path)
    assert durable(loaded) == durable(state)
    assert [r.number for r in loaded.history] == [0] and loaded.round.number == 6 and loaded.next_round == 7


def test_a_round_abandoned_while_members_are_unheard_is_not_resurrected(tmp_path):
    path = tmp_path / "coordinator.db"
    coordinator = two_members(path)
    coordinator((3, report(A, 1)))
    coordinator.state = resume(coordinator.state, 100)
    state = coordinator((101, Heartbeat(A, 5)))
    assert state.round is None and state.next_round == 6
    loaded = reloaded(path)
    assert loaded.round is None or loaded.round.number != 1
    assert all(r.number != 1 for r in loaded.history) and loaded.next_round == 6


def test_a_state_without_a_round_loads_back(tmp_path):
    path = tmp_path / "coordinator.db"
    coordinator = two_members(path)
    coordinator((3, report(A, 1)))
    coordinator.state = resume(coordinator.state, 100)
    state = coordinator((101, Heartbeat(A, 5)))
    assert durable(reloaded(path)) == durable(state)


def test_a_round_decided_and_followed_in_one_transition_is_kept(tmp_path):
    path = tmp_path / "coordinator.db"
    coordinator = two_members(path)
    state = coordinator((3, report(A, 1)), (20, Tick()))  # past both deadlines: decided, then round 2
    assert [r.number for r in state.history] == [0, 1] and state.round.number == 2
    assert state.history[-1].participants == (A,) and state.history[-1].stragglers == (B,)
    assert durable(reloaded(path)) == durable(state)


def test_the_history_keeps_its_reports_across_a_jump_in_the_numbering(tmp_path):
    path = tmp_path / "coordinator.db"
    coordinator = two_members(path)
    state = coordinator.play([A, B])
    state = coordinator((state.round.announced_at, Heartbeat(A, 50)))
    assert state.round.number == 51 and [r.participants for r in state.history] == [(A,), (A, B)]
    assert [r.participants for r in reloaded(path).history] == [(A,), (A, B)]


def test_a_heartbeat_that_changes_nothing_durable_writes_nothing(tmp_path):
    path = tmp_path / "coordinator.db"
    coordinator = two_members(path)
    with sqlite3.connect(path) as observer:
        before = observer.execute("PRAGMA data_version").fetchone()
        coordinator((3, Heartbeat(A, 0)), (4, Heartbeat(B)))
        assert observer.execute("PRAGMA data_version").fetchone() == before


def test_a_report_writes_its_row_and_not_the_rounds_list_of_every_member_again(tmp_path):
    """N reports of a round of N members must not write N copies of its member list (at 1,000 peers
    that was 50 kB per report); the round's row is written when it is announced and decided."""
    coordinator = two_members(tmp_path / "coordinator.db")
    db = coordinator.store._db
    before = db.total_changes
    coordinator((3, report(A, 1)))
    assert db.total_changes - before == 2  # the report, and A's member row (on time: +1)
    assert reloaded(tmp_path / "coordinator.db").round.reports.keys() == {A}
    coordinator((4, report(B, 1)))  # everyone reported: decided, so the row changes
    assert reloaded(tmp_path / "coordinator.db").round.decided_at == 4


def test_a_restart_continues_the_rounds_and_the_round_in_progress(tmp_path):
    path = tmp_path / "coordinator.db"
    coordinator = two_members(path)
    coordinator.play([A])  # B is struck; round 2 is announced at 13.5, compute deadline 23.5
    before = coordinator((14, report(A, 2)))
    coordinator.store.close()

    restarted = Coordinator(path, resume(reloaded(path), 15))
    assert restarted.state.round.number == 2 and list(restarted.state.round.reports) == [A]
    assert restarted.state.members[B].strikes == 1 and restarted.state.next_round == before.next_round == 3
    state = restarted((16, report(B, 2)))
    assert state.round.decided_at == 16 and state.round.participants == (A, B)
    assert state.round.reports[A] == before.round.reports[A]
    state = restarted((17, Heartbeat(A, 2)), (18, Tick()))
    assert not any(isinstance(a, Announced) for a in restarted.actions)  # B has not finished round 2
    state = restarted((19, Heartbeat(B, 2)))
    announced = [a.round for a in restarted.actions if isinstance(a, Announced)]
    assert [r.number for r in announced] == [3] and announced[0].expected == (A, B)
    assert [r.number for r in state.history] == [0, 1, 2]
    assert durable(reloaded(path)) == durable(state)
