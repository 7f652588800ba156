"""The coordinator's round state machine, driven with a fake clock (plain floats) through event sequences."""

import hashlib
import math
from dataclasses import replace

import pytest

from shoal.coordinator.actions import Abandoned, Announced, Capped, Decided, Dropped, Refused, Reply, Struck
from shoal.coordinator.events import Heartbeat, Join, Leave, Report, Tick
from shoal.coordinator.policy import Policy, compute_window, exchange_window, plausible_samples
from shoal.coordinator.rounds import (
    KEEP_EXCHANGE_TIMES,
    KEEP_ROUNDS,
    MAX_ROUND_JUMP,
    data_seed,
    initial_state,
    resume,
    round_result,
    transition,
)
from shoal.coordinator.state import Member, Round
from shoal.protocol.rules import is_peer_id

SEED = 1234
A, B, C, Z = (f"QmPeer{c * 16}" for c in "ABCZ")
P = Policy(min_compute_s=10, max_compute_s=100, initial_exchange_s=5, heartbeat_timeout_s=1000)


def run(state, steps, policy=P):
    """Applies `(now, event)` steps in order; returns the final state and all actions."""
    actions = []
    for now, event in steps:
        state, more = transition(state, now, event, policy)
        actions += more
    return state, actions


def kinds(actions):
    return [type(a).__name__ for a in actions]


def of(kind, actions):
    return [a for a in actions if isinstance(a, kind)]


def digest(peer, number):
    return hashlib.sha256(f"{peer}/{number}".encode()).digest()


def report(peer, number, **fields):
    return Report(peer, number, fields.pop("digest", digest(peer, number)), size=100, samples=10, **fields)


def swarm(*peers, policy=P):
    """A state whose round 1 (announced at t=2, deadlines 12 and 17) expects all `peers`."""
    steps = [(0, Join(p)) for p in peers] + [(1, report(peers[0], 0)), (2, Heartbeat(peers[0], 0))]
    state, _ = run(initial_state(SEED), steps, policy)
    current = state.round
    assert current.number == 1 and current.expected == tuple(sorted(peers))
    assert (current.announced_at, current.compute_deadline, current.exchange_deadline) == (2, 12, 17)
    return state


def cycle(state, reporters, policy=P):
    """Plays the current round: `reporters` report, the deadline passes, the participants finish it."""
    current = state.round
    t = current.announced_at + 1
    steps = [(t, report(p, current.number)) for p in reporters]
    end = current.compute_deadline + policy.report_grace_s
    steps += [(end, Tick())] + [(end + 1, Heartbeat(p, current.number)) for p in reporters]
    return run(state, steps, policy)


def test_peer_ids_are_base58_peer_ids():
    assert all(is_peer_id(p) for p in (A, B, C, Z))


def test_first_join_announces_round_zero_at_once():
    state, actions = run(initial_state(SEED), [(100, Join(A, throughput=10, min_samples=200))])
    assert kinds(actions) == ["Reply", "Announced"]
    assert actions[0] == Reply({"round": 0, "heartbeat_timeout_s": P.heartbeat_timeout_s})
    announced = actions[1].round
    assert announced == Round(
        number=0,
        announced_at=100,
        compute_deadline=100 + 30,  # 200 samples at 10/s, times headroom 1.5
        exchange_deadline=100 + 30 + P.initial_exchange_s,
        data_seed=data_seed(SEED, 0),
        expected=(A,),
    )
    assert state.round == announced and state.next_round == 1
    assert state.members[A] == Member(peer_id=A, joined_at=100, last_seen=100, throughput=10, min_samples=200)


def test_a_report_claiming_more_samples_than_its_member_can_compute_counts_at_the_bound():
    steps = [(0, Join(p, throughput=10, min_samples=50)) for p in (A, B)] + [(0, Join(C, throughput=1e9))]
    steps += [(1, report(A, 0)), (2, Heartbeat(A, 0))]
    state, _ = run(initial_state(SEED), steps)
    current = state.round  # round 1: a 10 s compute window (min_compute_s)
    assert current.compute_deadline - current.announced_at == 10
    # 4x its throughput over twice the window, plus its smallest contribution: 4 * 10 * 20 + 50
    assert plausible_samples(state.members[A], current, state.members) == 850
    # a claimed throughput counts at most 4x the members' lower median (10/s): 4 * 40 * 20 + 1
    assert plausible_samples(state.members[C], current, state.members) == 3201
    honest, lie = report(A, 1), replace(report(C, 1), samples=1 << 40)
    state, actions = run(state, [(3, honest), (4, lie)])
    assert of(Capped, actions) == [Capped(C, 1, 1 << 40, 3201)]
    assert kinds(actions) == ["Reply", "Capped", "Reply"]  # counted, not refused: it is still pulled
    assert state.round.reports[C].samples == 3201 and state.round.reports[A].samples == 10
    unknown = Member(peer_id=Z, joined_at=0, last_seen=0)  # no throughput reported yet: no bound
    assert plausible_samples(unknown, current, state.members) is None


