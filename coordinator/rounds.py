"""The coordinator's round state machine: `transition(state, now, event, policy) -> (state, actions)`.

Pure: no clock, no I/O, no randomness (the swarm's seed is part of the state). The gRPC layer
(shoal.coordinator.server) turns each request into an event, applies the transition, persists the new
state and carries out the actions; a ticker sends `Tick` so that deadlines fire without requests.

Life of round r (times are the coordinator's Unix seconds):

    announce at A      the members of that moment are the round's `expected` peers (their order is
                       their data slots); compute deadline C = A + compute window,
                       exchange deadline E = C + exchange window
    reports until C    a member's payload is ready (digest, size, samples); a report after C (plus
                       `report_grace_s` of network slack) leaves the member out of the round
    decide             at C, or as soon as every expected member still alive has reported: the
                       participant set is exactly the on-time reports; each expected member that missed
                       is a straggler and gets a strike (unless no one made it)
    exchange           participants pull each other's payloads; round r + 1 is announced as soon as every
                       participant says (heartbeat) it finished r, and at E at the latest

With `overlap` (DiLoCo's eager and delayed outer updates, overlapped DeMo), peers exchange round r while
they compute r + 1, so r + 1 need not wait for r's exchange, nor for its decision: it is announced as
soon as the first member reports r. A peer done with r then starts r + 1 at once instead of waiting for
the slowest peer's report. Round r still takes reports until its own deadline and is decided as above;
at most two rounds are undecided at a time (`previous` and `round`), so r + 2 waits for r's decision.
The compute window of a round announced while the last is undecided starts at the last one's compute
deadline if that is later, so that a peer may use all of r's window (window-filling peers report just
before it) and still have a whole one for r + 1; but one window from the announcement at the latest,
so that rounds whose peers finish early do not push the deadlines ever later.

Adaptive windows: the compute window lets at least a fraction `quantile` of the members finish their
smallest contribution (`min_samples / throughput`, times `headroom`), clamped to
[min_compute_s, max_compute_s]; the exchange window follows the same quantile of the members' recent
exchange times. Stragglers: from `shrink_after` strikes a member is told to use half its compute
window (down to `min_scale`); at `evict_after` strikes it is evicted for `eviction_s`, after which it
may join again; `forgive_after` on-time reports in a row take a strike back and double its scale.
Members silent for `heartbeat_timeout_s` are dropped at once.

State votes: a participant counted (on the round's agreed state, and chosen under `gather`) in
`EARN_ROUNDS` of the last `WORK_WINDOW` decided rounds has earned a vote (shoal.protocol.work;
`SwarmState.counted`, `Round.earned`); a bounded fan-in's tally counts earned votes, not heads, so that
identities that cost nothing cannot pick the round's state (shoal.coordinator.replies).

Round numbers only grow: a member that kept training while the coordinator was unreachable reports a
later round in its heartbeat, and the next announcement continues after it (an undecided round it has
passed is abandoned, without strikes). After a restart (`resume`), nothing is announced until every
member has been heard from again, or one heartbeat timeout has passed.

The records are in shoal.coordinator.state (the swarm), .events (what happens to it) and .actions
(what the server is to do); the windows and the sample bound in .policy; the checks of untrusted
request fields in .validation.
"""

import hashlib
import math
from dataclasses import replace
from typing import cast

from shoal.coordinator.actions import (
    Abandoned,
    Action,
    Announced,
    Capped,
    Decided,
    Dropped,
    Refused,
    Reply,
    Struck,
)
from shoal.coordinator.events import Event, Heartbeat, Join, Leave, Report, Tick
from shoal.coordinator.policy import Policy, compute_window, exchange_window, plausible_samples
from shoal.coordinator.replies import counted
from shoal.coordinator.state import Member, PayloadReport, Round, SwarmState
from shoal.coordinator.validation import check_member, check_payload, check_peer_id, check_progress
from shoal.protocol.work import earned, recorded

MAX_ROUND_JUMP = 1_000_000  # how far ahead a heartbeat may put the round numbering
KEEP_ROUNDS = 8  # decided rounds whose results stay available
KEEP_EXCHANGE_TIMES = 32


def initial_state(seed: int) -> SwarmState:
    return SwarmState(seed=seed)


