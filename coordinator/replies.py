"""The replies every member of a round is sent alike, built from the round state machine's decisions
(shoal.coordinator.rounds): pure functions, no I/O."""

from shoal.coordinator.state import Round
from shoal.protocol import coordinator_pb2 as pb
from shoal.protocol.rules import TALLY_HOLDERS, choose, eligible


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
    only the `gather` participants chosen by the peers' own rule among those on the majority's state
    and claiming within belief (shoal.protocol.rules, seeded with the round's data seed), and a tally
    of every participant's state for the state vote, so that the reply grows with G, not with the
    swarm."""
    participants = decided.participants
    reply = pb.RoundResultReply(
        round=decided.number,
        stragglers=decided.stragglers,
        exchange_deadline=decided.exchange_deadline,
        now=now,
    )
    if gather and len(participants) > gather:
        seed = decided.data_seed.to_bytes(8, "little")
        states = {p.encode(): (decided.reports[p].state, decided.reports[p].synced) for p in participants}
        claims = {p.encode(): decided.reports[p].samples for p in participants}
        chosen = choose(seed, decided.number, eligible(states, claims), gather)
        votes: dict[tuple[bytes, bool], list[str]] = {}
        for peer_id in participants:
            report = decided.reports[peer_id]
            votes.setdefault((report.state, report.synced), []).append(peer_id)
        reply.votes.extend(
            pb.StateVote(state=state, synced=synced, count=len(holders), holders=holders[:TALLY_HOLDERS])
            for (state, synced), holders in sorted(votes.items())
        )
        reply.reported = len(participants)
        participants = tuple(p for p in participants if p.encode() in chosen)
    reply.participants.extend(
        pb.Participant(
            peer_id=r.peer_id, digest=r.digest, size=r.size, samples=r.samples, state=r.state, synced=r.synced
        )
        for r in (decided.reports[p] for p in participants)
    )
    return reply
