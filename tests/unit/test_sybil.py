"""A state no headcount can buy (shoal.protocol.work, shoal.protocol.rules.weighed, state.decide,
RoundStages.agree): votes weigh by counted work, fresh identities weigh nothing, and a peer in sync
leaves its own state only for one that earned weight backs or a replay it could check. The Sybils here
claim to be in sync on one state of their own, as the process test's do (test_hostile)."""

import asyncio
import hashlib

import pytest
import torch

from shoal.peer.config.spec import PeerSpec
from shoal.peer.swarm.anchor import parse_anchor
from shoal.peer.swarm.counters import SwarmCounters
from shoal.peer.swarm.ledger import Ledger
from shoal.peer.swarm.names import parse_trust_key
from shoal.peer.swarm.records import Announcement
from shoal.peer.swarm.server import PayloadServer
from shoal.peer.swarm.stages import CLAIM_ROUNDS, RoundLimits, RoundStages
from shoal.peer.swarm.state import StateSnapshot, decide
from shoal.protocol.rules import eligible, weighed
from shoal.protocol.work import EARN_ROUNDS, Work

HONEST = [b"honest-%d" % i for i in range(3)]
GOOD, POISON = b"\x80" * 32, b"\x90" * 32
GROUND = b"\x00" * 32  # a digest ground to sort before any honest one, for ties


def sybils(count: int) -> list[bytes]:
    return [b"sybil-%04d" % i for i in range(count)]


def announce(owner: bytes, state: bytes, synced: bool = True) -> Announcement:
    return Announcement(owner, owner.decode() + "-peer", hashlib.sha256(owner).digest(), 10, 1, state, synced)


def worked(rounds: int, owners: list[bytes]) -> Work:
    work = Work()
    for number in range(rounds):
        work.record(number, owners)
    return work


def test_fresh_identities_weigh_nothing_and_a_vote_is_earned_by_counted_rounds_and_forgotten():
    work = Work(window=8, earn=3)
    work.record(0, [b"a", b"b"])
    work.record(1, [b"a"])
    assert work.weights([b"a", b"b"]) == {b"a": 0, b"b": 0}  # a young swarm: nobody earned a vote yet
    work.record(2, [b"a", b"c"])
    assert work.weights([b"a", b"b", b"c", b"d"]) == {b"a": 1, b"b": 0, b"c": 0, b"d": 0}
    work.record(2, [b"b"])  # a round already recorded changes nothing
    assert work.weight(b"b") == 0
    for number in range(3, 12):
        work.record(number, [b"c"])
    assert work.rounds == 8 and work.weight(b"a") == 0 and work.weight(b"c") == 1  # the window moved on
    for number in (11, 11, 10, 9, 8, 7):  # refused by screening after all (the same round twice: once)
        work.drop(number, b"c")
    assert work.weight(b"c") == 1  # 3 counted rounds left
    work.drop(6, b"c")
    assert work.weight(b"c") == 0
    work.record(12, [b"c"])
    work.forfeit(b"c")
    assert work.weight(b"c") == 0 and work.rounds == 8
    with pytest.raises(ValueError):
        Work(window=0)


@pytest.mark.parametrize("count", [1, 3, 6, 12, 1000])
def test_any_number_of_fresh_sybils_loses_to_three_peers_that_earned_their_weight(count):
    ballots = {o: announce(o, GOOD) for o in HONEST} | {o: announce(o, POISON) for o in sybils(count)}
    weights = worked(EARN_ROUNDS, HONEST).weights(ballots)
    states = {o: (a.state, a.synced) for o, a in ballots.items()}
    assert weighed(states, weights) == (GOOD, True)
    decision = decide(ballots, ballots[HONEST[0]], compare_states=True, weights=weights)
    assert decision.agreed == GOOD and not decision.behind and decision.earned
    assert decision.counted == HONEST and sorted(decision.stale) == sybils(count)
    # the honest bounded fan-in chooses among the honest alone
    assert eligible(states, weights=weights) == HONEST
    # and the headcount alone, what decided before, would have given a majority the round
    if count > 3:
        assert decide(ballots, ballots[HONEST[0]], compare_states=True).agreed == POISON


