"""A coordinator with a bounded fan-in (`shoal coordinator --gather G`) chooses the round's payloads
itself: its result lists the G chosen and tallies every participant's state (replies.result_reply),
and a peer reads that tally back as the round's vote (coordinated.tally_of)."""

from collections import Counter
from dataclasses import replace

from shoal.coordinator.events import Heartbeat, Join, Report, Tick
from shoal.coordinator.policy import Policy
from shoal.coordinator.replies import ROTATION_SEED, result_reply
from shoal.coordinator.rounds import initial_state, transition
from shoal.coordinator.state import PayloadReport, Round
from shoal.peer.swarm.coordinated import tally_of
from shoal.protocol import TALLY_HOLDERS
from shoal.protocol import coordinator_pb2 as pb
from shoal.protocol.rules import choose, tallied
from shoal.protocol.work import EARN_ROUNDS, earned

S1, S2 = b"\x01" * 32, b"\x02" * 32
BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
PEERS = [f"12D3KooW{BASE58[i] * 44}" for i in range(10)]


def decided(number: int, samples: dict[str, int], states: dict[str, bytes] | None = None) -> Round:
    states = states or {}
    reports = {
        p: PayloadReport(
            peer_id=p, digest=bytes([i]) * 32, size=100, samples=n, state=states.get(p, S1), synced=True
        )
        for i, (p, n) in enumerate(samples.items())
    }
    return Round(
        number=number,
        announced_at=0.0,
        compute_deadline=1.0,
        exchange_deadline=2.0,
        data_seed=1234 + number,
        expected=tuple(sorted(samples)),
        reports=reports,
        decided_at=1.5,
    )


def test_the_result_lists_the_g_of_the_rotation_on_the_majority_state_and_tallies_every_state():
    samples = {p: 10 for p in PEERS}
    samples[PEERS[3]] = samples[PEERS[7]] = 2**40  # beyond belief: no slot (and 640 would buy none)
    states = {PEERS[0]: S2, PEERS[1]: S2}  # another state: their payloads cannot count, nor take a slot
    for number in range(8):
        reply = result_reply(decided(number, samples, states), 9.0, gather=3)
        listed = [p.peer_id for p in reply.participants]
        assert len(listed) == 3 and listed == sorted(listed)
        assert not {PEERS[0], PEERS[1], PEERS[3], PEERS[7]} & set(listed)
        candidates = [p.encode() for p in PEERS[2:] if p not in (PEERS[3], PEERS[7])]
        assert {p.encode() for p in listed} == choose(ROTATION_SEED, number, candidates, 3)
    assert reply.reported == 10
    assert {(v.state, v.synced): v.count for v in reply.votes} == {(S1, True): 8, (S2, True): 2}
    assert all(len(v.holders) == min(v.count, TALLY_HOLDERS) for v in reply.votes)
    tally = tally_of(reply)
    assert tally.votes == Counter({(S1, True): 8, (S2, True): 2}) and set(tally.holders[S2]) == set(PEERS[:2])


def test_equal_claims_rotate_from_round_to_round_and_a_small_round_lists_everyone():
    samples = {p: 10 for p in PEERS}
    chosen = [
        frozenset(p.peer_id for p in result_reply(decided(n, samples), 0.0, 2).participants) for n in range(6)
    ]
    assert len(set(chosen)) > 1  # the draw is new every round
    everyone = result_reply(decided(1, dict(list(samples.items())[:2])), 0.0, gather=2)
    assert len(everyone.participants) == 2 and not everyone.votes and everyone.reported == 0
    assert tally_of(everyone) is None  # the peers vote among the listed themselves
    assert len(result_reply(decided(1, samples), 0.0, gather=0).participants) == 10


def test_a_peer_drops_what_is_malformed_in_a_tally():
    reply = pb.RoundResultReply(
        votes=[
            pb.StateVote(state=S1, synced=True, count=3, holders=[PEERS[0], "not a peer id", PEERS[1]]),
            pb.StateVote(state=b"short", synced=True, count=100, holders=[PEERS[2]]),
            pb.StateVote(state=S2, synced=True, count=1, holders=[PEERS[i] for i in range(9)]),
        ]
    )
    tally = tally_of(reply)
    assert tally.votes == Counter({(S1, True): 3, (S2, True): 1})
    assert tally.holders[S1] == (PEERS[0], PEERS[1]) and len(tally.holders[S2]) == TALLY_HOLDERS


def test_the_tally_counts_votes_earned_by_work_and_a_sybil_majority_buys_no_slot():
    """Three members counted together for EARN_ROUNDS rounds have earned their votes; then 6 fresh
    identities claim another state, in sync: the tally counts what was earned (they count 0), the state
    peers read from it is the members', and the fan-in gives the newcomers no slot."""
    policy = Policy(
        min_compute_s=10, max_compute_s=100, initial_exchange_s=5, heartbeat_timeout_s=1e6, gather=2
    )
    honest, sybils = PEERS[:3], PEERS[3:9]
    state, now = initial_state(7), 0.0

    def step(event):
        nonlocal state
        state, _ = transition(state, now, event, policy)

    def play(reporters):
        nonlocal now
        current = state.round
        now = current.announced_at + 1
        for i, p in enumerate(reporters):
            forged = p in sybils
            step(
                Report(
                    p,
                    current.number,
                    bytes([current.number % 256, i]) * 16,
                    100,
                    10,
                    S2 if forged else S1,
                    True,
                )
            )
        now = current.compute_deadline + policy.report_grace_s
        step(Tick())
        now += 1
        for p in reporters:
            step(Heartbeat(p, current.number))
        return next(r for r in (*state.history, state.round) if r.number == current.number)

    for p in honest:
        step(Join(p))
    for _ in range(2 * EARN_ROUNDS):  # (gather 2 of 3: each counts in two rounds of every three)
        play(honest)
    assert all(earned(state.counted[p], state.next_round) for p in honest)
    for p in sybils:
        step(Join(p))
    play(honest)  # (the Sybils are expected from the next round)
    decided = play([*honest, *sybils])
    assert set(decided.earned) == set(honest)
    reply = result_reply(decided, 0.0, gather=2)
    tally = tally_of(reply)
    assert tally is not None and tally.votes[(S1, True)] == 3 and tally.votes[(S2, True)] == 0
    assert tallied(tally.votes) == S1
    assert {p.peer_id for p in reply.participants} <= set(honest)
    assert not set(state.counted) & set(sybils)  # their contributions, on another state, never counted
    # before anyone earned a vote, the headcount decides, as on the peers (the coordinator admitted them)
    young = replace(decided, earned=())
    assert tallied(tally_of(result_reply(young, 0.0, gather=2)).votes) == S2