def resume(state: SwarmState, now: float) -> SwarmState:
    """The state of a restarted coordinator: members count as alive from now (they could not reach it
    while it was down) but must be heard from again before a round is announced; an undecided round
    whose compute deadline passed meanwhile is abandoned."""
    members = {p: replace(m, last_seen=now, heard=False) for p, m in state.members.items()}

    def kept(pending: Round | None) -> Round | None:
        # its peers gave up on it and finished it uncoordinated: no strikes for them
        gave_up = pending is not None and pending.decided_at is None and pending.compute_deadline <= now
        return None if gave_up else pending

    current, previous = kept(state.round), kept(state.previous)
    if current is None:  # the older round, if it lives on, is the one in progress
        current, previous = previous, None
    return replace(state, members=members, round=current, previous=previous, resumed_at=now)


def transition(
    state: SwarmState, now: float, event: Event, policy: Policy
) -> tuple[SwarmState, list[Action]]:
    """Lets time advance to `now` (deadlines and silences fire before a request is judged), applies
    `event`, then lets the rounds advance again. Request events yield exactly one `Reply` or `Refused`;
    a refused request changes nothing but what time alone changed."""
    state, actions = _advance(state, now, policy)
    match event:
        case Join():
            state, answer = _join(state, now, event, policy)
        case Leave():
            state, answer = _leave(state, event)
        case Heartbeat():
            state, answer = _heartbeat(state, now, event, policy)
        case Report():
            state, answer = _report(state, now, event, policy)
        case Tick():
            return state, actions
        case _:
            raise TypeError(f"not an event: {event!r}")
    if any(isinstance(a, Refused) for a in answer):
        return state, actions + answer
    state, more = _advance(state, now, policy)
    return state, actions + answer + more


def round_result(state: SwarmState, number: int) -> Round | Refused | None:
    """The decided round `number`; None while it is undecided; Refused if it is unknown."""
    if number >= state.next_round:
        return Refused(
            "OUT_OF_RANGE", f"round {number} has not been announced (the next is {state.next_round})"
        )
    for candidate in (state.round, state.previous, *reversed(state.history)):
        if candidate is not None and candidate.number == number:
            return candidate if candidate.decided_at is not None else None
    return Refused(
        "NOT_FOUND", f"round {number} is unknown, abandoned or too old (the last {KEEP_ROUNDS} are kept)"
    )


def data_seed(seed: int, round_number: int) -> int:
    """The round's data seed: a hash of the swarm's seed and the round number (63 bits)."""
    data = seed.to_bytes(8, "little", signed=False) + round_number.to_bytes(8, "little")
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") >> 1


# --- requests ---


def _join(state: SwarmState, now: float, event: Join, policy: Policy) -> tuple[SwarmState, list[Action]]:
    refusal = check_peer_id(event.peer_id) or check_progress(event.throughput, event.min_samples)
    if refusal:
        return state, [refusal]
    until = state.evicted.get(event.peer_id)
    if until is not None and now < until:
        return state, [
            Refused(
                "PERMISSION_DENIED",
                f"evicted as a repeated straggler; join again in {until - now:.0f} s",
            )
        ]
    member = state.members.get(event.peer_id)
    if member is None and len(state.members) >= policy.max_members:
        return state, [Refused("RESOURCE_EXHAUSTED", f"the swarm is full ({policy.max_members} members)")]
    if member is None:
        member = Member(peer_id=event.peer_id, joined_at=now, last_seen=now)
    member = replace(
        member,
        last_seen=now,
        heard=True,
        throughput=event.throughput or member.throughput,
        min_samples=event.min_samples or member.min_samples,
    )
    evicted = {p: t for p, t in state.evicted.items() if p != event.peer_id}
    state = replace(state, members={**state.members, event.peer_id: member}, evicted=evicted)
    current = state.round.number if state.round and state.round.decided_at is None else state.next_round
    return state, [Reply({"round": current, "heartbeat_timeout_s": policy.heartbeat_timeout_s})]


def _leave(state: SwarmState, event: Leave) -> tuple[SwarmState, list[Action]]:
    refusal = check_peer_id(event.peer_id) or check_member(state, event.peer_id)
    if refusal:
        return state, [refusal]
    members = {p: m for p, m in state.members.items() if p != event.peer_id}
    return replace(state, members=members), [Reply({}), Dropped(event.peer_id, "left")]


