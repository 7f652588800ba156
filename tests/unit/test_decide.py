"""The pure parts of a swarm round's decision: whose contributions count (state.decide) and what a
peer holds against the others (ledger.Ledger)."""

from shoal.peer.swarm.counters import SwarmCounters
from shoal.peer.swarm.ledger import Ledger
from shoal.peer.swarm.records import Announcement
from shoal.peer.swarm.state import Tally, decide, majority, tallied
from shoal.protocol import MalformedPayloadError

S1, S2 = b"\x01" * 32, b"\x02" * 32


def announce(owner: bytes, digest: bytes, state: bytes = S1, synced: bool = True) -> Announcement:
    return Announcement(owner, owner.decode() + "-peer", digest, 10, 1, state, synced)


def test_a_copied_payload_counts_once_for_the_smallest_key_and_states_are_not_compared_unless_asked():
    announced = {
        k: announce(k, d, state=s) for k, d, s in [(b"c", b"x", S2), (b"a", b"x", S1), (b"b", b"y", S1)]
    }
    decision = decide(announced, announced[b"b"], compare_states=False)
    assert decision.counted == [b"a", b"b"] and decision.copies == [b"c"]
    assert not decision.compared and not decision.behind and decision.stale == []


def test_under_a_bounded_fan_in_every_announcement_votes_not_only_the_chosen():
    """Two chosen payloads, one from a liar whose state digest sorts first: alone the two would tie and
    the liar's state would win; the round's other announcements outvote it."""
    s0 = b"\x00" * 32
    everyone = {k: announce(k, k * 2, S1) for k in (b"a", b"b", b"c", b"d")}
    everyone[b"e"] = announce(b"e", b"ee", s0)
    chosen = {k: everyone[k] for k in (b"a", b"e")}
    alone = decide(chosen, everyone[b"a"], compare_states=True)
    assert alone.agreed == s0 and alone.behind  # what the vote among the chosen would do
    decision = decide(chosen, everyone[b"a"], compare_states=True, voters=everyone)
    assert decision.agreed == S1 and not decision.behind
    assert decision.counted == [b"a"] and decision.stale == [b"e"]
    behind = decide(chosen, everyone[b"e"], compare_states=True, voters=everyone)
    assert behind.behind and behind.sources == ["a-peer", "b-peer", "c-peer", "d-peer"]  # any voter on it


def test_a_coordinators_tally_is_the_vote_and_names_sources_beyond_the_chosen():
    """Under a coordinator that chose the round's payloads, its tally of every participant's state is
    the vote: the liar among the two chosen is outvoted, and a peer behind re-syncs from the chosen on
    the majority's state, then from the holders the tally names."""
    s0 = b"\x00" * 32
    chosen = {b"a": announce(b"a", b"aa", S1), b"e": announce(b"e", b"ee", s0)}
    tally = Tally({(S1, True): 4, (s0, True): 1, (S2, False): 9}, {S1: ("b-peer", "a-peer"), s0: ("e-peer",)})
    decision = decide(chosen, chosen[b"a"], compare_states=True, voters=tally)
    assert decision.agreed == S1 and not decision.behind  # the 9 unsynced do not vote while 5 synced do
    assert decision.counted == [b"a"] and decision.stale == [b"e"]
    behind = decide(chosen, chosen[b"e"], compare_states=True, voters=tally)
    assert behind.behind and behind.sources == ["a-peer", "b-peer"]


def test_counted_votes_decide_as_the_ballots_would():
    ballots = {b"a": (S1, True), b"b": (S2, True), b"c": (S2, True), b"d": (S1, False), b"e": (b"", True)}
    assert majority(ballots) == tallied({(S1, True): 1, (S2, True): 2, (S1, False): 1}) == S2
    assert tallied({(S1, False): 2, (S2, False): 2}) == S1  # none synced: all vote; a tie: the smallest
    assert tallied({}) is None and tallied({(b"", True): 3}) is None