def test_peer_joining_mid_round_is_expected_only_in_the_next():
    state, actions = run(initial_state(SEED), [(0, Join(A)), (1, Join(B))])
    assert kinds(actions) == ["Reply", "Announced", "Reply"]
    assert actions[2].fields["round"] == 0 and state.round.expected == (A,)
    state, actions = run(state, [(2, report(B, 0))])
    assert kinds(actions) == ["Refused"] and actions[0].code == "FAILED_PRECONDITION"
    state, actions = run(state, [(3, report(A, 0))])
    assert kinds(actions) == ["Reply", "Decided"]
    assert state.round.participants == (A,) and state.round.stragglers == () and state.members[B].strikes == 0
    state, actions = run(state, [(4, Heartbeat(A, 0))])
    assert kinds(actions) == ["Reply", "Announced"] and actions[1].round.expected == (A, B)


def test_all_reports_decide_before_the_deadline_with_sorted_participants():
    state = swarm(C, A, B)
    state, actions = run(state, [(3, report(C, 1)), (4, report(B, 1))])
    assert kinds(actions) == ["Reply", "Reply"] and state.round.decided_at is None
    state, actions = run(state, [(5, report(A, 1))])
    assert kinds(actions) == ["Reply", "Decided"]
    assert actions[0] == Reply({"included": True, "strikes": 0, "compute_scale": 1.0})
    decided = actions[1].round
    assert decided.decided_at == 5 < decided.compute_deadline
    assert decided.participants == (A, B, C) and decided.stragglers == () and state.round == decided
    assert {p: r.at for p, r in decided.reports.items()} == {C: 3, B: 4, A: 5}


def test_next_round_waits_for_every_participant_to_finish():
    state, _ = run(swarm(A, B), [(3, report(A, 1)), (3, report(B, 1))])
    assert state.round.decided_at == 3
    state, actions = run(state, [(4, Heartbeat(A, 1)), (5, Heartbeat(B, 0)), (6, Heartbeat(A)), (6, Tick())])
    assert of(Announced, actions) == [] and state.round.number == 1
    state, actions = run(state, [(7, Heartbeat(B, 1))])
    assert kinds(actions) == ["Reply", "Announced"]
    assert actions[1].round.number == 2 and actions[1].round.announced_at == 7
    assert state.history[-1].number == 1 and state.next_round == 3


def test_next_round_is_announced_at_the_exchange_deadline_at_the_latest():
    state, _ = run(swarm(A, B), [(3, report(A, 1)), (3, report(B, 1)), (4, Heartbeat(A, 1))])
    state, actions = run(state, [(16.9, Tick())])
    assert actions == []
    state, actions = run(state, [(17, Tick())])
    assert kinds(actions) == ["Announced"] and actions[0].round.number == 2
    assert actions[0].round.announced_at == 17 and actions[0].round.expected == (A, B)


OVERLAP = replace(P, overlap=True, min_start_members=2)


