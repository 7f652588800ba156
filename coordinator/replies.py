"""The replies every member of a round is sent alike, built from the round state machine's decisions
(shoal.coordinator.rounds): pure functions, no I/O."""

from shoal.coordinator.state import Round
from shoal.protocol import coordinator_pb2 as pb
from shoal.protocol.rules import TALLY_HOLDERS, choose, eligible, weighed

ROTATION_SEED = b"shoal-coordinator"
"""The bounded fan-in's rotation seed: one for every round, so that in each cycle every candidate counts
its fair share (shoal.protocol.rules). A seed new every round (the round's data seed, until 2026-12-07)
made each round an independent draw: over 15 rounds of 2 of 3, one member counted 7 times, another 12.
Grinding a key for a place in the order buys nothing: the rotation gives each candidate the same share
whatever its place."""


def announcement(announced: Round, now: float) -> pb.RoundAnnouncement:
    return pb.RoundAnnouncement(
        round=announced.number,
        compute_deadline=announced.compute_deadline,
        exchange_deadline=announced.exchange_deadline,
        data_seed=announced.data_seed,
        peers=announced.expected,
        now=now,
    )


def result_reply(decided: Round, now: float, gather: int = 0) -> pb.RoundResultReply:
    """A decided round's result. With a bounded fan-in (`gather` > 0, fewer participants than that):
    only the `gather` participants chosen by the peers' own rule among those on the state earned votes
    hold and claiming within belief (`chosen`), and a tally of every participant's state for the state
    vote, so that the reply grows with G, not with the swarm. Where any participant earned its vote
    (`Round.earned`), a state's count is its earned votes: a peer reading the tally (`tallied`) then
    picks what earned votes hold, as it would by itself (shoal.protocol.rules.weighed), and a thousand
    fresh identities count nothing."""
    participants = decided.participants
    reply = pb.RoundResultReply(
        round=decided.number,
        stragglers=decided.stragglers,
        exchange_deadline=decided.exchange_deadline,
        now=now,
    )
    if gather and len(participants) > gather:
        picked = chosen(decided, gather)
        weighs = set(decided.earned) & set(participants)
        votes: dict[tuple[bytes, bool], list[str]] = {}
        for peer_id in participants:
            report = decided.reports[peer_id]
            votes.setdefault((report.state, report.synced), []).append(peer_id)
        reply.votes.extend(
            pb.StateVote(
                state=state,
                synced=synced,
                count=len(weighs.intersection(holders)) if weighs else len(holders),
                holders=holders[:TALLY_HOLDERS],
            )
            for (state, synced), holders in sorted(votes.items())
        )
        reply.reported = len(participants)
        participants = tuple(p for p in participants if p in picked)
    reply.participants.extend(
        pb.Participant(
            peer_id=r.peer_id, digest=r.digest, size=r.size, samples=r.samples, state=r.state, synced=r.synced
        )
        for r in (decided.reports[p] for p in participants)
    )
    return reply


def chosen(decided: Round, gather: int) -> frozenset[str]:
    """The participants whose payloads count in a decided round under a bounded fan-in of `gather`
    (every participant when there are no more), by the peers' own rule (shoal.protocol.rules.choose,
    its rotation seeded with `ROTATION_SEED`) among those on the state its earned votes hold (its headcount's
    while no participant has earned one) and claiming within belief."""
    participants = decided.participants
    if not gather or len(participants) <= gather:
        return frozenset(participants)
    states, weights = _ballots(decided)
    claims = {p.encode(): decided.reports[p].samples for p in participants}
    picked = choose(ROTATION_SEED, decided.number, eligible(states, claims, weights), gather)
    return frozenset(p for p in participants if p.encode() in picked)


def counted(decided: Round, gather: int) -> tuple[str, ...]:
    """The participants whose contributions counted in a decided round, for the votes they earn
    (shoal.protocol.work): the chosen (`chosen`) on the round's agreed state; none where only one did
    (a round no other participant checked earns nothing)."""
    states, weights = _ballots(decided)
    agreed, _ = weighed(states, weights)
    reports = decided.reports
    on_state = [p for p in sorted(chosen(decided, gather)) if reports[p].state in (b"", agreed)]
    return tuple(on_state) if len(on_state) > 1 else ()


def _ballots(decided: Round) -> tuple[dict[bytes, tuple[bytes, bool]], dict[bytes, int]]:
    """The round's state votes {peer: (state, synced)} and what each weighs {peer: 0 or 1}."""
    states = {p.encode(): (r.state, r.synced) for p, r in decided.reports.items()}
    earned = set(decided.earned)
    return states, {p.encode(): int(p in earned) for p in decided.reports}