def test_a_tie_with_a_ground_digest_changes_nothing_and_out_of_sync_voters_defer():
    ballots = {o: announce(o, GOOD) for o in HONEST} | {o: announce(o, GROUND) for o in sybils(3)}
    assert decide(ballots, ballots[HONEST[0]], compare_states=True).agreed == GROUND  # the headcount's tie
    weights = worked(EARN_ROUNDS, HONEST).weights(ballots)
    assert decide(ballots, ballots[HONEST[0]], compare_states=True, weights=weights).agreed == GOOD
    # between earned weights, one out of sync (it knows it is behind) defers to those in sync
    ballots = {HONEST[0]: announce(HONEST[0], GOOD), HONEST[1]: announce(HONEST[1], GROUND, synced=False)}
    states = {o: (a.state, a.synced) for o, a in ballots.items()}
    assert weighed(states, worked(EARN_ROUNDS, HONEST[:2]).weights(ballots)) == (GOOD, True)


def test_with_no_earned_weight_the_headcount_decides_but_marked_so_and_own_keeps_a_peer_in_sync():
    ballots = {o: announce(o, GOOD) for o in HONEST} | {o: announce(o, POISON) for o in sybils(4)}
    decision = decide(ballots, ballots[HONEST[0]], compare_states=True, weights=Work().weights(ballots))
    assert decision.agreed == POISON and decision.behind and not decision.earned
    kept = decide(ballots, ballots[HONEST[0]], compare_states=True, own=True)
    assert kept.agreed == GOOD and not kept.behind and kept.counted == HONEST


# -- a round's agreement on a peer (RoundStages.agree) -----------------------------------------------


class Sources:
    """The other peers, as a peer that falls behind sees them: no steps to replay, and a state that is
    counted when downloaded."""

    def __init__(self):
        self.downloads, self.asked = [], []

    async def steps(self, digest, source):
        self.asked.append(source)
        return b""  # the Sybils keep no step that leads to their state from any other

    async def state(self, digest, sources, like):
        self.downloads.append(digest)
        return [torch.ones(4)]


def stages_in_sync() -> RoundStages:
    counts = SwarmCounters()
    server = PayloadServer(run="r", counts=counts, max_payload_bytes=1 << 20, keep_states=3, timeout_s=1)
    stages = RoundStages(
        run="r", owner=HONEST[0], peer_id="me", server=server, directory=None,
        ledger=Ledger(HONEST[0], counts, strike_limit=3, ban_rounds=10), puller=Sources(), counts=counts,
        limits=RoundLimits(1 << 20, 1.0, 0.1, 0),
    )  # fmt: skip
    stages.transition = lambda *args: None
    stages.standing.synced = True
    return stages


def agree(stages: RoundStages, number: int, ballots: dict[bytes, Announcement]):
    snapshot = StateSnapshot.capture([torch.zeros(4)], number)
    return asyncio.run(stages.agree(ballots, ballots[HONEST[0]], (snapshot, [torch.zeros(4)])))


def round_ballots(own: bytes, count: int) -> dict[bytes, Announcement]:
    return {o: announce(o, own) for o in HONEST} | {o: announce(o, POISON) for o in sybils(count)}


def test_a_peer_in_sync_keeps_its_state_against_a_sybil_headcount_and_strikes_their_false_claims():
    """A young swarm: nobody earned a vote yet, four Sybils outnumber three peers in sync. No step leads
    from this peer's state to theirs, so it keeps its own and counts the honest (`unbacked_state`);
    from the third round running that they claim to be in sync on theirs, each is struck every round,
    and banned at the third strike. Once the honest peers earned their votes, the headcount no longer
    decides."""
    stages = stages_in_sync()
    for number in range(EARN_ROUNDS + 2):
        own = StateSnapshot.capture([torch.zeros(4)], number).digest
        agreement = agree(stages, number, round_ballots(own, 4))
        assert agreement.adopted is None and agreement.agreed == own
        assert agreement.counted == HONEST
        stages.work.record(number, agreement.counted)
    assert stages.puller.downloads == []  # the poisoned state was never pulled
    # every round before the honest earned their votes (a real round would ignore the banned ones)
    assert stages.counts.rejected["unbacked_state"] == EARN_ROUNDS
    # from the third round running, each Sybil, every round
    assert stages.counts.rejected["false_state"] == 4 * (EARN_ROUNDS + 2 - (CLAIM_ROUNDS - 1))
    assert set(stages.ledger.banned) == set(sybils(4))