def test_with_overlap_the_next_round_is_announced_at_the_first_report_of_the_last():
    steps = [(0, Join(A)), (0, Join(B)), (1, report(A, 0))]
    state, actions = run(initial_state(SEED), steps, OVERLAP)
    assert kinds(actions)[-2:] == ["Reply", "Announced"]
    following = actions[-1].round
    assert following.number == 1 and following.announced_at == 1 and following.expected == (A, B)
    # its window starts at round 0's compute deadline (10): B may compute round 0 until then
    assert (following.compute_deadline, following.exchange_deadline) == (20, 25)
    # round 0 is still open: B, still computing it, reports it on time
    assert state.previous.number == 0 and state.previous.decided_at is None
    assert round_result(state, 0) is None and round_result(state, 1) is None
    state, actions = run(state, [(2, report(B, 0))], OVERLAP)
    assert kinds(actions) == ["Reply", "Decided"] and actions[0].fields["included"]
    assert actions[1].round.participants == (A, B) and actions[1].round.decided_at == 2
    assert state.previous is None and state.history[-1].number == 0 and state.round.number == 1
    # no heartbeat said round 0's exchange is over; its result stays available meanwhile
    assert round_result(state, 0).participants == (A, B)
    state, actions = run(state, [(3, report(B, 1))], OVERLAP)
    assert kinds(actions) == ["Reply", "Announced"] and actions[1].round.number == 2
    # not round 1's deadline (20): one window after the announcement at the latest
    assert actions[1].round.compute_deadline == 3 + 10 + 10
    assert state.previous.number == 1 and state.round.number == 2 and state.next_round == 3


def test_with_overlap_at_most_two_rounds_are_undecided():
    state, _ = run(initial_state(SEED), [(0, Join(A)), (0, Join(B)), (1, report(A, 0))], OVERLAP)
    # A runs a round ahead of B, and is done with round 1 before B is done with round 0
    state, actions = run(state, [(2, report(A, 1)), (3, Tick())], OVERLAP)
    assert kinds(actions) == ["Reply"] and state.next_round == 2
    assert round_result(state, 2).code == "OUT_OF_RANGE"
    state, actions = run(state, [(4, report(A, 2))], OVERLAP)
    assert kinds(actions) == ["Refused"] and actions[0].code == "OUT_OF_RANGE"
    # B's report decides round 0; round 1 already has a report, so round 2 follows at once
    state, actions = run(state, [(5, report(B, 0))], OVERLAP)
    assert kinds(actions) == ["Reply", "Decided", "Announced"]
    assert actions[1].round.number == 0 and actions[2].round.number == 2
    assert [r.number for r in (state.previous, state.round)] == [1, 2]
    assert [r.number for r in state.history] == [0]


def test_with_overlap_the_later_round_may_be_decided_first():
    state, _ = run(initial_state(SEED), [(0, Join(A)), (0, Join(B)), (1, report(A, 0))], OVERLAP)
    # B skipped round 0 (it joined the round in progress late): round 1 is complete first
    state, actions = run(state, [(2, report(A, 1)), (3, report(B, 1))], OVERLAP)
    assert kinds(actions) == ["Reply", "Reply", "Decided"] and actions[2].round.number == 1
    assert state.previous.number == 0 and state.round.decided_at == 3
    assert round_result(state, 1).participants == (A, B) and round_result(state, 0) is None
    # round 0 is decided at its deadline: B is its straggler; only then is round 2 announced
    end = state.previous.compute_deadline + OVERLAP.report_grace_s
    state, actions = run(state, [(end, Tick())], OVERLAP)
    assert kinds(actions) == ["Decided", "Struck", "Announced"]
    assert actions[0].round.stragglers == (B,) and actions[2].round.number == 2
    assert [r.number for r in state.history] == [0, 1] and state.previous is None


def test_with_overlap_a_report_finds_the_open_round_of_its_number():
    state, _ = run(initial_state(SEED), [(0, Join(A)), (0, Join(B)), (1, report(A, 0))], OVERLAP)
    state, actions = run(state, [(2, report(A, 0))], OVERLAP)
    assert actions[0].code == "ALREADY_EXISTS"
    state, actions = run(state, [(2, report(B, 0, digest=digest(A, 0)))], OVERLAP)
    assert actions[0].code == "ALREADY_EXISTS"  # A's payload of round 0
    state, actions = run(state, [(3, report(B, 1, digest=digest(A, 0)))], OVERLAP)
    assert actions[0].fields["included"]  # the same bytes in another round are another report
    state, _ = run(state, [(4, report(B, 0))], OVERLAP)
    assert [r.number for r in (state.previous, state.round)] == [1, 2]
    state, actions = run(state, [(5, report(A, 0, digest=digest(A, 9)))], OVERLAP)
    assert actions[0].code == "FAILED_PRECONDITION" and "is over" in actions[0].message