def _heartbeat(
    state: SwarmState, now: float, event: Heartbeat, policy: Policy
) -> tuple[SwarmState, list[Action]]:
    refusal = (
        check_peer_id(event.peer_id)
        or check_member(state, event.peer_id)
        or check_progress(event.throughput, event.min_samples)
    )
    if refusal:
        return state, [refusal]
    if not -1 <= event.round <= state.next_round + MAX_ROUND_JUMP:
        return state, [Refused("INVALID_ARGUMENT", f"round {event.round} is not a round of this swarm")]
    if not (math.isfinite(event.exchange_s) and 0 <= event.exchange_s <= 1e6):
        return state, [Refused("INVALID_ARGUMENT", f"exchange_s {event.exchange_s} is not a duration")]
    member = state.members[event.peer_id]
    member = replace(
        member,
        last_seen=now,
        heard=True,
        round=max(member.round, event.round),
        throughput=event.throughput or member.throughput,
        min_samples=event.min_samples or member.min_samples,
    )
    state = replace(state, members={**state.members, event.peer_id: member})
    if event.exchange_s > 0:
        state = replace(
            state, exchange_times=(*state.exchange_times, event.exchange_s)[-KEEP_EXCHANGE_TIMES:]
        )
    actions: list[Action] = [Reply({"compute_scale": member.compute_scale})]
    if event.round >= state.next_round:  # it trained on while the coordinator was away: catch up
        state = replace(state, next_round=event.round + 1)
        if state.previous is not None:
            actions.append(Abandoned(state.previous))
            state = replace(state, previous=None)
        if state.round is not None and state.round.decided_at is None:
            actions.append(Abandoned(state.round))
            state = replace(state, round=None)
    return state, actions


def _report(state: SwarmState, now: float, event: Report, policy: Policy) -> tuple[SwarmState, list[Action]]:
    refusal = check_peer_id(event.peer_id) or check_member(state, event.peer_id) or check_payload(event)
    if refusal:
        return state, [refusal]
    latest = state.round
    if latest is None or event.round > latest.number:
        shown = "none yet" if latest is None else f"the current one is {latest.number}"
        return state, [Refused("OUT_OF_RANGE", f"round {event.round} has not been announced ({shown})")]
    current = next((r for r in (latest, state.previous) if r is not None and r.number == event.round), None)
    if current is None:
        return state, [
            Refused("FAILED_PRECONDITION", f"round {event.round} is over; the current one is {latest.number}")
        ]
    if event.peer_id in current.reports:
        return state, [Refused("ALREADY_EXISTS", f"already reported a payload for round {event.round}")]
    if event.peer_id not in current.expected:
        return state, [
            Refused(
                "FAILED_PRECONDITION", f"not expected in round {event.round} (joined after it was announced)"
            )
        ]
    if any(r.digest == event.digest for r in current.reports.values()):
        return state, [Refused("ALREADY_EXISTS", "another member reported this payload for this round")]
    member = replace(state.members[event.peer_id], last_seen=now, heard=True)
    state = replace(state, members={**state.members, event.peer_id: member})
    if current.decided_at is not None:  # late: it was struck when the round was decided
        return state, [
            Reply({"included": False, "strikes": member.strikes, "compute_scale": member.compute_scale})
        ]
    member = replace(member, on_time=member.on_time + 1)
    if member.on_time >= policy.forgive_after:
        scale = min(1.0, member.compute_scale * 2) if member.strikes else member.compute_scale
        member = replace(member, strikes=max(0, member.strikes - 1), compute_scale=scale, on_time=0)
    bound = plausible_samples(member, current, state.members)
    capped: list[Action] = []
    if bound is not None and event.samples > bound:
        capped = [Capped(event.peer_id, event.round, event.samples, bound)]
    report = PayloadReport(
        peer_id=event.peer_id,
        digest=event.digest,
        size=event.size,
        samples=event.samples if not capped else cast(int, bound),  # capped only when bound is an int
        state=event.state,
        synced=event.synced,
        at=now,
    )
    state = _put(state, replace(current, reports={**current.reports, event.peer_id: report}))
    state = replace(state, members={**state.members, event.peer_id: member})
    return state, [
        *capped,
        Reply({"included": True, "strikes": member.strikes, "compute_scale": member.compute_scale}),
    ]


# --- time ---


