"""When an uncoordinated round reads the DHT (shoal.peer.swarm.collect.Polls): no I/O, a clock goes in."""

import math

from shoal.peer.swarm import collect as collect_module
from shoal.peer.swarm.collect import Polls, Pulls


def test_polls_back_off_to_four_polls_or_a_tenth_of_a_round_and_news_resets_them():
    polls = Polls(shortest_s=0.2, round_seconds=12.0)
    assert [polls.next_poll_s(news=False) for _ in range(4)] == [0.4, 0.8, 0.8, 0.8]
    assert polls.next_poll_s(news=True) == 0.2
    short_rounds = Polls(shortest_s=0.2, round_seconds=4.0)
    assert max(short_rounds.next_poll_s(news=False) for _ in range(5)) == 0.4  # a tenth of the round
    assert Polls(shortest_s=2.0, round_seconds=4.0).longest_s == 2.0


def test_the_peer_list_is_read_once_a_round_and_at_once_for_each_new_stranger():
    polls = Polls(shortest_s=0.2, round_seconds=12.0)
    assert polls.records_due()  # not read this round
    polls.read_records()
    assert not polls.records_due()  # not again while waiting: a newcomer announces
    polls.stranger(b"new")
    assert polls.records_due()  # an unknown announcer: at once
    polls.read_records()
    polls.stranger(b"new")  # still not in the list (incompatible): not again
    assert not polls.records_due()
    polls.stranger(b"other")
    assert polls.records_due()
    assert polls.idle_s() == 6.0  # the announcements, once every payload is in: twice a round


def test_a_rounds_first_read_of_the_announcements_and_idle_reads_ask_the_nearest_replica_only():
    polls = Polls(shortest_s=0.2, round_seconds=12.0)
    assert polls.nearest_only(idle=False)  # the first: most peers have yet to announce
    assert not polls.nearest_only(idle=False)  # then as the directory decides (every replica at times)
    assert polls.nearest_only(idle=True)  # every payload in: only to notice a newcomer


def test_once_every_payload_is_in_reads_go_on_only_while_fewer_peers_are_seen_than_last_round():
    assert not Polls.looks_on(seen=16, last_round=16)  # all of last round's: nothing to look for
    assert not Polls.looks_on(seen=17, last_round=16)  # a newcomer already found
    assert Polls.looks_on(seen=1, last_round=4)  # its list lost records: their authors announce unknown
    assert Polls.looks_on(seen=3, last_round=4)
    assert Polls.looks_on(seen=4, last_round=0)  # a first round: no last round to go by


def test_under_a_fan_in_pulls_wait_for_every_compatible_peer_or_until_halfway_to_the_deadline(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(collect_module.time, "time", lambda: now[0])
    everyone = {b"a", b"b", b"c", b"d"}
    pulls = Pulls(gather=2, provisional_from=105.0)
    assert not pulls.due(everyone, {b"a", b"b", b"c"}, read_at=99.5)  # d may still outrank a chosen one
    assert not pulls.started  # news does not hasten the next read meanwhile
    assert pulls.due(everyone, everyone, read_at=99.8) and pulls.since == 100.0 and pulls.settled == 99.8
    assert pulls.due(everyone, {b"a"}, read_at=99.9)  # once started, for the rest of the round
    late = Pulls(gather=2, provisional_from=105.0)
    assert not late.due(everyone, {b"a"}, read_at=99.0)
    now[0] = 105.0
    assert late.due(everyone, {b"a"}, read_at=104.9) and late.since == 105.0  # halfway: as it stands
    assert late.settled == math.inf and late.settled_s(90.0, 0.2) is None  # next round: read at once
    now[0] = 100.0
    assert Pulls(gather=0, provisional_from=105.0).due(everyone, {b"a"}, read_at=99.0)  # every one counts
    assert Pulls(gather=4, provisional_from=105.0).due(everyone, {b"a"}, read_at=99.0)  # all of them fit


def test_the_next_rounds_first_read_follows_when_every_peer_was_in_without_adding_up_read_latency():
    everyone = {b"a", b"b"}
    missed = Pulls(gather=1, provisional_from=200.0)
    missed.due(everyone, {b"a"}, read_at=96.0)
    missed.due(everyone, everyone, read_at=97.0)  # the read that found them began at 97: 7 s in
    assert missed.settled_s(90.0, 0.2) == 7.0
    found = Pulls(gather=1, provisional_from=200.0)
    found.due(everyone, everyone, read_at=97.0)  # all in at the first read: maybe long before it
    assert found.settled_s(90.0, 0.2) == 7.0 - 0.2  # so the next round looks a poll sooner