def test_with_overlap_a_heartbeat_from_ahead_abandons_both_open_rounds():
    state, _ = run(initial_state(SEED), [(0, Join(A)), (0, Join(B)), (1, report(A, 0))], OVERLAP)
    opened = (state.previous, state.round)
    state, actions = run(state, [(2, Heartbeat(B, 5))], OVERLAP)
    assert of(Abandoned, actions) == [Abandoned(opened[0]), Abandoned(opened[1])]
    assert of(Announced, actions)[0].round.number == 6
    assert state.previous is None and state.history == ()


def test_resume_gives_up_the_open_rounds_whose_deadline_passed():
    state, _ = run(initial_state(SEED), [(0, Join(A)), (0, Join(B)), (1, report(A, 0))], OVERLAP)
    older, newer = state.previous, state.round
    assert older.compute_deadline < newer.compute_deadline
    kept = resume(state, older.compute_deadline - 1)
    assert (kept.previous, kept.round) == (older, newer)
    halfway = resume(state, older.compute_deadline)
    assert halfway.previous is None and halfway.round == newer
    assert round_result(halfway, 0).code == "NOT_FOUND"
    # the older round lives on alone (the newer one had a shorter window): it is the round in progress
    lasting = replace(state, previous=replace(older, compute_deadline=newer.compute_deadline + 5))
    alone = resume(lasting, newer.compute_deadline)
    assert alone.round.number == 0 and alone.previous is None and alone.next_round == 2


def test_report_within_the_grace_still_counts():
    state, actions = run(swarm(A, B), [(3, report(A, 1)), (12.3, Tick()), (12.4, report(B, 1))])
    assert kinds(actions) == ["Reply", "Reply", "Decided"]
    assert actions[1].fields["included"] and state.round.participants == (A, B)


def test_report_after_the_grace_is_a_straggler_and_not_included():
    state, actions = run(swarm(A, B), [(3, report(A, 1)), (12.49, Tick())])
    assert state.round.decided_at is None
    state, actions = run(state, [(12.5, Tick())])
    assert kinds(actions) == ["Decided", "Struck"]
    assert actions[1] == Struck(B, 1, 1, 1.0)
    assert (
        state.round.participants == (A,) and state.round.stragglers == (B,) and state.round.decided_at == 12.5
    )
    assert state.members[B].strikes == 1 and state.stragglers_total == 1
    decided = state.round
    state, actions = run(state, [(13, report(B, 1))])
    assert actions == [Reply({"included": False, "strikes": 1, "compute_scale": 1.0})]
    assert state.round == decided


def test_report_after_the_grace_is_late_even_without_a_tick_before_it():
    state, actions = run(swarm(A, B), [(3, report(A, 1)), (15, report(B, 1))])  # deadline 12 + grace 0.5
    assert Reply({"included": True, "strikes": 0, "compute_scale": 1.0}) not in actions[1:]
    assert state.round.participants == (A,) and state.round.stragglers == (B,)
    assert state.members[B].strikes == 1


def strike_out(policy):
    """Rounds in which A reports and B never does, until B is evicted."""
    state, actions = swarm(A, B, policy=policy), []
    while B in state.members:
        state, more = cycle(state, [A], policy)
        actions += more
    return state, actions


@pytest.mark.parametrize(
    ("shrink_after", "evict_after", "min_scale", "scales"),
    [(2, 4, 0.125, [1.0, 0.5, 0.25, 0.125]), (1, 5, 0.25, [0.5, 0.25, 0.25, 0.25, 0.25])],
)
def test_strikes_shrink_the_compute_scale_then_evict(shrink_after, evict_after, min_scale, scales):
    policy = replace(P, shrink_after=shrink_after, evict_after=evict_after, min_scale=min_scale)
    state, actions = strike_out(policy)
    struck = of(Struck, actions)
    assert [(s.peer_id, s.strikes, s.compute_scale) for s in struck] == [
        (B, n + 1, scale) for n, scale in enumerate(scales)
    ]
    assert [s.round for s in struck] == list(range(1, 1 + evict_after))
    assert of(Dropped, actions) == [Dropped(B, "evicted")]
    assert actions[actions.index(Dropped(B, "evicted")) - 1] == struck[-1]
    last = state.history[-1]
    assert last.stragglers == (B,) and state.evicted == {B: last.decided_at + policy.eviction_s}
    assert (state.stragglers_total, state.evictions_total) == (evict_after, 1)
    assert state.round.expected == (A,)