def _advance(state: SwarmState, now: float, policy: Policy) -> tuple[SwarmState, list[Action]]:
    """What time alone does: drops silent members, decides the round, announces the next one."""
    actions: list[Action] = []
    if now - state.seen_floor > policy.heartbeat_timeout_s:  # someone may be silent: look (O(members))
        silent = [p for p, m in state.members.items() if now - m.last_seen > policy.heartbeat_timeout_s]
        members = {p: m for p, m in state.members.items() if p not in silent} if silent else state.members
        floor = min((m.last_seen for m in members.values()), default=now)
        state = replace(state, members=members, seen_floor=floor)
        actions += [Dropped(p, "silent") for p in silent]
    evicted = {p: until for p, until in state.evicted.items() if until > now}
    if len(evicted) != len(state.evicted):
        state = replace(state, evicted=evicted)
    for pending in (state.previous, state.round):
        # decided at the deadline, or once every member still alive reported (the scan stops at the
        # first that did not: cheap mid-round)
        if (
            pending is not None
            and pending.decided_at is None
            and (
                now >= pending.compute_deadline + policy.report_grace_s
                or all(p in pending.reports or p not in state.members for p in pending.expected)
            )
        ):
            state, decided = _decide(state, pending, now, policy)
            actions += decided
    current = state.round
    if current is None:
        finished = True
    elif policy.overlap:  # a member is done computing it: the next may start (two undecided at most)
        finished = state.previous is None and (current.decided_at is not None or bool(current.reports))
    else:
        finished = current.decided_at is not None and (
            now >= current.exchange_deadline
            or all(  # the participants (unsorted: stops at the first not done)
                state.members[p].round >= current.number for p in current.reports if p in state.members
            )
        )
    quorum = len(state.members) >= (policy.min_start_members if state.next_round == 0 else 1)
    if finished and quorum and _all_heard(state, now, policy):
        state, announced = _announce(state, now, policy)
        actions += announced
    return state, actions


def _decide(state: SwarmState, current: Round, now: float, policy: Policy) -> tuple[SwarmState, list[Action]]:
    stragglers = tuple(p for p in current.expected if p in state.members and p not in current.reports)
    # the votes the round's participants earned before it (shoal.protocol.work), and what it counted
    earned_votes = tuple(p for p in current.participants if earned(state.counted.get(p, ()), current.number))
    current = replace(current, decided_at=now, stragglers=stragglers, earned=earned_votes)
    record = recorded(state.counted, current.number, counted(current, policy.gather))
    actions: list[Action]
    members, evicted, actions = dict(state.members), dict(state.evicted), []
    # when no one made it, the window was wrong (or the swarm was away), not the peers: no strikes
    for peer_id in stragglers if current.reports else ():
        member = members[peer_id]
        strikes = member.strikes + 1
        scale = member.compute_scale
        if strikes >= policy.shrink_after:
            scale = max(policy.min_scale, scale / 2)
        member = replace(member, strikes=strikes, compute_scale=scale, on_time=0)
        actions.append(Struck(peer_id, current.number, strikes, scale))
        if strikes >= policy.evict_after:
            del members[peer_id]
            evicted[peer_id] = now + policy.eviction_s
            actions.append(Dropped(peer_id, "evicted"))
        else:
            members[peer_id] = member
    state = replace(
        _put(state, current),
        members=members,
        evicted=evicted,
        counted=record,
        stragglers_total=state.stragglers_total + len(stragglers),
        evictions_total=state.evictions_total + len(state.members) - len(members),
    )
    return state, [Decided(current), *actions]


def _announce(state: SwarmState, now: float, policy: Policy) -> tuple[SwarmState, list[Action]]:
    number, current = state.next_round, state.round
    # with overlap, the round still undecided: it keeps taking reports, as `previous`
    undecided = current if current is not None and current.decided_at is None else None
    compute_s, start = compute_window(state.members, policy), now
    if undecided is not None:  # its peers may compute until its deadline, but one window at most
        start = min(max(now, undecided.compute_deadline), now + compute_s)
    announced = Round(
        number=number,
        announced_at=now,
        compute_deadline=start + compute_s,
        exchange_deadline=start + compute_s + exchange_window(state.exchange_times, policy),
        data_seed=data_seed(state.seed, number),
        expected=tuple(sorted(state.members)),
    )
    history = state.history if current is None else _kept(state.history, current)
    state = replace(state, round=announced, previous=undecided, next_round=number + 1, history=history)
    return state, [Announced(announced)]


def _put(state: SwarmState, updated: Round) -> SwarmState:
    """The state with `updated` in place of the open round of its number (`round` or `previous`); a
    decided `previous` joins the history, before `round`."""
    if state.previous is None or updated.number != state.previous.number:
        return replace(state, round=updated)
    if updated.decided_at is None:
        return replace(state, previous=updated)
    return replace(state, previous=None, history=_kept(state.history, updated))


def _all_heard(state: SwarmState, now: float, policy: Policy) -> bool:
    """After a restart, rounds wait until every member was heard from, or one heartbeat timeout."""
    if state.resumed_at is None or now - state.resumed_at >= policy.heartbeat_timeout_s:
        return True
    return all(m.heard for m in state.members.values())


def _kept(history: tuple[Round, ...], finished: Round) -> tuple[Round, ...]:
    """The history with `finished` appended, if it was decided, and only the last KEEP_ROUNDS."""
    return (*history, finished)[-KEEP_ROUNDS:] if finished.decided_at is not None else history