def test_the_majority_state_counts_and_a_peer_behind_it_resyncs_from_the_others_that_hold_it():
    announced = {
        b"a": announce(b"a", b"1", S1),
        b"b": announce(b"b", b"2", S1),
        b"c": announce(b"c", b"3", S2),
        b"d": announce(b"d", b"4", S2, synced=False),  # fresh joiners do not vote
    }
    on_majority = decide(announced, announced[b"a"], compare_states=True)
    assert on_majority.agreed == S1 and on_majority.compared and not on_majority.behind
    assert on_majority.counted == [b"a", b"b"] and on_majority.stale == [b"c", b"d"]
    assert on_majority.sources == []
    behind = decide(announced, announced[b"c"], compare_states=True)
    assert behind.behind and behind.sources == ["a-peer", "b-peer"]
    assert behind.counted == [b"a", b"b"] and behind.stale == [b"d"]  # its own is left out, not counted stale


def test_a_coordinated_round_without_participants_decides_nothing():
    mine = announce(b"a", b"1")
    decision = decide({}, mine, compare_states=True)
    assert decision.counted == [] and not decision.compared and not decision.behind


def test_strikes_ban_a_peer_for_ban_rounds_from_the_round_of_the_last_strike_and_never_this_one():
    counts = SwarmCounters()
    ledger = Ledger(b"me", counts, strike_limit=2, ban_rounds=3)
    ledger.strike(b"me", "unserved", 5)
    ledger.strike(b"", "unserved", 5)
    ledger.strike(b"x", "unserved", 5)
    assert ledger.banned == {} and counts.strikes_total == 1
    ledger.strike(b"x", "replayed", 7)
    assert ledger.banned == {b"x": 11} and ledger.strikes[b"x"] == 0 and counts.strikes_total == 2
    ledger.new_round(10)
    assert ledger.refusal(10, b"x", announce(b"x", b"d")) == "banned"
    ledger.new_round(11)  # heard again from round 11
    assert ledger.banned == {} and ledger.refusal(11, b"x", announce(b"x", b"d")) is None


def test_replays_are_refused_by_digest_and_by_content_and_malformed_announcements_by_their_reason():
    ledger = Ledger(b"me", SwarmCounters(), strike_limit=3, ban_rounds=10)
    ledger.announced(b"mine", 3)
    assert ledger.refusal(4, b"x", announce(b"x", b"mine")) == "replayed"
    assert ledger.refusal(4, b"y", announce(b"y", b"new")) is None
    assert ledger.refusal(4, b"z", announce(b"z", b"new")) is None  # a copy in the same round: not a replay
    assert ledger.refusal(4, b"z", MalformedPayloadError("too_large", "")) == "too_large"
    assert not ledger.replayed_content(b"\xff\xff", 4)  # no Payload: nothing to compare
    ledger.new_round(4 + 17)  # digests are forgotten after 16 rounds
    assert ledger.refusal(21, b"x", announce(b"x", b"mine")) is None


def test_newcomers_alone_in_a_round_do_not_roll_back_a_peer_in_sync():
    """Seen under load with the token ledger: a coordinated round decided with only a fresh joiner and
    a stale peer, the swarm's peers in sync left out of it; before, they took the joiner's state (the
    run's first parameters, an empty ledger)."""
    fresh, stale = b"\x00" * 32, b"\x03" * 32
    newcomers = {
        b"j": announce(b"j", b"1", fresh, synced=False),
        b"s": announce(b"s", b"2", stale, synced=False),
    }
    left_out = announce(b"a", b"3", S1, synced=True)
    decision = decide(newcomers, left_out, compare_states=True)
    assert decision.agreed == S1 and not decision.behind and decision.stale == [b"j", b"s"]
    counted = decide(newcomers, left_out, compare_states=True, voters=Tally({(fresh, False): 2}, {}))
    assert counted.agreed == S1 and not counted.behind
    # the newcomers themselves agree among themselves, as before; a synced vote still decides for all
    assert decide(newcomers, newcomers[b"j"], compare_states=True).agreed == fresh
    with_swarm = {**newcomers, b"a": left_out}
    assert decide(with_swarm, newcomers[b"j"], compare_states=True).agreed == S1