def test_evicted_peer_may_join_again_once_the_eviction_ends():
    state, _ = strike_out(P)
    until, number = state.evicted[B], state.round.number
    for event, code in [
        (Join(B), "PERMISSION_DENIED"),
        (Heartbeat(B), "NOT_FOUND"),
        (report(B, 1), "NOT_FOUND"),
    ]:
        new, actions = run(state, [(until - 1, event)])
        assert [r.code for r in of(Refused, actions)] == [code] and isinstance(actions[-1], Refused)
        assert new == run(state, [(until - 1, Tick())])[0]  # only time moved
    state, actions = run(state, [(until, Join(B))])
    # by then time had decided round `number` (A never reported) and announced the next without B
    assert of(Reply, actions) == [Reply({"round": number + 1, "heartbeat_timeout_s": P.heartbeat_timeout_s})]
    assert state.round.number == number + 1 and B in state.members and B not in state.round.expected
    assert state.evicted == {} and state.members[B].strikes == 0 and state.members[B].compute_scale == 1.0


def test_on_time_reports_in_a_row_take_strikes_back():
    policy = replace(P, shrink_after=1, forgive_after=2)
    state, seen = swarm(A, B, policy=policy), []
    for reporters in [[A, B], [A], [A], [A, B], [A, B], [A, B], [A, B]]:
        state, actions = cycle(state, reporters, policy)  # A reports first, then B
        fields = actions[1].fields if B in reporters else {"struck": of(Struck, actions)[0].compute_scale}
        seen.append(tuple(fields.values()))
    # B's on-time report before its strikes does not count towards forgiving them
    assert seen == [
        (True, 0, 1.0),
        (0.5,),
        (0.25,),
        (True, 2, 0.25),
        (True, 1, 0.5),
        (True, 1, 0.5),
        (True, 0, 1.0),
    ]
    assert state.members[B].on_time == 0 and state.members[B].strikes == 0


def test_silent_member_is_dropped_without_a_strike_and_not_waited_for():
    policy = replace(P, heartbeat_timeout_s=6)
    state, actions = run(swarm(A, B, policy=policy), [(3, report(A, 1)), (5, Heartbeat(A, 0))], policy)
    assert state.round.decided_at is None and B in state.members
    state, actions = run(state, [(6.5, Heartbeat(A, 0))], policy)
    assert actions[:2] == [Dropped(B, "silent"), Decided(state.round)]  # time first, then the request
    assert state.round.participants == (A,) and state.round.stragglers == ()
    assert B not in state.members and state.stragglers_total == 0


def test_member_silent_too_long_is_dropped_even_if_it_speaks_before_a_tick():
    policy = replace(P, heartbeat_timeout_s=6)
    _, actions = run(swarm(A, B, policy=policy), [(3, report(A, 1)), (50, Heartbeat(B, 0))], policy)
    assert [r.code for r in of(Refused, actions)] == ["NOT_FOUND"]  # "... silent too long: join"


def test_leave_drops_without_a_strike_and_the_round_decides_without_it():
    state, actions = run(swarm(A, B, C), [(3, report(A, 1)), (4, report(B, 1)), (5, Leave(C))])
    assert actions[2:] == [Reply({}), Dropped(C, "left"), Decided(state.round)]
    assert state.round.participants == (A, B) and state.round.stragglers == () and C not in state.members
    assert run(state, [(6, report(C, 1))])[1][0].code == "NOT_FOUND"


BAD_DIGEST = digest(B, 1)[:31]
REFUSALS = [
    (Report(Z, 1, digest(Z, 1), 100, 10), "NOT_FOUND", P),
    (Heartbeat(Z), "NOT_FOUND", P),
    (Leave(Z), "NOT_FOUND", P),
    (Join("not a peer id"), "INVALID_ARGUMENT", P),
    (Join("QmPeer0000000000000000"), "INVALID_ARGUMENT", P),
    (Join("QmShortPeer"), "INVALID_ARGUMENT", P),
    (Join(C, throughput=math.nan), "INVALID_ARGUMENT", P),
    (Join(C, min_samples=-1), "INVALID_ARGUMENT", P),
    (Heartbeat(B, throughput=math.inf), "INVALID_ARGUMENT", P),
    (Heartbeat(B, exchange_s=math.nan), "INVALID_ARGUMENT", P),
    (Heartbeat(B, round=-2), "INVALID_ARGUMENT", P),
    (Heartbeat(B, round=3 + MAX_ROUND_JUMP), "INVALID_ARGUMENT", P),
    (report(B, 1, digest=BAD_DIGEST), "INVALID_ARGUMENT", P),
    (report(B, 1, state=b"\x01" * 5), "INVALID_ARGUMENT", P),
    (Report(B, 1, digest(B, 1), size=0, samples=10), "INVALID_ARGUMENT", P),
    (Report(B, 1, digest(B, 1), size=100, samples=-1), "INVALID_ARGUMENT", P),
    (report(B, 2), "OUT_OF_RANGE", P),
    (report(B, 0), "FAILED_PRECONDITION", P),
    (report(A, 1, digest=digest(A, 99)), "ALREADY_EXISTS", P),
    (report(B, 1, digest=digest(A, 1)), "ALREADY_EXISTS", P),
    (Join(C), "RESOURCE_EXHAUSTED", replace(P, max_members=2)),
]