def test_a_peer_that_truly_parted_from_peers_that_earned_weight_still_downloads_their_state():
    stages = stages_in_sync()
    stages.work = worked(EARN_ROUNDS, HONEST)
    others = StateSnapshot.capture([torch.ones(4)], 7).digest
    ballots = {o: announce(o, others) for o in HONEST[1:]} | {o: announce(o, POISON) for o in sybils(12)}
    snapshot = StateSnapshot.capture([torch.zeros(4)], 7)
    mine = announce(HONEST[0], snapshot.digest)
    agreement = asyncio.run(stages.agree(ballots | {HONEST[0]: mine}, mine, (snapshot, [torch.zeros(4)])))
    assert stages.puller.downloads == [others] and agreement.adopted is not None
    assert agreement.counted == HONEST[1:] and stages.counts.resyncs == 1
    assert "unbacked_state" not in stages.counts.rejected


def test_in_a_young_swarm_a_split_heals_from_peers_counted_before_never_from_fresh_identities():
    """Before anyone earned a vote, a peer in sync that parted from the others (it missed a payload)
    downloads the headcount's state if an announcer of it had a contribution counted here; the same
    headcount of identities never counted is refused."""
    others = StateSnapshot.capture([torch.ones(4)], 1).digest
    snapshot = StateSnapshot.capture([torch.zeros(4)], 1)
    mine = announce(HONEST[0], snapshot.digest)
    for voters, downloads in ((HONEST[1:], [others]), (sybils(2), [])):
        stages = stages_in_sync()
        stages.work.record(0, HONEST)  # round 0: the three counted, no vote earned yet
        ballots = {o: announce(o, others) for o in voters} | {HONEST[0]: mine}
        agreement = asyncio.run(stages.agree(ballots, mine, (snapshot, [torch.zeros(4)])))
        assert stages.puller.downloads == downloads
        assert (agreement.adopted is None) == (not downloads)
        assert stages.counts.rejected.get("unbacked_state", 0) == (not downloads)


def test_a_joiner_given_the_run_key_takes_the_signed_state_not_the_headcounts():
    """A joiner (out of sync, no record: every identity weighs nothing to it) between three honest peers
    and 12 Sybils: the headcount sends it to the poison; the state the run key signed for the round
    (shoal.peer.swarm.anchor) sends it to the honest peers, its sources."""
    joiner = announce(b"joiner", b"\x70" * 32, synced=False)
    ballots = {o: announce(o, GOOD) for o in HONEST} | {o: announce(o, POISON) for o in sybils(12)}
    ballots[joiner.owner] = joiner
    weights = Work().weights(ballots)
    fooled = decide(ballots, joiner, compare_states=True, weights=weights)
    assert fooled.agreed == POISON and not fooled.earned
    anchored = decide(ballots, joiner, compare_states=True, weights=weights, anchor=GOOD)
    assert anchored.agreed == GOOD and anchored.behind
    assert set(anchored.sources) == {f"{o.decode()}-peer" for o in HONEST}
    assert set(anchored.counted) == set(HONEST)


class Signed:
    """A run key's signatures as `Anchor` reads them: the state signed for each round."""

    verifies = True

    def __init__(self, states: dict[int, bytes]):
        self.states, self.asked = states, []

    async def signed(self, number: int, *, quiet: bool = False) -> bytes | None:
        self.asked.append(number)
        return self.states.get(number)