@pytest.mark.parametrize(("event", "code", "policy"), REFUSALS)
def test_refused_request_has_its_code_and_leaves_the_state_as_it_was(event, code, policy):
    state, _ = run(swarm(A, B), [(3, report(A, 1))])
    new, actions = transition(state, 5, event, policy)  # 5: before the deadline, time changes nothing
    assert kinds(actions) == ["Refused"] and actions[0].code == code
    assert new is state


def test_report_before_any_round_is_out_of_range():
    # just restarted, A not heard from yet: nothing is announced
    member = Member(peer_id=A, joined_at=0, last_seen=0, heard=False)
    state = replace(initial_state(SEED), members={A: member}, resumed_at=0.0)
    assert transition(state, 0, report(A, 0), P)[1][0].code == "OUT_OF_RANGE"


@pytest.mark.parametrize("quantile", [0.5, 0.9, 1.0])
@pytest.mark.parametrize("n", [1, 2, 3, 7, 10, 11])
def test_compute_window_fits_the_quantile_of_the_members(quantile, n):
    policy = Policy(quantile=quantile, headroom=1.5, min_compute_s=0.1, max_compute_s=1000)
    members = {"unknown": member("unknown", 0.0, 10**9)}  # no throughput yet: not counted
    times = [((i * 7) % 13 + 1) / 2 for i in range(n)]
    members |= {f"p{i}": member(f"p{i}", 2.0, int(t * 2)) for i, t in enumerate(times)}
    window = compute_window(members, policy)
    assert sum(t * 1.5 <= window for t in times) >= math.ceil(quantile * n)
    assert sum(t * 1.5 < window for t in times) < math.ceil(quantile * n)  # and no longer than that


def member(peer_id, throughput, min_samples):
    return Member(peer_id=peer_id, joined_at=0, last_seen=0, throughput=throughput, min_samples=min_samples)


@pytest.mark.parametrize(
    ("rates", "window"),
    [([], 5.0), ([(0.0, 100)], 5.0), ([(10.0, 1)], 5.0), ([(1.0, 30)], 45.0), ([(1.0, 1000)], 100.0)],
)
def test_compute_window_is_clamped(rates, window):
    members = {f"p{i}": member(f"p{i}", rate, n) for i, (rate, n) in enumerate(rates)}
    assert compute_window(members, replace(P, min_compute_s=5.0)) == window


def test_announced_windows_follow_members_and_reported_exchange_times():
    state, _ = run(swarm(A, B), [(3, report(A, 1)), (3, report(B, 1))])
    steps = [(4, Heartbeat(A, 1, throughput=4.0, min_samples=160, exchange_s=8.0))]
    steps += [(5, Heartbeat(B, 1, throughput=10.0, min_samples=100, exchange_s=2.0))]
    state, actions = run(state, steps)
    announced = of(Announced, actions)[0].round
    assert state.exchange_times == (8.0, 2.0)
    assert announced.compute_deadline - announced.announced_at == 60.0  # the slower: 40 s, times 1.5
    assert announced.exchange_deadline - announced.compute_deadline == 12.0  # 8 s times 1.5


@pytest.mark.parametrize(
    ("times", "window"),
    [((), 5.0), ((1.0,), 2.0), (tuple(range(1, 11)), 13.5), ((10.0, 500.0), 300.0), ((1.0, 2.0, 3.0), 4.5)],
)
def test_exchange_window_is_the_clamped_quantile_of_reported_times(times, window):
    assert exchange_window(times, P) == window


def test_only_recent_exchange_times_are_kept():
    state, _ = run(swarm(A), [(3, Heartbeat(A, exchange_s=float(i + 1))) for i in range(40)])
    assert state.exchange_times == tuple(float(i) for i in range(41 - KEEP_EXCHANGE_TIMES, 41))


def test_heartbeat_ahead_abandons_the_undecided_round_and_the_numbering_goes_on():
    state, _ = run(swarm(A, B), [(3, report(A, 1))])
    abandoned = state.round
    state, actions = run(state, [(4, Heartbeat(B, 5))])
    assert kinds(actions) == ["Reply", "Abandoned", "Announced"]
    assert actions[1] == Abandoned(abandoned) and actions[2].round.number == 6 and state.next_round == 7
    assert [r.number for r in state.history] == [0] and state.members[B].round == 5
    assert all(m.strikes == 0 for m in state.members.values()) and state.stragglers_total == 0
    assert round_result(state, 1).code == "NOT_FOUND"


def test_heartbeat_ahead_of_a_decided_round_only_moves_the_numbering():
    state, _ = run(swarm(A, B), [(3, report(A, 1)), (3, report(B, 1)), (4, Heartbeat(A, 9))])
    assert state.round.number == 1 and state.round.decided_at == 3 and state.next_round == 10
    state, actions = run(state, [(5, Heartbeat(B, 1))])
    assert kinds(actions) == ["Reply", "Announced"] and actions[1].round.number == 10
    assert state.history[-1].participants == (A, B)


def finished_round_one(policy=P):
    state, _ = run(swarm(A, B, policy=policy), [(3, report(A, 1)), (3, report(B, 1))], policy)
    return state


def test_after_resume_nothing_is_announced_until_every_member_is_heard():
    state = resume(finished_round_one(), 100)
    assert state.resumed_at == 100 and not any(m.heard for m in state.members.values())
    state, actions = run(state, [(100, Tick()), (101, Heartbeat(A, 1)), (102, Tick())])
    assert of(Announced, actions) == []
    state, actions = run(state, [(103, Heartbeat(B, 1))])
    assert kinds(actions) == ["Reply", "Announced"] and actions[1].round.number == 2


def test_after_resume_rounds_go_on_after_one_heartbeat_timeout():
    policy = replace(P, heartbeat_timeout_s=6)
    state = resume(finished_round_one(policy), 100)
    state, actions = run(state, [(101, Heartbeat(A, 1)), (105.9, Tick())], policy)
    assert of(Announced, actions) == []
    state, actions = run(state, [(106, Tick())], policy)
    assert kinds(actions) == ["Announced"] and actions[0].round.number == 2


def test_round_result():
    state, _ = run(swarm(A, B), [(3, report(A, 1))])
    assert round_result(state, 1) is None
    assert round_result(state, 2).code == "OUT_OF_RANGE"
    assert round_result(state, 0).participants == (A,)
    state, _ = run(state, [(4, report(B, 1))])
    assert round_result(state, 1) is state.round and state.round.participants == (A, B)
    while state.round.number < KEEP_ROUNDS + 4:
        state, _ = cycle(state, [A, B])
    assert len(state.history) == KEEP_ROUNDS
    oldest = state.history[0].number
    assert round_result(state, oldest) is state.history[0]
    assert round_result(state, oldest - 1).code == "NOT_FOUND"
    assert round_result(initial_state(SEED), 0).code == "OUT_OF_RANGE"


def test_round_result_of_a_kept_round_after_an_abandonment():
    state = resume(run(swarm(A, B), [(3, report(A, 1))])[0], 100)
    state, _ = run(state, [(101, Heartbeat(A, 5))])
    assert state.round is None and [r.number for r in state.history] == [0]
    assert round_result(state, 0) is state.history[0]


def test_data_seed_is_deterministic_and_differs_per_round():
    seeds = [data_seed(SEED, n) for n in range(200)]
    assert seeds == [data_seed(SEED, n) for n in range(200)] and len(set(seeds)) == 200
    assert all(0 <= s < 2**63 for s in seeds) and data_seed(SEED + 1, 0) != seeds[0]
    state, _ = cycle(swarm(A), [A])
    assert [r.data_seed for r in (*state.history, state.round)] == seeds[:3]