def test_a_trusting_peer_in_sync_whose_step_came_out_otherwise_takes_the_signed_state():
    """A joiner in sync for two rounds, whose own step came out otherwise than the veterans' (its young
    record screened otherwise): its record of work backs its own state, so against the honest peers'
    it would keep it (`unbacked_state`) and stay apart for good. The run key signed the honest state:
    it downloads that instead. Where the key signed its own state, or nothing yet, it keeps its own;
    and a round where nobody holds another state reads no signature."""
    number, own = 7, StateSnapshot.capture([torch.zeros(4)], 7)
    for signatures, downloads in (({number: GOOD}, [GOOD]), ({number: own.digest}, []), ({}, [])):
        stages = stages_in_sync()
        stages.work.record(5, [HONEST[0], b"joiner"])  # what the joiner saw count, its own state's
        stages.work.record(6, [HONEST[0], b"joiner"])
        stages.anchor = Signed(signatures)
        mine = announce(HONEST[0], own.digest)
        ballots = {o: announce(o, GOOD) for o in HONEST[1:]} | {o: announce(o, POISON) for o in sybils(4)}
        agreement = asyncio.run(stages.agree(ballots | {HONEST[0]: mine}, mine, (own, [torch.zeros(4)])))
        assert stages.puller.downloads == downloads, signatures
        assert (agreement.adopted is not None) == bool(downloads)
        assert stages.counts.rejected.get("unbacked_state", 0) == (not downloads)
        assert "unanchored_state" not in stages.counts.rejected  # (a peer in sync is not waiting)
    stages = stages_in_sync()
    stages.anchor = Signed({number: GOOD})
    unanimous = {o: announce(o, own.digest) for o in HONEST}
    asyncio.run(stages.agree(unanimous, unanimous[HONEST[0]], (own, [torch.zeros(4)])))
    assert stages.anchor.asked == []


def test_under_a_coordinator_founders_on_different_initial_states_end_on_one():
    """Round 0 of a coordinated run: founders in sync, this one on its own initial state and two on
    another (torch draws other initial weights on other kernel sets), nobody's work counted yet. The
    coordinator admitted them: this one, left behind by the vote, downloads their state, where an
    uncoordinated peer keeps its own against identities it never saw count (`unbacked_state`)."""
    snapshot = StateSnapshot.capture([torch.zeros(4)], 0)
    other = StateSnapshot.capture([torch.ones(4)], 0).digest
    mine = announce(HONEST[0], snapshot.digest)
    ballots = {HONEST[0]: mine} | {o: announce(o, other) for o in HONEST[1:]}
    for coordinated in (True, False):
        stages = stages_in_sync()
        stages._coordinated = coordinated
        agreement = asyncio.run(stages.agree(ballots, mine, (snapshot, [torch.zeros(4)])))
        assert stages.puller.downloads == ([other] if coordinated else [])
        assert (agreement.adopted is not None) == coordinated
        assert stages.counts.rejected.get("unbacked_state", 0) == (not coordinated)


def test_a_run_key_and_an_anchor_from_the_dht_are_checked():
    key = "ab" * 32
    assert parse_trust_key(key) == b"\xab" * 32 and parse_trust_key(key.upper()) == b"\xab" * 32
    for bad in ("", "ab" * 31, "zz" * 32, "ab" * 33, " " + key):
        with pytest.raises(ValueError, match="64 hex digits"):
            parse_trust_key(bad)
        with pytest.raises(ValueError, match="--trust-key"):
            PeerSpec.of(trust_key=bad)
    assert PeerSpec.of(trust_key=key.upper()).network.trust_key == key
    assert parse_anchor([5, GOOD]) == (5, GOOD) and parse_anchor((0, GOOD)) == (0, GOOD)
    for bad in (None, b"", [5], [5, GOOD, 1], [True, GOOD], [-1, GOOD], [1 << 62, GOOD], [5, GOOD[:31]],
                [5, GOOD.hex()], [5.0, GOOD], {"round": 5}):  # fmt: skip
        assert parse_anchor(bad) is None, bad
